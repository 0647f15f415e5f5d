"""OpenAI's completions protocol (as vLLM serves it): a `/v1/completions` body to engine requests (one
per prompt and choice), and the engine's results to OpenAI's response, stream chunks and logprobs.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from service.delivery import events, sse, token_string
from service.detokenizer import IncrementalDetokenizer
from service.engine import Engine
from service.errors import RequestValidationFailed
from service.middleware import error_body
from service.schemas import CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse, Usage
from service.sequence import (
    Alternative,
    ErrorEvent,
    FinishEvent,
    FinishReason,
    GeneratedToken,
    GenerationRequest,
    PromptToken,
    Sequence,
    TokenEvent,
)
from service.settings import ServerSettings
from service.validation import OPENAI_FIELDS, Limits, check_request, encode_prompt, sampling_params
from weights import tokenizer


@dataclass(frozen=True)
class Choice:
    index: int
    prompt_ids: tuple[int, ...]
    prompt_text: str


def openai_generation_requests(
    body: CompletionRequest, limits: Limits, settings: ServerSettings
) -> tuple[list[Choice], list[GenerationRequest]]:
    prompt = body.prompt
    single = isinstance(prompt, str) or all(isinstance(item, int) for item in prompt)
    count = 1 if single else len(prompt)
    if count * body.n > settings.max_n:  # before tokenizing anything
        raise RequestValidationFailed(
            f"`n` x number of prompts must be <= {settings.max_n}, given {body.n} x {count}", param="n"
        )
    field = OPENAI_FIELDS.prompt
    if isinstance(prompt, str):
        prompts = [encode_prompt(prompt, limits, field)]
    elif all(isinstance(item, str) for item in prompt):
        prompts = [encode_prompt(item, limits, field) for item in prompt]
    elif all(isinstance(item, int) for item in prompt):
        prompts = [list(prompt)]
    else:
        prompts = [list(item) for item in prompt]
    if body.best_of is not None and body.best_of != body.n:
        raise RequestValidationFailed(
            "`best_of` other than `n` is not supported by this server", param="best_of"
        )

    greedy = body.temperature == 0.0
    top_k = body.top_k if body.top_k not in (None, 0, -1) else None
    top_p = body.top_p if body.top_p not in (None, 1.0) else None
    choices, requests = [], []
    for prompt_index, ids in enumerate(prompts):
        for sample in range(body.n):
            index = prompt_index * body.n + sample
            # Each choice gets its own seed (seed + index), so n > 1 gives n different, reproducible texts.
            seed = None if body.seed is None else (body.seed + index) % 2**64
            sampling = sampling_params(
                do_sample=not greedy,
                temperature=1.0 if greedy or body.temperature is None else body.temperature,
                top_k=None if greedy else top_k,
                top_p=None if greedy else top_p,
                repetition_penalty=body.repetition_penalty if body.repetition_penalty is not None else 1.0,
                seed=None if greedy else seed,
            )
            max_new = (
                body.max_tokens if body.max_tokens is not None else max(1, limits.context_length - len(ids))
            )
            request = GenerationRequest(
                prompt_ids=tuple(ids),
                max_new_tokens=max_new,
                sampling=sampling,
                stop_sequences=tuple(body.stop),
                stop_token_ids=frozenset(body.stop_token_ids or ()),
                ignore_eos=body.ignore_eos,
                prompt_logprobs=body.echo and body.logprobs is not None,
                top_n_tokens=body.logprobs or 0,
                timeout_s=settings.request_timeout_s,
            )
            requests.append(check_request(request, limits, OPENAI_FIELDS))
            choices.append(Choice(index, tuple(ids), tokenizer.decode(ids)))
    return choices, requests


def openai_finish_reason(final: FinishEvent, body: CompletionRequest) -> tuple[str, str | int | None]:
    """OpenAI's finish_reason and vLLM's stop_reason (the stop string or stop token, None for EOS)."""
    if final.finish_reason is FinishReason.LENGTH:
        return "length", None
    if final.finish_reason is FinishReason.STOP:
        return "stop", final.stop_sequence
    last = final.tokens[-1].id
    return "stop", last if last in (body.stop_token_ids or ()) else None


class LogprobsBuilder:
    """OpenAI's `logprobs` object, built token by token (text offsets count the returned text)."""

    def __init__(self, offset: int = 0):
        self.offset = offset

    def prompt(self, choice: Choice, prefill: tuple[PromptToken, ...]) -> CompletionLogprobs:
        pieces = IncrementalDetokenizer(tokenizer.token_bytes)
        entries = []
        for i, token in enumerate(choice.prompt_ids):
            known = prefill[i] if i < len(prefill) else None
            text = pieces.add(token).text
            top = (
                None if known is None or known.logprob is None else self._top(known.top, token, known.logprob)
            )
            entries.append((token, text, known.logprob if known else None, top))
        return self._build(entries)

    def generated(self, tokens: list[GeneratedToken] | tuple[GeneratedToken, ...]) -> CompletionLogprobs:
        return self._build([(t.id, t.text, t.logprob, self._top(t.top, t.id, t.logprob)) for t in tokens])

    @staticmethod
    def _top(top: tuple[Alternative, ...], chosen: int, logprob: float) -> dict[str, float]:
        table = {token_string(a.id): a.logprob for a in top}
        table.setdefault(token_string(chosen), logprob)
        return table

    def _build(self, entries: list) -> CompletionLogprobs:
        tokens, logprobs, tops, offsets = [], [], [], []
        for token, text, logprob, top in entries:
            tokens.append(token_string(token))
            logprobs.append(logprob)
            tops.append(top)
            offsets.append(self.offset)
            self.offset += len(text)
        return CompletionLogprobs(
            tokens=tokens, token_logprobs=logprobs, top_logprobs=tops, text_offset=offsets
        )


def merge_logprobs(first: CompletionLogprobs, second: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(
        tokens=first.tokens + second.tokens,
        token_logprobs=first.token_logprobs + second.token_logprobs,
        top_logprobs=first.top_logprobs + second.top_logprobs,
        text_offset=first.text_offset + second.text_offset,
    )


def completion_choice(body: CompletionRequest, choice: Choice, final: FinishEvent) -> CompletionChoice:
    reason, stop_reason = openai_finish_reason(final, body)
    text = (choice.prompt_text if body.echo else "") + final.text
    logprobs = None
    if body.logprobs is not None:
        builder = LogprobsBuilder()
        logprobs = builder.generated(final.tokens)
        if body.echo:
            builder = LogprobsBuilder()
            logprobs = merge_logprobs(builder.prompt(choice, final.prefill), builder.generated(final.tokens))
    return CompletionChoice(
        index=choice.index, text=text, logprobs=logprobs, finish_reason=reason, stop_reason=stop_reason
    )


def usage_of(choices: list[Choice], completion_tokens: int, n: int) -> Usage:
    prompt_tokens = sum(len(choice.prompt_ids) for choice in choices[::n])  # each prompt once
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )


async def openai_stream(
    engine: Engine,
    body: CompletionRequest,
    choices: list[Choice],
    sequences: list[Sequence],
    model: str,
    path: str,
) -> AsyncIterator[bytes]:
    completion_id, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    merged: asyncio.Queue = asyncio.Queue()

    async def pump(position: int, sequence: Sequence) -> None:
        async for event in events(sequence):
            await merged.put((position, event))

    def chunk(choice: Choice, text: str, logprobs=None, finish=None, stop_reason=None) -> bytes:
        data = CompletionResponse(
            id=completion_id,
            created=created,
            model=model,
            choices=[
                CompletionChoice(
                    index=choice.index,
                    text=text,
                    logprobs=logprobs,
                    finish_reason=finish,
                    stop_reason=stop_reason,
                )
            ],
        )
        return sse(data.model_dump(exclude_none=False))

    pumps = [asyncio.create_task(pump(i, sequence)) for i, sequence in enumerate(sequences)]
    builders = [LogprobsBuilder() for _ in choices]
    started = [False] * len(choices)
    remaining, completion_tokens = len(choices), 0
    try:
        while remaining:
            position, event = await merged.get()
            choice = choices[position]
            if isinstance(event, ErrorEvent):
                yield sse(error_body(event.error, path))
                break
            prefix, prefix_logprobs = "", None
            if not started[position]:
                started[position] = True
                if body.echo:
                    prefix = choice.prompt_text
                    if body.logprobs is not None:
                        prefill = event.prefill
                        prefix_logprobs = builders[position].prompt(choice, prefill)
            want = body.logprobs is not None
            if isinstance(event, TokenEvent):
                logprobs = builders[position].generated([event.token]) if want else None
                if prefix_logprobs is not None:
                    logprobs = merge_logprobs(prefix_logprobs, logprobs)
                yield chunk(choice, prefix + event.token.released, logprobs)
            else:
                remaining -= 1
                completion_tokens += len(event.tokens)
                last = event.tokens[-1]
                logprobs = builders[position].generated([last]) if want else None
                if prefix_logprobs is not None:
                    logprobs = merge_logprobs(prefix_logprobs, logprobs)
                reason, stop_reason = openai_finish_reason(event, body)
                yield chunk(choice, prefix + last.released + event.tail, logprobs, reason, stop_reason)
        else:
            if body.stream_options is not None and body.stream_options.include_usage:
                usage = usage_of(choices, completion_tokens, body.n)
                data = CompletionResponse(
                    id=completion_id, created=created, model=model, choices=[], usage=usage
                )
                yield sse(data.model_dump())
        yield sse("[DONE]")
    finally:
        for task in pumps:
            task.cancel()
        for sequence in sequences:
            engine.cancel(sequence)  # a no-op for those that finished
