"""The in-memory GPT-2 parameters every other part of the project consumes.

All arrays are float32 NumPy arrays. Linear weights are stored [in, out], as GPT-2's Conv1D stores
them, so a layer is `y = x @ w + b`. The LM head is tied to `wte`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from wafer_gpt2.model.config import GPT2Config

# Per-layer tensor names (suffixes of HF's `h.{i}.` names) and their shapes for a given width C.
LAYER_TENSORS: dict[str, str] = {
    "ln_1.weight": "C",
    "ln_1.bias": "C",
    "attn.c_attn.weight": "C,3C",
    "attn.c_attn.bias": "3C",
    "attn.c_proj.weight": "C,C",
    "attn.c_proj.bias": "C",
    "ln_2.weight": "C",
    "ln_2.bias": "C",
    "mlp.c_fc.weight": "C,4C",
    "mlp.c_fc.bias": "4C",
    "mlp.c_proj.weight": "4C,C",
    "mlp.c_proj.bias": "C",
}


def _dims(spec: str, c: int) -> tuple[int, ...]:
    table = {"C": c, "3C": 3 * c, "4C": 4 * c}
    return tuple(table[part] for part in spec.split(","))


def expected_shapes(config: GPT2Config) -> dict[str, tuple[int, ...]]:
    """Canonical tensor name -> shape, in HF's names without the `transformer.` prefix."""
    c = config.n_embd
    shapes: dict[str, tuple[int, ...]] = {
        "wte.weight": (config.vocab_size, c),
        "wpe.weight": (config.n_positions, c),
    }
    for i in range(config.n_layer):
        for suffix, spec in LAYER_TENSORS.items():
            shapes[f"h.{i}.{suffix}"] = _dims(spec, c)
    shapes["ln_f.weight"] = (c,)
    shapes["ln_f.bias"] = (c,)
    return shapes


@dataclass
class LayerParams:
    ln_1_g: np.ndarray
    ln_1_b: np.ndarray
    attn_w: np.ndarray  # [C, 3C]: q, k, v side by side
    attn_b: np.ndarray
    attn_proj_w: np.ndarray  # [C, C]
    attn_proj_b: np.ndarray
    ln_2_g: np.ndarray
    ln_2_b: np.ndarray
    fc_w: np.ndarray  # [C, 4C]
    fc_b: np.ndarray
    proj_w: np.ndarray  # [4C, C]
    proj_b: np.ndarray


_LAYER_FIELDS = dict(zip(LAYER_TENSORS, LayerParams.__dataclass_fields__, strict=True))


@dataclass
class GPT2Params:
    config: GPT2Config
    wte: np.ndarray  # [V, C], also the LM head
    wpe: np.ndarray  # [T, C]
    layers: list[LayerParams]
    ln_f_g: np.ndarray
    ln_f_b: np.ndarray

    @classmethod
    def from_tensors(cls, config: GPT2Config, tensors: dict[str, np.ndarray]) -> GPT2Params:
        """Build from canonical names (see `expected_shapes`); the caller has checked the shapes."""

        def get(name: str) -> np.ndarray:
            return np.ascontiguousarray(tensors[name], dtype=np.float32)

        layers = [
            LayerParams(**{field: get(f"h.{i}.{suffix}") for suffix, field in _LAYER_FIELDS.items()})
            for i in range(config.n_layer)
        ]
        return cls(
            config=config,
            wte=get("wte.weight"),
            wpe=get("wpe.weight"),
            layers=layers,
            ln_f_g=get("ln_f.weight"),
            ln_f_b=get("ln_f.bias"),
        )

    def to_tensors(self) -> dict[str, np.ndarray]:
        """Canonical name -> array; the inverse of `from_tensors`."""
        out = {"wte.weight": self.wte, "wpe.weight": self.wpe}
        for i, layer in enumerate(self.layers):
            for suffix, field in _LAYER_FIELDS.items():
                out[f"h.{i}.{suffix}"] = getattr(layer, field)
        out["ln_f.weight"] = self.ln_f_g
        out["ln_f.bias"] = self.ln_f_b
        return out

    @classmethod
    def random(cls, config: GPT2Config, seed: int = 0, std: float = 0.02) -> GPT2Params:
        """GPT-2's initialisation (normal(0, 0.02), LayerNorm at 1/0): the tests' stand-in for real weights."""
        rng = np.random.default_rng(seed)
        tensors = {}
        for name, shape in expected_shapes(config).items():
            if name.startswith(("ln", "h.")) and (".ln_" in name or name.startswith("ln_")):
                base = 1.0 if name.endswith("weight") else 0.0
                tensors[name] = (base + 0.1 * rng.standard_normal(shape)).astype(np.float32)
            elif name.endswith("bias"):
                tensors[name] = (0.02 * rng.standard_normal(shape)).astype(np.float32)
            else:
                tensors[name] = (std * rng.standard_normal(shape)).astype(np.float32)
        return cls.from_tensors(config, tensors)
