"""A backend step that never returns: the step watchdog (simulator backend, a real server on loopback).

What it guarantees: when a step runs past its deadline (`--step-timeout` plus `--step-timeout-per-item`
times the step's items), every request in flight ends at once with a 5xx `generation` error (504, or an
error event once its stream has started) that says the watchdog fired; /health answers 503 `reloading`
and names the fault while the worker restarts the backend on a fresh backend; the queued requests are
then served, and so are new ones. When the hung step finally returns, the abandoned worker goes away
without touching anything. A shutdown with a step hung drains for its timeout and then ends what is left
with 503: it never overruns by more than a few seconds.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from service_harness import HangingBackend, backend_factory, running_server, sse_events, wait_until
from test_robust_worker_fault import HealthWatch, in_thread, post, restarts

from wafer_gpt2.engine.worker import EngineState
from wafer_gpt2.settings import ServerSettings

SLOTS = 2
PROMPT = "The wafer stopped answering in the middle of"
STEP_TIMEOUT_S = 1.0  # far longer than a step of this small model takes
HANG_LIMIT_S = 20.0


def hanging_factory(small_params, backends: list[HangingBackend]):
    build = backend_factory("sim", small_params, slots=SLOTS)

    def factory() -> HangingBackend:
        backends.append(HangingBackend(build()))
        return backends[-1]

    return factory


def stream(url: str, started: threading.Event) -> dict:
    events = []
    with httpx.Client(base_url=url, timeout=HANG_LIMIT_S) as client:
        body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 100}}
        with client.stream("POST", "/generate_stream", json=body) as response:
            for event in sse_events(response):
                events.append(event)
                started.set()
    return {"status": response.status_code, "events": events}


def test_a_hung_step_fails_the_requests_in_flight_and_the_backend_restarts(small_params):
    backends: list[HangingBackend] = []
    settings = ServerSettings(
        backend="sim",
        dtype="fp32",
        max_concurrent_requests=SLOTS,
        step_timeout_s=STEP_TIMEOUT_S,
        step_timeout_per_item_s=0.01,
    )
    with running_server(settings, hanging_factory(small_params, backends)) as server:
        url = server.url
        before = restarts(server)
        streaming = threading.Event()
        running = [
            in_thread(lambda: stream(url, streaming)),
            in_thread(
                lambda: post(
                    url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 100, "ignore_eos": True}
                )
            ),
        ]
        wait_until(lambda: streaming.is_set() and server.engine.queue_sizes() == (0, SLOTS), timeout=20)
        queued = in_thread(
            lambda: post(url, "/generate", {"inputs": PROMPT, "parameters": {"max_new_tokens": 4}})
        )
        wait_until(lambda: server.engine.queue_sizes() == (1, SLOTS), timeout=10)

        with HealthWatch(url) as health:
            hung_at = time.monotonic()
            backends[0].hang_next()
            assert backends[0].hanging.wait(5)
            for thread, _ in running:
                thread.join(HANG_LIMIT_S)
                assert not thread.is_alive(), "a request hung behind the hung step"
            failed_after = time.monotonic() - hung_at
            queued[0].join(HANG_LIMIT_S)
            assert not queued[0].is_alive(), "the queued request hung"
            assert server.engine.wait_ready(30), server.engine.state
            wait_until(lambda: health.seen[-1] == (200, None), timeout=5)

        # Deadline 1 s + 0.01 s per item; the requests end soon after it, not at request_timeout_s.
        assert failed_after < STEP_TIMEOUT_S + 3.0, failed_after
        tgi, openai = (result for _, result in running)
        last = tgi["events"][-1]
        assert last["error_type"] == "generation" and "watchdog" in last["error"], last
        assert openai["status"] == 504, openai
        assert "watchdog" in openai["body"]["error"]["message"], openai
        assert (503, "reloading") in health.seen, health.seen
        assert queued[1]["status"] == 200 and queued[1]["body"]["generated_text"], queued[1]
        assert restarts(server) == before + 1 and len(backends) == 2

        # The hung step returns at last: the abandoned worker leaves without a trace.
        backends[0].release()
        time.sleep(0.5)
        later = post(url, "/generate", {"inputs": PROMPT, "parameters": {"max_new_tokens": 4}})
        assert later["status"] == 200, later
        assert server.engine.state is EngineState.READY and restarts(server) == before + 1
        with server.client() as client:
            assert client.get("/health").status_code == 200
            metrics = client.get("/metrics").text
        assert "wafer_engine_step_timeouts_total 1" in metrics


def test_health_names_the_fault_while_the_backend_restarts(small_params):
    backends: list[HangingBackend] = []
    build = hanging_factory(small_params, backends)
    release_second_load = threading.Event()

    def slow_second_load() -> HangingBackend:
        if backends:
            release_second_load.wait(HANG_LIMIT_S)
        return build()

    settings = ServerSettings(
        backend="sim",
        dtype="fp32",
        max_concurrent_requests=SLOTS,
        step_timeout_s=0.5,
        step_timeout_per_item_s=0.01,
    )
    with running_server(settings, slow_second_load) as server, server.client() as client:
        backends[0].hang_next()
        response = client.post("/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 4}})
        assert response.status_code == 504, response.text
        health = client.get("/health")
        assert health.status_code == 503 and health.json()["state"] == "reloading", health.text
        assert "watchdog" in health.json()["reason"], health.text
        refused = client.post("/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 4}})
        assert refused.status_code == 503 and refused.headers["retry-after"] == "5", refused.headers
        release_second_load.set()
        assert server.engine.wait_ready(30)
        backends[0].release()


@pytest.mark.slow  # among the slowest tests (make test-fast leaves it out)
@pytest.mark.parametrize("shutdown_timeout", [1.0])
def test_shutdown_with_a_hung_step_does_not_overrun(small_params, shutdown_timeout):
    backends: list[HangingBackend] = []
    settings = ServerSettings(
        backend="sim",
        dtype="fp32",
        max_concurrent_requests=SLOTS,
        step_timeout_s=60.0,  # the watchdog would fire far later than the shutdown's deadline
        shutdown_timeout_s=shutdown_timeout,
    )
    with running_server(settings, hanging_factory(small_params, backends)) as server:
        streaming = threading.Event()
        thread, result = in_thread(lambda: stream(server.url, streaming))
        assert streaming.wait(20)
        backends[0].hang_next()
        assert backends[0].hanging.wait(5)
        started = time.monotonic()
        server.server.begin_graceful_shutdown().join(30)
        took = time.monotonic() - started
        thread.join(HANG_LIMIT_S)
        assert not thread.is_alive()
        assert took < shutdown_timeout + 6.0, took
        last = result["events"][-1]
        assert last["error_type"] == "unavailable" and "shut down" in last["error"], last
        backends[0].release()
