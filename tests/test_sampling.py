"""The sampler on hand-computed cases: greedy, temperature, top-k, top-p, repetition penalty, seeds."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from wafer_gpt2.core.steps import TokenScores
from wafer_gpt2.engine.sampling import Sampler, SamplingParams

# A head answer whose top-4 probabilities (over the whole vocabulary) are 0.5, 0.3, 0.15, 0.05:
# logsumexp 0, logits = log(p), ids in best-first order.
PROBS = np.array([0.5, 0.3, 0.15, 0.05])
SCORES = TokenScores(
    topk_ids=np.array([40, 10, 30, 20], dtype=np.int32),
    topk_logits=np.log(PROBS).astype(np.float32),
    logsumexp=0.0,
)


def dist(params: SamplingParams, scores: TokenScores = SCORES, history=()) -> dict[int, float]:
    ids, probs = Sampler(params).distribution(scores, list(history))
    assert probs.sum() == pytest.approx(1.0)
    return {int(i): float(p) for i, p in zip(ids, probs, strict=True)}


def test_greedy_by_default_and_logprob_is_the_models():
    sampler = Sampler(SamplingParams())
    assert sampler.seed is None
    token, logprob = sampler.choose(SCORES, [])
    assert token == 40
    assert logprob == pytest.approx(math.log(0.5), abs=1e-6)


def test_sampling_switches_on_like_tgi():
    assert not SamplingParams().sampling
    assert not SamplingParams(top_p=1.0).sampling
    assert SamplingParams(do_sample=True).sampling
    assert SamplingParams(temperature=0.7).sampling
    assert SamplingParams(top_k=5).sampling
    assert SamplingParams(top_p=0.9).sampling


def test_plain_sampling_renormalises_over_the_top_k():
    assert dist(SamplingParams(do_sample=True)) == pytest.approx({40: 0.5, 10: 0.3, 30: 0.15, 20: 0.05})


def test_temperature():
    # T = 2: p_i ∝ p_i^(1/2).
    roots = np.sqrt(PROBS) / np.sqrt(PROBS).sum()
    assert dist(SamplingParams(temperature=2.0)) == pytest.approx(
        dict(zip([40, 10, 30, 20], roots, strict=True))
    )


def test_top_k():
    assert dist(SamplingParams(top_k=2)) == pytest.approx({40: 0.5 / 0.8, 10: 0.3 / 0.8})
    assert dist(SamplingParams(top_k=100)) == pytest.approx({40: 0.5, 10: 0.3, 30: 0.15, 20: 0.05})


@pytest.mark.parametrize(
    ("top_p", "expected"),
    [
        (0.4, {40: 1.0}),  # the best token alone already holds 0.5 >= 0.4
        (0.75, {40: 0.5 / 0.8, 10: 0.3 / 0.8}),  # 0.5 < 0.75, 0.5 + 0.3 >= 0.75
        (0.85, {40: 0.5 / 0.95, 10: 0.3 / 0.95, 30: 0.15 / 0.95}),
        (0.99, {40: 0.5, 10: 0.3, 30: 0.15, 20: 0.05}),
    ],
)
def test_top_p(top_p, expected):
    assert dist(SamplingParams(top_p=top_p)) == pytest.approx(expected)


def test_top_p_applies_after_temperature_and_top_k():
    # top_k=3 leaves 0.5, 0.3, 0.15 -> renormalised 0.526, 0.316, 0.158; top_p=0.8 keeps the first two.
    assert dist(SamplingParams(top_k=3, top_p=0.8)) == pytest.approx({40: 0.5 / 0.8, 10: 0.3 / 0.8})


def test_repetition_penalty_hf_semantics():
    scores = TokenScores(
        topk_ids=np.array([7, 8, 9], dtype=np.int32),
        topk_logits=np.array([2.0, 1.5, -1.0], dtype=np.float32),
        logsumexp=3.0,
    )
    # Penalty 2 on tokens 7 (positive: 2.0 / 2 = 1.0) and 9 (negative: -1.0 * 2 = -2.0); 8 untouched.
    token, logprob = Sampler(SamplingParams(repetition_penalty=2.0)).choose(scores, [7, 9, 7])
    assert token == 8
    assert logprob == pytest.approx(1.5 - 3.0)  # the model's logprob, not the penalised one
    logits = np.array([1.0, 1.5, -2.0])
    expected = np.exp(logits) / np.exp(logits).sum()
    got = dist(SamplingParams(do_sample=True, repetition_penalty=2.0), scores, [7, 9])
    assert got == pytest.approx(dict(zip([7, 8, 9], expected, strict=True)))
    # Without history the penalty changes nothing.
    assert Sampler(SamplingParams(repetition_penalty=2.0)).choose(scores, [])[0] == 7


def test_samples_follow_the_distribution():
    sampler = Sampler(SamplingParams(top_p=0.85, seed=1))
    draws = [sampler.choose(SCORES, [])[0] for _ in range(4000)]
    counts = {token: draws.count(token) / len(draws) for token in set(draws)}
    assert set(counts) == {40, 10, 30}  # 20 is cut by top_p
    for token, p in {40: 0.5 / 0.95, 10: 0.3 / 0.95, 30: 0.15 / 0.95}.items():
        assert counts[token] == pytest.approx(p, abs=0.03)


def test_same_seed_same_tokens_whatever_else_runs():
    params = SamplingParams(do_sample=True, seed=1234)
    alone = Sampler(params)
    first = [alone.choose(SCORES, [])[0] for _ in range(50)]
    # The same request again, this time interleaved with other requests drawing from their own samplers.
    again, others = Sampler(params), [Sampler(SamplingParams(do_sample=True, seed=s)) for s in range(3)]
    second = []
    for _ in range(50):
        for other in others:
            other.choose(SCORES, [])
        second.append(again.choose(SCORES, []))
    assert [token for token, _ in second] == first
    different = Sampler(SamplingParams(do_sample=True, seed=4321))
    assert [different.choose(SCORES, [])[0] for _ in range(50)] != first


def test_unseeded_sampling_reports_its_seed():
    sampler = Sampler(SamplingParams(do_sample=True))
    assert isinstance(sampler.seed, int)
    replay = Sampler(SamplingParams(do_sample=True, seed=sampler.seed))
    assert [sampler.choose(SCORES, [])[0] for _ in range(20)] == [
        replay.choose(SCORES, [])[0] for _ in range(20)
    ]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", 0.0),
        ("top_k", 0),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("repetition_penalty", 0.0),
        ("seed", -1),
    ],
)
def test_invalid_params(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_vllm_extras_min_p_output_penalties_and_banned_ids():
    # min_p 0.5: candidates at least half as likely as the best (0.5): 40 (0.5) and 10 (0.3).
    assert dist(SamplingParams(do_sample=True, min_p=0.5)) == pytest.approx({40: 0.5 / 0.8, 10: 0.3 / 0.8})
    # Frequency and presence penalties count the generated tokens only (not the prompt in `history`).
    ids, probs = Sampler(
        SamplingParams(do_sample=True, frequency_penalty=1.0, presence_penalty=0.5)
    ).distribution(SCORES, history=[40, 10, 10], output=[10, 10])
    expected = np.array([0.5, 0.3 * math.exp(-2.5), 0.15, 0.05])
    got = dict(zip(ids.tolist(), probs.tolist(), strict=True))
    assert got == pytest.approx(
        dict(zip([40, 10, 30, 20], (expected / expected.sum()).tolist(), strict=True))
    )
    # Banned ids are never chosen, unless nothing else is left.
    assert Sampler(SamplingParams()).choose(SCORES, [], banned={40})[0] == 10
    assert Sampler(SamplingParams()).choose(SCORES, [], banned={40, 10, 30, 20})[0] == 40
    with pytest.raises(ValueError, match="min_p"):
        SamplingParams(min_p=1.5)


# ----- totality: no parameter the validation lets through and no score the wafer returns may leave the
# sampler without a candidate or with a NaN probability (an empty top-p list would crash a step).


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", 1e-320),
        ("temperature", float("inf")),
        ("temperature", float("nan")),
        ("repetition_penalty", 1e-320),
        ("repetition_penalty", 1e300),
        ("repetition_penalty", float("inf")),
        ("top_p", float("nan")),
    ],
)
def test_parameters_beyond_what_the_math_carries_are_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field} must be") as caught:
        SamplingParams(**{field: value})
    assert getattr(caught.value, "field", None) == field


EXTREME_SCORES = [
    SCORES,
    # Ties at the top, a spread far beyond exp's range, and fp16-style overflow from the wafer.
    TokenScores(np.array([5, 6, 7, 8]), np.array([3.0, 3.0, -60000.0, -65504.0], np.float32), 4.0),
    TokenScores(np.array([5, 6, 7, 8]), np.array([np.inf, 2.0, np.inf, -np.inf], np.float32), 4.0),
    TokenScores(np.array([5, 6, 7, 8]), np.array([np.nan, 2.0, 1.0, np.nan], np.float32), 4.0),
    TokenScores(np.array([5, 6, 7, 8]), np.array([65504.0, 65504.0, 65000.0, -65504.0], np.float32), 70000.0),
]
EXTREME_PARAMS = [
    SamplingParams(temperature=1e-4, top_p=0.5, seed=1),
    SamplingParams(temperature=1e-4, seed=1),
    SamplingParams(temperature=1e4, top_p=1e-9, seed=1),
    SamplingParams(repetition_penalty=1e-4, top_p=0.3, seed=1),
    SamplingParams(repetition_penalty=1e4, temperature=1e-4, top_k=1, seed=1),
    SamplingParams(do_sample=True, top_p=0.999999, seed=1),
    SamplingParams(repetition_penalty=1e-4),
]


@pytest.mark.parametrize("params", EXTREME_PARAMS, ids=range(len(EXTREME_PARAMS)))
@pytest.mark.parametrize("scores", EXTREME_SCORES, ids=range(len(EXTREME_SCORES)))
def test_the_sampler_is_total(params, scores):
    sampler = Sampler(params)
    for history in ([], [5, 6, 40, 10], [7, 8, 30]):
        ids, probs = sampler.distribution(scores, history)
        assert len(ids) >= 1 and len(ids) == len(probs)
        assert np.isfinite(probs).all() and (probs >= 0).all() and probs.sum() == pytest.approx(1.0)
        assert set(ids.tolist()) <= set(np.asarray(scores.topk_ids).tolist())
        token, _ = sampler.choose(scores, history)
        assert token in ids.tolist()
        logits = np.asarray(scores.topk_logits, np.float64)
        assert not np.isnan(logits[list(np.asarray(scores.topk_ids)).index(token)]), "a NaN score was chosen"


def test_a_tiny_temperature_picks_the_best_candidate_not_the_worst():
    for top_p in (None, 0.9):
        sampler = Sampler(SamplingParams(temperature=1e-4, top_p=top_p, seed=3))
        assert {sampler.choose(SCORES, [])[0] for _ in range(50)} == {40}


def test_candidates_outside_the_tokenizer_are_never_chosen():
    # A model whose vocabulary is padded beyond the tokenizer's (50304 rows, 50257 tokens).
    scores = TokenScores(np.array([50300, 50260, 17, 50256]), np.array([9.0, 8.0, 1.0, 0.5], np.float32), 9.5)
    for params in (SamplingParams(), SamplingParams(do_sample=True, seed=2)):
        sampler = Sampler(params, vocab_size=50257)
        assert {sampler.choose(scores, [])[0] for _ in range(50)} <= {17, 50256}


def test_sample_batch_chooses_what_choose_does_with_the_same_seeds():
    from wafer_gpt2.core.steps import StepScores
    from wafer_gpt2.engine.sampling import sample_batch

    rng = np.random.default_rng(7)
    params = [
        SamplingParams(do_sample=True),
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.3, top_k=5),
        SamplingParams(top_k=1),  # one survivor: no draw
        SamplingParams(top_p=0.9),
        SamplingParams(top_p=0.01, temperature=0.5),  # only the best survives
        SamplingParams(temperature=0.8, top_k=20, top_p=0.95, min_p=0.05),
        SamplingParams(do_sample=True, min_p=0.2),
        SamplingParams(temperature=1e-4),
    ]
    m, k, vocab = 4 * len(params), 64, 1000
    batch = [Sampler(replace(params[i % len(params)], seed=100 + i), vocab_size=vocab) for i in range(m)]
    alone = [Sampler(replace(params[i % len(params)], seed=100 + i), vocab_size=vocab) for i in range(m)]
    for step in range(6):
        ids = np.stack([rng.choice(vocab + 8, size=k, replace=False) for _ in range(m)]).astype(np.int32)
        logits = np.sort(rng.normal(0, 3, (m, k)).astype(np.float32), axis=1)[:, ::-1].copy()
        if step % 2:  # not in order, a duplicate id, a NaN, an unknown id, ties
            logits[0] = rng.permutation(logits[0])
            ids[1, 5] = ids[1, 2]
            logits[2, 3] = np.nan
            logits[4, 1] = logits[4, 0]
        else:
            ids[ids >= vocab] -= vocab  # every id known, no NaN: every row batched
        lse = np.log(np.exp(logits.astype(np.float64)).sum(axis=1, where=~np.isnan(logits))) + 2.0
        scores = StepScores(
            count=m,
            index=np.arange(m),
            topk_ids=ids,
            topk_logits=logits,
            logsumexp=lse,
            target_logit=np.full(m, np.nan),
            has_target=np.zeros(m, dtype=bool),
        )
        picks = sample_batch(scores, list(range(m)), batch, vocab)
        left = 0
        for row, pick in enumerate(picks):
            if pick is None:  # left to `choose`, as the engine does
                left += 1
                pick = batch[row].choose(scores.row(row), ())
            assert pick == alone[row].choose(scores.row(row), ()), (step, row, params[row % len(params)])
        assert left == 0 if step % 2 == 0 else left >= 1
