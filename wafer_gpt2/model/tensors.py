"""What every checkpoint format shares: the error type, the checks on names, shapes and values, the
dtype conversions and the progress bar. `wafer_gpt2.model.checkpoint` dispatches to the formats; the formats
(`wafer_gpt2.model.hf_format`, `wafer_gpt2.model.llmc_format`) build on this module, so imports run one way.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np
from tqdm import tqdm

from wafer_gpt2.errors import WaferGPT2Error
from wafer_gpt2.model.config import GPT2Config
from wafer_gpt2.model.params import expected_shapes

LLMC_MAGIC = 20240326
PROGRESS_MIN_BYTES = 64 * 2**20  # below this a load takes well under a second: no bar


class CheckpointError(WaferGPT2Error, ValueError):
    """A checkpoint that cannot be loaded: the message names the file (and tensor) at fault."""


def _list_names(names: Iterable[str], limit: int = 6) -> str:
    names = sorted(names, key=_natural_key)
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _natural_key(name: str) -> list:
    return [int(part) if part.isdigit() else part for part in name.replace(".", " . ").split()]


def check_shapes(
    config: GPT2Config, shapes: dict[str, tuple[int, ...]], source: str, config_source: str
) -> None:
    """Compare canonical tensor names/shapes with what `config` expects; raise on any difference."""
    # Layers the config claims beyond the ones the weights hold are refused from the names alone: a
    # config claiming a million layers must not build (and list) twelve million expected names first.
    held = {int(n.split(".")[1]) for n in shapes if n.startswith("h.") and n.split(".")[1].isdigit()}
    if config.n_layer > len(held) and held == set(range(len(held))):
        raise CheckpointError(
            f"{source}: missing tensors h.{len(held)}.* .. h.{config.n_layer - 1}.* ({config_source} says "
            f"n_layer={config.n_layer}, the weights hold {len(held)} layers)"
        )
    expected = expected_shapes(config)
    missing = expected.keys() - shapes.keys()
    extra = shapes.keys() - expected.keys()
    describe = (
        f"{config_source} says n_layer={config.n_layer}, n_embd={config.n_embd}, "
        f"vocab_size={config.vocab_size}, n_positions={config.n_positions}"
    )
    if extra:
        raise CheckpointError(f"{source}: unexpected tensors {_list_names(extra)} ({describe})")
    if missing:
        raise CheckpointError(f"{source}: missing tensors {_list_names(missing)} ({describe})")
    for name, shape in expected.items():
        if tuple(shapes[name]) != shape:
            raise CheckpointError(
                f"{source}: tensor {name!r} has shape {tuple(shapes[name])}, expected {shape} ({describe})"
            )


def check_finite(values: np.ndarray, source: str | Path, tensor: str) -> None:
    """Refuse NaN or Inf weights at load time: loaded, they would only make every step fail."""
    finite = np.isfinite(values)
    if finite.all():
        return
    bad = values.size - int(np.count_nonzero(finite))
    nan = int(np.count_nonzero(np.isnan(values)))
    raise CheckpointError(
        f"{source}: tensor {tensor!r} holds {bad} non-finite values ({nan} NaN, {bad - nan} Inf) "
        f"among its {values.size}: the checkpoint is damaged"
    )


def to_float32(raw: np.ndarray, dtype: str) -> np.ndarray:
    """An fp32 copy of `raw` stored as `dtype` ("F32", "F16" or "BF16"; bf16 arrives as uint16 bits)."""
    if dtype == "BF16":
        return (raw.astype(np.uint32) << 16).view(np.float32)
    return np.array(raw, dtype=np.float32)


def bf16_bits(values: np.ndarray) -> np.ndarray:
    """fp32 -> bf16 bit patterns (uint16), rounding to nearest even as torch does."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounding = ((bits >> 16) & 1) + np.uint32(0x7FFF)
    return ((bits + rounding) >> 16).astype(np.uint16)


def bf16_round(values: np.ndarray) -> np.ndarray:
    """`values` rounded to bf16 and back to fp32 (what a bf16 checkpoint holds)."""
    return to_float32(bf16_bits(values), "BF16")


def progress_bar(total_bytes: int, desc: str, enabled: bool) -> tqdm:
    """A byte-counting bar on stderr, shown only for loads big enough to notice (else a no-op)."""
    return tqdm(
        total=total_bytes,
        desc=desc,
        unit="B",
        unit_scale=True,
        leave=False,
        disable=not enabled or total_bytes < PROGRESS_MIN_BYTES,
    )
