"""The operations routes: `GET /health` (and SageMaker's `/ping`), `/info`, `/version`, `/metrics`, and
SageMaker's `POST /invocations`, which serves a body of any generation family (chat, completion, TGI)."""

from __future__ import annotations

import asyncio
import dataclasses

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response

from wafer_gpt2.engine.metrics import Family
from wafer_gpt2.engine.process import EngineProcess
from wafer_gpt2.engine.worker import EngineState
from wafer_gpt2.service.delivery import JSONResponse
from wafer_gpt2.service.middleware import OPENAI_PREFIX
from wafer_gpt2.service.routes.context import VERSION, ServiceContext
from wafer_gpt2.service.routes.openai_routes import OpenAIHandlers
from wafer_gpt2.service.routes.tgi_routes import TGIHandlers
from wafer_gpt2.service.schemas import ChatCompletionRequest, CompletionRequest, TGIInfo, TGIRequest
from wafer_gpt2.service.validation import json_body, parse_body


def register_admin_routes(
    app: FastAPI, ctx: ServiceContext, tgi: TGIHandlers, openai: OpenAIHandlers
) -> None:
    engine, settings = ctx.engine, ctx.settings

    @app.post(
        "/invocations",
        summary="SageMaker's route: `messages` is a chat completion, `prompt` a completion, `inputs` TGI's `/`",
    )
    async def invocations(request: Request) -> Response:
        data = await json_body(request)
        if isinstance(data, dict) and "inputs" in data:
            return await tgi.compat(request, parse_body(TGIRequest, data))
        request.state.error_path = OPENAI_PREFIX  # OpenAI bodies: OpenAI's error schema
        if isinstance(data, dict) and "messages" in data:
            return await openai.chat_completions(request, parse_body(ChatCompletionRequest, data))
        return await openai.completions(request, parse_body(CompletionRequest, data))

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
        lim = ctx.limits()
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
            model_config_summary=ctx.model_summary,
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
            ctx.metrics.render(merged, own_only=own_only),
            media_type="text/plain; version=0.0.4; charset=utf-8",
        )
