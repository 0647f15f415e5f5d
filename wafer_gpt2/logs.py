"""The service's log lines: each carries the id of the HTTP request it belongs to, as text or JSON.

`RequestIdMiddleware` gives every HTTP request an id (the client's `X-Request-Id` when it sends a
usable one, else a fresh one), keeps it in a context variable for the request's handlers, and returns it
in the `X-Request-Id` response header. The engine names its per-request state after it, and its worker
thread passes that name explicitly (`extra={"request_id": ...}`): a context variable does not cross
into the worker thread.
"""

from __future__ import annotations

import contextvars
import json
import logging
import random
import re
import time
import uuid
from collections.abc import Awaitable, Callable

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(request_id)s]: %(message)s"
NO_REQUEST = "-"
HEADER = b"x-request-id"
USABLE_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")  # what a client's id may be (it goes into log lines)

request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default=NO_REQUEST)


class RequestIdFilter(logging.Filter):
    """Give every record a `request_id` (the current HTTP request's, unless the call passed one)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = request_id.get()
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, request id, message (and the traceback)."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "request_id": getattr(record, "request_id", NO_REQUEST),
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


# What `configure` was last called with: an engine process configures its logging the same way.
configured: tuple[str, str] | None = None


def configure(level: str, log_format: str = "text") -> None:
    """The root logger's one handler, for the service and (JSON mode) uvicorn's loggers too."""
    global configured
    configured = (level, log_format)
    handler = logging.StreamHandler()
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)


ASGIApp = Callable[[dict, Callable, Callable], Awaitable[None]]


# Fresh ids need to be unique, not secret (the client is given its id): a private generator, seeded
# from the OS at import, costs a fraction of uuid4's system call and object.
_fresh_ids = random.Random()


def fresh_hex(bits: int = 64) -> str:
    """A fresh id of `bits` random bits in hex: request, completion and chat ids."""
    return f"{_fresh_ids.getrandbits(bits):0{bits // 4}x}"


def request_id_for(headers: dict[bytes, bytes]) -> str:
    """The client's id when it sent a usable one, else a fresh one."""
    given = headers.get(HEADER, b"").decode("latin-1")
    return given if USABLE_ID.fullmatch(given) else fresh_hex()


class RequestIdMiddleware:
    """Plain ASGI (streaming passes through untouched): the request id for logs and the response."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = request_id_for(dict(scope.get("headers") or ()))
        request_id.set(rid)

        async def send_with_id(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), (HEADER, rid.encode())]}
            await send(message)

        # Not reset afterwards: each request runs in a task of its own, whose context dies with it, and
        # Starlette's error handler (outside this middleware) still logs under the id.
        await self.app(scope, receive, send_with_id)


def log_reference() -> str:
    """A short id that ties a client's error message to the log line with the details."""
    return uuid.uuid4().hex[:12]
