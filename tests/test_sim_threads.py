"""The simulator's threads split work, not arithmetic: the same steps give the same results on one
thread and on the pool (items split by slot, GEMVs by column blocks, attention and the head by items).

Not bit for bit: BLAS orders the products inside one PE's tile differently for calls of different
shapes (rounding-level differences in the partials, which the fp16 roundings of the layers carry
into the logits), the one freedom the simulator leaves (docs/simulator.md)."""

from __future__ import annotations

import numpy as np

from wafer_gpt2.backends.registry import BackendOptions, build_backend
from wafer_gpt2.core.steps import StepInputs, StepItem
from wafer_gpt2.sim import kernels, parallel, wafer_program


def run_steps(params, steps: list[list[StepItem]]) -> list:
    sim = build_backend("sim", params, BackendOptions(slots=8, dtype="fp16", context=64))
    try:
        return [sim.step(StepInputs.of_items(items)).rows() for items in steps]
    finally:
        sim.close()


def test_the_pool_changes_no_result(small_params, monkeypatch):
    rng = np.random.default_rng(7)
    lengths = [12, 3, 9, 1, 7, 10, 5, 8]  # 55 prompt items over 8 slots: uneven parts
    prompts = [rng.integers(0, small_params.config.vocab_size, n).tolist() for n in lengths]
    prefill = [StepItem(s, p, t) for s, prompt in enumerate(prompts) for p, t in enumerate(prompt)]
    decode = [StepItem(s, len(prompt), 11 * s + 1) for s, prompt in enumerate(prompts)]
    # odd slots decode while slot 0 takes three more prompt tokens
    mixed = [StepItem(s, len(prompt) + 1, 5) for s, prompt in enumerate(prompts) if s % 2]
    mixed += [StepItem(0, len(prompts[0]) + 1 + i, 7 + i) for i in range(3)]
    steps = [prefill, decode, mixed]

    monkeypatch.setattr(parallel, "SIM_THREADS", 1)
    serial = run_steps(small_params, steps)

    monkeypatch.setattr(parallel, "SIM_THREADS", 2)
    monkeypatch.setattr(wafer_program, "LAYER_SPLIT_ITEMS", 40)  # the prefill splits by slot
    monkeypatch.setattr(kernels, "GEMV_PARALLEL_MACS", 0)  # every other GEMV splits by columns
    pooled = run_steps(small_params, steps)

    scored = 0
    for serial_step, pooled_step in zip(serial, pooled, strict=True):
        for a, b in zip(serial_step, pooled_step, strict=True):
            assert (a is None) == (b is None)
            if a is not None:
                scored += 1
                assert a.topk_ids[0] == b.topk_ids[0]
                np.testing.assert_allclose(a.topk_logits, b.topk_logits, rtol=0, atol=5e-4)
                assert abs(a.logsumexp - b.logsumexp) < 5e-4
    assert scored == len(prefill) + len(decode) + len(steps[2])
