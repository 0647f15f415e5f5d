"""What `wafer-gpt2 bench host` and `python -m tools.bench service` share: the service app under
uvicorn on 127.0.0.1 (a free port), in a thread of the benchmark's process; a spawned helper process
(the clients) that answers over a pipe; and the error a benchmark that cannot run raises."""

from __future__ import annotations

import multiprocessing
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from wafer_gpt2.core.steps import Backend
from wafer_gpt2.errors import WaferGPT2Error

if TYPE_CHECKING:
    from wafer_gpt2.settings import ServerSettings


class BenchFailed(WaferGPT2Error, RuntimeError):
    """The benchmark could not run (its server, engine or clients failed): one line, exit 2."""


class BenchServer:
    """`with BenchServer(...) as server`: started, its engine ready; `server.port`, `server.url` and
    `server.engine` for the clients and the measurements."""

    def __init__(
        self,
        backend: Backend,
        settings: ServerSettings,
        model_name: str,
        ready_timeout_s: float,
        backend_factory: Callable[[], Backend] | None = None,
    ):
        """`backend_factory`: builds the backend where the engine runs (picklable, for
        `settings.engine_process`); by default the engine gets `backend` itself."""
        from wafer_gpt2.service.api import create_app
        from wafer_gpt2.service.server import ServiceServer

        self.fatal: list[str] = []
        factory = backend_factory if backend_factory is not None else lambda: backend
        app = create_app(settings, factory, model_summary={"name": model_name}, on_fatal=self.fatal.append)
        self.engine = app.state.engine
        self.ready_timeout_s = ready_timeout_s
        self.server = ServiceServer(app, settings, log_level="warning", access_log=False)
        self.thread = threading.Thread(target=self.server.run, name="bench-uvicorn", daemon=True)
        self.port = 0
        self.url = ""

    def __enter__(self) -> BenchServer:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise BenchFailed(f"the benchmark's server did not start {self.fatal}")
            time.sleep(0.01)
        if not self.engine.wait_ready(self.ready_timeout_s):
            raise BenchFailed(f"the engine did not become ready: {self.engine.state} {self.engine.error}")
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)


class HelperProcess:
    """A helper process (spawned: it shares nothing with this one) that answers over a pipe with
    ("ok", value) or ("error", message); `target(connection, *args)` runs in it and ends on None."""

    def __init__(self, target, name: str, args: tuple = ()):
        context = multiprocessing.get_context("spawn")
        self.connection, child = context.Pipe()
        self.process = context.Process(target=target, args=(child, *args), name=name, daemon=True)
        self.child = child

    def start(self) -> None:
        self.process.start()
        self.child.close()

    def answer(self, timeout_s: float, what: str):
        if not self.connection.poll(timeout_s):
            raise BenchFailed(f"the benchmark's {self.process.name} did not {what} within {timeout_s:g} s")
        status, value = self.connection.recv()
        if status == "error":
            raise BenchFailed(f"the benchmark's {self.process.name} failed: {value}")
        return value

    def stop(self) -> None:
        try:
            self.connection.send(None)
        except OSError:
            pass
        self.process.join(timeout=30)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(timeout=10)
        self.connection.close()
