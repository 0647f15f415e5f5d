"""Hugging Face GPT-2 directories: `config.json` + safetensors (single or sharded) or `pytorch_model.bin`.

Tensor names are HF's (`transformer.h.0.attn.c_attn.weight`, ...); the `transformer.` prefix is
optional (GPT2Model vs GPT2LMHeadModel). Conv1D weights are stored [in, out], as `GPT2Params` keeps
them. `lm_head.weight`, when present, must be the tied `wte`. The causal-mask buffers some versions
save (`attn.bias`, `attn.masked_bias`) are ignored.

Safetensors are read with a small parser of their documented layout (8-byte little-endian header
length, JSON header, raw little-endian data), so every name, dtype, shape and byte range is checked
before any data is read, and bf16 works without torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from wafer_gpt2.model import tokenizer
from wafer_gpt2.model.config import ConfigError, GPT2Config
from wafer_gpt2.model.hf_tokenizer import write_tokenizer_files
from wafer_gpt2.model.params import GPT2Params
from wafer_gpt2.model.tensors import (
    CheckpointError,
    bf16_bits,
    check_finite,
    check_shapes,
    progress_bar,
    to_float32,
)

CONFIG_FILE = "config.json"
SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
PYTORCH_FILE = "pytorch_model.bin"
PYTORCH_INDEX = "pytorch_model.bin.index.json"

PREFIX = "transformer."
LM_HEAD = "lm_head.weight"
IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias")  # causal-mask buffers, not parameters

# safetensors dtype name -> (NumPy storage dtype, bytes per element)
SAFETENSORS_DTYPES = {"F32": ("<f4", 4), "F16": ("<f2", 2), "BF16": ("<u2", 2)}
WRITE_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}


# ----------------------------------------------------------------------------- config.json


def read_config(directory: Path) -> GPT2Config:
    """The model config, refusing GPT-2 variants the reference forward pass does not compute."""
    path = directory / CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(f"{directory}: no {CONFIG_FILE} (a Hugging Face GPT-2 directory needs one)")
    try:
        config = GPT2Config.from_json_file(path)
        data = json.loads(path.read_text())
    except ConfigError as exc:
        raise CheckpointError(str(exc)) from None
    unsupported = {
        "model_type": (data.get("model_type", "gpt2"), ("gpt2",)),
        "activation_function": (
            data.get("activation_function", "gelu_new"),
            ("gelu_new", "gelu_pytorch_tanh"),
        ),
        "n_inner": (data.get("n_inner"), (None, 4 * config.n_embd)),
        "scale_attn_weights": (data.get("scale_attn_weights", True), (True,)),
        "scale_attn_by_inverse_layer_idx": (data.get("scale_attn_by_inverse_layer_idx", False), (False,)),
        "add_cross_attention": (data.get("add_cross_attention", False), (False,)),
    }
    for field, (value, allowed) in unsupported.items():
        if value not in allowed:
            raise CheckpointError(f"{path}: {field}={value!r} is not supported (expected one of {allowed})")
    return config


# ----------------------------------------------------------------------------- safetensors


@dataclass(frozen=True)
class StoredTensor:
    """Where one tensor's bytes lie in a safetensors file."""

    file: Path
    name: str  # as stored
    dtype: str  # safetensors dtype name
    shape: tuple[int, ...]
    start: int  # absolute byte offsets in the file
    end: int


def read_safetensors_header(path: Path) -> dict[str, StoredTensor]:
    """Parse and check a safetensors header against the file's size; read no tensor data."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise CheckpointError(f"{path}: truncated: {size} bytes, too short for a safetensors header")
        header_len = int.from_bytes(prefix, "little")
        if header_len > size - 8:
            raise CheckpointError(
                f"{path}: truncated or not safetensors: header of {header_len} bytes, file of {size}"
            )
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{path}: not a safetensors file (header is not JSON: {exc})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: not a safetensors file (header is not a JSON object)")
    data_start = 8 + header_len
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = (
                info["dtype"],
                tuple(int(n) for n in info["shape"]),
                info["data_offsets"],
            )
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: malformed header entry for tensor {name!r}") from None
        offsets = info["data_offsets"]
        if not all(type(n) is int for n in (begin, end)) or not 0 <= begin <= end:
            raise CheckpointError(
                f"{path}: tensor {name!r} has data_offsets {offsets}: expected two integers 0 <= begin <= end"
            )
        if any(n < 0 for n in shape):
            raise CheckpointError(f"{path}: tensor {name!r} has a negative dimension in its shape {shape}")
        if dtype not in SAFETENSORS_DTYPES:
            raise CheckpointError(
                f"{path}: tensor {name!r} has dtype {dtype}; expected one of {', '.join(SAFETENSORS_DTYPES)}"
            )
        nbytes = int(np.prod(shape, dtype=np.int64)) * SAFETENSORS_DTYPES[dtype][1]
        if end - begin != nbytes:
            raise CheckpointError(
                f"{path}: tensor {name!r} of shape {shape} ({dtype}) needs {nbytes} bytes, header gives {end - begin}"
            )
        if data_start + end > size:
            raise CheckpointError(
                f"{path}: truncated: tensor {name!r} needs bytes up to {data_start + end}, the file has {size}"
            )
        tensors[name] = StoredTensor(path, name, dtype, shape, data_start + begin, data_start + end)
    return tensors


def read_stored(tensor: StoredTensor, mapped: np.memmap) -> np.ndarray:
    storage, _ = SAFETENSORS_DTYPES[tensor.dtype]
    raw = mapped[tensor.start : tensor.end].view(storage).reshape(tensor.shape)
    return to_float32(raw, tensor.dtype)


def write_safetensors(path: Path, tensors: dict[str, np.ndarray], dtype: str = "float32") -> None:
    """Write `tensors` (fp32 arrays) as one safetensors file stored as `dtype`."""
    code = WRITE_DTYPES[dtype]
    blobs = {}
    for name, array in tensors.items():
        if code == "BF16":
            blobs[name] = bf16_bits(array).tobytes()
        else:
            blobs[name] = np.ascontiguousarray(array, dtype=SAFETENSORS_DTYPES[code][0]).tobytes()
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, array in tensors.items():
        header[name] = {
            "dtype": code,
            "shape": list(array.shape),
            "data_offsets": [offset, offset + len(blobs[name])],
        }
        offset += len(blobs[name])
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(header_bytes).to_bytes(8, "little"))
        f.write(header_bytes)
        for blob in blobs.values():
            f.write(blob)


# ----------------------------------------------------------------------------- names


def canonical_names(stored_names: list[str], source: Path) -> dict[str, str]:
    """Canonical name -> stored name, dropping the `transformer.` prefix and the mask buffers."""
    names: dict[str, str] = {}
    for stored in stored_names:
        if stored.endswith(IGNORED_SUFFIXES):
            continue
        name = stored.removeprefix(PREFIX)
        if name in names:
            raise CheckpointError(
                f"{source}: tensor {name!r} is stored twice ({names[name]!r} and {stored!r})"
            )
        names[name] = stored
    return names


def check_lm_head(config: GPT2Config, shapes: dict[str, tuple[int, ...]], source: Path) -> None:
    if LM_HEAD in shapes and tuple(shapes[LM_HEAD]) != (config.vocab_size, config.n_embd):
        raise CheckpointError(
            f"{source}: tensor {LM_HEAD!r} has shape {tuple(shapes[LM_HEAD])}, "
            f"expected {(config.vocab_size, config.n_embd)} (it must be tied to wte)"
        )


def untie(tensors: dict[str, np.ndarray], source: Path) -> dict[str, np.ndarray]:
    """Drop `lm_head.weight` after checking it is the tied token embedding."""
    head = tensors.pop(LM_HEAD, None)
    if head is not None and not np.array_equal(head, tensors["wte.weight"]):
        raise CheckpointError(
            f"{source}: {LM_HEAD!r} differs from 'wte.weight'; only tied LM heads are supported"
        )
    return tensors


# ----------------------------------------------------------------------------- loading


def weight_files(directory: Path) -> tuple[str, list[Path]]:
    """("safetensors" | "pytorch", the files holding the weights)."""
    for kind, single, index in (
        ("safetensors", SAFETENSORS_FILE, SAFETENSORS_INDEX),
        ("pytorch", PYTORCH_FILE, PYTORCH_INDEX),
    ):
        if (directory / single).is_file():
            return kind, [directory / single]
        if (directory / index).is_file():
            return kind, shard_files(directory / index)
    raise CheckpointError(
        f"{directory}: no weights: expected {SAFETENSORS_FILE}, {SAFETENSORS_INDEX}, {PYTORCH_FILE} or {PYTORCH_INDEX}"
    )


def shard_files(index_path: Path) -> list[Path]:
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{index_path}: not a valid shard index ({exc!r})") from None
    paths = [index_path.parent / name for name in files]
    for path in paths:
        if not path.is_file():
            raise CheckpointError(f"{index_path}: shard {path.name} is missing")
    return paths


def load_hf(directory: Path, progress: bool = True) -> GPT2Params:
    config = read_config(directory)
    kind, files = weight_files(directory)
    tensors = (
        load_safetensors(config, files, directory, progress)
        if kind == "safetensors"
        else load_pytorch(config, files, directory, progress)
    )
    return GPT2Params.from_tensors(config, untie(tensors, directory))


def load_safetensors(
    config: GPT2Config, files: list[Path], directory: Path, progress: bool
) -> dict[str, np.ndarray]:
    stored: dict[str, StoredTensor] = {}
    for path in files:
        for name, tensor in read_safetensors_header(path).items():
            if name in stored:
                raise CheckpointError(f"{path}: tensor {name!r} is also in {stored[name].file.name}")
            stored[name] = tensor
    source = files[0] if len(files) == 1 else directory
    names = canonical_names(list(stored), source)
    shapes = {name: stored[raw].shape for name, raw in names.items()}
    check_lm_head(config, shapes, source)
    check_shapes(
        config, {k: v for k, v in shapes.items() if k != LM_HEAD}, str(source), str(directory / CONFIG_FILE)
    )

    total = sum(stored[raw].end - stored[raw].start for raw in names.values())
    tensors: dict[str, np.ndarray] = {}
    mapped: dict[Path, np.memmap] = {}
    with progress_bar(total, f"loading {directory.name}", progress) as bar:
        for name, raw in names.items():
            tensor = stored[raw]
            if tensor.file not in mapped:
                mapped[tensor.file] = np.memmap(tensor.file, dtype=np.uint8, mode="r")
            tensors[name] = read_stored(tensor, mapped[tensor.file])
            check_finite(tensors[name], tensor.file, raw)
            bar.update(tensor.end - tensor.start)
    return tensors


def load_pytorch(
    config: GPT2Config, files: list[Path], directory: Path, progress: bool
) -> dict[str, np.ndarray]:
    try:
        import torch
    except ImportError:
        raise CheckpointError(
            f"{files[0]}: reading pytorch_model.bin needs torch, which is not installed "
            "(install torch, or convert the checkpoint to model.safetensors)"
        ) from None
    state: dict = {}
    total = sum(path.stat().st_size for path in files)
    with progress_bar(total, f"loading {directory.name}", progress) as bar:
        for path in files:
            try:
                part = torch.load(path, map_location="cpu", weights_only=True)
            except Exception as exc:  # torch reports damage as RuntimeError, EOFError, UnpicklingError...
                raise CheckpointError(
                    f"{path}: cannot read this PyTorch checkpoint ({type(exc).__name__}: {exc})"
                ) from None
            if not isinstance(part, dict):
                raise CheckpointError(f"{path}: expected a state dict, found {type(part).__name__}")
            state.update(part)
            bar.update(path.stat().st_size)
    source = files[0] if len(files) == 1 else directory
    names = canonical_names(list(state), source)
    for raw in names.values():
        if not isinstance(state[raw], torch.Tensor) or not state[raw].is_floating_point():
            raise CheckpointError(f"{source}: entry {raw!r} is not a floating-point tensor")
    shapes = {name: tuple(state[raw].shape) for name, raw in names.items()}
    check_lm_head(config, shapes, source)
    check_shapes(
        config, {k: v for k, v in shapes.items() if k != LM_HEAD}, str(source), str(directory / CONFIG_FILE)
    )
    tensors = {}
    for name, raw in names.items():
        tensors[name] = state[raw].detach().to(torch.float32).numpy().copy()
        check_finite(tensors[name], source, raw)
    return tensors


# ----------------------------------------------------------------------------- writing


def save_hf(
    params: GPT2Params,
    directory: str | Path,
    dtype: str = "float32",
    shards: int | None = None,
    fmt: str = "safetensors",
    prefix: str = PREFIX,
) -> Path:
    """Write `params` as an HF GPT-2 directory (config.json, weights and, for GPT-2's vocabulary, the
    tokenizer files); returns the directory.

    `dtype`: float32, float16 or bfloat16. `shards`: split the weights over that many files with an
    index. `fmt`: "safetensors" or "pytorch" (pytorch_model.bin, needs torch).
    """
    if dtype not in WRITE_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(WRITE_DTYPES)}, got {dtype!r}")
    if fmt not in ("safetensors", "pytorch"):
        raise ValueError(f"fmt must be 'safetensors' or 'pytorch', got {fmt!r}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / CONFIG_FILE).write_text(json.dumps(params.config.to_hf_dict(), indent=2) + "\n")
    if params.config.vocab_size >= tokenizer.VOCAB_SIZE:  # GPT-2's vocabulary (llm.c pads it): its tokenizer
        write_tokenizer_files(directory, params.config.n_positions)

    tensors = {prefix + name: array for name, array in params.to_tensors().items()}
    groups = split_evenly(tensors, shards or 1)
    single, index, ext = (
        (SAFETENSORS_FILE, SAFETENSORS_INDEX, "safetensors")
        if fmt == "safetensors"
        else (PYTORCH_FILE, PYTORCH_INDEX, "bin")
    )
    stem = single.rsplit(".", 1)[0]
    names = (
        [single]
        if len(groups) == 1
        else [f"{stem}-{i + 1:05d}-of-{len(groups):05d}.{ext}" for i in range(len(groups))]
    )
    for name, group in zip(names, groups, strict=True):
        if fmt == "safetensors":
            write_safetensors(directory / name, group, dtype)
        else:
            write_pytorch(directory / name, group, dtype)
    if len(groups) > 1:
        weight_map = {tensor: name for name, group in zip(names, groups, strict=True) for tensor in group}
        total = sum(array.size for array in tensors.values()) * (4 if dtype == "float32" else 2)
        index_doc = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (directory / index).write_text(json.dumps(index_doc, indent=2) + "\n")
    return directory


def split_evenly(tensors: dict[str, np.ndarray], parts: int) -> list[dict[str, np.ndarray]]:
    """Consecutive groups of tensors with about the same number of elements each."""
    if parts < 1 or parts > len(tensors):
        raise ValueError(f"shards must lie in 1..{len(tensors)}, got {parts}")
    total = sum(array.size for array in tensors.values())
    groups: list[dict[str, np.ndarray]] = [{}]
    seen = 0
    for i, (name, array) in enumerate(tensors.items()):
        groups_left = parts - len(groups)
        # Start the next shard once this one holds its share, or when every later tensor is needed
        # to keep the remaining shards non-empty.
        if (
            groups[-1]
            and groups_left
            and (seen >= len(groups) * total / parts or len(tensors) - i <= groups_left)
        ):
            groups.append({})
        groups[-1][name] = array
        seen += array.size
    return groups


def write_pytorch(path: Path, tensors: dict[str, np.ndarray], dtype: str) -> None:
    import torch

    torch_dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
    torch.save(
        {name: torch.from_numpy(np.array(array)).to(torch_dtype) for name, array in tensors.items()}, path
    )
