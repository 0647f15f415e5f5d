"""The HTTP API: TGI's routes, OpenAI's completions and chat, health, info and metrics, over one
engine.

`create_app(settings, backend_factory)` builds the FastAPI app; its lifespan starts the engine's
worker (which uploads the model; /health answers 503 until it is done) and drains it at shutdown.
Requests are validated and tokenized before they are queued, so bad input never reaches the wafer;
errors come back in the schema of the route, as a response or, once a stream has started, as a
stream event. The protocols themselves live in `wafer_gpt2.service.tgi`, `wafer_gpt2.service.openai_completions` and
`wafer_gpt2.service.openai_chat`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import quote

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import PlainTextResponse, Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException

from wafer_gpt2 import logs
from wafer_gpt2.engine import heap
from wafer_gpt2.engine.core import gpt2_tokenizer_hooks
from wafer_gpt2.engine.failures import MethodNotAllowed, NotFound, RequestValidationFailed, ServiceError
from wafer_gpt2.engine.metrics import Family, ServiceMetrics
from wafer_gpt2.engine.process import EngineOptions, EngineProcess
from wafer_gpt2.engine.serving import ServingEngine
from wafer_gpt2.engine.worker import BackendFactory, EngineState
from wafer_gpt2.logs import RequestIdMiddleware, log_reference
from wafer_gpt2.model import tokenizer
from wafer_gpt2.service import tokenize_api
from wafer_gpt2.service.chat_template import DEFAULT_CHAT_TEMPLATE, ChatTemplate
from wafer_gpt2.service.delivery import (
    ClientGone,
    EventStreamResponse,
    JSONResponse,
    submit_all,
    wait_for_results,
)
from wafer_gpt2.service.hot_routes import HotRoute, LeanPath, ServiceApp
from wafer_gpt2.service.middleware import OPENAI_PREFIX, GuardMiddleware, error_body, error_status
from wafer_gpt2.service.openai_chat import chat_generation_requests, chat_response, chat_stream
from wafer_gpt2.service.openai_completions import (
    completion_response,
    openai_generation_requests,
    openai_stream,
)
from wafer_gpt2.service.schemas import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TGIInfo,
    TGIRequest,
    TGIResponse,
    TGITokenizeRequest,
    ignored_fields,
)
from wafer_gpt2.service.tgi import tgi_generation_request, tgi_json, tgi_response, tgi_stream
from wafer_gpt2.service.validation import Limits, format_validation_errors, json_body, parse_body
from wafer_gpt2.settings import ServerSettings

log = logging.getLogger(__name__)
VERSION = "0.1.0"
PLACEHOLDER_MODELS = ("dummy", "tgi")  # what TGI clients send as `model` when they do not know it
# Threads that build requests (tokenizing is the slow part) off the event loop; started with the app.
REQUEST_THREADS = 2
# Bodies up to this size are tokenized on the event loop: well under 0.1 ms of work, less than the hop to
# a pool thread and back costs (issue 18's profile); longer ones go to the pool.
INLINE_BODY_BYTES = 1024
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def request_pool(threads: int = REQUEST_THREADS) -> ThreadPoolExecutor:
    """A pool whose threads all exist from the start (a lazily grown pool would look like a leak)."""
    pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="wafer-request")
    barrier = threading.Barrier(threads)
    for started in [pool.submit(barrier.wait) for _ in range(threads)]:
        started.result()
    return pool


class IgnoredFields:
    """Unknown fields are accepted and ignored (as vLLM and TGI do) but said so: in the response header
    `X-Ignored-Fields`, and in a warning logged once per route and set of names (not once per request)."""

    HEADER = "X-Ignored-Fields"
    MAX_NAMES = 20  # the header names at most these (a body may hold thousands of unknown fields)

    def __init__(self) -> None:
        self._logged: set[tuple[str, str]] = set()

    def headers(self, body: BaseModel, path: str) -> dict[str, str]:
        # Percent-encoded: a field name may hold anything, a header value only visible ASCII.
        names = [quote(name, safe="!#$&'()*+,/:;=?@[]^_`{|}~") for name in ignored_fields(body)]
        if not names:
            return {}
        shown = ", ".join(names[: self.MAX_NAMES])
        if len(names) > self.MAX_NAMES:
            shown += f" (and {len(names) - self.MAX_NAMES} more)"
        key = (path, shown)
        if key not in self._logged and len(self._logged) < 1000:
            self._logged.add(key)
            log.warning("%s: ignored unknown fields: %s", path, shown)
        return {self.HEADER: shown}


def create_app(
    settings: ServerSettings,
    backend_factory: BackendFactory,
    model_summary: dict | None = None,
    on_fatal: Callable[[str], None] | None = None,
) -> ServiceApp:
    """The service: `backend_factory` is called on the engine's worker thread to upload the model."""
    hooks = gpt2_tokenizer_hooks()
    ignored = IgnoredFields()
    chat_template = (
        DEFAULT_CHAT_TEMPLATE
        if settings.chat_template is None
        else ChatTemplate(settings.chat_template, name="--chat-template")
    )
    tokenizer.get_encoding()  # build the BPE tables now, not on the first request
    metrics = ServiceMetrics(settings.model_id)
    options = EngineOptions.of(settings, backend_factory)
    engine: ServingEngine = (
        EngineProcess(options, metrics, on_fatal=on_fatal)
        if settings.engine_process
        else options.engine(metrics, on_fatal=on_fatal)
    )

    pool = request_pool()

    async def off_loop(build: Callable, *args, request: Request | None = None):
        """Tokenize and validate in the request pool: a long prompt must not stall the event loop. A
        small `request` body is built right here (the pool's round trip costs more than the work)."""
        if request is not None:
            length = request.headers.get("content-length")
            if length is not None and length.isdigit() and int(length) <= INLINE_BODY_BYTES:
                return build(*args)
        return await asyncio.get_running_loop().run_in_executor(pool, build, *args)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        if settings.freeze_heap:
            heap.settle()  # this process's heap; an in-process backend loads later, on the worker
        yield
        await asyncio.to_thread(engine.shutdown, settings.shutdown_timeout_s)
        pool.shutdown(wait=False)

    app = ServiceApp(
        title="wafer-gpt2",
        version=VERSION,
        lifespan=lifespan,
        default_response_class=JSONResponse,
        # FastAPI's OpenTelemetry hooks look up the global providers on every request (3-4% of the
        # HTTP process's time, issue 18); the service's telemetry is /metrics and its logs.
        telemetry={"tracing": False, "metrics": False, "logs": False},
    )
    app.state.engine = engine
    app.state.settings = settings
    app.state.metrics = metrics
    app.add_middleware(
        GuardMiddleware, max_body_bytes=settings.max_body_bytes, api_key=settings.api_key, metrics=metrics
    )
    # Outermost of ours (the last added runs first): the guards' refusals carry the id too.
    app.add_middleware(RequestIdMiddleware)

    # The limits change only with the backend (a reload brings a new one): built once per backend,
    # not per request (issue 18).
    limits_of: list[tuple[object, Limits]] = []

    def limits() -> Limits:
        backend = engine.backend
        if not limits_of or limits_of[0][0] is not backend:
            limits_of[:] = [(backend, Limits.of(settings, backend))]
        return limits_of[0][1]

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

    # --- TGI ---

    async def generate_response(request: Request, body: TGIRequest, as_list: bool = False) -> Response:
        generation = await off_loop(tgi_generation_request, body, limits(), settings, request=request)
        sequences = submit_all(engine, [generation], stream=False)
        try:
            (final,) = await wait_for_results(request, engine, sequences)
        except ClientGone:
            return Response(status_code=499)
        headers = ignored.headers(body, request.scope["path"])
        data = tgi_json(tgi_response(body, final, hooks))
        return JSONResponse([data] if as_list else data, headers=headers)

    async def generate_stream_response(request: Request, body: TGIRequest) -> Response:
        if body.parameters.decoder_input_details:
            raise RequestValidationFailed(
                "parameters.decoder_input_details: `decoder_input_details` == true is not supported when "
                "streaming tokens",
                param="parameters.decoder_input_details",
            )
        generation = await off_loop(tgi_generation_request, body, limits(), settings, request=request)
        (sequence,) = submit_all(engine, [generation])
        stream = tgi_stream(engine, sequence, body, hooks, request.scope["path"])
        headers = SSE_HEADERS | ignored.headers(body, request.scope["path"])
        return EventStreamResponse(stream, media_type="text/event-stream", headers=headers)

    @app.post("/generate", response_model=TGIResponse, summary="Generate text (TGI)")
    async def generate(request: Request, body: TGIRequest) -> Response:
        return await generate_response(request, body)

    @app.post("/generate_stream", summary="Generate text as Server-Sent Events (TGI)")
    async def generate_stream(request: Request, body: TGIRequest) -> Response:
        return await generate_stream_response(request, body)

    @app.post(
        "/",
        response_model=list[TGIResponse],
        summary="TGI's compatibility route: `stream` picks /generate_stream, else /generate's answer in a list",
    )
    async def compat_generate(request: Request, body: TGIRequest) -> Response:
        if body.stream:
            return await generate_stream_response(request, body)
        return await generate_response(request, body, as_list=True)

    # --- OpenAI ---

    def check_model(model: str | None) -> None:
        # huggingface_hub names the model "dummy" when it talks to a URL (TGI ignores the name): accept it.
        if model is not None and model not in (settings.model_id, *PLACEHOLDER_MODELS):
            raise NotFound(
                f"the model `{model}` does not exist; this server serves `{settings.model_id}`", param="model"
            )

    @app.post("/v1/completions", response_model=CompletionResponse, summary="Completions (OpenAI)")
    async def completions(request: Request, body: CompletionRequest) -> Response:
        return await completions_response(request, body)

    async def completions_response(request: Request, body: CompletionRequest) -> Response:
        check_model(body.model)
        choices, generations = await off_loop(
            openai_generation_requests, body, limits(), settings, request=request
        )
        sequences = submit_all(engine, generations, stream=bool(body.stream))
        model = settings.model_id
        headers = ignored.headers(body, request.scope["path"])
        if body.stream:
            stream = openai_stream(engine, body, choices, sequences, model, request.scope["path"])
            return EventStreamResponse(stream, media_type="text/event-stream", headers=SSE_HEADERS | headers)
        try:
            finals = await wait_for_results(request, engine, sequences)
        except ClientGone:
            return Response(status_code=499)
        response = completion_response(
            body, choices, finals, model, f"cmpl-{logs.fresh_hex(128)}", int(time.time())
        )
        return JSONResponse(response, headers=headers)

    @app.post(
        "/v1/chat/completions",
        response_model=ChatCompletionResponse,
        summary="Chat completions (OpenAI): the chat template turns the messages into one prompt",
    )
    async def chat_completions(request: Request, body: ChatCompletionRequest) -> Response:
        return await chat_completions_response(request, body)

    async def chat_completions_response(request: Request, body: ChatCompletionRequest) -> Response:
        check_model(body.model)
        choices, generations = await off_loop(
            chat_generation_requests, body, chat_template, limits(), settings
        )
        sequences = submit_all(engine, generations, stream=bool(body.stream))
        headers = ignored.headers(body, request.scope["path"])
        if body.stream:
            stream = chat_stream(engine, body, choices, sequences, settings.model_id, request.scope["path"])
            return EventStreamResponse(stream, media_type="text/event-stream", headers=SSE_HEADERS | headers)
        try:
            finals = await wait_for_results(request, engine, sequences)
        except ClientGone:
            return Response(status_code=499)
        response = chat_response(body, choices, finals, settings.model_id)
        return JSONResponse(response.model_dump(), headers=headers)

    # The generation routes' lean path, in front of the middleware (wafer_gpt2/service/hot_routes.py); the routes
    # are declared above too, for the requests it leaves to FastAPI and for the OpenAPI schema.
    app.lean = LeanPath(
        routes={
            "/generate": HotRoute(TGIRequest, generate_response),
            "/generate_stream": HotRoute(TGIRequest, generate_stream_response),
            "/v1/completions": HotRoute(CompletionRequest, completions_response),
        },
        max_body_bytes=settings.max_body_bytes,
        api_key=settings.api_key,
        on_error=service_error,
        on_unexpected=unexpected_error,
    )

    def model_card() -> ModelCard:
        context = engine.backend.context_length if engine.ready else None
        return ModelCard(id=settings.model_id, created=int(time.time()), max_model_len=context)

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> ModelList:
        return ModelList(data=[model_card()])

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard)
    async def model(model_id: str) -> ModelCard:
        if model_id != settings.model_id:
            raise NotFound(f"the model `{model_id}` does not exist; this server serves `{settings.model_id}`")
        return model_card()

    # --- tokenizer ---

    @app.post("/tokenize", summary="Tokenize: vLLM's shape (`prompt` or `messages`), or TGI's (`inputs`)")
    async def tokenize(request: Request) -> Response:
        data, path = await json_body(request), request.scope["path"]
        if tokenize_api.is_tgi_body(data):
            tgi_body = parse_body(TGITokenizeRequest, data)
            tokens = [t.model_dump() for t in await off_loop(tokenize_api.tgi_tokenize, tgi_body, limits())]
            return JSONResponse(tokens, headers=ignored.headers(tgi_body, path))
        request.state.error_path = OPENAI_PREFIX  # vLLM's body: OpenAI's error schema
        body = tokenize_api.vllm_tokenize_body(data)
        check_model(body.model)
        response = await off_loop(tokenize_api.vllm_tokenize, body, chat_template, limits())
        return JSONResponse(response.model_dump(), headers=ignored.headers(body, path))

    @app.post("/detokenize", response_model=DetokenizeResponse, summary="Token ids to text (vLLM)")
    async def detokenize(request: Request, body: DetokenizeRequest) -> Response:
        check_model(body.model)
        response = tokenize_api.vllm_detokenize(body, limits().vocab_size)
        return JSONResponse(response.model_dump(), headers=ignored.headers(body, request.scope["path"]))

    @app.get("/tokenizer_info", summary="The tokenizer's config and the chat template (vLLM)")
    async def tokenizer_info() -> dict:
        return tokenize_api.tokenizer_info(chat_template, limits().context_length)

    # --- operations ---

    @app.post(
        "/invocations",
        summary="SageMaker's route: `messages` is a chat completion, `prompt` a completion, `inputs` TGI's `/`",
    )
    async def invocations(request: Request) -> Response:
        data = await json_body(request)
        if isinstance(data, dict) and "inputs" in data:
            return await compat_generate(request, parse_body(TGIRequest, data))
        request.state.error_path = OPENAI_PREFIX  # OpenAI bodies: OpenAI's error schema
        if isinstance(data, dict) and "messages" in data:
            return await chat_completions_response(request, parse_body(ChatCompletionRequest, data))
        return await completions_response(request, parse_body(CompletionRequest, data))

    @app.get("/version", summary="The server's version (vLLM)")
    async def version() -> dict:
        return {"version": VERSION}

    @app.get("/ping", summary="SageMaker's health check: as /health")
    async def ping() -> Response:
        return await health()

    app.post("/ping", summary="SageMaker's health check: as /health", operation_id="ping_post")(ping)

    @app.get(
        "/health",
        summary="200 when the engine serves; 503 while loading, reloading, draining, unresponsive or dead",
    )
    async def health() -> Response:
        if engine.ready:
            return Response(status_code=200)
        body = {"error": "unhealthy", "error_type": "healthcheck", "state": engine.state.value}
        retry = engine.unavailable().retry_after
        headers = {"Retry-After": str(retry)} if retry is not None else None
        if engine.state is EngineState.FAILED and engine.error:
            body["reason"] = engine.error
        elif engine.state in (EngineState.RELOADING, EngineState.UNRESPONSIVE) and engine.fault:
            body["reason"] = engine.fault
        return JSONResponse(body, status_code=503, headers=headers)

    @app.get("/info", response_model=TGIInfo)
    async def info() -> TGIInfo:
        lim = limits()
        description = engine.describe()
        # A round trip to an engine process, whose messages this event loop reads: not on the loop.
        kv_usage = await asyncio.to_thread(engine.kv_usage)
        return TGIInfo(
            model_id=settings.model_id,
            model_dtype=description["dtype"],
            model_device_type=description["device_type"],
            backend=description["backend"],
            max_concurrent_requests=description["num_slots"],
            max_queue=settings.max_queue,
            max_input_tokens=lim.max_input_tokens,
            max_total_tokens=lim.context_length,
            max_new_tokens=lim.max_new_tokens,
            max_stop_sequences=lim.max_stop_sequences,
            max_best_of=1,
            max_top_n_tokens=lim.max_top_n_tokens,
            top_k=lim.top_k,
            kv_slots=description["num_slots"],
            context_length=lim.context_length,
            version=VERSION,
            model_config_summary=model_summary or {},
            plan=description["plan"],
            engine={
                "state": engine.state.value,
                "load_seconds": engine.load_seconds,
                "restarts": engine.restarts,
                "steps": engine.steps,
                "step_token_budget": max(settings.step_token_budget, description["num_slots"]),
                "kv_usage": dataclasses.asdict(kv_usage),
            },
        )

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prometheus_metrics() -> PlainTextResponse:
        merged: list[list[Family]] = []
        own_only = False
        if isinstance(engine, EngineProcess):  # the engine's metrics are recorded over there
            samples = await asyncio.to_thread(engine.metric_samples)
            # Without the engine's samples its series are left out, not shown as 0 (a counter reset).
            own_only = samples is None
            merged.append(samples or [])
        return PlainTextResponse(
            metrics.render(merged, own_only=own_only), media_type="text/plain; version=0.0.4; charset=utf-8"
        )

    return app
