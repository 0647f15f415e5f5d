"""Running the app under uvicorn, with a shutdown that drains instead of dropping requests.

The first SIGINT/SIGTERM (or `begin_graceful_shutdown()`):

1. stops accepting: the connections the kernel has already completed are accepted, then the port is
   closed. A new connection is refused from then on, which a client or balancer can retry elsewhere
   knowing the request never reached this server (HAProxy does, `deploy/haproxy/haproxy.cfg`), and
   which takes this server out of the balancer's health checks.
2. serves what was accepted: every connection closes after its current request's response, or its
   first one's if it has sent none yet; those get up to the header timeout to send it.
3. drains: the engine refuses any further request (503, on a kept-alive connection) while the running
   ones finish, up to `shutdown_timeout_s` in all; what is still running then gets a 503 error, and
   only then does uvicorn exit.

A second signal exits at once.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
import threading
import time
from typing import Any

import uvicorn
from fastapi import FastAPI

from wafer_gpt2.engine.serving import ServingEngine
from wafer_gpt2.service.connections import ConnectionLimits, protocol_class
from wafer_gpt2.settings import ServerSettings

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
        (`wafer_gpt2.logs.configure`), in the same format as the service's (JSON lines, say)."""
        extra: dict[str, Any] = {"log_config": None} if own_log_format else {}
        self.protocol = protocol_class(
            ConnectionLimits(
                header_timeout_s=settings.header_timeout_s,
                body_timeout_s=settings.body_timeout_s,
                keep_alive_timeout_s=settings.keep_alive_timeout_s,
                max_connections=settings.max_connections,
                max_body_pending_per_client=settings.max_body_pending_per_client,
                body_pending_grace_s=settings.body_pending_grace_s,
            )
        )
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
            http=self.protocol,
        )
        super().__init__(config)
        self.engine: ServingEngine = app.state.engine
        self.shutdown_timeout_s = settings.shutdown_timeout_s
        self.first_request_grace_s = min(settings.header_timeout_s, settings.shutdown_timeout_s)
        self._draining = threading.Event()
        self._not_accepting = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()

    def handle_exit(self, sig: int, frame) -> None:
        if self._draining.is_set():
            log.warning("second shutdown signal: exiting without waiting for running requests")
            self.force_exit = True
            self.should_exit = True
            return
        self.begin_graceful_shutdown()

    def begin_graceful_shutdown(self) -> threading.Thread:
        """Stop accepting connections, serve what was accepted, refuse further requests (503) while the
        running ones finish, then stop the server (the module's docstring has the steps). Called off the
        event loop's thread, it returns once the port is closed."""
        self._draining.set()
        log.info(
            "shutting down: closing the port, draining running requests (up to %.0f s)",
            self.shutdown_timeout_s,
        )
        loop = self._loop
        stopping = None
        if loop is not None and not loop.is_closed():
            stopping = asyncio.run_coroutine_threadsafe(self._stop_accepting(), loop)

        def drain_then_exit() -> None:
            started = time.monotonic()
            if stopping is not None:
                try:
                    stopping.result(self.shutdown_timeout_s)
                except Exception:  # the drain goes on whatever happened to the listener
                    log.exception("stopping the listener failed")
            self.engine.shutdown(max(0.0, self.shutdown_timeout_s - (time.monotonic() - started)))
            self.should_exit = True

        thread = threading.Thread(target=drain_then_exit, name="wafer-drain", daemon=True)
        thread.start()
        if stopping is not None and threading.get_ident() != self._loop_thread:
            self._not_accepting.wait(5.0)
        return thread

    async def _stop_accepting(self) -> None:
        """Steps 1 and 2 of the shutdown, on the event loop."""
        loop = asyncio.get_running_loop()
        servers = getattr(self, "servers", [])
        # The loop accepts no more on its own; the connections it has accepted get their protocol while
        # their server is open (asyncio drops one whose server closed first).
        for server in servers:
            for listener in server.sockets:
                loop.remove_reader(listener.fileno())
        for _ in range(2):
            await asyncio.sleep(0)
        accepted: list[socket.socket] = []
        for server in servers:
            for listener in server.sockets:
                accepted += _accept_queued(listener)
            server.close()
        self.protocol.begin_closing(self.server_state.connections)
        self._not_accepting.set()
        protocol = functools.partial(
            self.protocol,
            config=self.config,
            server_state=self.server_state,
            app_state=self.lifespan.state,
        )
        for connection in accepted:
            await loop.connect_accepted_socket(protocol, connection)
        if accepted:
            log.info("shutting down: %d connections accepted before the port closed", len(accepted))
        # The engine drains (refusing new requests) once every connection accepted so far has sent
        # its first request, or has had the header timeout to.
        deadline = loop.time() + self.first_request_grace_s
        while loop.time() < deadline:
            await asyncio.sleep(0.01)  # the connections accepted just before run their connection_made
            if not self.protocol.awaiting_first_request():
                break
        self.engine.begin_drain()


def _accept_queued(listener: Any) -> list[socket.socket]:
    """The connections the kernel has completed on `listener` and nobody has accepted yet (closing the
    port would reset them)."""
    accepted: list[socket.socket] = []
    with listener.dup() as sock:  # a real socket on the same port (asyncio hands out a wrapper)
        sock.setblocking(False)
        while True:
            try:
                connection, _ = sock.accept()
            except (BlockingIOError, InterruptedError):
                return accepted
            except OSError as exc:  # out of descriptors, say: what is left is lost with the port
                log.warning("accepting the last connections before closing the port failed: %s", exc)
                return accepted
            connection.setblocking(False)
            accepted.append(connection)
