"""The engine in a process of its own (`serve --engine-process`, `wafer_gpt2/engine/process.py`).

Every route runs against it in tests/test_service_api.py (the `engine-process` cases). Here: what
crossing a process boundary adds. The HTTP process refuses at once when the engine is not ready
(503; when it is full, 429: tests/test_service_api.py); a failed step reaches the requests in flight and the engine reloads (the engine's
metrics, merged into /metrics, count the restart); a graceful shutdown drains and then stops the engine
process. An engine process that stops, stops reading or dies: tests/test_robust_engine_process.py.
"""

from __future__ import annotations

import asyncio
import functools
import multiprocessing
import os
import re
import struct
import threading

import httpx
import pytest
from service_harness import (
    backend_factory,
    built_late,
    running_server,
    slow_backend,
    sse_events,
)

from wafer_gpt2.engine.metrics import ServiceMetrics
from wafer_gpt2.engine.process import EngineOptions, EngineProcess, FrameReader
from wafer_gpt2.settings import ServerSettings

PROMPT = "The engine runs in a process of its own"
LONG = 100  # tokens: far more than a test lets run before it acts (the context is 128)


def settings(**overrides) -> ServerSettings:
    return ServerSettings(backend="reference", model_id="tiny-gpt2", engine_process=True, **overrides)


def slow(small_params, slots: int, delay_s: float = 0.02):
    return functools.partial(slow_backend, backend_factory("reference", small_params, slots=slots), delay_s)


def long_stream(url: str, first_token: threading.Event) -> dict:
    """A TGI stream of LONG tokens; `first_token` is set when its first event arrives."""
    events: list = []
    with httpx.Client(base_url=url, timeout=30) as client:
        body = {"inputs": PROMPT, "parameters": {"max_new_tokens": LONG}}
        with client.stream("POST", "/generate_stream", json=body) as response:
            for event in sse_events(response):
                events.append(event)
                first_token.set()
    return {"status": response.status_code, "events": events}


def in_thread(call) -> tuple[threading.Thread, dict]:
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(call()), daemon=True)
    thread.start()
    return thread, result


def test_the_engine_runs_in_another_process_and_answers_like_the_in_process_one(small_params):
    body = {
        "inputs": PROMPT,
        "parameters": {"max_new_tokens": 12, "details": True, "decoder_input_details": True},
    }
    answers = []
    for engine_process in (False, True):
        config = ServerSettings(backend="reference", model_id="tiny-gpt2", engine_process=engine_process)
        with running_server(config, backend_factory("reference", small_params, slots=2)) as running:
            assert isinstance(running.engine, EngineProcess) is engine_process
            if engine_process:
                assert running.engine.pid not in (None, os.getpid())
            with running.client() as c:
                answers.append(c.post("/generate", json=body).json())
    assert answers[0] == answers[1]


STREAMS = [
    ("/generate_stream", {"inputs": PROMPT, "parameters": {"max_new_tokens": 14, "details": True}}),
    (
        "/generate_stream",
        {
            "inputs": "A second prompt, streamed",
            "parameters": {
                "max_new_tokens": 9,
                "top_n_tokens": 2,
                "details": True,
            },
        },
    ),
    (
        "/generate_stream",
        {
            "inputs": PROMPT,
            "parameters": {"max_new_tokens": 11, "do_sample": True, "temperature": 0.8, "seed": 4},
        },
    ),
    ("/generate_stream", {"inputs": PROMPT, "parameters": {"max_new_tokens": 12, "stop": ["e", "in"]}}),
    (
        "/v1/completions",
        {
            "prompt": "Streams of different lengths",
            "max_tokens": 7,
            "stream": True,
            "logprobs": 1,
            "ignore_eos": True,
            "skip_special_tokens": False,
            "temperature": 0,
        },
    ),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 16, "stream": True, "seed": 9, "temperature": 0.7}),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "stream": True, "temperature": 0, "stop": [" "]}),
    (
        "/v1/completions",
        {"prompt": "Echoed", "max_tokens": 5, "stream": True, "echo": True, "logprobs": 2, "seed": 1},
    ),
]


def _stream_events(url: str, route: str, body: dict) -> list[dict | str]:
    with httpx.Client(base_url=url, timeout=60) as client:
        with client.stream("POST", route, json=body) as response:
            assert response.status_code == 200
            events = list(sse_events(response))
    for event in events:  # an OpenAI chunk's id and time are its own
        if isinstance(event, dict):
            event.pop("id", None)
            event.pop("created", None)
    return events


def test_streams_from_the_engine_process_are_the_in_process_engines(small_params):
    """Streamed requests whose text the HTTP process makes (no stop sequences: their token events cross
    the pipe as ids) and those whose text the engine makes (stop sequences) hear the same events, token
    by token and at the end, as from an engine in the server's own process (one at a time: the
    reference backend's logprobs depend on what else is in the step)."""
    heard = []
    for engine_process in (False, True):
        config = ServerSettings(backend="reference", model_id="tiny-gpt2", engine_process=engine_process)
        with running_server(config, backend_factory("reference", small_params, slots=2)) as running:
            heard.append([_stream_events(running.url, route, body) for route, body in STREAMS])
    assert heard[0] == heard[1]
    assert all(len(events) > 2 for events in heard[0])


def test_a_failed_step_reaches_the_requests_in_flight_and_the_engine_reloads(small_params):
    with running_server(settings(max_concurrent_requests=2), slow(small_params, 2)) as running:
        first_token = threading.Event()
        thread, result = in_thread(lambda: long_stream(running.url, first_token))
        assert first_token.wait(20)
        running.engine.inject_fault("injected: fabric link down")
        thread.join(30)
        assert not thread.is_alive()
        last = result["events"][-1]
        assert result["status"] == 200 and len(result["events"]) < LONG
        assert last["error_type"] == "generation" and "fabric link down" not in last["error"], last
        assert running.engine.wait_ready(30), running.engine.state
        with running.client() as c:
            served = c.post("/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 3}})
            assert served.status_code == 200, served.text
            assert re.search(r"^wafer_engine_restarts_total 1$", c.get("/metrics").text, re.M)
        running.wait_idle()
        assert running.engine.restarts == 1 and running.fatal == []


def test_a_graceful_shutdown_drains_then_stops_the_engine_process(small_params):
    with running_server(settings(max_concurrent_requests=2), slow(small_params, 2, 0.01)) as running:
        process = running.engine.process
        with (
            running.client() as c,
            c.stream(
                "POST", "/generate_stream", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 20}}
            ) as response,
        ):
            events = sse_events(response)
            next(events)
            drain = running.server.begin_graceful_shutdown()
            with pytest.raises(httpx.ConnectError):  # the port is closed first
                httpx.post(
                    running.url + "/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 3}}
                )
            rest = list(events)
        assert rest[-1]["generated_text"] is not None and "error" not in rest[-1], rest[-1]
        drain.join(30)
        process.join(10)
        assert process.exitcode == 0 and running.fatal == []


def test_the_engine_process_reports_loading_until_its_backend_is_built(small_params):
    factory = functools.partial(built_late, backend_factory("reference", small_params, slots=1), 1.5)
    with running_server(settings(max_concurrent_requests=1), factory, wait_ready=False) as running:
        with running.client() as c:
            early = c.get("/health")
            assert early.status_code == 503 and early.json()["state"] == "loading", early.text
            refused = c.post("/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 3}})
            assert refused.status_code == 503 and refused.headers["Retry-After"], refused.text
            assert running.engine.wait_ready(30)
            assert c.get("/health").status_code == 200
            info = c.get("/info").json()
            assert (info["kv_slots"], info["backend"]) == (1, "reference"), info


def test_settling_the_heap_freezes_what_lives_and_frees_what_a_reload_dropped():
    import gc
    import weakref

    from wafer_gpt2.engine import heap

    class Node:
        pass

    try:
        kept, dropped = Node(), Node()
        dropped.self = dropped  # a cycle: only the cyclic collector frees it
        gone = weakref.ref(dropped)
        heap.settle()
        assert gc.get_freeze_count() > 0 and gone() is not None  # frozen while it is referenced
        del dropped
        gc.collect()
        assert gone() is not None  # a frozen cycle is out of the collector's reach...
        heap.settle()
        assert gone() is None and kept is not None  # ...until the next settle unfreezes it first
    finally:
        gc.unfreeze()


def test_a_server_that_freezes_its_heap_has_frozen_it_once_started(small_params):
    import gc

    try:
        config = ServerSettings(backend="reference", model_id="tiny-gpt2", freeze_heap=True)
        with running_server(config, backend_factory("reference", small_params, slots=1)) as running:
            assert gc.get_freeze_count() > 0
            with running.client() as c:
                assert (
                    c.post(
                        "/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 2}}
                    ).status_code
                    == 200
                )
    finally:
        gc.unfreeze()


def test_the_pipe_is_read_whole_message_by_whole_message_at_one_read():
    """`FrameReader` reads `Connection.send_bytes`' frames as the other end wrote them, every whole one
    that has arrived at once: several in one read, none of a frame whose bytes have not all arrived,
    the long form of the length, and None once the other end is closed."""
    ours, theirs = multiprocessing.Pipe()
    reader = FrameReader(ours.fileno())
    try:
        assert reader.read() == []  # nothing yet, and it does not block
        for payload in (b"first", b"", b"x" * 70_000):
            theirs.send_bytes(payload)
        got: list[bytes] = []
        while len(got) < 3:
            got += reader.read(wait=True) or []
        assert got == [b"first", b"", b"x" * 70_000]

        frame = struct.pack("!i", 6) + b"second"
        os.write(theirs.fileno(), frame[:7])  # the length and a byte: not a whole message yet
        assert reader.read() == []
        os.write(theirs.fileno(), frame[7:] + struct.pack("!iQ", -1, 4) + b"long")
        assert reader.read(wait=True) == [b"second", b"long"]
        theirs.send_bytes(b"last")
        theirs.close()
        assert reader.read(wait=True) == [b"last"]
        assert reader.read(wait=True) is None
    finally:
        reader.close()
        ours.close()


def test_asking_the_engine_process_on_the_loop_that_reads_its_answers_is_refused(small_params):
    """The server's event loop reads the engine's pipe, so a round trip asked on that loop could never
    get its answer: it is refused at once instead of stalling the loop for the answer's timeout. Off the
    loop (as /info and /metrics ask) the answer comes."""
    options = EngineOptions.of(settings(), backend_factory("reference", small_params, slots=1))
    engine = EngineProcess(options, ServiceMetrics("tiny-gpt2"))

    async def ask_both_ways():
        engine.start()
        try:
            with pytest.raises(RuntimeError, match="kv_usage on the event loop that reads its answers"):
                engine.kv_usage()
            assert await asyncio.to_thread(engine.wait_ready, 30), engine.state
            usage = await asyncio.to_thread(engine.kv_usage)
            assert usage.slots_total == 1
        finally:
            await asyncio.to_thread(engine.shutdown, 10.0)

    asyncio.run(ask_both_ways())
