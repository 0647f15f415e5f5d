"""A lean path for the generation routes (issue 18): `POST /generate`, `/generate_stream` and
`/v1/completions` with a JSON body that parses and validates are served here, in plain ASGI, instead
of through Starlette's routing, FastAPI's request handling and its exception middleware, which cost
more per request than the route's own work.

It is the same route: the body is parsed as FastAPI parses it (`json.loads`, then the route's model),
the same handler runs and its response (or, for a `ServiceError`, the same error handler's) is sent the
same way. Anything else goes on to FastAPI untouched, body included: another path or method, a body
that is not declared `application/json`, one that does not parse or validate (FastAPI then reports the
error in its own words, as before). An unexpected exception propagates as it would from the route, to
the server-error middleware outside, which answers with the `Exception` handler and logs it.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response

from service.errors import ServiceError
from service.middleware import replay_body

ASGIApp = Callable[[dict, Callable, Callable], Awaitable[None]]
Handler = Callable[[Request, Any], Awaitable[Response]]  # called with the route's model
ErrorHandler = Callable[[Request, ServiceError], Awaitable[Response]]
JSON_TYPES = (b"application/json", b"application/json; charset=utf-8")  # what FastAPI parses as JSON


@dataclass(frozen=True)
class HotRoute:
    model: type[BaseModel]
    handler: Handler


class HotRoutesMiddleware:
    """Innermost of the service's middleware: the guards and the request id apply as to every route."""

    def __init__(self, app: ASGIApp, routes: dict[str, HotRoute], on_error: ErrorHandler):
        self.app = app
        self.routes = routes
        self.on_error = on_error

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        route = self.routes.get(scope["path"]) if scope["type"] == "http" else None
        if route is None or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        content_type = next(
            (value.lower() for name, value in scope["headers"] if name == b"content-type"), None
        )
        more, disconnected = True, False
        chunks: list[bytes] = []
        while more:
            message = await receive()
            if message["type"] != "http.request":
                disconnected = True
                break
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        parsed = None if disconnected or content_type not in JSON_TYPES else _parse(route.model, body)
        if parsed is None:
            await self.app(scope, replay_body(body, receive, disconnected), send)
            return
        request = Request(scope, receive)
        try:
            response = await route.handler(request, parsed)
        except ServiceError as error:
            response = await self.on_error(request, error)
        await response(scope, receive, send)


def _parse(model: type[BaseModel], body: bytes) -> BaseModel | None:
    """The body as the route's model, or None where FastAPI would answer with an error."""
    try:
        return model.model_validate(json.loads(body))
    except Exception:  # not JSON, or not the model: FastAPI's own path reports it
        return None
