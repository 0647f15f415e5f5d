"""Running the app under uvicorn, with a shutdown that drains instead of dropping requests.

Plain uvicorn stops accepting connections as soon as it is told to exit. Here the first SIGINT/SIGTERM
(or `begin_graceful_shutdown()`) keeps the listener open and puts the engine into draining: new
requests get 503 while the running ones finish, up to `shutdown_timeout_s`; what is still running then
gets a 503 error, and only then does uvicorn exit. A second signal exits at once.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import uvicorn
from fastapi import FastAPI

from service.connections import ConnectionLimits, protocol_class
from service.serving import ServingEngine
from service.settings import ServerSettings

log = logging.getLogger(__name__)


class ServiceServer(uvicorn.Server):
    def __init__(
        self,
        app: FastAPI,
        settings: ServerSettings,
        log_level: str = "info",
        access_log: bool = True,
        own_log_format: bool = False,
    ):
        """`own_log_format`: uvicorn installs no handlers of its own; its records reach the root logger's
        (`service.logs.configure`), in the same format as the service's (JSON lines, say)."""
        extra: dict[str, Any] = {"log_config": None} if own_log_format else {}
        config = uvicorn.Config(
            app,
            **extra,
            host=settings.host,
            port=settings.port,
            log_level=log_level,
            loop=settings.event_loop,
            access_log=access_log,
            timeout_graceful_shutdown=5,  # by then the engine has ended every request
            # uvicorn annotates int but only hands it to loop.call_later: fractional seconds work.
            timeout_keep_alive=settings.keep_alive_timeout_s,  # type: ignore[arg-type]
            http=protocol_class(
                ConnectionLimits(
                    header_timeout_s=settings.header_timeout_s,
                    body_timeout_s=settings.body_timeout_s,
                    keep_alive_timeout_s=settings.keep_alive_timeout_s,
                    max_connections=settings.max_connections,
                    max_body_pending_per_client=settings.max_body_pending_per_client,
                )
            ),
        )
        super().__init__(config)
        self.engine: ServingEngine = app.state.engine
        self.shutdown_timeout_s = settings.shutdown_timeout_s
        self._draining = threading.Event()

    def handle_exit(self, sig: int, frame) -> None:
        if self._draining.is_set():
            log.warning("second shutdown signal: exiting without waiting for running requests")
            self.force_exit = True
            self.should_exit = True
            return
        self.begin_graceful_shutdown()

    def begin_graceful_shutdown(self) -> threading.Thread:
        """Refuse new requests (503), let running ones finish, then stop the server."""
        self._draining.set()
        log.info("shutting down: draining running requests (up to %.0f s)", self.shutdown_timeout_s)
        self.engine.begin_drain()

        def drain_then_exit() -> None:
            self.engine.shutdown(self.shutdown_timeout_s)
            self.should_exit = True

        thread = threading.Thread(target=drain_then_exit, name="wafer-drain", daemon=True)
        thread.start()
        return thread
