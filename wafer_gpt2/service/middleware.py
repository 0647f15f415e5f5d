"""Guards in front of every route, as plain ASGI middleware (so streaming and client-disconnect
detection pass through untouched): a request body size limit, and the optional API key.

Both answer in the error schema of the route family (OpenAI's for `/v1/...`, TGI's otherwise), and
count their refusals in the failure metric as the routes do. The key is compared as bytes: the header's
raw bytes against the key's UTF-8, so a key outside Latin-1 matches what clients send.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable

from wafer_gpt2.engine.failures import PayloadTooLarge, ServiceError, Unauthorized
from wafer_gpt2.engine.metrics import ServiceMetrics

ASGIApp = Callable[[dict, Callable, Callable], Awaitable[None]]
OPEN_PATHS = ("/health", "/ping", "/metrics")  # probes and scrapers do not carry the key


OPENAI_PREFIX = "/v1/"
# vLLM's routes outside /v1/ (TGI has none of these): their errors are OpenAI's too.
OPENAI_ROOT_PATHS = ("/detokenize", "/tokenizer_info", "/version")


def is_openai_path(path: str) -> bool:
    return path.startswith(OPENAI_PREFIX) or path in OPENAI_ROOT_PATHS


def openai_error_type(error: ServiceError) -> str:
    return {
        "validation": "invalid_request_error",
        "authentication": "authentication_error",
        "overloaded": "overloaded_error",
        "unavailable": "service_unavailable_error",
        "generation": "generation_error",
        "timeout": "timeout_error",
        "not_found": "not_found_error",
        "method_not_allowed": "invalid_request_error",
    }.get(error.error_type, "internal_error")


def error_status(error: ServiceError, path: str) -> int:
    # OpenAI clients expect 400 for a bad request; TGI clients 422.
    if is_openai_path(path) and error.status == 422:
        return 400
    return error.status


def error_body(error: ServiceError, path: str) -> dict:
    """The JSON body of an error in the schema of the route family."""
    if is_openai_path(path):
        return {
            "error": {
                "message": error.message,
                "type": openai_error_type(error),
                "param": error.param,
                "code": error_status(error, path),
            }
        }
    return {"error": error.message, "error_type": error.error_type}


async def send_error(
    send: Callable, error: ServiceError, path: str, extra_headers: list | None = None
) -> None:
    body = json.dumps(error_body(error, path)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send(
        {
            "type": "http.response.start",
            "status": error_status(error, path),
            "headers": headers + (extra_headers or []),
        }
    )
    await send({"type": "http.response.body", "body": body})


def replay_body(body: bytes, receive: Callable, disconnected: bool = False) -> Callable:
    """`receive` for the app behind a middleware that read the request's body: that body once (unless the
    client was found gone: the server reports the disconnect again to whoever asks), then the server's
    own messages."""
    sent = disconnected

    async def replay() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def authorized(headers: dict[bytes, bytes], api_key: str) -> bool:
    """Whether the request's `Authorization: Bearer` header carries the key."""
    scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), api_key.encode())


class GuardMiddleware:
    def __init__(
        self, app: ASGIApp, max_body_bytes: int, api_key: str | None, metrics: ServiceMetrics | None = None
    ):
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.api_key = api_key
        self.metrics = metrics

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        headers = dict(scope.get("headers") or [])

        if self.api_key is not None and path not in OPEN_PATHS and not authorized(headers, self.api_key):
            error = Unauthorized("missing or wrong API key: send the header `Authorization: Bearer <key>`")
            await self._refuse(send, error, path, [(b"www-authenticate", b"Bearer")])
            return

        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            await self._refuse(send, self._too_large(int(declared)), path)
            return

        # Read the body here (it is small) so a chunked body over the limit is refused too, then replay
        # it to the app; later receive() calls go to the server (the app watches them for disconnects).
        if scope["method"] in ("POST", "PUT", "PATCH"):
            chunks, size = [], 0
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > self.max_body_bytes:
                    await self._refuse(send, self._too_large(size, at_least=True), path)
                    return
                chunks.append(chunk)
                if not message.get("more_body", False):
                    break
            await self.app(scope, replay_body(b"".join(chunks), receive), send)
            return
        await self.app(scope, receive, send)

    async def _refuse(
        self, send: Callable, error: ServiceError, path: str, extra_headers: list | None = None
    ):
        if self.metrics is not None:
            self.metrics.record_failure(error.metric_reason)
        await send_error(send, error, path, extra_headers)

    def _too_large(self, size: int, at_least: bool = False) -> PayloadTooLarge:
        found = f"at least {size}" if at_least else str(size)
        return PayloadTooLarge(
            f"request body too large: {found} bytes, the limit is {self.max_body_bytes} bytes"
        )
