"""The NumPy reference forward pass against Hugging Face `GPT2LMHeadModel` on the same checkpoints.

Each case: a 32-token prefill followed by 16 decode steps through the KV cache (teacher-forced with
fixed tokens, so both sides see the same inputs), comparing every position's logits.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from wafer_gpt2.model.checkpoint import bf16_round, load_checkpoint
from wafer_gpt2.model.forward import KVCache, forward
from wafer_gpt2.model.params import GPT2Params

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

PREFILL, DECODE = 32, 16
TOLERANCE = 1e-4


def token_sequence(vocab_size: int, seed: int = 7) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab_size, PREFILL + DECODE)


def reference_logits(params: GPT2Params, tokens: np.ndarray) -> np.ndarray:
    cache = KVCache(params.config)
    rows = [forward(params, tokens[:PREFILL], cache, 0)]
    for position in range(PREFILL, PREFILL + DECODE):
        rows.append(forward(params, tokens[position : position + 1], cache, position))
    return np.concatenate(rows)


def load_hf_model(directory: Path):
    model, info = transformers.GPT2LMHeadModel.from_pretrained(
        directory, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    # Every parameter must come from the file: a silently re-initialised tensor would void the test.
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model.eval()


@torch.no_grad()
def hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    ids = torch.from_numpy(tokens.astype(np.int64))[None]
    out = model(ids[:, :PREFILL], use_cache=True)
    rows, past = [out.logits[0]], out.past_key_values
    for position in range(PREFILL, PREFILL + DECODE):
        out = model(ids[:, position : position + 1], past_key_values=past, use_cache=True)
        rows.append(out.logits[0])
        past = out.past_key_values
    return torch.cat(rows).numpy()


def assert_close(ours: np.ndarray, theirs: np.ndarray, tolerance: float = TOLERANCE) -> None:
    assert ours.shape == theirs.shape == (PREFILL + DECODE, ours.shape[1])
    diff = float(np.abs(ours - theirs).max())
    assert diff <= tolerance, f"max |logit difference| {diff:.3g} > {tolerance}"
    # The comparison must be meaningful: logits vary across the vocabulary and across positions.
    assert float(theirs.std()) > 100 * tolerance


def test_small_safetensors_matches_hf(small_params, write_checkpoint):
    directory = write_checkpoint(small_params, "safetensors")
    ours = load_checkpoint(directory, progress=False)
    tokens = token_sequence(small_params.config.vocab_size)
    assert_close(reference_logits(ours, tokens), hf_logits(load_hf_model(directory), tokens))


@pytest.mark.slow  # among the slowest tests (make test-fast leaves it out)
def test_gpt2_124m_safetensors_matches_hf(gpt2_params, write_checkpoint):
    directory = write_checkpoint(gpt2_params, "safetensors")
    ours = load_checkpoint(directory, progress=False)
    tokens = token_sequence(gpt2_params.config.vocab_size, seed=8)
    assert_close(reference_logits(ours, tokens), hf_logits(load_hf_model(directory), tokens))


def test_checkpoint_saved_by_transformers_matches_hf(small_config, tmp_path):
    """A directory written by `save_pretrained` itself (HF's own init and file writer)."""
    hf_config = transformers.GPT2Config(
        **{k: v for k, v in small_config.to_hf_dict().items() if k != "architectures"}
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(hf_config).eval()
    model.save_pretrained(tmp_path / "saved")
    ours = load_checkpoint(tmp_path / "saved", progress=False)
    tokens = token_sequence(small_config.vocab_size, seed=9)
    assert_close(reference_logits(ours, tokens), hf_logits(load_hf_model(tmp_path / "saved"), tokens))


def test_llmc_fp32_matches_hf(small_params, write_checkpoint):
    ours = load_checkpoint(write_checkpoint(small_params, "llmc", version=3), progress=False)
    tokens = token_sequence(small_params.config.vocab_size, seed=10)
    model = load_hf_model(write_checkpoint(small_params, "safetensors"))
    assert_close(reference_logits(ours, tokens), hf_logits(model, tokens))


def test_llmc_bf16_matches_hf_on_rounded_weights(small_params, write_checkpoint):
    """A bf16 checkpoint holds bf16-rounded weights: HF runs (in fp32) on those same rounded weights."""
    ours = load_checkpoint(write_checkpoint(small_params, "llmc", version=5), progress=False)
    rounded = GPT2Params.from_tensors(
        small_params.config, {k: bf16_round(v) for k, v in small_params.to_tensors().items()}
    )
    tokens = token_sequence(small_params.config.vocab_size, seed=11)
    model = load_hf_model(write_checkpoint(rounded, "safetensors"))
    assert_close(reference_logits(ours, tokens), hf_logits(model, tokens), tolerance=2 * TOLERANCE)
    # ...and it really is a different model from the fp32 one.
    assert not np.array_equal(ours.wte, small_params.wte)
