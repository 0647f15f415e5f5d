"""Chat templates: a list of messages to the one prompt text a base model continues.

GPT-2 was never trained on a chat format, so there is no "right" template. A server started with
`--chat-template FILE` renders the Jinja template in FILE, as vLLM and TGI do with a model's own
template (same variables: `messages`, `add_generation_prompt`, `bos_token`, `eos_token`, plus any
`chat_template_kwargs`; same helpers: `raise_exception`, `strftime_now`, `tojson`). Without one the
server uses `DEFAULT_TEMPLATE`, a plain transcript ("User: ...", "Assistant:") that a base model can
continue, and stops the reply where the model starts to write the user's next turn.

Templates run in Jinja's immutable sandbox: a template comes from the operator, but a message's content
is rendered through it and must never reach Python objects.
"""

from __future__ import annotations

import datetime
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from wafer_gpt2.errors import WaferGPT2Error
from wafer_gpt2.model import tokenizer

# One line per message, then the cue for the reply. GPT-2 continues "Assistant:" with a reply and, left
# alone, goes on to write the next "User:" turn itself: DEFAULT_STOP ends the reply there.
DEFAULT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] | capitalize }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)
DEFAULT_STOP = ("\nUser:",)


class ChatTemplateError(WaferGPT2Error, ValueError):
    """The template cannot be compiled, or cannot render these messages (the message says why)."""


def _raise_exception(message: str) -> None:
    # HF templates call this to refuse a conversation they cannot format (e.g. roles out of order).
    raise ChatTemplateError(message)


def _tojson(value: Any, indent: int | None = None) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


@dataclass(frozen=True)
class ChatTemplate:
    source: str
    stop: tuple[str, ...] = ()  # stop strings every chat request gets (the default template's turn cue)
    name: str = "default"
    _compiled: jinja2.Template = field(init=False, repr=False, compare=False)  # set from `source`

    def __post_init__(self) -> None:
        object.__setattr__(self, "_compiled", _environment().from_string(self.source))

    def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        extra: dict[str, Any] | None = None,
    ) -> str:
        """The prompt text for `messages` (each a dict with `role` and string `content`)."""
        variables = {
            **(extra or {}),
            "messages": messages,
            "add_generation_prompt": add_generation_prompt and not continue_final_message,
            "bos_token": tokenizer.EOT_TEXT,  # GPT-2 uses <|endoftext|> for both
            "eos_token": tokenizer.EOT_TEXT,
        }
        try:
            text = self._compiled.render(**variables)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the chat template failed: {exc}") from None
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
            raise ChatTemplateError(f"the chat template failed ({type(exc).__name__}: {exc})") from None
        if continue_final_message:
            # vLLM's rule: the prompt ends where the last message's content ends, so the model continues
            # that message instead of starting a new turn.
            last = messages[-1]["content"] if messages else ""
            end = text.rfind(last) if last else -1
            if end < 0:
                raise ChatTemplateError(
                    "continue_final_message: the rendered prompt does not contain the final message's content"
                )
            text = text[: end + len(last)]
        return text


def _environment() -> ImmutableSandboxedEnvironment:
    # The settings transformers uses for chat templates, so a template written for HF renders alike.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


DEFAULT_CHAT_TEMPLATE = ChatTemplate(DEFAULT_TEMPLATE, stop=DEFAULT_STOP)


def load_chat_template(value: str) -> ChatTemplate:
    """`--chat-template`: a file holding a Jinja template, or (as vLLM accepts) the template itself."""
    path = Path(value)
    try:
        is_file = path.is_file()
    except OSError:  # a template string too long to be a path
        is_file = False
    if is_file:
        source, name = path.read_text(encoding="utf-8"), str(path)
    elif any(c in value for c in "{}\n"):
        source, name = value, "inline"
    else:
        raise ChatTemplateError(f"--chat-template: no such file: {value}")
    try:
        return ChatTemplate(source, name=name)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"--chat-template {name}: line {exc.lineno}: {exc.message}") from None
