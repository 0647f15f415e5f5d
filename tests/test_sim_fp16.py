"""fp16 mode against fp32 mode on the embedded demo model: the error stays inside a measured bound.

Measured with tools/bench/fp16_error.py over 20 prompts (docs/simulator.md has the figures); the bound
here is a few times the worst difference measured there.
"""

from __future__ import annotations

import numpy as np
import pytest

from wafer_gpt2.backends.registry import BackendOptions, build_backend
from wafer_gpt2.core.steps import StepInputs, StepItem
from wafer_gpt2.model import tokenizer
from wafer_gpt2.model.checkpoint import DEMO_MODEL_DIR, load_checkpoint

BOUND = 0.01
PROMPTS = ["The meaning of life is", "Never trust a man who", "Programming is", "Once upon a time"]


@pytest.fixture(scope="module")
def demo_params():
    if not (DEMO_MODEL_DIR / "config.json").is_file():
        pytest.skip(f"the demo model {DEMO_MODEL_DIR} is not in this checkout")
    return load_checkpoint(DEMO_MODEL_DIR, progress=False)


def test_fp16_stays_within_the_bound_of_fp32(demo_params):
    context = 48
    runs = {
        dtype: build_backend("sim", demo_params, BackendOptions(slots=1, context=context, dtype=dtype))
        for dtype in ("fp32", "fp16")
    }
    try:
        worst = 0.0
        for prompt in PROMPTS:
            tokens = tokenizer.encode(prompt)
            tokens = (tokens * 8)[:24]  # a longer sequence, to exercise the KV cache in fp16
            scores = {}
            for dtype, backend in runs.items():
                backend.reset()
                scores[dtype] = backend.step(
                    StepInputs.of_items([StepItem(0, i, t) for i, t in enumerate(tokens)])
                ).rows()
            for a, b in zip(scores["fp32"], scores["fp16"], strict=True):
                _, ia, ib = np.intersect1d(a.topk_ids, b.topk_ids, return_indices=True)
                worst = max(worst, float(np.abs(a.topk_logits[ia] - b.topk_logits[ib]).max()))
                assert abs(a.logsumexp - b.logsumexp) < BOUND
                if a.topk_logits[0] - a.topk_logits[1] > 2 * BOUND:  # a clear winner must stay the winner
                    assert a.topk_ids[0] == b.topk_ids[0]
        assert 0 < worst < BOUND  # fp16 is not fp32 (the rounding is really there), but it is close
    finally:
        for backend in runs.values():
            backend.close()
