"""OpenAI's routes as vLLM serves them: `POST /v1/completions`, `/v1/chat/completions`, and the
served model, `GET /v1/models` and `/v1/models/{id}`."""

from __future__ import annotations

import time
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import Response

from wafer_gpt2 import logs
from wafer_gpt2.engine.failures import NotFound
from wafer_gpt2.service.delivery import (
    ClientGone,
    EventStreamResponse,
    JSONResponse,
    submit_all,
    wait_for_results,
)
from wafer_gpt2.service.hot_routes import Handler
from wafer_gpt2.service.openai_chat import chat_generation_requests, chat_response, chat_stream
from wafer_gpt2.service.openai_completions import (
    completion_response,
    openai_generation_requests,
    openai_stream,
)
from wafer_gpt2.service.routes.context import SSE_HEADERS, ServiceContext
from wafer_gpt2.service.schemas import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
)


@dataclass(frozen=True)
class OpenAIHandlers:
    """The family's handlers, called with the parsed body: the lean path's (`completions`) and
    SageMaker's /invocations' (both)."""

    completions: Handler
    chat_completions: Handler


def register_openai_routes(app: FastAPI, ctx: ServiceContext) -> OpenAIHandlers:
    engine, settings, ignored = ctx.engine, ctx.settings, ctx.ignored

    @app.post("/v1/completions", response_model=CompletionResponse, summary="Completions (OpenAI)")
    async def completions(request: Request, body: CompletionRequest) -> Response:
        return await completions_response(request, body)

    async def completions_response(request: Request, body: CompletionRequest) -> Response:
        ctx.check_model(body.model)
        choices, generations = await ctx.off_loop(
            openai_generation_requests, body, ctx.limits(), settings, request=request
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
        ctx.check_model(body.model)
        choices, generations = await ctx.off_loop(
            chat_generation_requests, body, ctx.chat_template, ctx.limits(), settings
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

    return OpenAIHandlers(completions_response, chat_completions_response)
