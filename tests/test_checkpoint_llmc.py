"""llm.c `.bin` checkpoints: the layout byte by byte, round trips, and every damaged header or body."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from wafer_gpt2.model.checkpoint import CheckpointError, bf16_round, load_checkpoint
from wafer_gpt2.model.config import GPT2Config
from wafer_gpt2.model.llmc_format import HEADER_BYTES, save_llmc
from wafer_gpt2.model.params import GPT2Params

TINY = GPT2Config(n_layer=2, n_head=2, n_embd=16, vocab_size=100, n_positions=32, name="tiny")


@pytest.fixture(scope="module")
def tiny_params() -> GPT2Params:
    return GPT2Params.random(TINY, seed=6)


def refused(path: Path, *fragments: str) -> None:
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path, progress=False)
    for fragment in fragments:
        assert fragment in str(info.value), f"{fragment!r} not in {str(info.value)!r}"


def test_layout_matches_llmc(tiny_params, tmp_path):
    """Decode the file by hand, following llm.c's `fill_in_parameter_sizes` order, independently of the loader."""
    path = save_llmc(tiny_params, tmp_path / "m.bin", version=3)
    header = np.fromfile(path, dtype="<i4", count=256)
    assert header[:8].tolist() == [20240326, 3, 32, 100, 2, 2, 16, 128]  # Vp: 100 padded to a multiple of 128
    assert not header[8:].any()
    body = np.fromfile(path, dtype="<f4", offset=HEADER_BYTES)
    L, C, Vp, T = 2, 16, 128, 32
    sizes = [Vp * C, T * C, L * C, L * C, L * 3 * C * C, L * 3 * C, L * C * C, L * C, L * C, L * C]
    sizes += [L * 4 * C * C, L * 4 * C, L * C * 4 * C, L * C, C, C]
    assert body.size == sum(sizes)
    chunks = np.split(body, np.cumsum(sizes)[:-1])
    wte = chunks[0].reshape(Vp, C)
    np.testing.assert_array_equal(wte[:100], tiny_params.wte)
    assert not wte[100:].any()  # padding rows are zero
    np.testing.assert_array_equal(chunks[1].reshape(T, C), tiny_params.wpe)
    qkvw = chunks[4].reshape(L, 3 * C, C)  # PyTorch Linear [out, in]
    np.testing.assert_array_equal(qkvw[1], tiny_params.layers[1].attn_w.T)
    fcprojw = chunks[12].reshape(L, C, 4 * C)
    np.testing.assert_array_equal(fcprojw[0], tiny_params.layers[0].proj_w.T)
    np.testing.assert_array_equal(chunks[9].reshape(L, C)[1], tiny_params.layers[1].ln_2_b)
    np.testing.assert_array_equal(chunks[15], tiny_params.ln_f_b)


@pytest.mark.parametrize(("version", "rounding"), [(3, lambda x: x), (5, bf16_round)])
def test_round_trip(tiny_params, tmp_path, version, rounding):
    loaded = load_checkpoint(save_llmc(tiny_params, tmp_path / "m.bin", version=version), progress=False)
    assert loaded.config.n_positions == 32 and loaded.config.vocab_size == 100
    for name, array in tiny_params.to_tensors().items():
        got = loaded.to_tensors()[name]
        assert got.dtype == np.float32 and got.flags.c_contiguous
        np.testing.assert_array_equal(got, rounding(array), err_msg=name)


def test_bf16_file_is_half_the_size(tiny_params, tmp_path):
    fp32 = save_llmc(tiny_params, tmp_path / "a.bin", version=3).stat().st_size - HEADER_BYTES
    bf16 = save_llmc(tiny_params, tmp_path / "b.bin", version=5).stat().st_size - HEADER_BYTES
    assert fp32 == 2 * bf16


def patch_header(path: Path, index: int, value: int) -> None:
    header = np.fromfile(path, dtype="<i4", count=256)
    header[index] = value
    data = bytearray(path.read_bytes())
    data[:HEADER_BYTES] = header.tobytes()
    path.write_bytes(bytes(data))


def test_wrong_magic(tiny_params, tmp_path):
    path = save_llmc(tiny_params, tmp_path / "m.bin")
    patch_header(path, 0, 20240327)
    refused(path, str(path), "bad magic 20240327", "20240326")


@pytest.mark.parametrize("version", [1, 2, 4, 6])
def test_unknown_version(tiny_params, tmp_path, version):
    path = save_llmc(tiny_params, tmp_path / "m.bin")
    patch_header(path, 1, version)
    refused(path, str(path), f"version {version} is not supported")


def test_truncated(tiny_params, tmp_path):
    path = save_llmc(tiny_params, tmp_path / "m.bin")
    data = path.read_bytes()
    path.write_bytes(data[:-4])
    refused(path, str(path), "truncated", "tensor lnfb (16,)")
    path.write_bytes(data[: HEADER_BYTES + 128 * 16 * 4 + 10])
    refused(path, "truncated", "tensor wpe (32, 16)")
    path.write_bytes(data[:100])
    refused(path, "truncated", "shorter than the 1024-byte llm.c header")


def test_header_that_disagrees_with_the_body(tiny_params, tmp_path):
    path = save_llmc(tiny_params, tmp_path / "m.bin")
    patch_header(path, 4, 1)  # claims one layer: the file holds two layers' worth of bytes
    refused(path, str(path), "bytes more than the header's model needs")
    path = save_llmc(tiny_params, tmp_path / "m2.bin")
    patch_header(path, 7, 64)
    refused(path, "padded vocab size 64 is smaller than the vocab size 100")
    path = save_llmc(tiny_params, tmp_path / "m3.bin")
    patch_header(path, 5, 3)  # 16 channels do not split into 3 heads
    refused(path, "header describes no valid GPT-2", "divisible by n_head")
    path = save_llmc(tiny_params, tmp_path / "m4.bin")
    patch_header(path, 6, 0)
    refused(path, "header field C = 0")


def test_save_refuses_unknown_versions(tiny_params, tmp_path):
    with pytest.raises(ValueError, match="version must be 3"):
        save_llmc(tiny_params, tmp_path / "m.bin", version=4)


@pytest.mark.parametrize("version", [3, 5])
def test_non_finite_weights_are_refused(tiny_params, tmp_path, version):
    tensors = tiny_params.to_tensors()
    fc = tensors["h.1.mlp.c_fc.weight"].copy()
    fc[0, :2], fc[1, 0] = np.nan, -np.inf
    tensors["h.1.mlp.c_fc.weight"] = fc
    path = save_llmc(GPT2Params.from_tensors(TINY, tensors), tmp_path / "m.bin", version=version)
    refused(path, f"{path}: tensor 'fcw[1] (h.1.mlp.c_fc.weight)'", "3 non-finite values (2 NaN, 1 Inf)")

    tensors = tiny_params.to_tensors()
    tensors["ln_f.bias"] = np.full_like(tensors["ln_f.bias"], np.inf)
    path = save_llmc(GPT2Params.from_tensors(TINY, tensors), tmp_path / "f.bin", version=version)
    refused(path, "tensor 'lnfb'", "16 non-finite values (0 NaN, 16 Inf)")


def test_non_finite_vocab_padding_is_ignored(tiny_params, tmp_path):
    path = save_llmc(tiny_params, tmp_path / "m.bin", version=3)
    data = bytearray(path.read_bytes())
    padding = HEADER_BYTES + TINY.vocab_size * TINY.n_embd * 4  # the rows llm.c pads wte with
    data[padding : padding + 8] = np.array([np.nan, np.inf], dtype="<f4").tobytes()
    path.write_bytes(bytes(data))
    assert np.isfinite(load_checkpoint(path, progress=False).wte).all()
