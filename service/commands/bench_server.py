"""What `bench service` and `bench host` share: the service app under uvicorn on 127.0.0.1 (a free
port), in a thread of the benchmark's process, and the error a benchmark that cannot run raises."""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

from wafer.errors import WaferGPT2Error
from wafer.executor import Executor

if TYPE_CHECKING:
    from service.settings import ServerSettings


class BenchFailed(WaferGPT2Error, RuntimeError):
    """The benchmark could not run (its server, engine or clients failed): one line, exit 2."""


class BenchServer:
    """`with BenchServer(...) as server`: started, its engine ready; `server.port`, `server.url` and
    `server.engine` for the clients and the measurements."""

    def __init__(self, executor: Executor, settings: ServerSettings, model_name: str, ready_timeout_s: float):
        from service.api import create_app
        from service.server import ServiceServer

        self.fatal: list[str] = []
        app = create_app(
            settings, lambda: executor, model_summary={"name": model_name}, on_fatal=self.fatal.append
        )
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
