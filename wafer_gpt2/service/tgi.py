"""TGI's protocol: a `/generate` body to an engine request, and the engine's results to TGI's
response, stream events and details.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from json.encoder import encode_basestring_ascii

from wafer_gpt2.engine.core import TokenizerHooks
from wafer_gpt2.engine.request import (
    Alternative,
    FinishEvent,
    GeneratedToken,
    GenerationRequest,
    Submitted,
    TokenEvent,
)
from wafer_gpt2.engine.serving import ServingEngine
from wafer_gpt2.service.delivery import event_batches, sse, token_string
from wafer_gpt2.service.middleware import error_body
from wafer_gpt2.service.schemas import (
    TGIDetails,
    TGIPrefillToken,
    TGIRequest,
    TGIResponse,
    TGIToken,
)
from wafer_gpt2.service.validation import TGI_FIELDS, Limits, check_request, encode_prompt, sampling_params
from wafer_gpt2.settings import ServerSettings


def tgi_generation_request(body: TGIRequest, limits: Limits, settings: ServerSettings) -> GenerationRequest:
    p = body.parameters
    prompt_ids = encode_prompt(body.inputs, limits, TGI_FIELDS.prompt, truncating=p.truncate is not None)
    if p.truncate is not None:
        prompt_ids = prompt_ids[-p.truncate :]
    max_new = p.max_new_tokens
    if max_new is None:
        # TGI's default, shortened to what the context leaves (never below 1: check_request reports it).
        max_new = max(1, min(settings.max_new_tokens_default, limits.context_length - len(prompt_ids)))
    sampling = sampling_params(
        do_sample=p.do_sample,
        temperature=p.temperature if p.temperature is not None else 1.0,
        top_k=p.top_k,
        top_p=p.top_p,
        repetition_penalty=p.repetition_penalty if p.repetition_penalty is not None else 1.0,
        seed=p.seed,
    )
    request = GenerationRequest(
        prompt_ids=tuple(prompt_ids),
        max_new_tokens=max_new,
        sampling=sampling,
        stop_sequences=tuple(p.stop),
        # TGI keeps a matched stop sequence in the text (its generated_text decodes every generated
        # token); vLLM's routes cut it.
        include_stop_str_in_output=True,
        prompt_logprobs=p.decoder_input_details and p.details,
        top_n_tokens=p.top_n_tokens or 0,
        timeout_s=settings.request_timeout_s,
    )
    return check_request(request, limits, TGI_FIELDS)


def tgi_json(response: TGIResponse) -> dict:
    """TGI leaves out `details` (and `top_tokens`) when not asked for, but keeps null logprobs."""
    data = response.model_dump()
    if data["details"] is None:
        del data["details"]
    elif data["details"]["top_tokens"] is None:
        del data["details"]["top_tokens"]
    return data


def tgi_token(token: GeneratedToken, text: str | None = None) -> TGIToken:
    """`text` defaults to what the token added to the text (a special token shows its name)."""
    if text is None:
        text = token_string(token.id) if token.special else token.text
    return TGIToken(id=token.id, text=text, logprob=token.logprob, special=token.special)


def tgi_alternatives(alternatives: tuple[Alternative, ...], special_ids: dict[int, str]) -> list[TGIToken]:
    return [
        TGIToken(id=a.id, text=token_string(a.id), logprob=a.logprob, special=a.id in special_ids)
        for a in alternatives
    ]


def tgi_response(body: TGIRequest, final: FinishEvent, hooks: TokenizerHooks) -> TGIResponse:
    p = body.parameters
    text = (body.inputs + final.text) if p.return_full_text else final.text
    if not p.details:
        return TGIResponse(generated_text=text)
    prefill = [TGIPrefillToken(id=t.id, text=token_string(t.id), logprob=t.logprob) for t in final.prefill]
    details = TGIDetails(
        finish_reason=final.finish_reason.value,
        generated_tokens=len(final.tokens),
        seed=final.seed,
        prefill=prefill,
        tokens=[tgi_token(token) for token in final.tokens],
        top_tokens=[tgi_alternatives(t.top, hooks.special_names) for t in final.tokens]
        if p.top_n_tokens
        else None,
    )
    return TGIResponse(generated_text=text, details=details)


def _alternative_dicts(alternatives: tuple[Alternative, ...], special_ids: dict[int, str]) -> list[dict]:
    """`tgi_alternatives`' tokens as their models' dumps."""
    return [
        {"id": a.id, "text": token_string(a.id), "logprob": a.logprob, "special": a.id in special_ids}
        for a in alternatives
    ]


def tgi_token_event(event: TokenEvent, special_ids: dict[int, str]) -> dict:
    """A token's stream event as `TGIStreamEvent(...).model_dump()` gives it, built directly: this runs
    for every token of every stream, and the model's validation and dump cost more than the rest of
    the event's path (tests/test_service_units.py checks the two agree)."""
    token = event.token
    return {
        "index": event.number,
        "token": {"id": token.id, "text": token.released, "logprob": token.logprob, "special": token.special},
        "top_tokens": _alternative_dicts(token.top, special_ids),
        "generated_text": None,
        "details": None,
    }


def tgi_final_event(event: FinishEvent, body: TGIRequest, special_ids: dict[int, str]) -> dict:
    """A stream's last event as `TGIStreamEvent(...).model_dump()` gives it, built directly: once per
    stream, where the model's validation and dump cost more than the rest of the event
    (tests/test_host_stack.py checks the two agree)."""
    p, last = body.parameters, event.tokens[-1]
    details = None
    if p.details:
        details = {
            "finish_reason": event.finish_reason.value,
            "generated_tokens": len(event.tokens),
            "seed": event.seed,
            "input_length": event.input_length,
        }
    return {
        "index": len(event.tokens),
        "token": {
            "id": last.id,
            "text": last.released + event.tail,
            "logprob": last.logprob,
            "special": last.special,
        },
        "top_tokens": _alternative_dicts(last.top, special_ids),
        "generated_text": (body.inputs + event.text) if p.return_full_text else event.text,
        "details": details,
    }


def tgi_token_frame(event: TokenEvent, special_ids: dict[int, str]) -> bytes:
    """`sse(tgi_token_event(event, special_ids))`, formatted directly for the usual token (no top tokens,
    a finite logprob): the same bytes without building and encoding the dict, once per token."""
    token = event.token
    logprob = token.logprob
    if token.top or type(logprob) is not float or not math.isfinite(logprob):
        return sse(tgi_token_event(event, special_ids))
    return (
        f'data: {{"index":{int(event.number)},"token":{{"id":{int(token.id)},'
        f'"text":{encode_basestring_ascii(token.released)},"logprob":{float.__repr__(logprob)},'
        f'"special":{"true" if token.special else "false"}}},"top_tokens":[],"generated_text":null,'
        '"details":null}\n\n'
    ).encode()


async def tgi_stream(
    engine: ServingEngine, sequence: Submitted, body: TGIRequest, hooks: TokenizerHooks, path: str
) -> AsyncIterator[bytes]:
    finished = False
    try:
        async for batch in event_batches(sequence):
            # The events that have arrived go out as one chunk (one write).
            yield b"".join(_tgi_frames(batch, body, hooks, path))
        finished = True
    finally:
        if not finished:
            engine.cancel(sequence)  # the client went away mid-stream: free the slot now


def _tgi_frames(batch: list, body: TGIRequest, hooks: TokenizerHooks, path: str) -> list[bytes]:
    frames = []
    for event in batch:
        if isinstance(event, TokenEvent):
            frames.append(tgi_token_frame(event, hooks.special_names))
        elif isinstance(event, FinishEvent):
            frames.append(sse(tgi_final_event(event, body, hooks.special_names)))
        else:
            frames.append(sse(error_body(event.error, path)))
    return frames
