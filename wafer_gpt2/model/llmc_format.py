"""llm.c GPT-2 checkpoints (`gpt2_124M.bin` and friends), as written by llm.c's `train_gpt2.py`.

Layout (checked against `write_model`/`write_tensors` there and `fill_in_parameter_sizes` in
`train_gpt2.c`): a header of 256 little-endian int32 (magic 20240326, version, maxT, V, L, H, C,
padded V), then 16 tensors back to back, each stacking all layers:

    wte [Vp, C], wpe [maxT, C], ln1w [L, C], ln1b [L, C], qkvw [L, 3C, C], qkvb [L, 3C],
    attprojw [L, C, C], attprojb [L, C], ln2w [L, C], ln2b [L, C], fcw [L, 4C, C], fcb [L, 4C],
    fcprojw [L, C, 4C], fcprojb [L, C], lnfw [C], lnfb [C]

Version 3 stores everything fp32, version 5 everything bf16. Matrices are PyTorch Linear weights
[out, in]; `GPT2Params` keeps [in, out], so they are transposed. Rows V..Vp-1 of wte are padding.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from wafer_gpt2.model.config import ConfigError, GPT2Config
from wafer_gpt2.model.params import GPT2Params
from wafer_gpt2.model.tensors import (
    LLMC_MAGIC,
    CheckpointError,
    bf16_bits,
    check_finite,
    progress_bar,
    to_float32,
)

HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
VERSIONS = {3: "F32", 5: "BF16"}  # version -> element type of every tensor
VOCAB_PAD_MULTIPLE = 128  # llm.c pads the vocabulary rows to a multiple of 128

# (llm.c name, canonical per-layer suffix or global name, stored shape as a function of the dims).
# `None` in the second column marks wte, whose padded rows are dropped.
LAYOUT = [
    ("wte", None, lambda d: (d["Vp"], d["C"])),
    ("wpe", "wpe.weight", lambda d: (d["maxT"], d["C"])),
    ("ln1w", "ln_1.weight", lambda d: (d["L"], d["C"])),
    ("ln1b", "ln_1.bias", lambda d: (d["L"], d["C"])),
    ("qkvw", "attn.c_attn.weight", lambda d: (d["L"], 3 * d["C"], d["C"])),
    ("qkvb", "attn.c_attn.bias", lambda d: (d["L"], 3 * d["C"])),
    ("attprojw", "attn.c_proj.weight", lambda d: (d["L"], d["C"], d["C"])),
    ("attprojb", "attn.c_proj.bias", lambda d: (d["L"], d["C"])),
    ("ln2w", "ln_2.weight", lambda d: (d["L"], d["C"])),
    ("ln2b", "ln_2.bias", lambda d: (d["L"], d["C"])),
    ("fcw", "mlp.c_fc.weight", lambda d: (d["L"], 4 * d["C"], d["C"])),
    ("fcb", "mlp.c_fc.bias", lambda d: (d["L"], 4 * d["C"])),
    ("fcprojw", "mlp.c_proj.weight", lambda d: (d["L"], d["C"], 4 * d["C"])),
    ("fcprojb", "mlp.c_proj.bias", lambda d: (d["L"], d["C"])),
    ("lnfw", "ln_f.weight", lambda d: (d["C"],)),
    ("lnfb", "ln_f.bias", lambda d: (d["C"],)),
]
GLOBAL_TENSORS = {"wte", "wpe", "lnfw", "lnfb"}
MATRICES = {"qkvw", "attprojw", "fcw", "fcprojw"}  # stored [out, in]


def read_header(path: Path) -> tuple[int, dict[str, int]]:
    """(version, dims) from the 256-int header, with every field checked."""
    size = path.stat().st_size
    if size < HEADER_BYTES:
        raise CheckpointError(
            f"{path}: truncated: {size} bytes, shorter than the {HEADER_BYTES}-byte llm.c header"
        )
    header = np.fromfile(path, dtype="<i4", count=HEADER_INTS)
    if header[0] != LLMC_MAGIC:
        raise CheckpointError(
            f"{path}: bad magic {header[0]}, an llm.c GPT-2 checkpoint starts with {LLMC_MAGIC}"
        )
    version = int(header[1])
    if version not in VERSIONS:
        raise CheckpointError(
            f"{path}: llm.c checkpoint version {version} is not supported (3 = fp32, 5 = bf16, both with padded vocab)"
        )
    dims = dict(zip(("maxT", "V", "L", "H", "C", "Vp"), (int(n) for n in header[2:8]), strict=True))
    for field, value in dims.items():
        if value <= 0:
            raise CheckpointError(f"{path}: header field {field} = {value}, expected a positive integer")
    if dims["Vp"] < dims["V"]:
        raise CheckpointError(
            f"{path}: padded vocab size {dims['Vp']} is smaller than the vocab size {dims['V']}"
        )
    return version, dims


def load_llmc(path: Path, progress: bool = True) -> GPT2Params:
    version, dims = read_header(path)
    try:
        config = GPT2Config(
            n_layer=dims["L"],
            n_head=dims["H"],
            n_embd=dims["C"],
            vocab_size=dims["V"],
            n_positions=dims["maxT"],
            name=path.stem,
        )
    except ConfigError as exc:
        raise CheckpointError(f"{path}: header describes no valid GPT-2: {exc}") from None

    dtype = VERSIONS[version]
    itemsize = 4 if dtype == "F32" else 2
    shapes = [(name, shape(dims)) for name, _, shape in LAYOUT]
    expected_size = HEADER_BYTES + sum(int(np.prod(shape)) for _, shape in shapes) * itemsize
    size = path.stat().st_size
    if size < expected_size:
        offset = HEADER_BYTES
        for name, shape in shapes:  # name the first tensor the file does not hold in full
            offset += int(np.prod(shape)) * itemsize
            if offset > size:
                raise CheckpointError(
                    f"{path}: truncated: tensor {name} {shape} ends at byte {offset}, the file has {size} "
                    f"(expected {expected_size} bytes for version {version})"
                )
    if size > expected_size:
        raise CheckpointError(
            f"{path}: {size - expected_size} bytes more than the header's model needs "
            f"(expected {expected_size} bytes for version {version}): not this layout"
        )

    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    tensors: dict[str, np.ndarray] = {}
    offset = HEADER_BYTES
    with progress_bar(expected_size, f"loading {path.name}", progress) as bar:
        for (name, canonical, _), (_, shape) in zip(LAYOUT, shapes, strict=True):
            nbytes = int(np.prod(shape)) * itemsize
            raw = mapped[offset : offset + nbytes].view("<f4" if dtype == "F32" else "<u2").reshape(shape)
            array = to_float32(raw, dtype)
            offset += nbytes
            bar.update(nbytes)
            if name == "wte":
                tensors["wte.weight"] = np.ascontiguousarray(array[: dims["V"]])  # padding rows dropped
                check_finite(tensors["wte.weight"], path, name)
            elif name in GLOBAL_TENSORS:
                assert canonical is not None  # only wte has no canonical name
                tensors[canonical] = array
                check_finite(array, path, name)
            else:
                for layer in range(dims["L"]):
                    value = array[layer].T if name in MATRICES else array[layer]
                    check_finite(value, path, f"{name}[{layer}] (h.{layer}.{canonical})")
                    tensors[f"h.{layer}.{canonical}"] = np.ascontiguousarray(value)
    return GPT2Params.from_tensors(config, tensors)


def save_llmc(params: GPT2Params, path: str | Path, version: int = 3) -> Path:
    """Write `params` as an llm.c checkpoint (version 3: fp32, version 5: bf16)."""
    if version not in VERSIONS:
        raise ValueError(f"version must be 3 (fp32) or 5 (bf16), got {version}")
    cfg = params.config
    c, n_layer = cfg.n_embd, cfg.n_layer
    padded_vocab = -(-cfg.vocab_size // VOCAB_PAD_MULTIPLE) * VOCAB_PAD_MULTIPLE
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:8] = [LLMC_MAGIC, version, cfg.n_positions, cfg.vocab_size, n_layer, cfg.n_head, c, padded_vocab]

    canonical = params.to_tensors()
    wte = np.zeros((padded_vocab, c), dtype=np.float32)
    wte[: cfg.vocab_size] = params.wte
    path = Path(path)
    with open(path, "wb") as f:
        f.write(header.tobytes())
        for name, suffix, _ in LAYOUT:
            if name == "wte":
                array = wte
            elif name in GLOBAL_TENSORS:
                assert suffix is not None  # only wte has no canonical name
                array = canonical[suffix]
            else:
                per_layer = [canonical[f"h.{i}.{suffix}"] for i in range(n_layer)]
                array = np.stack([w.T for w in per_layer] if name in MATRICES else per_layer)
            data = (
                bf16_bits(array) if VERSIONS[version] == "BF16" else np.ascontiguousarray(array, dtype="<f4")
            )
            f.write(data.tobytes())
    return path
