"""Real servers for the service tests: the app under uvicorn on 127.0.0.1 (a free port), in a thread.

`SlowBackend` wraps a real backend and sleeps before each step: it makes step timing predictable on
a busy machine for the tests that need time to act mid-generation (shutdown, timeouts, faults).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

import httpx
import numpy as np

from wafer_gpt2.backends.reference import ReferenceBackend
from wafer_gpt2.backends.registry import BackendOptions, build_backend
from wafer_gpt2.core.steps import Backend, StepInputs, StepItem
from wafer_gpt2.engine.worker import Engine
from wafer_gpt2.model import tokenizer
from wafer_gpt2.model.params import GPT2Params
from wafer_gpt2.service.api import create_app
from wafer_gpt2.service.server import ServiceServer
from wafer_gpt2.settings import ServerSettings


@dataclass
class RunningServer:
    url: str
    server: ServiceServer
    engine: Engine
    thread: threading.Thread
    fatal: list[str]

    def client(self, **kwargs) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=kwargs.pop("timeout", 60.0), **kwargs)

    def wait_idle(self, timeout: float = 10.0) -> None:
        """Until no request is queued or running and no KV slot is held."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.engine.queue_sizes() == (0, 0) and self.engine.kv_usage().slots_used == 0:
                return
            time.sleep(0.01)
        raise AssertionError(
            f"engine not idle: queue {self.engine.queue_sizes()}, kv {self.engine.kv_usage()}"
        )


def backend_factory(
    backend: str,
    params: GPT2Params,
    slots: int,
    context: int | None = None,
    top_k: int = 64,
    dtype: str = "fp32",
):
    """Picklable: it also serves an engine in a process of its own (`settings.engine_process`)."""
    options = BackendOptions(slots=slots, context=context, top_k=top_k, dtype=dtype)
    return functools.partial(build_backend, backend, params, options)


class SlowBackend:
    """A real backend whose steps take at least `delay_s` (for tests that act mid-generation)."""

    def __init__(self, inner: Backend, delay_s: float):
        self.inner = inner
        self.delay_s = delay_s
        self.num_slots = inner.num_slots
        self.context_length = inner.context_length
        self.vocab_size = inner.vocab_size
        self.top_k = inner.top_k

    def step(self, inputs):
        time.sleep(self.delay_s)
        return self.inner.step(inputs)

    def free_slot(self, slot: int) -> None:
        self.inner.free_slot(slot)

    def reset(self) -> None:
        self.inner.reset()

    def describe(self) -> dict:
        return self.inner.describe()

    def close(self) -> None:
        self.inner.close()


def slow_backend(factory: Callable[[], Backend], delay_s: float) -> SlowBackend:
    """`functools.partial(slow_backend, factory, delay_s)`: a picklable factory of a SlowBackend."""
    return SlowBackend(factory(), delay_s)


def built_late(factory: Callable[[], Backend], delay_s: float) -> Backend:
    """`functools.partial(built_late, factory, delay_s)`: a picklable factory whose build (the model's
    upload) takes `delay_s`."""
    time.sleep(delay_s)
    return factory()


class HangingBackend(SlowBackend):
    """A real backend whose next step, once `hang_next()` is called, blocks until `release()`: a
    backend step that never returns (as a wafer that stops answering would)."""

    def __init__(self, inner: Backend):
        super().__init__(inner, 0.0)
        self._armed = threading.Event()
        self._released = threading.Event()
        self.hanging = threading.Event()  # set while a step hangs

    def hang_next(self) -> None:
        self._armed.set()

    def release(self) -> None:
        self._released.set()

    def step(self, inputs):
        if self._armed.is_set():
            self._armed.clear()
            self.hanging.set()
            self._released.wait()
        return self.inner.step(inputs)


@contextmanager
def running_server(
    settings: ServerSettings, factory: Callable[[], Backend], wait_ready: bool = True
) -> Iterator[RunningServer]:
    fatal: list[str] = []
    app = create_app(settings, factory, model_summary={"name": "test"}, on_fatal=fatal.append)
    server = ServiceServer(app, replace(settings, port=0), log_level="warning", access_log=False)
    thread = threading.Thread(target=server.run, name="uvicorn-test", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    running = RunningServer(f"http://127.0.0.1:{port}", server, app.state.engine, thread, fatal)
    if wait_ready:
        assert running.engine.wait_ready(30), (
            f"engine not ready: {running.engine.state} {running.engine.error}"
        )
    try:
        yield running
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def sse_events(response: httpx.Response) -> Iterator[dict | str]:
    """The `data:` payloads of a Server-Sent Events response (JSON decoded, `[DONE]` as a string)."""
    for line in response.iter_lines():
        if line.startswith("data:"):
            payload = line[len("data:") :].strip()
            yield payload if payload == "[DONE]" else json.loads(payload)


def reference_greedy(params, prompt: list[int], n_new: int) -> tuple[list[int], list[float], list[float]]:
    """Greedy tokens, their logprobs and the prompt logprobs, straight from the reference forward pass."""
    backend = ReferenceBackend(params, slots=1, context=len(prompt) + n_new, top_k=64)
    items = [
        StepItem(0, p, t, target=prompt[p + 1] if p + 1 < len(prompt) else None) for p, t in enumerate(prompt)
    ]
    scores = backend.step(StepInputs.of_items(items)).rows()
    prompt_logprobs = [s.logprob(s.target_logit) for s in scores[:-1]]
    tokens, logprobs, last = [], [], scores[-1]
    for i in range(n_new):
        token = int(last.topk_ids[0])
        tokens.append(token)
        logprobs.append(last.logprob(last.topk_logits[0]))
        if i < n_new - 1:
            (last,) = backend.step(StepInputs.of_items([StepItem(0, len(prompt) + i, token)])).rows()
    return tokens, logprobs, prompt_logprobs


def always_end_of_text(params: GPT2Params) -> GPT2Params:
    """The model rigged to predict <|endoftext|> after any input: the final LayerNorm outputs one
    direction whatever its input, and <|endoftext|>'s embedding (the tied LM head row) is that direction."""
    direction = np.random.default_rng(0).standard_normal(params.config.n_embd).astype(np.float32)
    wte = params.wte.copy()
    wte[tokenizer.EOT_ID] = direction
    return dataclasses.replace(params, wte=wte, ln_f_g=np.zeros_like(params.ln_f_g), ln_f_b=direction)


def run_concurrently(calls) -> list:
    results = [None] * len(calls)

    def run(i, call):
        results[i] = call()

    threads = [threading.Thread(target=run, args=(i, call)) for i, call in enumerate(calls)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return results


def wait_until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.005)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (for servers started as subprocesses)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
