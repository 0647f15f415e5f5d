"""The HTTP API: TGI's routes, OpenAI's completions and chat, tokenizing, health, info and metrics,
over one engine.

`create_app(settings, backend_factory)` builds the FastAPI app; its lifespan starts the engine's
worker (which uploads the model; /health answers 503 until it is done) and drains it at shutdown.
Requests are validated and tokenized before they are queued, so bad input never reaches the wafer;
errors come back in the schema of the route, as a response or, once a stream has started, as a
stream event. The routes live in `wafer_gpt2.service.routes`, one module per family, each registered
from the shared `ServiceContext`; the protocols themselves in `wafer_gpt2.service.tgi`,
`wafer_gpt2.service.openai_completions` and `wafer_gpt2.service.openai_chat`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI

from wafer_gpt2.engine import heap
from wafer_gpt2.engine.core import gpt2_tokenizer_hooks
from wafer_gpt2.engine.metrics import ServiceMetrics
from wafer_gpt2.engine.process import EngineOptions, EngineProcess
from wafer_gpt2.engine.serving import ServingEngine
from wafer_gpt2.engine.worker import BackendFactory
from wafer_gpt2.logs import RequestIdMiddleware
from wafer_gpt2.model import tokenizer
from wafer_gpt2.service.chat_template import DEFAULT_CHAT_TEMPLATE, ChatTemplate
from wafer_gpt2.service.delivery import JSONResponse
from wafer_gpt2.service.hot_routes import HotRoute, LeanPath, ServiceApp
from wafer_gpt2.service.middleware import GuardMiddleware
from wafer_gpt2.service.routes.admin_routes import register_admin_routes
from wafer_gpt2.service.routes.context import VERSION, ServiceContext, request_pool
from wafer_gpt2.service.routes.error_handlers import register_error_handlers
from wafer_gpt2.service.routes.openai_routes import register_openai_routes
from wafer_gpt2.service.routes.tgi_routes import register_tgi_routes
from wafer_gpt2.service.routes.tokenize_routes import register_tokenize_routes
from wafer_gpt2.service.schemas import CompletionRequest, TGIRequest
from wafer_gpt2.settings import ServerSettings


def create_app(
    settings: ServerSettings,
    backend_factory: BackendFactory,
    model_summary: dict | None = None,
    on_fatal: Callable[[str], None] | None = None,
) -> ServiceApp:
    """The service: `backend_factory` is called on the engine's worker thread to upload the model."""
    tokenizer.get_encoding()  # build the BPE tables now, not on the first request
    metrics = ServiceMetrics(settings.model_id)
    options = EngineOptions.of(settings, backend_factory)
    engine: ServingEngine = (
        EngineProcess(options, metrics, on_fatal=on_fatal)
        if settings.engine_process
        else options.engine(metrics, on_fatal=on_fatal)
    )
    ctx = ServiceContext(
        settings=settings,
        engine=engine,
        metrics=metrics,
        hooks=gpt2_tokenizer_hooks(),
        chat_template=(
            DEFAULT_CHAT_TEMPLATE
            if settings.chat_template is None
            else ChatTemplate(settings.chat_template, name="--chat-template")
        ),
        pool=request_pool(),
        model_summary=model_summary or {},
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        if settings.freeze_heap:
            heap.settle()  # this process's heap; an in-process backend loads later, on the worker
        yield
        await asyncio.to_thread(engine.shutdown, settings.shutdown_timeout_s)
        ctx.pool.shutdown(wait=False)

    app = ServiceApp(
        title="wafer-gpt2",
        version=VERSION,
        lifespan=lifespan,
        default_response_class=JSONResponse,
        # FastAPI's OpenTelemetry hooks look up the global providers on every request, a few percent of
        # the HTTP process's time; the service's telemetry is /metrics and its logs.
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

    errors = register_error_handlers(app, metrics)
    # In this order: the OpenAPI schema lists the paths in the order they were registered.
    tgi = register_tgi_routes(app, ctx)
    openai = register_openai_routes(app, ctx)
    register_tokenize_routes(app, ctx)
    register_admin_routes(app, ctx, tgi, openai)

    # The generation routes' lean path, in front of the middleware (wafer_gpt2/service/hot_routes.py); the
    # routes are registered above too, for the requests it leaves to FastAPI and for the OpenAPI schema.
    app.lean = LeanPath(
        routes={
            "/generate": HotRoute(TGIRequest, tgi.generate),
            "/generate_stream": HotRoute(TGIRequest, tgi.generate_stream),
            "/v1/completions": HotRoute(CompletionRequest, openai.completions),
        },
        max_body_bytes=settings.max_body_bytes,
        api_key=settings.api_key,
        on_error=errors.service_error,
        on_unexpected=errors.unexpected_error,
    )
    return app
