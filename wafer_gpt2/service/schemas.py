"""Request and response bodies: TGI's (`/generate`, `/generate_stream`, `/`) and OpenAI's
(`/v1/completions`, `/v1/models`), as pydantic models.

The models check what a body can be checked for on its own (types, signs, ranges); limits that depend
on the server (context length, number of stop sequences, ...) are checked in `wafer_gpt2.service.api` once the
prompt is tokenized. Field validators raise messages that name the rule and the value found.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictStr, field_validator

U64_MAX = 2**64 - 1


def _unsigned_64(value: int | None) -> int | None:
    if value is not None and not 0 <= value <= U64_MAX:
        raise ValueError(f"must be an unsigned 64-bit integer, got {value}")
    return value


def _strictly_positive(value: float | None) -> float | None:
    if value is not None and not value > 0:
        raise ValueError(f"must be strictly positive, got {value}")
    return value


def _not_negative(value: int | None) -> int | None:
    if value is not None and value < 0:
        raise ValueError(f"must be 0 or more, got {value}")
    return value


# Fields both APIs check alike (each model's own rules are its field validators).
Seed = Annotated[int | None, AfterValidator(_unsigned_64)]
StrictlyPositive = Annotated[float | None, AfterValidator(_strictly_positive)]


def _json_type(value: Any) -> str:
    names = {
        str: "a string",
        bool: "a boolean",
        int: "a number",
        float: "a number",
        list: "a list",
        dict: "an object",
    }
    return "null" if value is None else names.get(type(value), type(value).__name__)


class _Body(BaseModel):
    # Unknown fields are accepted and ignored, as vLLM and TGI do (clients send fields other servers
    # know); they are not ignored silently: `ignored_fields` names them for a warning header and log.
    model_config = ConfigDict(extra="allow")
    # The fields that hold a list of bodies (chat's `messages`), whose unknown fields are named too;
    # declared per model so that the walk below looks into no list of another body (a prompt of token
    # ids) on every request.
    body_lists: ClassVar[tuple[str, ...]] = ()


def ignored_fields(body: BaseModel, prefix: str = "") -> list[str]:
    """The unknown fields of a body and of the bodies inside it, as dotted paths (`messages.0.foo` for a
    body in a list)."""
    if not isinstance(body, _Body):
        return []
    names = [prefix + name for name in body.model_extra or {}]
    # The declared fields (`__dict__`; iterating the model builds a list of every field and extra, and
    # extras are plain JSON values, never bodies): this runs for every request.
    for name, value in body.__dict__.items():
        if isinstance(value, _Body):
            names += ignored_fields(value, f"{prefix}{name}.")
    for name in body.body_lists:
        for index, item in enumerate(getattr(body, name)):
            names += ignored_fields(item, f"{prefix}{name}.{index}.")
    return names


# ----- TGI -----------------------------------------------------------------------------------------


class TGIParameters(_Body):
    best_of: int | None = None
    decoder_input_details: StrictBool = False
    details: StrictBool = False
    do_sample: StrictBool = False
    frequency_penalty: float | None = None
    grammar: Any = None
    max_new_tokens: int | None = None
    repetition_penalty: StrictlyPositive = None
    return_full_text: StrictBool | None = None
    seed: Seed = None
    stop: list[StrictStr] = Field(default_factory=list)
    temperature: StrictlyPositive = None
    top_k: int | None = None
    top_n_tokens: int | None = None
    top_p: float | None = None
    truncate: int | None = None
    typical_p: float | None = None
    watermark: StrictBool = False
    adapter_id: str | None = None

    @field_validator("max_new_tokens", "top_k", "truncate")
    @classmethod
    def _positive_int(cls, value: int | None) -> int | None:
        if value is not None and value <= 0:
            raise ValueError(f"must be strictly positive, got {value}")
        return value

    @field_validator("top_n_tokens")
    @classmethod
    def _top_n_tokens(cls, value: int | None) -> int | None:
        if value is not None and value < 0:
            raise ValueError(f"must be 0 (none) or more, got {value}")
        return value

    @field_validator("top_p")
    @classmethod
    def _top_p(cls, value: float | None) -> float | None:
        if value is not None and not 0.0 < value < 1.0:
            raise ValueError(f"must be > 0.0 and < 1.0, got {value} (omit it to disable top-p)")
        return value

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, value: int | None) -> int | None:
        if value is not None and value != 1:
            raise ValueError(f"best_of != 1 is not supported by this server, got {value}")
        return value

    # Knobs this server does not implement: their neutral values (TGI's defaults) are accepted.
    @field_validator("typical_p")
    @classmethod
    def _typical_p(cls, value: float | None) -> float | None:
        if value is not None and not 0.0 < value <= 1.0:
            raise ValueError(f"must be > 0.0 and <= 1.0, got {value}")
        if value is not None and value != 1.0:
            raise ValueError(f"only 1.0 (off) is supported by this server, got {value}")
        return value

    @field_validator("frequency_penalty")
    @classmethod
    def _frequency_penalty(cls, value: float | None) -> float | None:
        if value:
            raise ValueError(
                f"only 0.0 (off) is supported on this route, got {value} (use repetition_penalty, or "
                "frequency_penalty on /v1/completions)"
            )
        return value

    @field_validator("watermark")
    @classmethod
    def _watermark(cls, value: bool) -> bool:
        if value:
            raise ValueError("watermarking is not supported by this server")
        return value

    @field_validator("grammar", "adapter_id")
    @classmethod
    def _unsupported(cls, value: Any) -> Any:
        if value is not None:
            raise ValueError("is not supported by this server")
        return value


class TGIRequest(_Body):
    inputs: Any
    parameters: TGIParameters = Field(default_factory=TGIParameters)
    stream: StrictBool = False  # only read by the compatibility route `POST /`

    @field_validator("inputs")
    @classmethod
    def _inputs(cls, value: Any) -> str:
        if not isinstance(value, str):
            raise ValueError(f"must be a string, got {_json_type(value)}")
        if not value:
            raise ValueError("cannot be empty")
        return value


class TGIToken(BaseModel):
    id: int
    text: str
    logprob: float | None
    special: bool


class TGIPrefillToken(BaseModel):
    id: int
    text: str
    logprob: float | None


class TGIDetails(BaseModel):
    finish_reason: Literal["length", "eos_token", "stop_sequence"]
    generated_tokens: int
    seed: int | None
    prefill: list[TGIPrefillToken]
    tokens: list[TGIToken]
    top_tokens: list[list[TGIToken]] | None = None


class TGIResponse(BaseModel):
    generated_text: str
    details: TGIDetails | None = None


class TGIStreamDetails(BaseModel):
    finish_reason: Literal["length", "eos_token", "stop_sequence"]
    generated_tokens: int
    seed: int | None
    input_length: int


class TGIStreamEvent(BaseModel):
    index: int
    token: TGIToken
    top_tokens: list[TGIToken] | None = None
    generated_text: str | None = None
    details: TGIStreamDetails | None = None


class TGIError(BaseModel):
    error: str
    error_type: str


class TGIInfo(BaseModel):
    model_id: str
    model_dtype: str
    model_device_type: str
    backend: str
    max_concurrent_requests: int
    max_queue: int
    max_input_tokens: int
    max_total_tokens: int
    max_new_tokens: int
    max_stop_sequences: int
    max_best_of: int
    max_top_n_tokens: int
    top_k: int
    kv_slots: int
    context_length: int
    version: str
    model_config_summary: dict = Field(default_factory=dict)
    plan: dict = Field(default_factory=dict)
    engine: dict = Field(default_factory=dict)

    model_config = ConfigDict(protected_namespaces=())


# ----- OpenAI --------------------------------------------------------------------------------------


class StreamOptions(_Body):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False


class OpenAIGenerationBody(_Body):
    """The fields `/v1/completions` and `/v1/chat/completions` share (vLLM's sampling extras included)."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    n: int = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: Any = Field(default_factory=list)
    stop_token_ids: list[int] | None = None
    seed: Seed = None
    repetition_penalty: StrictlyPositive = None
    ignore_eos: StrictBool = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extras.
    min_p: float | None = None
    min_tokens: int = 0
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    truncate_prompt_tokens: int | None = None
    prompt_logprobs: int | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: Any) -> list[str]:
        if value is None:
            return []
        if isinstance(value, str):
            return [value]
        if isinstance(value, list) and all(isinstance(item, str) for item in value):
            return value
        raise ValueError(f"must be a string or a list of strings, got {_json_type(value)}")

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, value: float | None) -> float | None:
        if value is not None and not 0.0 <= value <= 2.0:
            raise ValueError(f"must be between 0 and 2 (0 is greedy), got {value}")
        return value

    @field_validator("top_p")
    @classmethod
    def _top_p(cls, value: float | None) -> float | None:
        if value is not None and not 0.0 < value <= 1.0:
            raise ValueError(f"must be > 0 and <= 1, got {value}")
        return value

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, value: int | None) -> int | None:
        if value is not None and value < -1:
            raise ValueError(f"must be -1 or 0 (off) or a positive number of candidates, got {value}")
        return value

    @field_validator("n")
    @classmethod
    def _n(cls, value: int) -> int:
        if value < 1:
            raise ValueError(f"must be at least 1, got {value}")
        return value

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _penalties(cls, value: float | None) -> float | None:
        if value is not None and not -2.0 <= value <= 2.0:
            raise ValueError(f"must be between -2 and 2, got {value}")
        return value

    @field_validator("min_p")
    @classmethod
    def _min_p(cls, value: float | None) -> float | None:
        if value is not None and not 0.0 <= value <= 1.0:
            raise ValueError(f"must be between 0 and 1, got {value}")
        return value

    @field_validator("min_tokens")
    @classmethod
    def _min_tokens(cls, value: int) -> int:
        if value < 0:
            raise ValueError(f"must be 0 or more, got {value}")
        return value

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _truncate_prompt_tokens(cls, value: int | None) -> int | None:
        if value is not None and value < 1 and value != -1:
            raise ValueError(
                f"must be at least 1 (keep the last N prompt tokens) or -1 (the limit), got {value}"
            )
        return value

    @field_validator("prompt_logprobs")
    @classmethod
    def _prompt_logprobs(cls, value: int | None) -> int | None:
        return _not_negative(value)  # the upper limit is the server's (wafer_gpt2.service.validation)

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, value: dict | None) -> dict | None:
        if value:
            raise ValueError("is not supported by this server")
        return value


class CompletionRequest(OpenAIGenerationBody):
    prompt: Any
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: StrictBool = False
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, value: Any) -> str | list[str] | list[int] | list[list[int]]:
        """A string, a list of strings, a list of token ids, or a list of lists of token ids."""

        def is_ids(item: Any) -> bool:
            return isinstance(item, list) and all(
                isinstance(x, int) and not isinstance(x, bool) for x in item
            )

        if isinstance(value, str):
            if not value:
                raise ValueError("cannot be empty")
            return value
        if isinstance(value, list) and value:
            if all(isinstance(item, str) for item in value):
                if not all(value):
                    raise ValueError("cannot contain empty strings")
                return value
            if is_ids(value):
                return value
            if all(is_ids(item) for item in value):
                if not all(value):
                    raise ValueError("cannot contain empty token lists")
                return value
        raise ValueError(
            "must be a non-empty string, a list of strings, a list of token ids or a list of lists of token "
            f"ids, got {_json_type(value)}"
        )

    @field_validator("max_tokens")
    @classmethod
    def _max_tokens(cls, value: int | None) -> int | None:
        if value is not None and value < 0:
            raise ValueError(f"must be at least 1 (or 0 with `echo`: score the prompt), got {value}")
        return value

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, value: int | None) -> int | None:
        return _not_negative(value)  # the upper limit is the server's (wafer_gpt2.service.validation)

    @field_validator("suffix")
    @classmethod
    def _suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("is not supported by this server (GPT-2 has no infilling)")
        return value


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(BaseModel):
    """vLLM's entry per candidate of a prompt position (`prompt_logprobs`), keyed by token id."""

    logprob: float
    rank: int | None = None
    decoded_token: str


PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None
    stop_reason: str | int | None = None
    prompt_logprobs: PromptLogprobs | None = None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "wafer-gpt2"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class OpenAIErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class OpenAIError(BaseModel):
    error: OpenAIErrorBody


# ----- OpenAI chat ---------------------------------------------------------------------------------


class ChatMessage(_Body):
    """A chat message: its role and content, and the fields of OpenAI's messages a chat template may
    read. Other keys are ignored, and named (`messages.0.foo`) as unknown fields are."""

    role: StrictStr
    content: Any = None
    name: str | None = None
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None

    def for_template(self) -> dict[str, Any]:
        """What the chat template sees: role, content, and the other fields the message sent (vLLM
        hands its templates these and leaves other keys out)."""
        data = {"role": self.role, "content": self.content}
        for field in ("name", "tool_calls", "tool_call_id"):
            if field in self.model_fields_set:
                data[field] = getattr(self, field)
        return data

    @field_validator("content")
    @classmethod
    def _content(cls, value: Any) -> str:
        """A string, or a list of text parts (`{"type": "text", "text": ...}`), joined as one string."""
        if value is None:
            return ""
        if isinstance(value, str):
            return value
        if isinstance(value, list):
            texts = []
            for i, part in enumerate(value):
                if (
                    not isinstance(part, dict)
                    or part.get("type") != "text"
                    or not isinstance(part.get("text"), str)
                ):
                    kind = part.get("type") if isinstance(part, dict) else _json_type(part)
                    raise ValueError(f"part {i}: only text parts are supported by this server, got {kind!r}")
                texts.append(part["text"])
            return "\n".join(texts)
        raise ValueError(f"must be a string or a list of text parts, got {_json_type(value)}")


class ChatCompletionRequest(OpenAIGenerationBody):
    body_lists = ("messages",)

    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: StrictBool = False
    top_logprobs: int | None = None
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None

    @field_validator("messages")
    @classmethod
    def _messages(cls, value: list[ChatMessage]) -> list[ChatMessage]:
        if not value:
            raise ValueError("must hold at least one message")
        return value

    @field_validator("max_tokens", "max_completion_tokens")
    @classmethod
    def _max_tokens(cls, value: int | None) -> int | None:
        if value is not None and value <= 0:
            raise ValueError(f"must be at least 1, got {value}")
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, value: int | None) -> int | None:
        return _not_negative(value)  # the upper limit is the server's (wafer_gpt2.service.validation)

    @field_validator("chat_template")
    @classmethod
    def _chat_template(cls, value: str | None) -> str | None:
        if value is not None:
            raise ValueError("a template per request is not accepted: start the server with --chat-template")
        return value

    @field_validator("tools")
    @classmethod
    def _tools(cls, value: list | None) -> list | None:
        if value:
            raise ValueError("tool calling is not supported by this server (GPT-2 has no tool format)")
        return value

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, value: Any) -> Any:
        if value not in (None, "none"):
            raise ValueError(f"only 'none' is supported by this server, got {value!r}")
        return value

    @field_validator("response_format")
    @classmethod
    def _response_format(cls, value: dict | None) -> dict | None:
        if value is not None and value.get("type") != "text":
            raise ValueError(
                f"only {{'type': 'text'}} is supported by this server, got {value.get('type')!r}"
            )
        return value


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None
    stop_reason: str | int | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None
    prompt_logprobs: PromptLogprobs | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None
    stop_reason: str | int | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


# ----- tokenizer routes ----------------------------------------------------------------------------


class TokenizePromptRequest(_Body):
    """vLLM's `/tokenize` with a prompt (`add_special_tokens` changes nothing: GPT-2 adds none)."""

    model: str | None = None
    prompt: StrictStr
    add_special_tokens: StrictBool = True
    return_token_strs: StrictBool = False


class TokenizeChatRequest(_Body):
    """vLLM's `/tokenize` with chat messages: the prompt the chat template makes of them."""

    body_lists = ("messages",)

    model: str | None = None
    messages: list[ChatMessage]
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: StrictBool = False
    return_token_strs: StrictBool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class TGITokenizeRequest(_Body):
    """TGI's `/tokenize` (its `parameters` are accepted and do not change the tokens)."""

    inputs: StrictStr
    parameters: dict[str, Any] | None = None


class TGISimpleToken(BaseModel):
    id: int
    text: str
    start: int  # byte offsets of the token in the UTF-8 input
    stop: int
