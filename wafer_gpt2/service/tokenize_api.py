"""The tokenizer over HTTP: vLLM's `/tokenize` (a prompt, or chat messages through the chat
template), `/detokenize` and `/tokenizer_info`, and TGI's `/tokenize` (which shares vLLM's path: a
body with `inputs` is TGI's). They tokenize exactly as the generation routes do, and take texts up to
the same length in characters as a prompt (tokenizing shares the request pool with the prompts).
"""

from __future__ import annotations

from typing import Any

from wafer_gpt2.engine.failures import RequestValidationFailed
from wafer_gpt2.model import hf_tokenizer, tokenizer
from wafer_gpt2.service.chat_template import ChatTemplate
from wafer_gpt2.service.delivery import token_string
from wafer_gpt2.service.openai_chat import render_chat
from wafer_gpt2.service.schemas import (
    DetokenizeRequest,
    DetokenizeResponse,
    TGISimpleToken,
    TGITokenizeRequest,
    TokenizeChatRequest,
    TokenizePromptRequest,
    TokenizeResponse,
)
from wafer_gpt2.service.validation import Limits, encode_prompt, parse_body


def is_tgi_body(data: Any) -> bool:
    return isinstance(data, dict) and "inputs" in data


def vllm_tokenize_body(data: Any) -> TokenizePromptRequest | TokenizeChatRequest:
    if isinstance(data, dict) and "messages" in data:
        return parse_body(TokenizeChatRequest, data)
    return parse_body(TokenizePromptRequest, data)


def vllm_tokenize(
    body: TokenizePromptRequest | TokenizeChatRequest, template: ChatTemplate, limits: Limits
) -> TokenizeResponse:
    if isinstance(body, TokenizeChatRequest):
        ids = encode_prompt(render_chat(body, template), limits, "messages")
    else:
        ids = encode_prompt(body.prompt, limits, "prompt")
    strs = [token_string(t) for t in ids] if body.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=limits.context_length, tokens=ids, token_strs=strs)


def vllm_detokenize(body: DetokenizeRequest, vocab_size: int) -> DetokenizeResponse:
    bad = [t for t in body.tokens if not 0 <= t < vocab_size]
    if bad:
        raise RequestValidationFailed(
            f"`tokens`: token id {bad[0]} is outside 0..{vocab_size - 1}", param="tokens"
        )
    return DetokenizeResponse(prompt=tokenizer.decode(body.tokens))


def tgi_tokenize(body: TGITokenizeRequest, limits: Limits) -> list[TGISimpleToken]:
    tokens, offset = [], 0
    for token in encode_prompt(body.inputs, limits, "inputs"):
        size = len(tokenizer.token_bytes(token))
        tokens.append(TGISimpleToken(id=token, text=token_string(token), start=offset, stop=offset + size))
        offset += size
    return tokens


def tokenizer_info(template: ChatTemplate, context_length: int) -> dict[str, Any]:
    """vLLM's `/tokenizer_info`: the tokenizer's config (as in the model directory's
    tokenizer_config.json) and the chat template in use; lm-eval's remote tokenizer reads it."""
    return {**hf_tokenizer.tokenizer_config(context_length), "chat_template": template.source}
