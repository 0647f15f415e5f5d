"""The engine process stopped, not reading, or dead (a real server on loopback, its engine in a real
process of its own, the reference backend).

What it guarantees:
- an engine process that stops reporting (SIGSTOP) is noticed by the HTTP side within its heartbeat
  deadline: /health answers 503 `unresponsive` naming it, new requests get 503, /metrics answers at
  once without the engine's series, and the requests it holds end at their own deadline with 504
  saying the engine process is silent; when it resumes, /health is 200 again, it serves, and the
  requests that ended meanwhile hold no KV slot;
- an engine process that does not read its pipe never blocks the event loop: a bounded outbox keeps
  what the pipe cannot take, requests beyond it get 503 at once, /health answers all along, and the
  kept requests are served once the engine reads again;
- /metrics never shows the engine's counters as 0: when the engine process does not answer within
  `engine_answer_timeout_s` its series are left out (the HTTP process's own are shown) and the
  scrape answers within that timeout;
- an engine process that dies is started again in place: its requests end with 503, /health answers
  503 `reloading` naming the death while the model loads, then 200; the restart is counted; one death
  more than `engine_restart_limit` within the window fails the engine and tells the server to exit.
"""

from __future__ import annotations

import asyncio
import functools
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
from service_harness import (
    backend_factory,
    built_late,
    running_server,
    slow_backend,
    sse_events,
    wait_until,
)

from wafer_gpt2.engine.worker import EngineState
from wafer_gpt2.settings import ServerSettings

PROMPT = "The engine process stopped answering while"
LONG = 100  # tokens: far more than a test lets run before it acts (the context is 128)
HEARTBEAT_S = 1.0  # the engine process reports every quarter of it
REQUEST_TIMEOUT_S = 6.0
STEP_S = 0.1  # each step of the requests in flight takes this long: LONG tokens take 10 s
HANG_LIMIT_S = 30.0


def settings(**overrides) -> ServerSettings:
    return ServerSettings(backend="reference", model_id="tiny-gpt2", engine_process=True, **overrides)


def slow(small_params, slots: int, delay_s: float = STEP_S):
    return functools.partial(slow_backend, backend_factory("reference", small_params, slots=slots), delay_s)


@contextmanager
def stopped(pid: int) -> Iterator[float]:
    """The process stopped (SIGSTOP) for the block; yields when it was stopped."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield time.monotonic()
    finally:
        os.kill(pid, signal.SIGCONT)


def in_thread(call) -> tuple[threading.Thread, dict]:
    result: dict = {}

    def run() -> None:
        try:
            result.update(call())
        finally:
            result["ended_at"] = time.monotonic()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result


def long_stream(url: str, first_token: threading.Event) -> dict:
    events: list = []
    with httpx.Client(base_url=url, timeout=HANG_LIMIT_S) as client:
        body = {"inputs": PROMPT, "parameters": {"max_new_tokens": LONG}}
        with client.stream("POST", "/generate_stream", json=body) as response:
            for event in sse_events(response):
                events.append(event)
                first_token.set()
    return {"status": response.status_code, "events": events}


def post(url: str, route: str, body: dict) -> dict:
    response = httpx.post(url + route, json=body, timeout=HANG_LIMIT_S)
    return {"status": response.status_code, "body": response.json(), "headers": response.headers}


def timed_get(client: httpx.Client, path: str) -> tuple[httpx.Response, float]:
    started = time.monotonic()
    response = client.get(path)
    return response, time.monotonic() - started


def metric(text: str, name: str) -> float | None:
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return None if found is None else float(found[1])


def test_a_stopped_engine_process_is_unhealthy_and_its_requests_end_at_their_deadline(small_params):
    config = settings(
        max_concurrent_requests=2, engine_heartbeat_timeout_s=HEARTBEAT_S, request_timeout_s=REQUEST_TIMEOUT_S
    )
    with running_server(config, slow(small_params, 2)) as running, running.client(timeout=5) as client:
        url = running.url
        first_token = threading.Event()
        streaming = in_thread(lambda: long_stream(url, first_token))
        plain = in_thread(
            lambda: post(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": LONG, "ignore_eos": True})
        )
        assert first_token.wait(20)
        wait_until(lambda: running.engine.queue_sizes() == (0, 2), timeout=10)

        with stopped(running.engine.pid) as stopped_at:
            slowest = 0.0
            while True:  # /health answers at once all along, and turns 503 past the heartbeat deadline
                health, took = timed_get(client, "/health")
                slowest = max(slowest, took)
                if health.status_code != 200:
                    break
                assert time.monotonic() - stopped_at < HEARTBEAT_S + 3, "/health stayed 200"
                time.sleep(0.05)
            assert slowest < 1.0, slowest
            body = health.json()
            assert health.status_code == 503 and body["state"] == "unresponsive", health.text
            assert "heartbeat" in body["reason"] and "stopped or hung" in body["reason"], body
            assert health.headers["retry-after"] == "5"

            refused = client.post("/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 3}})
            assert refused.status_code == 503 and refused.headers["retry-after"] == "5", refused.text
            assert "stopped or hung" in refused.json()["error"], refused.text

            scrape, took = timed_get(client, "/metrics")  # no question to a silent engine: at once
            assert scrape.status_code == 200 and took < 1.0, took
            assert metric(scrape.text, "wafer_engine_process_up") == 0, scrape.text
            assert metric(scrape.text, "tgi_request_count") is None, scrape.text

            # The requests in flight end at their own deadline, answered by the HTTP side.
            for thread, _ in (streaming, plain):
                thread.join(REQUEST_TIMEOUT_S + 5)
                assert not thread.is_alive(), "a request hung behind the stopped engine process"
            ended = max(result["ended_at"] for _, result in (streaming, plain)) - stopped_at
            assert ended < REQUEST_TIMEOUT_S + 2, ended

        last = streaming[1]["events"][-1]
        assert last["error_type"] == "timeout" and "engine process has not reported" in last["error"], last
        answer = plain[1]
        assert answer["status"] == 504, answer
        assert "engine process has not reported" in answer["body"]["error"]["message"], answer

        # Resumed: it reports again, serves, and the requests that ended meanwhile freed their slots.
        wait_until(lambda: client.get("/health").status_code == 200, timeout=5)
        served = client.post("/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 3}})
        assert served.status_code == 200, served.text
        running.wait_idle()
        assert metric(client.get("/metrics").text, "wafer_engine_process_up") == 1
        assert running.engine.state is EngineState.READY and running.fatal == []


STOPS = ["." * 199 + str(i % 10) for i in range(20)]  # 4,000 characters: each request's message ~4 KB
FLOOD = 100  # requests: far more than the pipe (about 200 KB of buffers: 44 of them here) and the outbox hold
OUTBOX = 8


def test_an_engine_process_that_does_not_read_never_blocks_the_event_loop(small_params):
    config = settings(
        max_concurrent_requests=4,
        max_queue=FLOOD,  # the capacity check lets every one through: only the outbox refuses
        engine_outbox_limit=OUTBOX,
        engine_heartbeat_timeout_s=60.0,  # not silent long enough to be refused for that
    )
    factory = backend_factory("reference", small_params, slots=4)
    with running_server(config, factory) as running, running.client(timeout=5) as client:
        answers: list[tuple[int, dict]] = []

        async def flood() -> None:
            async with httpx.AsyncClient(
                base_url=running.url, timeout=HANG_LIMIT_S, limits=httpx.Limits(max_connections=FLOOD)
            ) as flooding:

                async def one() -> None:
                    body = {"prompt": PROMPT, "max_tokens": 4, "stop": STOPS}
                    response = await flooding.post("/v1/completions", json=body)
                    answers.append((response.status_code, response.json()))

                await asyncio.gather(*(one() for _ in range(FLOOD)))

        flooding = threading.Thread(target=asyncio.run, args=(flood(),), daemon=True)
        with stopped(running.engine.pid):
            flooding.start()
            # The pipe fills, then the outbox: the next requests are refused at once, the loop never waits.
            wait_until(lambda: any(status == 503 for status, _ in answers), timeout=20)
            health, took = timed_get(client, "/health")
            assert health.status_code == 200 and took < 1.0, (health.status_code, took)
            scrape, took = timed_get(client, "/metrics")  # the outbox is full: no question is sent
            assert took < 1.0 and metric(scrape.text, "wafer_engine_outbox_messages") == OUTBOX, scrape.text
        flooding.join(HANG_LIMIT_S)
        assert not flooding.is_alive() and len(answers) == FLOOD, len(answers)

        refusals = [body for status, body in answers if status == 503]
        served = [body for status, body in answers if status == 200]
        assert len(refusals) + len(served) == FLOOD, [status for status, _ in answers]
        assert len(served) > OUTBOX, len(served)  # the pipe's share and the outbox's are all served
        for body in refusals:
            assert "not reading its pipe" in body["error"]["message"], body
        running.wait_idle()
        assert client.get("/health").status_code == 200 and running.fatal == []


def test_metrics_leave_out_the_engine_series_when_the_engine_process_does_not_answer(small_params):
    config = settings(max_concurrent_requests=1, engine_heartbeat_timeout_s=60.0, engine_answer_timeout_s=0.5)
    with running_server(config, backend_factory("reference", small_params, slots=1)) as running:
        with running.client(timeout=10) as client:
            assert client.post("/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 2}})
            before = client.get("/metrics").text
            count = metric(before, "tgi_request_count")
            assert count is not None and count >= 1, before

            with stopped(running.engine.pid):
                scrape, took = timed_get(client, "/metrics")
            text = scrape.text
            assert metric(text, "tgi_request_count") is None, text  # left out, not 0
            assert scrape.status_code == 200 and took < 2.0, took  # within the answer timeout
            assert "wafer_kv_slots_used" not in text and "tgi_request_failure" not in text, text
            assert metric(text, "wafer_engine_process_up") == 1, text  # still within its heartbeat
            assert metric(text, "wafer_engine_process_restarts_total") == 0, text

            after = client.get("/metrics").text
            assert metric(after, "tgi_request_count") == count, after  # resumed: the same count
            assert metric(before, "wafer_engine_process_up") == 1, before


def test_an_engine_process_that_dies_is_started_again(small_params):
    # Every load takes 1.5 s: the restart's /health 503 is seen whatever the machine's speed.
    factory = functools.partial(built_late, slow(small_params, 2, 0.02), 1.5)
    with running_server(settings(max_concurrent_requests=2), factory) as running:
        first_token = threading.Event()
        thread, result = in_thread(lambda: long_stream(running.url, first_token))
        assert first_token.wait(20)
        dead = running.engine.pid
        os.kill(dead, signal.SIGKILL)
        thread.join(HANG_LIMIT_S)
        assert not thread.is_alive(), "a request hung after the engine process died"
        last = result["events"][-1]
        assert last["error_type"] == "unavailable" and "ended unexpectedly (exit code -9)" in last["error"], (
            last
        )
        with running.client() as client:
            health = client.get("/health")
            body = health.json()
            assert health.status_code == 503 and body["state"] == "reloading", health.text
            assert "ended unexpectedly (exit code -9)" in body["reason"], body
            refused = client.post("/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 3}})
            assert refused.status_code == 503 and refused.headers["retry-after"] == "5", refused.text

            assert running.engine.wait_ready(60), (running.engine.state, running.engine.error)
            assert running.engine.pid not in (None, dead)
            assert client.get("/health").status_code == 200
            served = client.post("/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 3}})
            assert served.status_code == 200, served.text
            scrape = client.get("/metrics").text
            assert metric(scrape, "wafer_engine_process_restarts_total") == 1, scrape
            assert client.get("/info").json()["engine"]["restarts"] == 1
        running.wait_idle()
        assert running.fatal == []


def test_an_engine_process_that_keeps_dying_stops_the_server(small_params):
    config = settings(max_concurrent_requests=1, engine_restart_limit=1, engine_restart_window_s=600.0)
    with running_server(config, backend_factory("reference", small_params, slots=1)) as running:
        os.kill(running.engine.pid, signal.SIGKILL)
        wait_until(lambda: running.engine.state is not EngineState.READY, timeout=10)
        assert running.engine.wait_ready(60), (running.engine.state, running.engine.error)
        assert running.fatal == []  # the first death is within the limit: started again
        os.kill(running.engine.pid, signal.SIGKILL)
        wait_until(lambda: running.fatal, timeout=10)  # the server is told to exit
        assert "ended unexpectedly (exit code -9), 2 times within 600 s" in running.fatal[0], running.fatal
        assert running.engine.state is EngineState.FAILED
        with running.client() as client:
            health = client.get("/health")
            assert health.status_code == 503 and health.json()["state"] == "failed", health.text
            refused = client.post("/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 3}})
            assert refused.status_code == 503 and "Retry-After" not in refused.headers, refused.text
