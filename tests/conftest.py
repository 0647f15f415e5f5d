"""Shared fixtures: small and full-size GPT-2 configs with random weights, and checkpoint writers.

Random weights use GPT-2's initialisation (`GPT2Params.random`), so activations have realistic scale;
no test needs real weights or the network.
"""

from __future__ import annotations

import os

# On the project's shared 2-core machines OpenBLAS's thread hand-off costs milliseconds per call when
# the other core is busy (docs/simulator.md, "Speed", has the measurement). Set before
# NumPy is first imported; an explicit setting in the environment wins.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from collections.abc import Callable
from pathlib import Path

import pytest

from wafer_gpt2.model.config import PRESETS, GPT2Config
from wafer_gpt2.model.params import GPT2Params

# Full vocabulary so real tokenizer ids are valid; narrow and shallow so everything is fast.
SMALL_CONFIG = GPT2Config(n_layer=2, n_head=4, n_embd=64, vocab_size=50257, n_positions=128, name="small")


@pytest.fixture(scope="session")
def small_config() -> GPT2Config:
    return SMALL_CONFIG


@pytest.fixture(scope="session")
def small_params() -> GPT2Params:
    return GPT2Params.random(SMALL_CONFIG, seed=1)


@pytest.fixture(scope="session")
def gpt2_params() -> GPT2Params:
    """The 124M configuration with random weights (about 0.5 GB; built once per session)."""
    return GPT2Params.random(PRESETS["gpt2"], seed=124)


@pytest.fixture
def write_checkpoint(tmp_path: Path) -> Callable[..., Path]:
    """`write_checkpoint(params, fmt, **options) -> path` in a fresh temporary directory.

    fmt: "safetensors" | "pytorch" (HF directories; options go to `save_hf`) or "llmc" (options go
    to `save_llmc`, e.g. version=5).
    """
    from wafer_gpt2.model.hf_format import save_hf
    from wafer_gpt2.model.llmc_format import save_llmc

    count = 0

    def write(params: GPT2Params, fmt: str = "safetensors", **options) -> Path:
        nonlocal count
        count += 1
        if fmt == "llmc":
            return save_llmc(params, tmp_path / f"model{count}.bin", **options)
        return save_hf(params, tmp_path / f"hf{count}", fmt=fmt, **options)

    return write
