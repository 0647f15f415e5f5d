"""What the API needs of an engine. Two provide it: `wafer_gpt2.engine.worker.Engine` (the worker on a thread of
the server's process) and `wafer_gpt2.engine.process.EngineProcess` (the engine in a process of its own).
A submitted request is whatever the engine hands back; the handlers only read its events."""

from __future__ import annotations

from typing import Protocol

from wafer_gpt2.core.steps import BackendShape
from wafer_gpt2.engine.failures import Unavailable
from wafer_gpt2.engine.kv_slots import KVUsage
from wafer_gpt2.engine.request import GenerationRequest, Submitted
from wafer_gpt2.engine.worker import EngineState


class ServingEngine(Protocol):
    @property
    def state(self) -> EngineState: ...

    @property
    def ready(self) -> bool: ...

    @property
    def error(self) -> str | None: ...

    @property
    def fault(self) -> str | None: ...

    @property
    def load_seconds(self) -> float | None: ...

    @property
    def restarts(self) -> int: ...

    @property
    def steps(self) -> int: ...

    @property
    def backend(self) -> BackendShape: ...

    def start(self) -> None: ...

    def wait_ready(self, timeout: float) -> bool: ...

    def begin_drain(self) -> None: ...

    def shutdown(self, timeout: float = 30.0) -> None: ...

    def submit(self, request: GenerationRequest, stream: bool = True) -> Submitted: ...

    def cancel(self, state: Submitted) -> None:
        """`state`: what this engine's `submit` returned."""
        ...

    def describe(self) -> dict: ...

    def kv_usage(self) -> KVUsage: ...

    def queue_sizes(self) -> tuple[int, int]: ...

    def unavailable(self) -> Unavailable: ...
