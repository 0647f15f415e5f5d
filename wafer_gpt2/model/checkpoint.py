"""Load GPT-2 weights from whatever format they come in, and check them before anyone uses them.

Formats (one module each):
- a Hugging Face GPT-2 directory (`wafer_gpt2.model.hf_format`): `config.json` plus `model.safetensors`, a
  sharded `model.safetensors.index.json`, or `pytorch_model.bin` (which needs torch);
- an llm.c checkpoint (`wafer_gpt2.model.llmc_format`): one `.bin` with a 256-int32 header, magic 20240326.

Every loader checks every tensor name and shape against the config before reading data, and every
value as it reads it (NaN or Inf weights would make every step fail later), so a damaged checkpoint
raises `CheckpointError` naming the file, the tensor and what is wrong with it, and nothing
half-loaded is ever returned.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from wafer_gpt2.model.hf_format import load_hf
from wafer_gpt2.model.llmc_format import load_llmc
from wafer_gpt2.model.params import GPT2Params
from wafer_gpt2.model.tensors import (
    LLMC_MAGIC,
    CheckpointError,
    bf16_bits,
    bf16_round,
    check_finite,
    check_shapes,
    progress_bar,
    to_float32,
)

__all__ = [
    "DEMO_MODEL_DIR",
    "LLMC_MAGIC",
    "CheckpointError",
    "bf16_bits",
    "bf16_round",
    "check_finite",
    "check_shapes",
    "detect_format",
    "load_checkpoint",
    "progress_bar",
    "resolve_weights",
    "to_float32",
]

DEMO_MODEL_DIR = Path(__file__).parent / "data" / "demo-gpt2"


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
        return load_llmc(path, progress=progress)
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
