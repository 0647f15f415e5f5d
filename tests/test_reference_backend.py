"""`ReferenceBackend` against the plain reference forward pass, slot by slot."""

from __future__ import annotations

import numpy as np
import pytest

from wafer_gpt2.backends.reference import ReferenceBackend
from wafer_gpt2.backends.registry import BackendOptions, build_backend
from wafer_gpt2.core.steps import BackendError, StepInputs, StepItem, TokenScores
from wafer_gpt2.model.forward import KVCache, forward, logsumexp

TOP_K = 8


def full_logits(params, sequence: list[int]) -> np.ndarray:
    """Logits of every position of `sequence`, from one uncached prefill."""
    return forward(params, sequence, KVCache(params.config), 0)


def assert_scores(scores: TokenScores, logits_row: np.ndarray, target: int | None = None) -> None:
    expected_ids = np.argsort(-logits_row, kind="stable")[:TOP_K]
    np.testing.assert_array_equal(scores.topk_ids, expected_ids)
    assert scores.topk_ids.dtype == np.int32 and scores.topk_logits.dtype == np.float32
    assert np.all(np.diff(scores.topk_logits) <= 0), "best first"
    np.testing.assert_allclose(scores.topk_logits, logits_row[expected_ids], atol=1e-5, rtol=0)
    assert scores.logsumexp == pytest.approx(float(logsumexp(logits_row)), abs=1e-5)
    if target is None:
        assert scores.target_logit is None
    else:
        assert scores.target_logit == pytest.approx(float(logits_row[target]), abs=1e-5)


def test_mixed_batches_match_the_reference(small_params):
    backend = ReferenceBackend(small_params, slots=4, context=64, top_k=TOP_K)
    rng = np.random.default_rng(3)
    seqs = {slot: rng.integers(0, small_params.config.vocab_size, 20).tolist() for slot in range(4)}
    reused = rng.integers(0, small_params.config.vocab_size, 20).tolist()

    # Step 1: slot 0's prompt (positions 0..4) interleaved with slot 1's (0..2); only the last
    # prompt token of each wants scores; one item asks for a target logit.
    step1 = [
        StepItem(0, 0, seqs[0][0], want_scores=False),
        StepItem(1, 0, seqs[1][0], want_scores=False),
        StepItem(0, 1, seqs[0][1], want_scores=False),
        StepItem(0, 2, seqs[0][2], want_scores=False),
        StepItem(1, 1, seqs[1][1], want_scores=False, target=seqs[1][2]),
        StepItem(0, 3, seqs[0][3], want_scores=False),
        StepItem(1, 2, seqs[1][2]),
        StepItem(0, 4, seqs[0][4], target=seqs[0][5]),
    ]
    out1 = backend.step(StepInputs.of_items(step1)).rows()
    assert [s is None for s in out1] == [not item.want_scores for item in step1]
    assert_scores(out1[6], full_logits(small_params, seqs[1][:3])[2])
    assert_scores(out1[7], full_logits(small_params, seqs[0][:5])[4], target=seqs[0][5])

    # Step 2: decode slots 0 and 1, prefill slot 2 with targets (prompt logprobs) on every token.
    step2 = [StepItem(1, 3, seqs[1][3]), StepItem(0, 5, seqs[0][5])]
    step2 += [StepItem(2, p, seqs[2][p], target=seqs[2][p + 1]) for p in range(6)]
    out2 = backend.step(StepInputs.of_items(step2)).rows()
    assert_scores(out2[0], full_logits(small_params, seqs[1][:4])[3])
    assert_scores(out2[1], full_logits(small_params, seqs[0][:6])[5])
    slot2_logits = full_logits(small_params, seqs[2][:6])
    for p in range(6):
        assert_scores(out2[2 + p], slot2_logits[p], target=seqs[2][p + 1])

    # Step 3: slot 0 is freed and reused by a new sequence from position 0; the others carry on.
    backend.free_slot(0)
    out3 = backend.step(
        StepInputs.of_items(
            [StepItem(0, 0, reused[0]), StepItem(0, 1, reused[1]), StepItem(2, 6, seqs[2][6])]
        )
    ).rows()
    reused_logits = full_logits(small_params, reused[:2])
    assert_scores(out3[0], reused_logits[0])
    assert_scores(out3[1], reused_logits[1])
    assert_scores(out3[2], full_logits(small_params, seqs[2][:7])[6])


def test_bad_items_are_refused_without_touching_the_caches(small_params):
    backend = ReferenceBackend(small_params, slots=2, context=16, top_k=TOP_K)
    seq = [11, 22, 33, 44]
    backend.step(StepInputs.of_items([StepItem(0, p, t, want_scores=False) for p, t in enumerate(seq[:3])]))
    bad_steps = {
        "slot 5 outside": [StepItem(5, 0, 1)],
        "position 16 outside": [StepItem(1, 16, 1)],
        "token 50257 outside": [StepItem(1, 0, 50257)],
        "consecutive": [StepItem(1, 0, 1), StepItem(1, 2, 1)],
        "leaves a gap": [StepItem(1, 0, 1), StepItem(0, 4, 1)],
    }
    for message, items in bad_steps.items():
        with pytest.raises(BackendError, match=message):
            backend.step(StepInputs.of_items(items))
    # The refused steps (one started with a valid slot-1 item) left both slots as they were.
    (scores,) = backend.step(StepInputs.of_items([StepItem(0, 3, seq[3])])).rows()
    assert_scores(scores, full_logits(small_params, seq)[3])
    with pytest.raises(BackendError, match="leaves a gap"):
        backend.step(StepInputs.of_items([StepItem(1, 1, 5)]))


def test_construction_limits_and_backend_factory(small_params):
    with pytest.raises(ValueError, match="top_k"):
        ReferenceBackend(small_params, top_k=small_params.config.vocab_size + 1)
    with pytest.raises(ValueError, match="context"):
        ReferenceBackend(small_params, context=small_params.config.n_positions + 1)
    backend = build_backend("reference", small_params, BackendOptions(slots=3, context=32, top_k=5))
    assert (backend.num_slots, backend.context_length, backend.vocab_size, backend.top_k) == (
        3,
        32,
        50257,
        5,
    )
    assert backend.step(StepInputs.of_items([])).count == 0
    (scores,) = backend.step(StepInputs.of_items([StepItem(2, 0, 464)])).rows()
    assert scores.topk_ids.shape == (5,)
    backend.reset()
    with pytest.raises(BackendError, match="leaves a gap"):
        backend.step(StepInputs.of_items([StepItem(2, 1, 464)]))
