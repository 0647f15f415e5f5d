"""OpenAI's completions protocol (as vLLM serves it): a `/v1/completions` body to engine requests (one
per prompt and choice), and the engine's results to OpenAI's response, stream chunks and logprobs.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from json.encoder import encode_basestring_ascii
from typing import Literal

from wafer_gpt2 import logs
from wafer_gpt2.engine.detokenizer import IncrementalDetokenizer
from wafer_gpt2.engine.failures import RequestValidationFailed
from wafer_gpt2.engine.request import (
    Alternative,
    FinishEvent,
    FinishReason,
    GeneratedToken,
    GenerationRequest,
    PromptToken,
    Submitted,
    TokenEvent,
)
from wafer_gpt2.engine.serving import ServingEngine
from wafer_gpt2.model import tokenizer
from wafer_gpt2.service.delivery import openai_sse, sse, token_string
from wafer_gpt2.service.schemas import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    OpenAIGenerationBody,
    PromptLogprob,
    PromptLogprobs,
    Usage,
)
from wafer_gpt2.service.validation import (
    OPENAI_FIELDS,
    FieldNames,
    Limits,
    check_request,
    encode_prompt,
    sampling_params,
)
from wafer_gpt2.settings import ServerSettings


@dataclass(frozen=True)
class Choice:
    index: int
    prompt_ids: tuple[int, ...]
    prompt_text: str


def completion_prompts(body: CompletionRequest, limits: Limits) -> list[list[int]]:
    """The prompts' token ids; text is bounded by characters before it is tokenized."""
    prompt, field = body.prompt, OPENAI_FIELDS.prompt
    truncating = body.truncate_prompt_tokens is not None
    if isinstance(prompt, str):
        return [encode_prompt(prompt, limits, field, truncating)]
    if all(isinstance(item, str) for item in prompt):
        return [encode_prompt(item, limits, field, truncating) for item in prompt]
    if all(isinstance(item, int) for item in prompt):
        return [list(prompt)]
    return [list(item) for item in prompt]


def openai_generation_requests(
    body: CompletionRequest, limits: Limits, settings: ServerSettings
) -> tuple[list[Choice], list[GenerationRequest]]:
    if body.max_tokens == 0 and not body.echo:
        raise RequestValidationFailed(
            "`max_tokens` must be at least 1, got 0 (0 is allowed with `echo`: score the prompt)",
            param="max_tokens",
        )
    prompt = body.prompt
    single = isinstance(prompt, str) or all(isinstance(item, int) for item in prompt)
    count = 1 if single else len(prompt)
    if count * body.n > settings.max_n:  # before tokenizing anything
        raise RequestValidationFailed(
            f"`n` x number of prompts must be <= {settings.max_n}, given {body.n} x {count}", param="n"
        )
    if body.best_of is not None and body.best_of != body.n:
        raise RequestValidationFailed(
            "`best_of` other than `n` is not supported by this server", param="best_of"
        )
    return generation_requests(
        body,
        completion_prompts(body, limits),
        body.max_tokens,
        limits,
        settings,
        prompt_logprobs=body.echo and body.logprobs is not None,
        top_n=body.logprobs or 0,
        prompt_top_n=max(body.logprobs or 0, body.prompt_logprobs or 0),
    )


def generation_requests(
    body: OpenAIGenerationBody,
    prompts: list[list[int]],
    max_tokens: int | None,
    limits: Limits,
    settings: ServerSettings,
    prompt_logprobs: bool = False,
    top_n: int = 0,
    prompt_top_n: int | None = None,
    extra_stop: tuple[str, ...] = (),
    names: FieldNames = OPENAI_FIELDS,
) -> tuple[list[Choice], list[GenerationRequest]]:
    """One engine request per prompt and choice, from the fields both OpenAI routes share (`names`: what
    the route calls them)."""
    if len(prompts) * body.n > settings.max_n:
        raise RequestValidationFailed(
            f"`n` x number of prompts must be <= {settings.max_n}, given {body.n} x {len(prompts)}", param="n"
        )
    if body.prompt_logprobs is not None and body.stream:
        raise RequestValidationFailed(
            "`prompt_logprobs` is not available when streaming", param="prompt_logprobs"
        )
    if max_tokens is not None and body.min_tokens > max_tokens:
        raise RequestValidationFailed(
            f"`min_tokens` must be <= `max_tokens`, given {body.min_tokens} > {max_tokens}",
            param="min_tokens",
        )
    truncate = body.truncate_prompt_tokens
    if truncate is not None:
        keep = limits.max_input_tokens if truncate == -1 else truncate  # vLLM: keep the last N tokens
        prompts = [ids[-keep:] for ids in prompts]
    greedy = body.temperature == 0.0
    top_k = body.top_k if body.top_k not in (None, 0, -1) else None
    top_p = body.top_p if body.top_p not in (None, 1.0) else None
    stops = tuple(body.stop) + tuple(s for s in extra_stop if s not in body.stop)
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
                presence_penalty=body.presence_penalty or 0.0,
                frequency_penalty=body.frequency_penalty or 0.0,
                min_p=body.min_p or 0.0,
            )
            max_new = max_tokens if max_tokens is not None else max(1, limits.context_length - len(ids))
            request = GenerationRequest(
                prompt_ids=tuple(ids),
                max_new_tokens=max_new,
                sampling=sampling,
                stop_sequences=stops,
                stop_token_ids=frozenset(body.stop_token_ids or ()),
                ignore_eos=body.ignore_eos,
                prompt_logprobs=prompt_logprobs or body.prompt_logprobs is not None,
                top_n_tokens=top_n,
                timeout_s=settings.request_timeout_s,
                min_tokens=body.min_tokens,
                include_stop_str_in_output=body.include_stop_str_in_output,
                skip_special_tokens=body.skip_special_tokens,
                prompt_top_n=prompt_top_n,
            )
            requests.append(check_request(request, limits, names))
            choices.append(Choice(index, tuple(ids), tokenizer.decode(ids)))
    return choices, requests


def openai_finish_reason(
    final: FinishEvent, body: OpenAIGenerationBody
) -> tuple[Literal["stop", "length"], str | int | None]:
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

    def prompt(self, choice: Choice, prefill: tuple[PromptToken, ...], n: int) -> CompletionLogprobs:
        """The prompt's entries with n alternatives each (the engine may have kept more)."""
        pieces = IncrementalDetokenizer(tokenizer.token_bytes, token_text=tokenizer.token_text)
        entries = []
        for i, token in enumerate(choice.prompt_ids):
            known = prefill[i] if i < len(prefill) else None
            text = pieces.add(token).text
            top = (
                None
                if known is None or known.logprob is None
                else self._top(known.top[:n], token, known.logprob)
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


def prompt_logprobs_of(choice: Choice, prefill: tuple[PromptToken, ...], n: int) -> PromptLogprobs:
    """vLLM's `prompt_logprobs`: None for the first token, then per position the prompt's token and the
    model's n best candidates, keyed by token id."""
    out: PromptLogprobs = [None]
    for known in prefill[1:]:
        if known.logprob is None:  # only the first prompt token has none (nothing predicts it)
            raise ValueError(f"prompt token {known.id} has no logprob")
        entries = {
            str(a.id): PromptLogprob(logprob=a.logprob, rank=rank, decoded_token=token_string(a.id))
            for rank, a in enumerate(known.top[:n], start=1)
        }
        entries.setdefault(
            str(known.id),
            PromptLogprob(logprob=known.logprob, rank=known.rank, decoded_token=token_string(known.id)),
        )
        out.append(entries)
    return out[: len(choice.prompt_ids)]


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
            logprobs = merge_logprobs(
                builder.prompt(choice, final.prefill, body.logprobs), builder.generated(final.tokens)
            )
    prompt_logprobs = None
    if body.prompt_logprobs is not None:
        prompt_logprobs = prompt_logprobs_of(choice, final.prefill, body.prompt_logprobs)
    return CompletionChoice(
        index=choice.index,
        text=text,
        logprobs=logprobs,
        finish_reason=reason,
        stop_reason=stop_reason,
        prompt_logprobs=prompt_logprobs,
    )


def chunk_usage(
    body: OpenAIGenerationBody, choices: list[Choice], position: int, generated: int
) -> Usage | None:
    """vLLM's `stream_options.continuous_usage_stats` (with `include_usage`): every chunk carries its
    choice's usage so far."""
    options = body.stream_options
    if options is None or not (options.include_usage and options.continuous_usage_stats):
        return None
    prompt = len(choices[position].prompt_ids)
    return Usage(prompt_tokens=prompt, completion_tokens=generated, total_tokens=prompt + generated)


def usage_of(choices: list[Choice], completion_tokens: int, n: int) -> Usage:
    prompt_tokens = sum(len(choice.prompt_ids) for choice in choices[::n])  # each prompt once
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )


def plain_choice(index: int, text: str, finish: str | None, stop_reason: str | int | None) -> dict:
    """`CompletionChoice(...).model_dump()` of a choice without logprobs of either kind."""
    return {
        "index": index,
        "text": text,
        "logprobs": None,
        "finish_reason": finish,
        "stop_reason": stop_reason,
        "prompt_logprobs": None,
    }


def response_dict(
    completion_id: str, created: int, model: str, choices: list[dict], usage: dict | None
) -> dict:
    """`CompletionResponse(...).model_dump()`, given its choices and usage dumped."""
    return {
        "id": completion_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage,
        "system_fingerprint": None,
    }


def completion_response(
    body: CompletionRequest,
    choices: list[Choice],
    finals: list[FinishEvent],
    model: str,
    completion_id: str,
    created: int,
) -> dict:
    """The non-streamed response, as `CompletionResponse(...).model_dump()` gives it. A choice without
    logprobs is built as a plain dict: the models' validation and dump cost more than the rest of the
    response, on every request (tests/test_host_stack.py checks the two agree)."""
    plain = body.logprobs is None and body.prompt_logprobs is None
    dumped = []
    for choice, final in zip(choices, finals, strict=True):
        if plain:
            reason, stop_reason = openai_finish_reason(final, body)
            text = (choice.prompt_text if body.echo else "") + final.text
            dumped.append(plain_choice(choice.index, text, reason, stop_reason))
        else:
            dumped.append(completion_choice(body, choice, final).model_dump())
    usage = usage_of(choices, sum(len(final.tokens) for final in finals), body.n)
    return response_dict(completion_id, created, model, dumped, usage.model_dump())


def plain_chunk(
    completion_id: str, created: int, model: str, index: int, text: str, finish: str | None, stop_reason
) -> dict:
    """`CompletionResponse(...).model_dump()` of a stream chunk with one choice, no logprobs, no usage."""
    return response_dict(
        completion_id, created, model, [plain_choice(index, text, finish, stop_reason)], None
    )


def chunk_head(completion_id: str, created: int, model: str) -> str:
    """What every plain chunk of a stream begins with (`plain_chunk_frame`)."""
    return (
        f'data: {{"id":{encode_basestring_ascii(completion_id)},"object":"text_completion",'
        f'"created":{int(created)},"model":{encode_basestring_ascii(model)},"choices":[{{"index":'
    )


def plain_chunk_frame(head: str, index: int, text: str, finish: str | None) -> bytes:
    """`sse(plain_chunk(..., index, text, finish, None))` given the stream's `chunk_head`, formatted
    directly: the same bytes without building and encoding the dict, once per token."""
    shown = "null" if finish is None else encode_basestring_ascii(finish)
    return (
        f'{head}{int(index)},"text":{encode_basestring_ascii(text)},"logprobs":null,"finish_reason":{shown},'
        '"stop_reason":null,"prompt_logprobs":null}],"usage":null,"system_fingerprint":null}\n\n'
    ).encode()


def openai_stream(
    engine: ServingEngine,
    body: CompletionRequest,
    choices: list[Choice],
    sequences: list[Submitted],
    model: str,
    path: str,
) -> AsyncIterator[bytes]:
    """The stream's bytes: `openai_sse`'s generator, with this protocol's chunks (built here, at the call)."""
    completion_id, created = f"cmpl-{logs.fresh_hex(128)}", int(time.time())
    head = chunk_head(completion_id, created, model)

    def chunk(
        position: int, generated: int, text: str, logprobs=None, finish=None, stop_reason=None
    ) -> bytes:
        usage = chunk_usage(body, choices, position, generated)
        if logprobs is None and usage is None:
            # A plain token chunk, as the model's dump below gives it, built directly: this runs for every
            # token of every stream (tests/test_service_units.py checks the two agree).
            if stop_reason is None:
                return plain_chunk_frame(head, choices[position].index, text, finish)
            return sse(
                plain_chunk(completion_id, created, model, choices[position].index, text, finish, stop_reason)
            )
        data = CompletionResponse(
            id=completion_id,
            created=created,
            model=model,
            choices=[
                CompletionChoice(
                    index=choices[position].index,
                    text=text,
                    logprobs=logprobs,
                    finish_reason=finish,
                    stop_reason=stop_reason,
                )
            ],
            usage=usage,
        )
        return sse(data.model_dump(exclude_none=False))

    builders = [LogprobsBuilder() for _ in choices]
    started = [False] * len(choices)
    want = body.logprobs is not None

    def render(position: int, event: TokenEvent | FinishEvent) -> list[bytes]:
        choice = choices[position]
        prefix, prefix_logprobs = "", None
        if not started[position]:
            started[position] = True
            if body.echo:
                prefix = choice.prompt_text
                if body.logprobs is not None:
                    prefix_logprobs = builders[position].prompt(choice, event.prefill, body.logprobs)
        if isinstance(event, TokenEvent):
            logprobs = builders[position].generated([event.token]) if want else None
            if prefix_logprobs is not None and logprobs is not None:  # both or neither: `want`
                logprobs = merge_logprobs(prefix_logprobs, logprobs)
            return [chunk(position, event.number, prefix + event.token.released, logprobs)]
        last = event.tokens[-1:]  # none when only the prompt was scored (max_tokens 0)
        logprobs = builders[position].generated(last) if want else None
        if prefix_logprobs is not None and logprobs is not None:  # both or neither: `want`
            logprobs = merge_logprobs(prefix_logprobs, logprobs)
        reason, stop_reason = openai_finish_reason(event, body)
        text = prefix + "".join(t.released for t in last) + event.tail
        return [chunk(position, len(event.tokens), text, logprobs, reason, stop_reason)]

    def usage_chunk(completion_tokens: int) -> bytes | None:
        if body.stream_options is None or not body.stream_options.include_usage:
            return None
        usage = usage_of(choices, completion_tokens, body.n)
        return sse(
            CompletionResponse(
                id=completion_id, created=created, model=model, choices=[], usage=usage
            ).model_dump()
        )

    return openai_sse(engine, sequences, path, render, usage_chunk)
