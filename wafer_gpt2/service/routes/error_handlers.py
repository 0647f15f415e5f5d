"""The app's error handlers: every error answers in the schema of its route's family (TGI's or
OpenAI's), a bug with a reference to the log; never FastAPI's bare `{"detail": ...}`."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException

from wafer_gpt2.engine.failures import MethodNotAllowed, NotFound, RequestValidationFailed, ServiceError
from wafer_gpt2.engine.metrics import ServiceMetrics
from wafer_gpt2.logs import log_reference
from wafer_gpt2.service.delivery import JSONResponse
from wafer_gpt2.service.hot_routes import ErrorHandler, UnexpectedHandler
from wafer_gpt2.service.middleware import error_body, error_status
from wafer_gpt2.service.validation import format_validation_errors

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ErrorHandlers:
    """The two handlers the lean path answers with too (`wafer_gpt2.service.hot_routes.LeanPath`)."""

    service_error: ErrorHandler
    unexpected_error: UnexpectedHandler


def register_error_handlers(app: FastAPI, metrics: ServiceMetrics) -> ErrorHandlers:
    @app.exception_handler(ServiceError)
    async def service_error(request: Request, error: ServiceError) -> JSONResponse:
        if not error.counted:
            metrics.record_failure(error.metric_reason)
        # A route serving two protocols on one path (TGI's and vLLM's /tokenize) names the family to use.
        path = getattr(request.state, "error_path", request.url.path)
        headers = {"Retry-After": str(error.retry_after)} if error.retry_after is not None else None
        return JSONResponse(error_body(error, path), status_code=error_status(error, path), headers=headers)

    @app.exception_handler(Exception)
    async def unexpected_error(request: Request, exc: Exception) -> JSONResponse:
        # A bug, not the client's fault: answer in the route's schema with a reference to the log, which
        # has the details (the exception's text is no message for a client).
        reference = log_reference()
        log.error("internal error, reference %s, on %s", reference, request.url.path, exc_info=exc)
        error = ServiceError(f"internal server error (reference {reference}; the server log has the details)")
        return await service_error(request, error)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = format_validation_errors(exc.errors())
        return await service_error(request, RequestValidationFailed(message, param=param))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        # Errors raised outside a route (unknown path, wrong method, a body FastAPI cannot decode) answer
        # in the error schema of the path's family too, never FastAPI's bare `{"detail": ...}`.
        where = f"{request.method} {request.url.path}"
        if exc.status_code == 400:
            message = f"the request body could not be read ({exc.detail}): send JSON encoded as UTF-8"
            return await service_error(request, RequestValidationFailed(message))
        if exc.status_code == 404:
            error: ServiceError = NotFound(f"no route {where}; see /docs for the routes this server serves")
        elif exc.status_code == 405:
            allowed = (exc.headers or {}).get("Allow", "")
            error = MethodNotAllowed(
                f"{where} is not allowed; this path accepts {allowed or 'other methods'}"
            )
        else:
            error = ServiceError(f"{where}: {exc.detail}")
            error.status = exc.status_code
            if exc.status_code < 500:
                error.error_type = "validation"
        error.counted = True  # not a generation request: tgi_request_failure does not count it
        response = await service_error(request, error)
        response.headers.update(exc.headers or {})
        return response

    return ErrorHandlers(service_error, unexpected_error)
