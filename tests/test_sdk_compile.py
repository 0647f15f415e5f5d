"""SDK tier: compile the kernels with the real cslc and run a tiny GPT-2 on simfabric.

Skipped unless the Cerebras SDK is present (cslc on PATH and the Python runtime importable): run them
inside the SDK image, see docs/kernels.md ("Compile and run with the SDK").
"""

from __future__ import annotations

import importlib.util
import shutil

import numpy as np
import pytest

from wafer_gpt2.core.steps import StepInputs
from wafer_gpt2.host.compile import compile_program, prepare_sources
from wafer_gpt2.model.config import GPT2Config
from wafer_gpt2.plan import build_plan

HAVE_CSLC = shutil.which("cslc") is not None
HAVE_RUNTIME = importlib.util.find_spec("cerebras") is not None and (
    importlib.util.find_spec("cerebras.sdk.runtime") is not None
)

pytestmark = [
    pytest.mark.sdk,
    pytest.mark.skipif(not HAVE_CSLC, reason="cslc is not on PATH (needs the Cerebras SDK)"),
]


TINY = GPT2Config(n_layer=2, n_head=2, n_embd=16, vocab_size=100, n_positions=32, name="tiny")


@pytest.mark.parametrize("dtype", ["fp16", "fp32"])
def test_tiny_program_compiles(tmp_path, dtype):
    job = prepare_sources(
        build_plan(TINY, slots=2, context=32, top_k=8, dtype=dtype), tmp_path, simfabric=True
    )
    compile_program(job)
    assert (job.bin_dir / "out.json").is_file()


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_RUNTIME, reason="cerebras.sdk.runtime is not importable (run under cs_python)")
def test_tiny_gpt2_on_simfabric_matches_the_reference():
    from wafer_gpt2.backends.registry import BackendOptions, build_backend
    from wafer_gpt2.core.steps import StepItem
    from wafer_gpt2.model.params import GPT2Params

    params = GPT2Params.random(TINY, seed=0)
    options = BackendOptions(slots=2, context=8, dtype="fp32", top_k=4)
    wafer = build_backend("sdk-container", params, options)
    reference = build_backend("reference", params, options)
    items = [StepItem(0, pos, tok) for pos, tok in enumerate([46, 32, 28, 12])]
    try:
        got, want = (
            wafer.step(StepInputs.of_items(items)).rows(),
            reference.step(StepInputs.of_items(items)).rows(),
        )
    finally:
        wafer.close()
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g.topk_ids, w.topk_ids)
        np.testing.assert_allclose(g.topk_logits, w.topk_logits, rtol=1e-4, atol=1e-4)
        assert abs(g.logsumexp - w.logsumexp) < 1e-3
