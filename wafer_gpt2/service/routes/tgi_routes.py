"""TGI's generation routes: `POST /generate`, `/generate_stream`, and `/` (either, by `stream`)."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import Response

from wafer_gpt2.engine.failures import RequestValidationFailed
from wafer_gpt2.service.delivery import (
    ClientGone,
    EventStreamResponse,
    JSONResponse,
    submit_all,
    wait_for_results,
)
from wafer_gpt2.service.hot_routes import Handler
from wafer_gpt2.service.routes.context import SSE_HEADERS, ServiceContext
from wafer_gpt2.service.schemas import TGIRequest, TGIResponse
from wafer_gpt2.service.tgi import tgi_generation_request, tgi_json, tgi_response, tgi_stream


@dataclass(frozen=True)
class TGIHandlers:
    """The family's handlers, called with the parsed body: the lean path's (`generate`,
    `generate_stream`) and SageMaker's /invocations' (`compat`)."""

    generate: Handler
    generate_stream: Handler
    compat: Handler


def register_tgi_routes(app: FastAPI, ctx: ServiceContext) -> TGIHandlers:
    engine, settings, ignored = ctx.engine, ctx.settings, ctx.ignored

    async def generate_response(request: Request, body: TGIRequest, as_list: bool = False) -> Response:
        generation = await ctx.off_loop(tgi_generation_request, body, ctx.limits(), settings, request=request)
        sequences = submit_all(engine, [generation], stream=False)
        try:
            (final,) = await wait_for_results(request, engine, sequences)
        except ClientGone:
            return Response(status_code=499)
        headers = ignored.headers(body, request.scope["path"])
        data = tgi_json(tgi_response(body, final, ctx.hooks))
        return JSONResponse([data] if as_list else data, headers=headers)

    async def generate_stream_response(request: Request, body: TGIRequest) -> Response:
        if body.parameters.decoder_input_details:
            raise RequestValidationFailed(
                "parameters.decoder_input_details: `decoder_input_details` == true is not supported when "
                "streaming tokens",
                param="parameters.decoder_input_details",
            )
        generation = await ctx.off_loop(tgi_generation_request, body, ctx.limits(), settings, request=request)
        (sequence,) = submit_all(engine, [generation])
        stream = tgi_stream(engine, sequence, body, ctx.hooks, request.scope["path"])
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

    return TGIHandlers(generate_response, generate_stream_response, compat_generate)
