"""Worker faults on the simulator backend: the wafer worker fails or dies in the middle of generation.

What it guarantees, for each way of failing: every request in flight (streaming or not, TGI or OpenAI)
ends promptly with a `generation` error (424, or an error event once its stream has started) and never
hangs; /health answers 503 (`reloading`) while the worker rebuilds the backend and re-uploads the
model; requests that were waiting in the queue are then served, and so are new ones; no KV slot is left
held.

The three faults:
- the engine's test hook makes the next step raise (`Engine.inject_fault`);
- a corrupted message reaches the simulated wafer's input stream: the PE program's guard raises inside
  the runtime's command thread, and the runtime refuses every later command (the SDK's behaviour);
- the simulated wafer goes away: its runtime is stopped under the worker (`SimRuntime.stop()`), so the
  runtime's command thread is gone and the step in flight cannot complete.
The last two use only the runtime's public contract (`memcpy_h2d`, `stop`); no hook in the simulator.
A step that raises `SystemExit` (not an `Exception`) is a fault like any other. When the worker itself
cannot go on (its reload raises `SystemExit`, or it is interrupted), the engine does not sit silently
stopped: every request ends, /health answers 503 and the server is told to exit (`on_fatal`).
"""

from __future__ import annotations

import re
import threading
import time

import httpx
import numpy as np
import pytest
from service_harness import backend_factory, running_server, sse_events, wait_until

from wafer_gpt2.core.steps import WANT_SCORES
from wafer_gpt2.core.wire import H2D_COLOR
from wafer_gpt2.engine.worker import EngineState
from wafer_gpt2.settings import ServerSettings

SLOTS = 2
PROMPT = "The worker was in the middle of a step when"
LONG = 100  # tokens for the requests in flight: the fault comes long before they could finish
SHORT = 4  # tokens for the queued ones
HANG_LIMIT_S = 20.0  # far above any answer here; a request still open by then hangs


@pytest.fixture(scope="module")
def server(small_params):
    settings = ServerSettings(
        backend="sim", model_id="faulty", dtype="fp32", max_concurrent_requests=SLOTS, max_queue=8
    )
    with running_server(settings, GatedReloads(backend_factory("sim", small_params, slots=SLOTS))) as running:
        yield running


class GatedReloads:
    """The server's backend factory; every build after the first (a reload) waits for `RELOAD_GATE`,
    which the test's HealthWatch opens once /health has said 503 "reloading": a reload that takes
    milliseconds (the plan kept from the first build) is still seen."""

    def __init__(self, factory):
        self.factory = factory
        self.builds = 0

    def __call__(self):
        if self.builds:
            RELOAD_GATE.wait(30)
        self.builds += 1
        return self.factory()


RELOAD_GATE = threading.Event()
RELOAD_GATE.set()  # open unless a HealthWatch is watching for the reload


class HealthWatch:
    """Polls /health every 10 ms in a thread, keeping each distinct (status, state) in order."""

    def __init__(self, url: str):
        self.url = url
        self.seen: list[tuple[int, str | None]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=5) as client:
            while not self._stop.is_set():
                response = client.get("/health")
                answer = (response.status_code, response.json()["state"] if response.content else None)
                if not self.seen or self.seen[-1] != answer:
                    self.seen.append(answer)
                if answer == (503, "reloading"):
                    RELOAD_GATE.set()
                time.sleep(0.01)

    def __enter__(self) -> HealthWatch:
        RELOAD_GATE.clear()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)
        RELOAD_GATE.set()  # a reload still to come (none expected) need not wait


def in_thread(call) -> tuple[threading.Thread, dict]:
    result: dict = {}

    def run() -> None:
        started = time.monotonic()
        try:
            result.update(call())
        finally:
            result["seconds"] = time.monotonic() - started

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result


def stream(url: str, route: str, body: dict, progress: threading.Event | None = None) -> dict:
    events = []
    with httpx.Client(base_url=url, timeout=HANG_LIMIT_S) as client:
        with client.stream("POST", route, json=body) as response:
            for event in sse_events(response):
                events.append(event)
                if progress is not None and len(events) == 3:
                    progress.set()
    return {"status": response.status_code, "events": events}


def post(url: str, route: str, body: dict) -> dict:
    response = httpx.post(url + route, json=body, timeout=HANG_LIMIT_S)
    return {"status": response.status_code, "body": response.json()}


def restarts(server) -> int:
    with server.client() as c:
        return int(float(re.search(r"^wafer_engine_restarts_total (\S+)$", c.get("/metrics").text, re.M)[1]))


REFERENCE = re.compile(r"\(reference ([0-9a-f]{12}); the server log has the details\)")


def run_fault_drill(server, inject, names_the_fault: str, caplog) -> None:
    """Two requests running (a TGI stream, a non-streaming OpenAI request), two queued (a non-streaming
    TGI request, an OpenAI stream); `inject()` fails the worker; check what each gets and what follows.
    The errors of the requests in flight carry a log reference, not the fault's text (no internal text in bodies); the
    log line with that reference matches the regular expression `names_the_fault`."""
    url = server.url
    restarts_before = restarts(server)
    streaming = threading.Event()
    running = [
        in_thread(
            lambda: stream(
                url, "/generate_stream", {"inputs": PROMPT, "parameters": {"max_new_tokens": LONG}}, streaming
            )
        ),
        in_thread(
            lambda: post(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": LONG, "ignore_eos": True})
        ),
    ]
    wait_until(lambda: streaming.is_set() and server.engine.queue_sizes() == (0, SLOTS), timeout=20)
    queued = [
        in_thread(
            lambda: post(url, "/generate", {"inputs": PROMPT, "parameters": {"max_new_tokens": SHORT}})
        ),
        in_thread(
            lambda: stream(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": SHORT, "stream": True})
        ),
    ]
    wait_until(lambda: server.engine.queue_sizes() == (2, SLOTS), timeout=10)

    with HealthWatch(url) as health:
        inject()
        for thread, _ in running + queued:
            thread.join(HANG_LIMIT_S)
            assert not thread.is_alive(), "a request hung after the worker failed"
        assert server.engine.wait_ready(30), f"no recovery: {server.engine.state} {server.engine.error}"
        wait_until(lambda: health.seen[-1] == (200, None), timeout=5)

    # The requests in flight failed with a generation error naming the fault.
    tgi_stream, openai_call = (result for _, result in running)
    assert tgi_stream["status"] == 200 and len(tgi_stream["events"]) < LONG
    last = tgi_stream["events"][-1]
    assert last["error_type"] == "generation" and not re.search(names_the_fault, last["error"]), last
    reference = REFERENCE.search(last["error"])[1]
    assert openai_call["status"] == 424, openai_call
    error = openai_call["body"]["error"]
    assert error["type"] == "generation_error" and REFERENCE.search(error["message"])[1] == reference, error
    (logged,) = [r.getMessage() for r in caplog.records if f"(reference {reference})" in r.getMessage()]
    assert re.search(names_the_fault, logged), logged

    # /health said 503 while the worker reloaded, then 200 again.
    assert (503, "reloading") in health.seen and health.seen[-1] == (200, None), health.seen
    assert restarts(server) == restarts_before + 1

    # The queued requests were kept through the reload and served after it.
    tgi_queued, openai_queued = (result for _, result in queued)
    assert tgi_queued["status"] == 200 and tgi_queued["body"]["generated_text"], tgi_queued
    assert openai_queued["status"] == 200 and openai_queued["events"][-1] == "[DONE]", openai_queued
    assert not any("error" in event for event in openai_queued["events"][:-1]), openai_queued

    server.wait_idle(timeout=10)
    later = post(
        url, "/generate", {"inputs": PROMPT, "parameters": {"max_new_tokens": SHORT, "details": True}}
    )
    assert later["status"] == 200 and later["body"]["details"]["generated_tokens"] == SHORT
    assert server.engine.state is EngineState.READY


def test_a_failed_step_fails_the_requests_in_flight_and_the_worker_reloads(server, caplog):
    run_fault_drill(
        server, lambda: server.engine.inject_fault("injected: fabric link down"), "fabric link down", caplog
    )


def test_a_fault_inside_the_simulated_wafer_fails_the_step(server, caplog):
    def corrupt_the_input_stream() -> None:
        # A message whose slot lies outside the program: the PE program's guard raises (KernelFault) in
        # the runtime's command thread, mid-way between the engine's own messages.
        backend = server.engine.backend
        plan = backend.plan
        words = np.array([1, plan.slots, 0, 0, WANT_SCORES, 0], dtype=np.uint32)  # header, one item
        port_in, _ = plan.io_ports(0)
        backend.runtime.memcpy_h2d(
            H2D_COLOR, words, port_in.x, port_in.y, 1, 1, words.size, streaming=True, nonblock=True
        )

    run_fault_drill(server, corrupt_the_input_stream, "is outside the program's", caplog)


def test_the_simulated_wafer_going_away_fails_the_step(server, caplog):
    # The step in flight meets the stopped runtime's own refusal (never the thread pool's error).
    stopped = r"the runtime was stopped; no command is accepted after stop\(\)"
    run_fault_drill(server, lambda: server.engine.backend.runtime.stop(), stopped, caplog)


def test_a_step_raising_system_exit_is_a_fault_the_worker_recovers_from(server, caplog):
    run_fault_drill(
        server,
        lambda: server.engine.inject_fault("injected: backend called exit", error=SystemExit),
        r"SystemExit: injected: backend called exit",
        caplog,
    )
    assert server.fatal == []


@pytest.mark.parametrize(
    ("error", "reloads", "state", "names_it"),
    [
        (SystemExit, 1, "failed", "the wafer worker died (SystemExit: injected: no way back"),
        (KeyboardInterrupt, 0, "stopped", "interrupted (KeyboardInterrupt)"),
    ],
)
def test_a_worker_that_cannot_go_on_ends_every_request_and_the_server(
    small_params, error, reloads, state, names_it
):
    settings = ServerSettings(backend="reference", max_concurrent_requests=1)
    with (
        running_server(settings, backend_factory("reference", small_params, slots=1)) as running,
        running.client() as c,
    ):
        # A SystemExit step is recovered from, but then the reload raises SystemExit too: the worker
        # is gone. A KeyboardInterrupt ends the worker at once.
        running.engine.inject_fault("injected: no way back", steps=1, reloads=reloads, error=error)
        failed = c.post("/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": SHORT}})
        assert failed.status_code == (424 if reloads else 503), failed.text
        wait_until(lambda: running.fatal, timeout=10)  # the server is told to exit

        health = c.get("/health")
        assert health.status_code == 503 and health.json()["state"] == state, health.text
        refused = c.post("/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": SHORT}})
        assert refused.status_code == 503, refused.text
        assert len(running.fatal) == 1 and names_it in running.fatal[0], running.fatal
        if state == "failed":
            # clients get the log reference the server's exit message names, never the exception's text
            reason, error = health.json()["reason"], refused.json()["error"]
            reference = REFERENCE.search(reason)[1]
            assert reason.startswith("the wafer worker died (reference") and reference in running.fatal[0]
            assert REFERENCE.search(error)[1] == reference and "injected" not in reason + error
