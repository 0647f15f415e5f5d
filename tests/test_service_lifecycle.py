"""The server's life: loading, worker failure and recovery, timeouts, graceful shutdown, `serve`."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from service_harness import SlowBackend, backend_factory, running_server, sse_events, wait_until

from wafer_gpt2.cli.main import main
from wafer_gpt2.engine import worker
from wafer_gpt2.engine.core import gpt2_tokenizer_hooks
from wafer_gpt2.engine.metrics import ServiceMetrics
from wafer_gpt2.engine.worker import EngineState
from wafer_gpt2.settings import ServerSettings

PROMPT = "Once upon a time"
REPO = Path(__file__).resolve().parents[1]


def slow_factory(params, delay_s: float, slots: int = 2, build_delays=(), first_build_gate=None):
    """Backends whose steps take `delay_s`; the i-th build first sleeps build_delays[i] (if given); the
    first waits for `first_build_gate` (a threading.Event) when one is given."""
    builds = []

    def build():
        if first_build_gate is not None and not builds:
            first_build_gate.wait(30)
        if len(builds) < len(build_delays):
            time.sleep(build_delays[len(builds)])
        builds.append(1)
        return SlowBackend(backend_factory("reference", params, slots=slots)(), delay_s)

    build.builds = builds
    return build


def test_health_is_503_while_the_model_uploads(small_params):
    settings = ServerSettings(backend="reference", max_concurrent_requests=2)
    # The upload lasts until the test has seen the refusals (a fixed delay raced a loaded CI machine).
    uploaded = threading.Event()
    factory = slow_factory(small_params, 0.0, first_build_gate=uploaded)
    with running_server(settings, factory, wait_ready=False) as running, running.client() as c:
        health = c.get("/health")
        assert health.status_code == 503
        assert health.json() == {"error": "unhealthy", "error_type": "healthcheck", "state": "loading"}
        refused = c.post("/generate", json={"inputs": PROMPT})
        assert refused.status_code == 503 and "still being uploaded" in refused.json()["error"]
        uploaded.set()
        assert running.engine.wait_ready(10)
        assert c.get("/health").status_code == 200
        assert (
            c.post("/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 2}}).status_code
            == 200
        )
        assert len(factory.builds) == 1  # uploaded once, not per request


def test_a_failed_step_fails_the_requests_in_flight_then_the_worker_recovers(small_params):
    settings = ServerSettings(backend="reference", max_concurrent_requests=2)
    factory = slow_factory(small_params, 0.01, build_delays=(0.0, 0.5))  # the reload takes 0.5 s
    with running_server(settings, factory) as running, running.client() as c:
        result = {}

        def non_streaming():
            body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 100}}
            result["response"] = httpx.post(running.url + "/generate", json=body, timeout=30)

        other = threading.Thread(target=non_streaming)
        other.start()
        wait_until(lambda: running.engine.queue_sizes() == (0, 1))  # it runs before the fault comes
        body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 100}}
        with c.stream("POST", "/generate_stream", json=body) as response:
            events = []
            for event in sse_events(response):
                events.append(event)
                if len(events) == 3:
                    running.engine.inject_fault("simulated fabric error")
        other.join(30)
        assert "error" in events[-1] and events[-1]["error_type"] == "generation"
        # the client gets a log reference, the log the fault: no internal text in response bodies
        assert "reference" in events[-1]["error"] and "simulated fabric error" not in events[-1]["error"]
        failed = result["response"]
        assert failed.status_code == 424 and failed.json()["error_type"] == "generation"

        health = c.get("/health")  # the reload takes 0.5 s
        assert health.status_code == 503 and health.json()["state"] == "reloading"
        assert running.engine.wait_ready(10)
        assert c.get("/health").status_code == 200
        ok = c.post("/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 3}})
        assert ok.status_code == 200
        assert len(factory.builds) == 2
        metrics = c.get("/metrics").text
        assert "wafer_engine_restarts_total 1" in metrics
        assert 'tgi_request_failure{err="generation"} 2' in metrics
        running.wait_idle()


def test_an_engine_that_cannot_reload_reports_itself_dead(small_params):
    settings = ServerSettings(backend="reference", max_concurrent_requests=1)
    with (
        running_server(settings, backend_factory("reference", small_params, slots=1)) as running,
        running.client() as c,
    ):
        running.engine.inject_fault("wafer lost", steps=1, reloads=3)
        failed = c.post("/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 5}})
        assert failed.status_code == 424
        wait_until(lambda: running.engine.state is EngineState.FAILED)
        health = c.get("/health")
        assert health.status_code == 503 and "wafer lost" in health.json()["reason"]
        refused = c.post("/generate", json={"inputs": PROMPT})
        assert refused.status_code == 503 and "cannot serve" in refused.json()["error"]
        assert running.fatal and "wafer lost" in running.fatal[0]


def test_a_failed_first_upload_is_fatal(small_params):
    def broken():
        raise ValueError("the plan needs 900 x 900 PEs; the fabric has 757 x 996")

    settings = ServerSettings(backend="reference")
    with running_server(settings, broken, wait_ready=False) as running, running.client() as c:
        wait_until(lambda: running.engine.state is EngineState.FAILED)
        assert running.fatal == [
            "the model could not be loaded: ValueError: the plan needs 900 x 900 PEs; the fabric has 757 x 996"
        ]
        assert c.get("/health").status_code == 503


def test_a_request_past_its_timeout_fails_and_frees_its_slot(small_params):
    settings = ServerSettings(backend="reference", max_concurrent_requests=1, request_timeout_s=0.3)
    with (
        running_server(settings, slow_factory(small_params, 0.02, slots=1)) as running,
        running.client() as c,
    ):
        body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 100}}
        late = c.post("/generate", json=body)
        assert late.status_code == 504 and late.json()["error_type"] == "timeout"
        assert "within 0.3 s" in late.json()["error"]
        with c.stream(
            "POST", "/v1/completions", json={"prompt": PROMPT, "max_tokens": 100, "stream": True}
        ) as response:
            events = list(sse_events(response))
        assert events[-2]["error"]["type"] == "timeout_error" and events[-1] == "[DONE]"
        running.wait_idle()


def test_graceful_shutdown_finishes_running_requests_and_refuses_new_ones(small_params):
    """The shutdown closes the port first (a new connection is refused: its client or balancer can go
    elsewhere, knowing nothing was sent), serves the first request of a connection accepted before,
    then refuses requests on kept-alive connections (503, connection closed) while the running
    request finishes, and the server exits by itself."""
    settings = ServerSettings(backend="reference", max_concurrent_requests=2, shutdown_timeout_s=20)
    with (
        running_server(settings, slow_factory(small_params, 0.02)) as running,
        running.client() as c,
        running.client() as kept,
    ):
        assert kept.get("/health").status_code == 200  # kept alive, idle when the shutdown begins
        port = int(running.url.rsplit(":", 1)[1])
        early = socket.create_connection(("127.0.0.1", port), timeout=10)  # accepted, nothing sent yet
        body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 30, "details": True}}
        with c.stream("POST", "/generate_stream", json=body) as response:
            events = []
            for event in sse_events(response):
                events.append(event)
                if len(events) == 1:
                    running.server.begin_graceful_shutdown()
                    with pytest.raises(httpx.ConnectError):
                        httpx.post(running.url + "/generate", json=body, timeout=10)
                    with pytest.raises(httpx.ConnectError):
                        httpx.get(running.url + "/health", timeout=10)
                    short = json.dumps({"inputs": PROMPT, "parameters": {"max_new_tokens": 2}}).encode()
                    early.sendall(
                        b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                        b"Content-Length: %d\r\n\r\n%s" % (len(short), short)
                    )
                    answer = b"".join(iter(lambda: early.recv(65536), b""))  # until the server closes
                    assert answer.startswith(b"HTTP/1.1 200") and b"connection: close" in answer, answer
                    wait_until(lambda: running.engine.state is EngineState.DRAINING)
                    refused = kept.post("/generate", json=body)
                    assert refused.status_code == 503 and refused.json()["error_type"] == "unavailable"
                    assert "shutting down" in refused.json()["error"]
                    assert refused.headers["connection"] == "close"
        early.close()
        assert len(events) == 30 and events[-1]["details"]["finish_reason"] == "length"
        running.thread.join(10)
        assert not running.thread.is_alive()  # the server exited by itself once drained


def test_shutdown_timeout_ends_what_is_still_running(small_params):
    settings = ServerSettings(backend="reference", max_concurrent_requests=2, shutdown_timeout_s=0.3)
    with running_server(settings, slow_factory(small_params, 0.02)) as running, running.client() as c:
        body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 120}}
        with c.stream("POST", "/generate_stream", json=body) as response:
            events = []
            for event in sse_events(response):
                events.append(event)
                if len(events) == 1:
                    running.server.begin_graceful_shutdown()
        assert events[-1]["error_type"] == "unavailable"
        assert "shut down before this request finished" in events[-1]["error"]
        running.thread.join(10)
        assert not running.thread.is_alive()


class _CountedClose(SlowBackend):
    """A backend that counts its closes."""

    def __init__(self, inner, closes: list[int]):
        super().__init__(inner, 0.0)
        self.closes = closes

    def close(self) -> None:
        self.closes.append(1)
        super().close()


@pytest.mark.parametrize("load_outlasts_the_wait", [False, True])
def test_a_model_loaded_after_shutdown_is_closed_not_served(
    small_params, monkeypatch, caplog, load_outlasts_the_wait
):
    # Shut down while the model uploads. Where the upload ends within shutdown's wait for the worker, or
    # only after shutdown gave up on it, the backend it builds is closed once, the engine never reports
    # "model ready", and it stays stopped.
    monkeypatch.setattr(worker, "SHUTDOWN_JOIN_S", 0.2 if load_outlasts_the_wait else 10.0)
    gate, building, closes = threading.Event(), threading.Event(), []

    def build():
        building.set()
        assert gate.wait(30)
        return _CountedClose(backend_factory("reference", small_params, slots=2)(), closes)

    engine = worker.Engine(
        build, gpt2_tokenizer_hooks(), ServiceMetrics("test"), max_queue=4, step_token_budget=64
    )
    caplog.set_level(logging.INFO, logger=worker.__name__)
    engine.start()
    assert building.wait(10)
    if load_outlasts_the_wait:
        engine.shutdown(timeout=0.0)
        assert "still loading at shutdown" in caplog.text
        gate.set()
    else:
        threading.Timer(0.2, gate.set).start()
        engine.shutdown(timeout=0.0)
    wait_until(lambda: closes, timeout=10)
    time.sleep(0.1)  # a second close, if any, comes at once
    assert closes == [1]
    assert engine.state is EngineState.STOPPED
    assert "model ready" not in caplog.text
    assert "finished loading after the engine was shut down" in caplog.text


# ----- the `serve` command -------------------------------------------------------------------------


def test_serve_refuses_a_bad_checkpoint_with_one_line(tmp_path, capsys):
    assert main(["serve", "--weights", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "missing: no such file or directory" in err

    corrupt = tmp_path / "model.bin"
    corrupt.write_bytes(b"\x00" * 64)
    assert main(["serve", "--weights", str(corrupt)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "bad magic" in err


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_serve_command_serves_and_exits_cleanly_on_sigterm(small_params, write_checkpoint):
    """`serve` as it starts by default, its engine in a process of its own, here logging JSON (with
    `--no-engine-process` it runs as a subprocess in test_robust_bad_checkpoints)."""
    checkpoint = write_checkpoint(small_params, "safetensors")
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "wafer_gpt2.cli.main",
        "serve",
        "--weights",
        str(checkpoint),
        "--backend",
        "reference",
    ]
    command += ["--port", str(port), "--max-concurrent", "2", "--model", "tiny", "--log-level", "info"]
    command += ["--log-format", "json"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    process = subprocess.Popen(
        command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        url = f"http://127.0.0.1:{port}"

        def healthy() -> bool:
            assert process.poll() is None, process.communicate()[1]
            try:
                return httpx.get(url + "/health", timeout=1).status_code == 200
            except httpx.TransportError:
                return False

        wait_until(healthy, timeout=60)
        info = httpx.get(url + "/info").json()
        assert info["model_id"] == "tiny" and info["kv_slots"] == 2
        assert info["model_config_summary"]["n_layer"] == small_params.config.n_layer
        response = httpx.post(url + "/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 4}})
        assert response.status_code == 200
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
        err = process.stderr.read() if process.stderr is not None else ""
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    entries = [json.loads(line) for line in err.splitlines() if line.strip()]  # every line is JSON
    ready = [
        e for e in entries if e["logger"] == "wafer_gpt2.engine.worker" and "model ready" in e["message"]
    ]
    assert len(ready) == 1, err  # logged by the engine process, in the HTTP process's format


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--max-concurrent", "0"], "--max-concurrent must be at least 1, got 0"),
        (["--context", "4096"], "--context 4096 exceeds the model's n_positions"),
    ],
)
def test_serve_rejects_bad_options(small_params, write_checkpoint, capsys, flags, message):
    checkpoint = write_checkpoint(small_params, "safetensors")
    assert main(["serve", "--weights", str(checkpoint), *flags]) == 2
    assert message in capsys.readouterr().err
