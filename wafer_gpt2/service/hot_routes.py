"""A lean path for the generation routes: `POST /generate`, `/generate_stream` and
`/v1/completions` with a JSON body that parses and validates are served here, in front of the app's
middleware stack, instead of through it: FastAPI's and Starlette's entry, the server-error and
body-limit middleware, the service's request-id and guard middleware, Starlette's routing and FastAPI's
request handling each cost more per request than the route's own work.

It is the same route. The lean path does what those layers do for such a request:
- the guards' checks (API key, body size) pass, else the whole request goes to the stack, which
  refuses it as before;
- the body is parsed as the routes behind FastAPI get it parsed (`validation.parse_json`, which
  `ServiceRoute` puts in front of FastAPI's own reading, then the route's model);
- the request id is chosen and set as `RequestIdMiddleware` does, and returned in the same header;
- the same handler runs, and a `ServiceError` gets the same error handler's response;
- an unexpected exception is answered as Starlette's server-error middleware answers it: the app's
  `Exception` handler (which logs it) gives the response, sent unless the response had started, and
  the exception propagates to the server.

Anything else goes to the stack untouched, body included: another path or method, a body not declared
`application/json`, one that does not parse or validate (the route on the stack then reports the
error: `parse_json`'s words for a body that is not JSON, FastAPI's for one that is not the model), a
request the guards refuse, a client gone before its body arrived.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from fastapi.routing import APIRoute
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from wafer_gpt2 import logs
from wafer_gpt2.engine.failures import ServiceError
from wafer_gpt2.service.middleware import authorized, replay_body
from wafer_gpt2.service.validation import parse_json

Handler = Callable[[Request, Any], Awaitable[Response]]  # called with the route's model
ErrorHandler = Callable[[Request, ServiceError], Awaitable[Response]]
UnexpectedHandler = Callable[[Request, Exception], Awaitable[Response]]
JSON_TYPES = (b"application/json", b"application/json; charset=utf-8")  # what FastAPI parses as JSON


@dataclass(frozen=True)
class HotRoute:
    model: type[BaseModel]
    handler: Handler


@dataclass(frozen=True)
class LeanPath:
    routes: dict[str, HotRoute]
    max_body_bytes: int  # GuardMiddleware's limits, checked the same way
    api_key: str | None
    on_error: ErrorHandler  # the app's ServiceError handler
    on_unexpected: UnexpectedHandler  # the app's Exception handler


class ParsedJSONRequest(Request):
    """A request whose JSON body is parsed by `validation.parse_json` (once), not by Starlette's
    `json.loads`, which lets RecursionError and the integer-length ValueError through."""

    async def json(self) -> Any:
        if not hasattr(self, "_parsed"):
            self._parsed = parse_json(await self.body())
        return self._parsed


def declares_json(content_type: str | None) -> bool:
    """Whether FastAPI reads a body of this content type as JSON (`application/json`, `.../*+json`)."""
    if not content_type:
        return False
    main, _, sub = content_type.split(";", 1)[0].strip().lower().partition("/")
    return main == "application" and (sub == "json" or sub.endswith("+json"))


class ServiceRoute(APIRoute):
    """FastAPI's route, with a JSON body parsed by `validation.parse_json` before FastAPI reads it:
    FastAPI turns any other parsing failure into a bare "There was an error parsing the body", while a
    `RequestValidationFailed` raised here reaches the app's handler and says what was wrong."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handle = super().get_route_handler()
        if self.body_field is None:  # FastAPI reads no body for this route
            return handle

        async def parse_then_handle(request: Request) -> Response:
            request = ParsedJSONRequest(request.scope, request.receive)
            # An empty body is left to FastAPI, which reports the missing fields.
            if declares_json(request.headers.get("content-type")) and await request.body():
                await request.json()
            return await handle(request)

        return parse_then_handle


class ServiceApp(FastAPI):
    """The service's FastAPI app, with the lean path in front of its middleware stack (set `lean` once
    the routes' handlers exist); its routes parse JSON bodies as the lean path does (`ServiceRoute`)."""

    lean: LeanPath | None = None

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.router.route_class = ServiceRoute

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        lean = self.lean
        if lean is not None and scope["type"] == "http" and scope["method"] == "POST":
            route = lean.routes.get(scope["path"])
            if route is not None:
                await self._serve_lean(lean, route, scope, receive, send)
                return
        await super().__call__(scope, receive, send)

    async def _serve_lean(
        self, lean: LeanPath, route: HotRoute, scope: Scope, receive: Receive, send: Send
    ) -> None:
        headers = dict(scope["headers"])  # the last of a repeated header, as the guards read them
        declared = headers.get(b"content-length")
        if (lean.api_key is not None and not authorized(headers, lean.api_key)) or (
            declared is not None and declared.isdigit() and int(declared) > lean.max_body_bytes
        ):
            await super().__call__(scope, receive, send)  # refused there, in the route family's words
            return
        body, whole, disconnected = await _read_body(receive, lean.max_body_bytes)
        # FastAPI reads the first content-type header.
        content_type = next((v.lower() for n, v in scope["headers"] if n == b"content-type"), None)
        parsed = _parse(route.model, body) if whole and content_type in JSON_TYPES else None
        if parsed is None:
            await super().__call__(scope, replay_body(body, receive, disconnected), send)
            return

        rid = logs.request_id_for(headers)
        logs.request_id.set(rid)  # not reset: the request's task (and its context) ends with it
        scope["app"] = self
        request = Request(scope, receive)
        try:
            response = await route.handler(request, parsed)
        except ServiceError as error:
            response = await lean.on_error(request, error)
        except Exception as exc:
            # Outside the request-id middleware on the stack: no id header, as there.
            await (await lean.on_unexpected(request, exc))(scope, receive, send)
            raise
        response.raw_headers.append((logs.HEADER, rid.encode()))
        try:
            await response(scope, receive, send)
        except Exception as exc:
            # The hot routes' responses (JSONResponse, EventStreamResponse) send their start before
            # anything that can raise: the response has started, only the log is left to write.
            await lean.on_unexpected(request, exc)
            raise


async def _read_body(receive: Receive, limit: int) -> tuple[bytes, bool, bool]:
    """(what arrived, whether that is the whole body within `limit` bytes, whether the client left)."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return b"".join(chunks), False, True
        chunk = message.get("body", b"")
        chunks.append(chunk)
        size += len(chunk)
        if size > limit:
            return b"".join(chunks), False, False
        if not message.get("more_body", False):
            return b"".join(chunks), True, False


def _parse(model: type[BaseModel], body: bytes) -> BaseModel | None:
    """The body as the route's model, or None where FastAPI would answer with an error."""
    try:
        return model.model_validate(parse_json(body))
    except Exception:  # not JSON, or not the model: the stack's route reports it
        return None
