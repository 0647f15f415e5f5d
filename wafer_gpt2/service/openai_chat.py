"""OpenAI's chat completions protocol (as vLLM serves it): the messages are rendered by the chat
template into one prompt, which then runs like a completion; the results come back as chat messages,
chunks and chat-style logprobs.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from json.encoder import encode_basestring_ascii

from wafer_gpt2 import logs
from wafer_gpt2.engine.failures import RequestValidationFailed
from wafer_gpt2.engine.request import FinishEvent, GeneratedToken, GenerationRequest, Submitted, TokenEvent
from wafer_gpt2.engine.serving import ServingEngine
from wafer_gpt2.model import tokenizer
from wafer_gpt2.service.chat_template import ChatTemplate, ChatTemplateError
from wafer_gpt2.service.delivery import openai_sse, sse, token_string
from wafer_gpt2.service.openai_completions import (
    Choice,
    chunk_usage,
    generation_requests,
    openai_finish_reason,
    prompt_logprobs_of,
    usage_of,
)
from wafer_gpt2.service.schemas import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatResponseMessage,
    ChatTokenLogprob,
    ChatTopLogprob,
    TokenizeChatRequest,
)
from wafer_gpt2.service.validation import CHAT_FIELDS, Limits, encode_prompt
from wafer_gpt2.settings import ServerSettings


def render_chat(body: ChatCompletionRequest | TokenizeChatRequest, template: ChatTemplate) -> str:
    """The prompt text of a chat body (also what `/tokenize` shows of one)."""
    messages = [message.for_template() for message in body.messages]
    try:
        return template.render(
            messages,
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            extra=body.chat_template_kwargs,
        )
    except ChatTemplateError as exc:
        raise RequestValidationFailed(f"`messages`: {exc}", param="messages") from None


def chat_generation_requests(
    body: ChatCompletionRequest, template: ChatTemplate, limits: Limits, settings: ServerSettings
) -> tuple[list[Choice], list[GenerationRequest]]:
    if body.top_logprobs and not body.logprobs:
        raise RequestValidationFailed("`top_logprobs` needs `logprobs: true`", param="top_logprobs")
    if (
        body.add_generation_prompt
        and body.continue_final_message
        and "add_generation_prompt" in body.model_fields_set
    ):
        raise RequestValidationFailed(
            "`add_generation_prompt` and `continue_final_message` cannot both be true",
            param="continue_final_message",
        )
    # A template may place <|endoftext|> itself (as `eos_token`): it is the special token, as in vLLM.
    truncating = body.truncate_prompt_tokens is not None
    prompt = encode_prompt(render_chat(body, template), limits, CHAT_FIELDS.prompt, truncating)
    names = CHAT_FIELDS
    max_tokens = body.max_tokens
    if body.max_completion_tokens is not None:  # it wins over max_tokens: errors name it
        names = dataclasses.replace(CHAT_FIELDS, max_new_tokens="max_completion_tokens")
        max_tokens = body.max_completion_tokens
    return generation_requests(
        body,
        [prompt],
        max_tokens,
        limits,
        settings,
        top_n=(body.top_logprobs or 0) if body.logprobs else 0,
        prompt_top_n=body.prompt_logprobs,
        extra_stop=template.stop,
        names=names,
    )


def chat_logprobs(tokens: list[GeneratedToken] | tuple[GeneratedToken, ...]) -> ChatLogprobs:
    def entry(token_id: int, logprob: float) -> ChatTopLogprob:
        return ChatTopLogprob(
            token=token_string(token_id), logprob=logprob, bytes=list(tokenizer.token_bytes(token_id))
        )

    content = []
    for token in tokens:
        chosen = entry(token.id, token.logprob)
        top = [entry(a.id, a.logprob) for a in token.top]
        content.append(ChatTokenLogprob(**chosen.model_dump(), top_logprobs=top))
    return ChatLogprobs(content=content)


def chat_response(
    body: ChatCompletionRequest, choices: list[Choice], finals: list[FinishEvent], model: str
) -> ChatCompletionResponse:
    out = []
    for choice, final in zip(choices, finals, strict=True):
        reason, stop_reason = openai_finish_reason(final, body)
        out.append(
            ChatChoice(
                index=choice.index,
                message=ChatResponseMessage(content=final.text),
                logprobs=chat_logprobs(final.tokens) if body.logprobs else None,
                finish_reason=reason,
                stop_reason=stop_reason,
            )
        )
    prompt_logprobs = None
    if body.prompt_logprobs is not None:  # vLLM puts them beside the choices (one prompt for all)
        prompt_logprobs = prompt_logprobs_of(choices[0], finals[0].prefill, body.prompt_logprobs)
    return ChatCompletionResponse(
        id=f"chatcmpl-{logs.fresh_hex(128)}",
        created=int(time.time()),
        model=model,
        choices=out,
        usage=usage_of(choices, sum(len(f.tokens) for f in finals), body.n),
        prompt_logprobs=prompt_logprobs,
    )


def chat_chunk_head(chat_id: str, created: int, model: str) -> str:
    """What every content chunk of a chat stream begins with (`chat_content_frame`)."""
    return (
        f'data: {{"id":{encode_basestring_ascii(chat_id)},"object":"chat.completion.chunk",'
        f'"created":{int(created)},"model":{encode_basestring_ascii(model)},"choices":[{{"index":'
    )


def chat_content_frame(head: str, index: int, content: str, finish: str | None) -> bytes:
    """The SSE frame of `ChatCompletionChunk(...).model_dump()` with one choice whose delta is `content`
    alone (no role, logprobs, stop reason or usage), given the stream's `chat_chunk_head`, formatted
    directly: this runs for every token of every chat stream, where the models' validation and dump
    cost several times the rest (tests/test_host_stack.py checks the two agree)."""
    shown = "null" if finish is None else encode_basestring_ascii(finish)
    return (
        f'{head}{int(index)},"delta":{{"role":null,"content":{encode_basestring_ascii(content)}}},'
        f'"logprobs":null,"finish_reason":{shown},"stop_reason":null}}],"usage":null,'
        '"system_fingerprint":null}\n\n'
    ).encode()


def chat_stream(
    engine: ServingEngine,
    body: ChatCompletionRequest,
    choices: list[Choice],
    sequences: list[Submitted],
    model: str,
    path: str,
) -> AsyncIterator[bytes]:
    """The stream's bytes: `openai_sse`'s generator, with this protocol's chunks (built here, at the call)."""
    chat_id, created = f"chatcmpl-{logs.fresh_hex(128)}", int(time.time())
    head = chat_chunk_head(chat_id, created, model)
    started = [False] * len(choices)

    def chunk(
        position: int, generated: int, content: str, role=None, tokens=(), finish=None, stop_reason=None
    ) -> bytes:
        logprobs = chat_logprobs(tokens) if body.logprobs and tokens else None
        usage = chunk_usage(body, choices, position, generated)
        if role is None and logprobs is None and usage is None and stop_reason is None:
            return chat_content_frame(head, choices[position].index, content, finish)
        choice = ChatChunkChoice(
            index=choices[position].index,
            delta=ChatDelta(role=role, content=content),
            logprobs=logprobs,
            finish_reason=finish,
            stop_reason=stop_reason,
        )
        data = ChatCompletionChunk(id=chat_id, created=created, model=model, choices=[choice], usage=usage)
        return sse(data.model_dump(exclude_none=False))

    def render(position: int, event: TokenEvent | FinishEvent) -> list[bytes]:
        out = []
        if not started[position]:
            started[position] = True  # OpenAI's first chunk of a choice names the role
            out.append(chunk(position, 0, "", role="assistant"))
        if isinstance(event, TokenEvent):
            out.append(chunk(position, event.number, event.token.released, tokens=[event.token]))
            return out
        last = event.tokens[-1:]
        text = "".join(t.released for t in last) + event.tail
        reason, stop_reason = openai_finish_reason(event, body)
        out.append(chunk(position, len(event.tokens), text, None, last, reason, stop_reason))
        return out

    def usage_chunk(completion_tokens: int) -> bytes | None:
        if body.stream_options is None or not body.stream_options.include_usage:
            return None
        usage = usage_of(choices, completion_tokens, body.n)
        data = ChatCompletionChunk(id=chat_id, created=created, model=model, choices=[], usage=usage)
        return sse(data.model_dump())

    return openai_sse(engine, sequences, path, render, usage_chunk)
