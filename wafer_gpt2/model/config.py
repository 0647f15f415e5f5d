"""GPT-2 model configurations: the four published sizes and custom ones."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from wafer_gpt2.errors import WaferGPT2Error


class ConfigError(WaferGPT2Error, ValueError):
    """A configuration that cannot describe a GPT-2 model."""


@dataclass(frozen=True)
class GPT2Config:
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    vocab_size: int = 50257
    n_positions: int = 1024
    layer_norm_epsilon: float = 1e-5
    name: str = "custom"

    def __post_init__(self) -> None:
        for field in ("n_layer", "n_head", "n_embd", "vocab_size", "n_positions"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"config field {field!r} must be a positive integer, got {value!r}")
        eps = self.layer_norm_epsilon
        if isinstance(eps, bool) or not isinstance(eps, int | float) or not (math.isfinite(eps) and eps > 0):
            raise ConfigError(f"'layer_norm_epsilon' must be a positive finite number, got {eps!r}")
        if self.n_embd % self.n_head:
            raise ConfigError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def n_params(self) -> int:
        """Parameter count with the LM head tied to wte (as published: 124M, 355M, 774M, 1558M)."""
        c = self.n_embd
        per_layer = 12 * c * c + 13 * c
        return self.vocab_size * c + self.n_positions * c + self.n_layer * per_layer + 2 * c

    def to_hf_dict(self) -> dict:
        """The `config.json` a Hugging Face GPT-2 directory carries."""
        return {
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "n_layer": self.n_layer,
            "n_head": self.n_head,
            "n_embd": self.n_embd,
            "vocab_size": self.vocab_size,
            "n_positions": self.n_positions,
            "n_ctx": self.n_positions,
            "layer_norm_epsilon": self.layer_norm_epsilon,
            "activation_function": "gelu_new",
            "bos_token_id": 50256,
            "eos_token_id": 50256,
            "tie_word_embeddings": True,
        }

    @classmethod
    def from_hf_dict(cls, data: dict, name: str = "custom", source: str = "config") -> GPT2Config:
        """The config a `config.json` describes; any ConfigError names `source` (the file)."""

        if not isinstance(data, dict):
            raise ConfigError(f"{source}: expected a JSON object, got {json_kind(data)}")

        def number(field: str, kind: type, default: object = None) -> Any:
            value = data.get(field, default)
            if value is None:
                raise ConfigError(f"{source}: missing field {field!r}")
            # JSON's own types only: 2.7 is no layer count (int() would make it 2), true is no number.
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ConfigError(f"{source}: field {field!r} must be a number, got {value!r}")
            if kind is int and not isinstance(value, int):
                raise ConfigError(f"{source}: field {field!r} must be an integer, got {value!r}")
            return kind(value)

        n_positions = "n_positions" if "n_positions" in data else "n_ctx"
        fields = dict(
            n_layer=number("n_layer", int),
            n_head=number("n_head", int),
            n_embd=number("n_embd", int),
            vocab_size=number("vocab_size", int),
            n_positions=number(n_positions, int, 1024),
            layer_norm_epsilon=number("layer_norm_epsilon", float, 1e-5),
        )
        try:
            return cls(**fields, name=name)
        except ConfigError as exc:  # the dataclass's own checks do not know which file they read
            raise ConfigError(f"{source}: {exc}") from None

    @classmethod
    def from_json_file(cls, path: str | Path) -> GPT2Config:
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path}: no such file") from None
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}: not valid JSON ({exc})") from None
        return cls.from_hf_dict(data, name=path.parent.name or "custom", source=str(path))

    def as_dict(self) -> dict:
        return asdict(self)


def json_kind(value: object) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean"}.get(
        type(value), "null" if value is None else "a number"
    )


PRESETS: dict[str, GPT2Config] = {
    "gpt2": GPT2Config(12, 12, 768, name="gpt2"),
    "gpt2-medium": GPT2Config(24, 16, 1024, name="gpt2-medium"),
    "gpt2-large": GPT2Config(36, 20, 1280, name="gpt2-large"),
    "gpt2-xl": GPT2Config(48, 25, 1600, name="gpt2-xl"),
}


def resolve_config(model: str) -> GPT2Config:
    """A preset name, a `config.json`, or a directory holding one."""
    if model in PRESETS:
        return PRESETS[model]
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        return GPT2Config.from_json_file(path)
    raise ConfigError(
        f"unknown model {model!r}: expected one of {', '.join(PRESETS)} or a path to a config.json / HF directory"
    )
