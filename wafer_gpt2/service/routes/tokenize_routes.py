"""The tokenizer's routes: `POST /tokenize` (vLLM's body or TGI's), `/detokenize` and
`GET /tokenizer_info` (vLLM's)."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import Response

from wafer_gpt2.service import tokenize_api
from wafer_gpt2.service.delivery import JSONResponse
from wafer_gpt2.service.middleware import OPENAI_PREFIX
from wafer_gpt2.service.routes.context import ServiceContext
from wafer_gpt2.service.schemas import DetokenizeRequest, DetokenizeResponse, TGITokenizeRequest
from wafer_gpt2.service.validation import json_body, parse_body


def register_tokenize_routes(app: FastAPI, ctx: ServiceContext) -> None:
    ignored = ctx.ignored

    @app.post("/tokenize", summary="Tokenize: vLLM's shape (`prompt` or `messages`), or TGI's (`inputs`)")
    async def tokenize(request: Request) -> Response:
        data, path = await json_body(request), request.scope["path"]
        if tokenize_api.is_tgi_body(data):
            tgi_body = parse_body(TGITokenizeRequest, data)
            tokens = [
                t.model_dump() for t in await ctx.off_loop(tokenize_api.tgi_tokenize, tgi_body, ctx.limits())
            ]
            return JSONResponse(tokens, headers=ignored.headers(tgi_body, path))
        request.state.error_path = OPENAI_PREFIX  # vLLM's body: OpenAI's error schema
        body = tokenize_api.vllm_tokenize_body(data)
        ctx.check_model(body.model)
        response = await ctx.off_loop(tokenize_api.vllm_tokenize, body, ctx.chat_template, ctx.limits())
        return JSONResponse(response.model_dump(), headers=ignored.headers(body, path))

    @app.post("/detokenize", response_model=DetokenizeResponse, summary="Token ids to text (vLLM)")
    async def detokenize(request: Request, body: DetokenizeRequest) -> Response:
        ctx.check_model(body.model)
        response = tokenize_api.vllm_detokenize(body, ctx.limits().vocab_size)
        return JSONResponse(response.model_dump(), headers=ignored.headers(body, request.scope["path"]))

    @app.get("/tokenizer_info", summary="The tokenizer's config and the chat template (vLLM)")
    async def tokenizer_info() -> dict:
        return tokenize_api.tokenizer_info(ctx.chat_template, ctx.limits().context_length)
