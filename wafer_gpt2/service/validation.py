"""Request checks that need the server's limits: what a request may ask for, and the messages that
say which field broke which rule (the route-independent part; pydantic checks each body on its own).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from wafer_gpt2.core.steps import BackendShape
from wafer_gpt2.engine.failures import RequestValidationFailed
from wafer_gpt2.engine.request import GenerationRequest
from wafer_gpt2.engine.sampling import InvalidSamplingParam, SamplingParams
from wafer_gpt2.model import tokenizer
from wafer_gpt2.settings import ServerSettings

BaseModelT = TypeVar("BaseModelT", bound=BaseModel)


@dataclass(frozen=True)
class Limits:
    """What a request may ask for, from the settings and the backend's shape."""

    context_length: int
    max_input_tokens: int
    max_input_chars: int  # prompt text, before tokenizing
    # Prompt text when the request truncates its prompt (TGI `truncate`, vLLM `truncate_prompt_tokens`):
    # any text truncation can bring within the limit must get through, so the bound on what is tokenized
    # is the request body's size limit (a JSON string of N characters takes at least N bytes).
    max_truncated_input_chars: int
    max_new_tokens: int
    max_stop_sequences: int
    max_stop_length: int
    top_k: int  # candidates per token the wafer returns
    max_top_n_tokens: int  # TGI's top_n_tokens
    max_logprobs: int  # the OpenAI routes' logprobs, top_logprobs and prompt_logprobs
    vocab_size: int  # token ids the model and the tokenizer both know
    max_stop_chars_total: int = 4000  # all stop sequences of a request together

    @classmethod
    def of(cls, settings: ServerSettings, backend: BackendShape) -> Limits:
        context = backend.context_length
        max_input_tokens = min(settings.max_input_tokens or context - 1, context - 1)
        max_input_chars = settings.max_input_chars or max_input_tokens * tokenizer.longest_token_chars()
        return cls(
            context_length=context,
            max_input_tokens=max_input_tokens,
            max_input_chars=max_input_chars,
            max_truncated_input_chars=max(max_input_chars, settings.max_body_bytes),
            max_new_tokens=min(settings.max_new_tokens_limit or context - 1, context - 1),
            max_stop_sequences=settings.max_stop_sequences,
            max_stop_length=settings.max_stop_length,
            max_stop_chars_total=settings.max_stop_chars_total,
            top_k=backend.top_k,
            max_top_n_tokens=min(settings.max_top_n_tokens, backend.top_k),
            max_logprobs=min(settings.max_logprobs, backend.top_k),
            vocab_size=min(backend.vocab_size, tokenizer.VOCAB_SIZE),  # ids both model and tokenizer know
        )


@dataclass(frozen=True)
class FieldNames:
    """How each route calls the fields a validation message names, and whose rules it follows."""

    prompt: str
    max_new_tokens: str
    top_n: str
    # vLLM's rules (the OpenAI routes): any number of stop sequences (TGI caps them), and a request over
    # the context refused in vLLM's words, on which clients key their fallbacks (litellm's context-window
    # fallback looks for "This model's maximum context length is").
    openai: bool = False


TGI_FIELDS = FieldNames(prompt="inputs", max_new_tokens="max_new_tokens", top_n="top_n_tokens")
OPENAI_FIELDS = FieldNames(prompt="prompt", max_new_tokens="max_tokens", top_n="logprobs", openai=True)
CHAT_FIELDS = FieldNames(prompt="messages", max_new_tokens="max_tokens", top_n="top_logprobs", openai=True)


def context_exceeded(n_prompt: int, n_new: int, limits: Limits) -> str:
    """vLLM's message for a request over the context: the prompt alone, or the prompt with the tokens
    asked for (vLLM's serving layer words them so)."""
    context = limits.context_length
    if n_prompt > limits.max_input_tokens:
        # vLLM's prompt limit is the context less one; a lower --max-input-tokens is named too.
        lower = limits.max_input_tokens < context - 1
        taken = f" and this server takes at most {limits.max_input_tokens} input tokens" if lower else ""
        return (
            f"This model's maximum context length is {context} tokens{taken}. However, your request has "
            f"{n_prompt} input tokens. Please reduce the length of the input messages."
        )
    return (
        f"'max_tokens' or 'max_completion_tokens' is too large: {n_new}. This model's maximum context "
        f"length is {context} tokens and your request has {n_prompt} input tokens "
        f"({n_new} > {context} - {n_prompt})."
    )


def check_request(request: GenerationRequest, limits: Limits, names: FieldNames) -> GenerationRequest:
    """Every limit a request must meet before it is queued; RequestValidationFailed names the first miss."""

    def fail(message: str, param: str) -> None:
        raise RequestValidationFailed(message, param=param)

    n_prompt, n_new = len(request.prompt_ids), request.max_new_tokens
    if n_prompt == 0:
        fail(f"`{names.prompt}` must contain at least one token", names.prompt)
    if n_prompt > limits.max_input_tokens:
        if names.openai:
            fail(context_exceeded(n_prompt, n_new, limits), names.prompt)
        fail(
            f"`{names.prompt}` must have at most {limits.max_input_tokens} tokens, given {n_prompt}",
            names.prompt,
        )
    bad_ids = [t for t in request.prompt_ids if not 0 <= t < limits.vocab_size]
    if bad_ids:
        fail(f"`{names.prompt}` token id {bad_ids[0]} is outside 0..{limits.vocab_size - 1}", names.prompt)
    if names.openai and n_prompt + n_new > limits.context_length:  # before the limit on new tokens, as vLLM
        fail(context_exceeded(n_prompt, n_new, limits), names.max_new_tokens)
    if not 0 <= n_new <= limits.max_new_tokens:  # 0: score the prompt only (the routes allow it or not)
        fail(
            f"`{names.max_new_tokens}` must be between 1 and {limits.max_new_tokens}, given {n_new}",
            names.max_new_tokens,
        )
    if n_prompt + n_new > limits.context_length:
        fail(
            f"`{names.prompt}` tokens + `{names.max_new_tokens}` must be <= {limits.context_length} (the KV "
            f"capacity of a slot), given {n_prompt} `{names.prompt}` tokens and {n_new} `{names.max_new_tokens}`",
            names.max_new_tokens,
        )
    stops = request.stop_sequences
    if not names.openai and len(stops) > limits.max_stop_sequences:
        fail(f"`stop` accepts at most {limits.max_stop_sequences} stop sequences, given {len(stops)}", "stop")
    total = sum(len(stop) for stop in stops)
    if total > limits.max_stop_chars_total:
        fail(
            f"`stop` sequences may hold at most {limits.max_stop_chars_total} characters in all, given {total}",
            "stop",
        )
    if any(not stop for stop in stops):
        fail("`stop` sequences cannot be empty strings", "stop")
    longest = max((len(stop) for stop in stops), default=0)
    if longest > limits.max_stop_length:
        fail(f"`stop` sequences may be at most {limits.max_stop_length} characters, given {longest}", "stop")
    top_k = request.sampling.top_k
    if top_k is not None and top_k > limits.top_k:
        fail(
            f"`top_k` must be <= {limits.top_k} (the candidates the wafer returns per token), given {top_k}",
            "top_k",
        )
    if names.openai:
        # The engine keeps max(logprobs, prompt_logprobs) alternatives per prompt token on completions:
        # a prompt_top_n over the limit with top_n within it is prompt_logprobs'.
        for field, asked in ((names.top_n, request.top_n_tokens), ("prompt_logprobs", request.prompt_top_n)):
            if asked is not None and asked > limits.max_logprobs:
                fail(
                    f"`{field}` must be between 0 and {limits.max_logprobs} (the server's --max-logprobs, at "
                    f"most the {limits.top_k} candidates the wafer returns per token), given {asked}",
                    field,
                )
    elif request.top_n_tokens > limits.max_top_n_tokens:
        fail(
            f"`{names.top_n}` must be <= {limits.max_top_n_tokens}, given {request.top_n_tokens}", names.top_n
        )
    bad_stop_ids = [t for t in request.stop_token_ids if not 0 <= t < limits.vocab_size]
    if bad_stop_ids:
        fail(f"`stop_token_ids` id {bad_stop_ids[0]} is outside 0..{limits.vocab_size - 1}", "stop_token_ids")
    return request


def encode_prompt(text: str, limits: Limits, field: str, truncating: bool = False) -> list[int]:
    """The prompt's token ids, once its length in characters allows it (tokenizing a long text is
    slow; callers run this off the event loop). `truncating`: the request keeps only the prompt's last
    tokens, so the text may be longer than any prompt that fits."""
    if truncating and len(text) > limits.max_truncated_input_chars:
        raise RequestValidationFailed(
            f"`{field}` must have at most {limits.max_truncated_input_chars} characters even when it is "
            f"truncated, given {len(text)}",
            param=field,
        )
    if not truncating and len(text) > limits.max_input_chars:
        raise RequestValidationFailed(
            f"`{field}` must have at most {limits.max_input_chars} characters (no longer text fits in "
            f"{limits.max_input_tokens} tokens; a request that truncates its prompt may send up to "
            f"{limits.max_truncated_input_chars}), given {len(text)}",
            param=field,
        )
    return tokenizer.encode_prompt(text)  # `<|endoftext|>` is the EOT token, as in TGI and vLLM


def sampling_params(**kwargs) -> SamplingParams:
    try:
        return SamplingParams(**kwargs)
    except InvalidSamplingParam as exc:
        raise RequestValidationFailed(str(exc), param=exc.field) from None


def parse_body(model: type[BaseModelT], data: Any) -> BaseModelT:
    """`data` as `model`, or RequestValidationFailed naming the fields (for routes that pick the body's
    model from its content, as FastAPI reports bodies it parses itself)."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        message, param = format_validation_errors(exc.errors())
        raise RequestValidationFailed(message, param=param) from None


def parse_json(body: bytes) -> Any:
    """A request body as JSON: every route's body is parsed here (the lean path's, the FastAPI routes'
    through `hot_routes.ServiceRoute`, and the routes that pick their model from the body), so a body
    that Python's json cannot take is a 4xx saying why on every route, never a server error that
    drops the connection."""
    try:
        return json.loads(body)
    except UnicodeDecodeError as exc:
        raise RequestValidationFailed(
            f"request body is not valid JSON: {exc.reason} at byte {exc.start}; send JSON encoded as UTF-8"
        ) from None
    except json.JSONDecodeError as exc:
        raise RequestValidationFailed(f"request body is not valid JSON ({exc})") from None
    except RecursionError:
        # The decoder recurses once per level of arrays and objects, up to the interpreter's limit.
        raise RequestValidationFailed(
            "request body nests arrays and objects too deeply: this server parses at most about "
            f"{sys.getrecursionlimit()} levels"
        ) from None
    except ValueError:
        # An integer longer than Python converts from text (a guard against quadratic conversions).
        raise RequestValidationFailed(
            f"request body holds an integer of more than {sys.get_int_max_str_digits()} digits, the most "
            "this server parses"
        ) from None


async def json_body(request: Request) -> Any:
    return parse_json(await request.body())


def format_validation_errors(errors: Sequence[Mapping[str, Any]]) -> tuple[str, str | None]:
    """pydantic's errors as one line: `field: problem; field: problem`."""
    parts, first_param = [], None
    for error in errors:
        loc = [str(part) for part in error.get("loc", ()) if part != "body"]
        if error.get("type") == "json_invalid":
            reason = (error.get("ctx") or {}).get("error", "")
            parts.append(
                f"request body is not valid JSON ({reason})" if reason else "request body is not valid JSON"
            )
            continue
        message = str(error.get("msg", "invalid")).removeprefix("Value error, ")
        if error.get("type") == "extra_forbidden":
            message = "unknown field"
        field = ".".join(loc) or "body"
        first_param = first_param or field
        parts.append(f"{field}: {message}")
    return "; ".join(parts), first_param
