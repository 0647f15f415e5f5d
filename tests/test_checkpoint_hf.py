"""Hugging Face directories: every supported variant loads exactly; every damaged one is refused clearly."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest

from wafer_gpt2.model import tensors
from wafer_gpt2.model.checkpoint import CheckpointError, bf16_round, load_checkpoint
from wafer_gpt2.model.config import GPT2Config
from wafer_gpt2.model.hf_format import save_hf, write_safetensors
from wafer_gpt2.model.params import GPT2Params

TINY = GPT2Config(n_layer=2, n_head=2, n_embd=16, vocab_size=100, n_positions=32, name="tiny")


@pytest.fixture(scope="module")
def tiny_params() -> GPT2Params:
    return GPT2Params.random(TINY, seed=5)


def assert_same_params(loaded: GPT2Params, expected: GPT2Params, rounding=lambda x: x) -> None:
    assert loaded.config.n_layer == expected.config.n_layer and loaded.config.n_embd == expected.config.n_embd
    got, want = loaded.to_tensors(), expected.to_tensors()
    assert got.keys() == want.keys()
    for name, array in want.items():
        assert got[name].dtype == np.float32 and got[name].flags.c_contiguous, name
        np.testing.assert_array_equal(got[name], rounding(array), err_msg=name)


def write_dir(directory: Path, tensors: dict[str, np.ndarray], config: dict | None = None) -> Path:
    """An HF directory holding exactly `tensors` (to damage a checkpoint one way at a time)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config or TINY.to_hf_dict()))
    write_safetensors(directory / "model.safetensors", tensors)
    return directory


def prefixed(params: GPT2Params) -> dict[str, np.ndarray]:
    return {"transformer." + name: array for name, array in params.to_tensors().items()}


# ----------------------------------------------------------------------------- what loads


@pytest.mark.parametrize(
    ("options", "rounding"),
    [
        ({}, None),
        ({"dtype": "float16"}, lambda x: x.astype(np.float16).astype(np.float32)),
        ({"dtype": "bfloat16"}, bf16_round),
        ({"shards": 3}, None),
        ({"shards": 2, "dtype": "float16"}, lambda x: x.astype(np.float16).astype(np.float32)),
        ({"prefix": ""}, None),
        ({"fmt": "pytorch"}, None),
        ({"fmt": "pytorch", "dtype": "bfloat16"}, bf16_round),
        ({"fmt": "pytorch", "shards": 2}, None),
    ],
    ids=[
        "fp32",
        "fp16",
        "bf16",
        "sharded",
        "sharded-fp16",
        "no-prefix",
        "pytorch",
        "pytorch-bf16",
        "pytorch-sharded",
    ],
)
def test_round_trip(tiny_params, write_checkpoint, options, rounding):
    if options.get("fmt") == "pytorch":
        pytest.importorskip("torch")
    directory = write_checkpoint(tiny_params, options.pop("fmt", "safetensors"), **options)
    assert_same_params(load_checkpoint(directory, progress=False), tiny_params, rounding or (lambda x: x))


def test_bf16_rounding_matches_torch(tiny_params):
    torch = pytest.importorskip("torch")
    values = np.concatenate([tiny_params.wte.ravel(), np.float32([1 + 2**-8, 1 + 3 * 2**-8, -2.5e-3, 0.0])])
    expected = torch.from_numpy(values).to(torch.bfloat16).to(torch.float32).numpy()
    np.testing.assert_array_equal(bf16_round(values), expected)


def test_tied_lm_head_and_mask_buffers_are_accepted(tiny_params, tmp_path):
    tensors = prefixed(tiny_params)
    tensors["lm_head.weight"] = tiny_params.wte
    for i in range(TINY.n_layer):
        tensors[f"transformer.h.{i}.attn.bias"] = np.tril(np.ones((1, 1, 32, 32), np.float32))
        tensors[f"transformer.h.{i}.attn.masked_bias"] = np.float32([-1e4])
    assert_same_params(load_checkpoint(write_dir(tmp_path / "m", tensors), progress=False), tiny_params)


def test_any_path_inside_the_directory_loads_it(tiny_params, write_checkpoint):
    directory = write_checkpoint(tiny_params)
    for path in (directory / "model.safetensors", directory / "config.json"):
        assert_same_params(load_checkpoint(path, progress=False), tiny_params)


def test_progress_bar_on_stderr_for_big_loads(tiny_params, write_checkpoint, monkeypatch, capsys):
    directory = write_checkpoint(tiny_params)
    load_checkpoint(directory, progress=True)
    assert "loading" not in capsys.readouterr().err  # small: no bar
    monkeypatch.setattr(tensors, "PROGRESS_MIN_BYTES", 0)
    load_checkpoint(directory, progress=True)
    assert f"loading {directory.name}" in capsys.readouterr().err
    load_checkpoint(directory, progress=False)
    assert capsys.readouterr().err == ""


# ----------------------------------------------------------------------------- what is refused


def refused(path: Path, *fragments: str) -> None:
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path, progress=False)
    for fragment in fragments:
        assert fragment in str(info.value), f"{fragment!r} not in {str(info.value)!r}"


def test_missing_tensor(tiny_params, tmp_path):
    tensors = prefixed(tiny_params)
    del tensors["transformer.h.1.mlp.c_fc.bias"]
    directory = write_dir(tmp_path / "m", tensors)
    refused(directory, "model.safetensors", "missing tensors h.1.mlp.c_fc.bias")


def test_unexpected_tensor(tiny_params, tmp_path):
    tensors = prefixed(tiny_params)
    tensors["transformer.h.0.attn.rotary.weight"] = np.zeros(4, np.float32)
    refused(
        write_dir(tmp_path / "m", tensors), "model.safetensors", "unexpected tensors h.0.attn.rotary.weight"
    )


def test_wrong_shape(tiny_params, tmp_path):
    tensors = prefixed(tiny_params)
    tensors["transformer.h.0.attn.c_attn.weight"] = tensors["transformer.h.0.attn.c_attn.weight"].T.copy()
    refused(
        write_dir(tmp_path / "m", tensors), "'h.0.attn.c_attn.weight' has shape (48, 16), expected (16, 48)"
    )


def test_config_disagrees_with_tensors(tiny_params, tmp_path):
    deeper = dict(TINY.to_hf_dict(), n_layer=3)
    refused(
        write_dir(tmp_path / "a", prefixed(tiny_params), deeper),
        "missing tensors h.2.",
        "config.json says n_layer=3",
    )
    wider = dict(TINY.to_hf_dict(), n_embd=32)
    refused(write_dir(tmp_path / "b", prefixed(tiny_params), wider), "has shape", "expected", "n_embd=32")


def test_lm_head_must_be_the_tied_embedding(tiny_params, tmp_path):
    tensors = prefixed(tiny_params)
    tensors["lm_head.weight"] = tiny_params.wte[:50]
    refused(write_dir(tmp_path / "a", tensors), "'lm_head.weight' has shape (50, 16), expected (100, 16)")
    tensors["lm_head.weight"] = tiny_params.wte + 1
    refused(write_dir(tmp_path / "b", tensors), "lm_head.weight", "differs from 'wte.weight'")


def test_unsupported_dtype_and_duplicate_names(tiny_params, tmp_path):
    directory = write_dir(tmp_path / "a", prefixed(tiny_params))
    raw = (directory / "model.safetensors").read_bytes()
    # Same byte count per element is needed to keep offsets valid: relabel one F32 tensor as I32.
    header_len = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + header_len])
    header["transformer.ln_f.bias"]["dtype"] = "I32"
    new_header = json.dumps(header, separators=(",", ":")).encode().ljust(header_len)
    (directory / "model.safetensors").write_bytes(raw[:8] + new_header + raw[8 + header_len :])
    refused(directory, "'transformer.ln_f.bias' has dtype I32")

    tensors = prefixed(tiny_params)
    tensors["ln_f.bias"] = tiny_params.ln_f_b
    refused(write_dir(tmp_path / "b", tensors), "'ln_f.bias' is stored twice")


def test_truncated_safetensors(tiny_params, write_checkpoint):
    directory = write_checkpoint(tiny_params)
    weights = directory / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:-100])
    refused(directory, str(weights), "truncated", "transformer.")
    weights.write_bytes(data[:5])
    refused(directory, "truncated")
    weights.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    refused(directory, "not a safetensors file")


def test_missing_config_and_missing_weights(tiny_params, write_checkpoint):
    directory = write_checkpoint(tiny_params)
    (directory / "model.safetensors").unlink()
    refused(directory, str(directory), "no weights", "model.safetensors")
    (directory / "config.json").unlink()
    refused(directory, "no config.json")


def test_bad_config_json(tiny_params, write_checkpoint):
    directory = write_checkpoint(tiny_params)
    config_path = directory / "config.json"
    config_path.write_text("{not json")
    refused(directory, str(config_path), "not valid JSON")
    config_path.write_text(json.dumps(dict(TINY.to_hf_dict(), activation_function="relu")))
    refused(directory, "activation_function='relu' is not supported")
    config_path.write_text(json.dumps({"n_layer": 2}))
    refused(directory, "missing field 'n_head'")


def test_broken_shards(tiny_params, write_checkpoint):
    directory = write_checkpoint(tiny_params, shards=2)
    (directory / "model-00002-of-00002.safetensors").unlink()
    refused(directory, "model.safetensors.index.json", "shard model-00002-of-00002.safetensors is missing")

    directory = write_checkpoint(tiny_params, shards=2)
    first, second = (
        directory / "model-00001-of-00002.safetensors",
        directory / "model-00002-of-00002.safetensors",
    )
    second.write_bytes(first.read_bytes())  # the same tensors in both shards
    refused(directory, re.sub(r"^.*/", "", str(second)), "is also in")


def test_damaged_pytorch_bin(tiny_params, write_checkpoint):
    pytest.importorskip("torch")
    directory = write_checkpoint(tiny_params, "pytorch")
    weights = directory / "pytorch_model.bin"
    weights.write_bytes(weights.read_bytes()[:-300])
    refused(directory, str(weights), "cannot read this PyTorch checkpoint")


def test_pytorch_bin_without_torch_says_so(tiny_params, write_checkpoint, monkeypatch):
    pytest.importorskip("torch")
    directory = write_checkpoint(tiny_params, "pytorch")
    monkeypatch.setitem(sys.modules, "torch", None)  # makes `import torch` fail, as if not installed
    refused(directory, "pytorch_model.bin", "needs torch")


def spoiled(params: GPT2Params, name: str, nan: int, inf: int) -> GPT2Params:
    """`params` with `nan` NaN and `inf` Inf values written into tensor `name`."""
    tensors = params.to_tensors()
    values = tensors[name].copy().reshape(-1)
    values[:nan] = np.nan
    values[nan : nan + inf] = np.inf
    tensors[name] = values.reshape(tensors[name].shape)
    return GPT2Params.from_tensors(params.config, tensors)


@pytest.mark.parametrize(
    "options",
    [
        {"dtype": "float32"},
        {"dtype": "bfloat16", "shards": 3},
        {"dtype": "float16", "fmt": "pytorch"},
    ],
    ids=["safetensors-fp32", "safetensors-bf16-sharded", "pytorch-fp16"],
)
def test_non_finite_weights_are_refused(tiny_params, tmp_path, options):
    if options.get("fmt") == "pytorch":
        pytest.importorskip("torch")
    params = spoiled(tiny_params, "h.1.mlp.c_fc.weight", nan=3, inf=1)
    directory = save_hf(params, tmp_path / "m", **options)
    index = directory / "model.safetensors.index.json"
    holder = (
        json.loads(index.read_text())["weight_map"]["transformer.h.1.mlp.c_fc.weight"]
        if index.is_file()
        else next(p.name for p in directory.iterdir() if p.name != "config.json")
    )
    refused(
        directory,
        f"{directory / holder}: tensor 'transformer.h.1.mlp.c_fc.weight'",
        "4 non-finite values (3 NaN, 1 Inf)",
    )
