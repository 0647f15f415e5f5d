"""The ways a request can be refused or fail, each with its HTTP status and TGI `error_type`.

The engine raises or delivers these; `wafer_gpt2.service.api` renders them in the schema of the route (TGI's
`{"error", "error_type"}` or OpenAI's `{"error": {...}}`), as a response or as a stream event.
"""

from __future__ import annotations

from wafer_gpt2.errors import WaferGPT2Error


class ServiceError(WaferGPT2Error):
    status = 500
    error_type = "incomplete_generation"
    metric_reason = "internal"  # the `err` label of tgi_request_failure
    retry_after: int | None = None  # seconds, sent as `Retry-After` when set

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param  # the request field at fault, when there is one
        self.counted = False  # set once tgi_request_failure has counted it


class RequestValidationFailed(ServiceError):
    """The request cannot be served as asked (bad field, too long for the context, ...)."""

    status = 422
    error_type = "validation"
    metric_reason = "validation"


class PayloadTooLarge(RequestValidationFailed):
    status = 413


class NotFound(ServiceError):
    status = 404
    error_type = "not_found"
    metric_reason = "validation"


class MethodNotAllowed(ServiceError):
    status = 405
    error_type = "method_not_allowed"
    metric_reason = "validation"


class Unauthorized(ServiceError):
    status = 401
    error_type = "authentication"
    metric_reason = "authentication"


class Overloaded(ServiceError):
    """The queue is full: try again later."""

    status = 429
    error_type = "overloaded"
    metric_reason = "overloaded"
    retry_after = 1  # a slot frees at the next step boundary that ends a request


class Unavailable(ServiceError):
    """The engine is loading, reloading after a failure, shutting down, or dead."""

    status = 503
    error_type = "unavailable"
    metric_reason = "unavailable"
    retry_after: int | None = 5  # loading, reloading, draining

    def __init__(self, message: str, final: bool = False):
        super().__init__(message)
        if final:  # the engine failed or stopped: it will not serve again, retrying here cannot help
            self.retry_after = None


class GenerationFailed(ServiceError):
    """The wafer worker failed while this request was running."""

    status = 424
    error_type = "generation"
    metric_reason = "generation"


class StepTimedOut(GenerationFailed):
    """The step this request was in ran past the step watchdog's deadline: the backend restarts."""

    status = 504


class RequestFailed(ServiceError):
    """This request alone failed inside the server (choosing or decoding its tokens): a 500."""


class RequestTimedOut(ServiceError):
    status = 504
    error_type = "timeout"
    metric_reason = "timeout"
