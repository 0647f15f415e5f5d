"""The HTTP API: TGI's routes, OpenAI's completions, health, info and metrics, over one engine.

`create_app(settings, executor_factory)` builds the FastAPI app; its lifespan starts the engine's
worker (which uploads the model; /health answers 503 until it is done) and drains it at shutdown.
Requests are validated and tokenized before they are queued, so bad input never reaches the wafer;
errors come back in the schema of the route, as a response or, once a stream has started, as a
stream event. The protocols themselves live in `service.tgi` and `service.openai_completions`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from fastapi import FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from service.delivery import ClientGone, JSONResponse, submit_all, wait_for_results
from service.engine import Engine, EngineState, ExecutorFactory, TokenizerHooks
from service.errors import NotFound, RequestValidationFailed, ServiceError
from service.metrics import ServiceMetrics
from service.middleware import GuardMiddleware, error_body, error_status
from service.openai_completions import completion_choice, openai_generation_requests, openai_stream, usage_of
from service.schemas import (
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
    TGIInfo,
    TGIRequest,
    TGIResponse,
)
from service.settings import ServerSettings
from service.tgi import tgi_generation_request, tgi_json, tgi_response, tgi_stream
from service.validation import Limits, format_validation_errors
from weights import tokenizer

log = logging.getLogger("wafer_gpt2.api")

VERSION = "0.1.0"
# Threads that build requests (tokenizing is the slow part) off the event loop; started with the app.
REQUEST_THREADS = 2
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def request_pool(threads: int = REQUEST_THREADS) -> ThreadPoolExecutor:
    """A pool whose threads all exist from the start (a lazily grown pool would look like a leak)."""
    pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="wafer-request")
    barrier = threading.Barrier(threads)
    for started in [pool.submit(barrier.wait) for _ in range(threads)]:
        started.result()
    return pool


def tokenizer_hooks() -> TokenizerHooks:
    return TokenizerHooks(
        token_bytes=tokenizer.token_bytes,
        eos_token_id=tokenizer.EOT_ID,
        special_names={tokenizer.EOT_ID: tokenizer.EOT_TEXT},
        vocab_size=tokenizer.VOCAB_SIZE,
    )


def create_app(
    settings: ServerSettings,
    executor_factory: ExecutorFactory,
    model_summary: dict | None = None,
    on_fatal: Callable[[str], None] | None = None,
) -> FastAPI:
    """The service: `executor_factory` is called on the engine's worker thread to upload the model."""
    hooks = tokenizer_hooks()
    tokenizer.get_encoding()  # build the BPE tables now, not on the first request
    metrics = ServiceMetrics(settings.model_id)
    engine = Engine(
        executor_factory,
        hooks,
        metrics,
        max_queue=settings.max_queue,
        step_token_budget=settings.step_token_budget,
        on_fatal=on_fatal,
        step_timeout_s=settings.step_timeout_s,
        step_timeout_per_item_s=settings.step_timeout_per_item_s,
    )

    pool = request_pool()

    async def off_loop(build: Callable, *args):
        """Tokenize and validate in the request pool: a long prompt must not stall the event loop."""
        return await asyncio.get_running_loop().run_in_executor(pool, build, *args)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        await asyncio.to_thread(engine.shutdown, settings.shutdown_timeout_s)
        pool.shutdown(wait=False)

    app = FastAPI(title="wafer-gpt2", version=VERSION, lifespan=lifespan, default_response_class=JSONResponse)
    app.state.engine = engine
    app.state.settings = settings
    app.state.metrics = metrics
    app.add_middleware(
        GuardMiddleware, max_body_bytes=settings.max_body_bytes, api_key=settings.api_key, metrics=metrics
    )

    def limits() -> Limits:
        return Limits.of(settings, engine.executor)

    @app.exception_handler(ServiceError)
    async def service_error(request: Request, error: ServiceError) -> JSONResponse:
        if not error.counted:
            metrics.record_failure(error.metric_reason)
        path = request.url.path
        headers = {"Retry-After": str(error.retry_after)} if error.retry_after is not None else None
        return JSONResponse(error_body(error, path), status_code=error_status(error, path), headers=headers)

    @app.exception_handler(Exception)
    async def unexpected_error(request: Request, exc: Exception) -> JSONResponse:
        # A bug, not the client's fault: answer in the route's schema with a reference to the log, which
        # has the details (the exception's text is no message for a client).
        reference = uuid.uuid4().hex[:12]
        log.error("internal error, reference %s, on %s", reference, request.url.path, exc_info=exc)
        error = ServiceError(f"internal server error (reference {reference}; the server log has the details)")
        return await service_error(request, error)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = format_validation_errors(exc.errors())
        return await service_error(request, RequestValidationFailed(message, param=param))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        # FastAPI refuses a body it cannot decode (not UTF-8) with a bare 400: answer it like invalid
        # JSON, in the route's schema. Other HTTP errors (unknown path or method) keep FastAPI's answer.
        if exc.status_code == 400:
            message = f"the request body could not be read ({exc.detail}): send JSON encoded as UTF-8"
            return await service_error(request, RequestValidationFailed(message))
        return await http_exception_handler(request, exc)

    # --- TGI ---

    async def generate_response(request: Request, body: TGIRequest) -> Response:
        generation = await off_loop(tgi_generation_request, body, limits(), settings)
        sequences = submit_all(engine, [generation])
        try:
            (final,) = await wait_for_results(request, engine, sequences)
        except ClientGone:
            return Response(status_code=499)
        return JSONResponse(tgi_json(tgi_response(body, final, hooks)))

    async def generate_stream_response(request: Request, body: TGIRequest) -> Response:
        generation = await off_loop(tgi_generation_request, body, limits(), settings)
        (sequence,) = submit_all(engine, [generation])
        stream = tgi_stream(engine, sequence, body, hooks, request.url.path)
        return StreamingResponse(stream, media_type="text/event-stream", headers=SSE_HEADERS)

    @app.post("/generate", response_model=TGIResponse, summary="Generate text (TGI)")
    async def generate(request: Request, body: TGIRequest) -> Response:
        return await generate_response(request, body)

    @app.post("/generate_stream", summary="Generate text as Server-Sent Events (TGI)")
    async def generate_stream(request: Request, body: TGIRequest) -> Response:
        return await generate_stream_response(request, body)

    @app.post("/", summary="TGI's compatibility route: `stream` picks /generate or /generate_stream")
    async def compat_generate(request: Request, body: TGIRequest) -> Response:
        if body.stream:
            return await generate_stream_response(request, body)
        return await generate_response(request, body)

    # --- OpenAI ---

    @app.post("/v1/completions", response_model=CompletionResponse, summary="Completions (OpenAI)")
    async def completions(request: Request, body: CompletionRequest) -> Response:
        if body.model is not None and body.model != settings.model_id:
            raise NotFound(
                f"the model `{body.model}` does not exist; this server serves `{settings.model_id}`",
                param="model",
            )
        choices, generations = await off_loop(openai_generation_requests, body, limits(), settings)
        sequences = submit_all(engine, generations)
        model = settings.model_id
        if body.stream:
            stream = openai_stream(engine, body, choices, sequences, model, request.url.path)
            return StreamingResponse(stream, media_type="text/event-stream", headers=SSE_HEADERS)
        try:
            finals = await wait_for_results(request, engine, sequences)
        except ClientGone:
            return Response(status_code=499)
        response = CompletionResponse(
            id=f"cmpl-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=model,
            choices=[completion_choice(body, c, f) for c, f in zip(choices, finals, strict=True)],
            usage=usage_of(choices, sum(len(f.tokens) for f in finals), body.n),
        )
        return JSONResponse(response.model_dump())

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> ModelList:
        context = engine.executor.context_length if engine.ready else None
        return ModelList(
            data=[ModelCard(id=settings.model_id, created=int(time.time()), max_model_len=context)]
        )

    # --- operations ---

    @app.get("/health", summary="200 when the engine serves; 503 while loading, reloading, draining or dead")
    async def health() -> Response:
        if engine.ready:
            return Response(status_code=200)
        body = {"error": "unhealthy", "error_type": "healthcheck", "state": engine.state.value}
        retry = engine.unavailable().retry_after
        headers = {"Retry-After": str(retry)} if retry is not None else None
        if engine.state is EngineState.FAILED and engine.error:
            body["reason"] = engine.error
        elif engine.state is EngineState.RELOADING and engine.fault:
            body["reason"] = engine.fault
        return JSONResponse(body, status_code=503, headers=headers)

    @app.get("/info", response_model=TGIInfo)
    async def info() -> TGIInfo:
        lim = limits()
        return TGIInfo(
            model_id=settings.model_id,
            model_dtype="fp32" if settings.backend == "reference" else settings.dtype,  # reference: fp32
            model_device_type="wafer" if settings.backend.startswith("sdk") else settings.backend,
            backend=settings.backend,
            max_concurrent_requests=engine.executor.num_slots,
            max_queue=settings.max_queue,
            max_input_tokens=lim.max_input_tokens,
            max_total_tokens=lim.context_length,
            max_new_tokens=lim.max_new_tokens,
            max_stop_sequences=lim.max_stop_sequences,
            max_best_of=1,
            max_top_n_tokens=lim.max_top_n_tokens,
            top_k=lim.top_k,
            kv_slots=engine.executor.num_slots,
            context_length=lim.context_length,
            version=VERSION,
            model_config_summary=model_summary or {},
            plan=engine.describe(),
            engine={
                "state": engine.state.value,
                "load_seconds": engine.load_seconds,
                "restarts": engine.restarts,
                "steps": engine.steps,
                "step_token_budget": max(settings.step_token_budget, engine.executor.num_slots),
                "kv_usage": dataclasses.asdict(engine.kv_usage()),
            },
        )

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prometheus_metrics() -> PlainTextResponse:
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app
