"""Load GPT-2 weights from whatever format they come in, and check them before anyone uses them.

Formats (one module each):
- a Hugging Face GPT-2 directory (`weights.hf_format`): `config.json` plus `model.safetensors`, a
  sharded `model.safetensors.index.json`, or `pytorch_model.bin` (which needs torch);
- an llm.c checkpoint (`weights.llmc_format`): one `.bin` with a 256-int32 header, magic 20240326.

Every loader checks every tensor name and shape against the config before reading data, and every
value as it reads it (NaN or Inf weights would make every step fail later), so a damaged checkpoint
raises `CheckpointError` naming the file, the tensor and what is wrong with it, and nothing
half-loaded is ever returned.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np
from tqdm import tqdm

from weights.config import GPT2Config
from weights.params import GPT2Params, expected_shapes

DEMO_MODEL_DIR = Path(__file__).parent / "data" / "demo-gpt2"
LLMC_MAGIC = 20240326
PROGRESS_MIN_BYTES = 64 * 2**20  # below this a load takes well under a second: no bar


class CheckpointError(ValueError):
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


def detect_format(path: Path) -> str:
    """ "hf" (a directory, or a file inside one) or "llmc"; CheckpointError for anything else."""
    if path.is_dir():
        return "hf"
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or directory")
    with open(path, "rb") as f:
        head = f.read(8)
    if len(head) >= 4 and int(np.frombuffer(head[:4], dtype="<i4")[0]) == LLMC_MAGIC:
        return "llmc"
    if path.name == "config.json" or path.suffix in (".safetensors", ".json") or head[:2] == b"PK":
        if (path.parent / "config.json").is_file():
            return "hf"
        raise CheckpointError(f"{path}: a Hugging Face weights file needs the config.json of its directory")
    if path.suffix == ".bin" and len(head) >= 4:
        found = int(np.frombuffer(head[:4], dtype="<i4")[0])
        raise CheckpointError(
            f"{path}: bad magic {found}, an llm.c GPT-2 checkpoint starts with {LLMC_MAGIC}"
        )
    raise CheckpointError(
        f"{path}: not a checkpoint this loader knows: expected a Hugging Face GPT-2 directory "
        f"(config.json + model.safetensors or pytorch_model.bin) or an llm.c .bin (magic {LLMC_MAGIC})"
    )


def load_checkpoint(path: str | Path, progress: bool = True) -> GPT2Params:
    """GPT-2 parameters (fp32) from an HF directory or an llm.c `.bin`."""
    path = Path(path)
    fmt = detect_format(path)
    if fmt == "llmc":
        from weights.llmc_format import load_llmc

        return load_llmc(path, progress=progress)
    from weights.hf_format import load_hf

    return load_hf(path if path.is_dir() else path.parent, progress=progress)


def resolve_weights(path: str | Path | None) -> Path:
    """The checkpoint to load: `path`, or the embedded demo model when `path` is None."""
    if path is None:
        if not (DEMO_MODEL_DIR / "config.json").is_file():
            raise CheckpointError(
                f"no weights given and the embedded demo model {DEMO_MODEL_DIR} is missing: "
                "pass a checkpoint (an HF GPT-2 directory or an llm.c .bin)"
            )
        return DEMO_MODEL_DIR
    path = Path(path).expanduser()
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or directory")
    return path
