"""Choosing the next token from what the wafer returns: its top-k (ids, logits) and the log-sum-exp.

The semantics follow Hugging Face's `generate` and TGI: the repetition penalty first (positive logits
of tokens already seen are divided by it, negative ones multiplied), then vLLM's presence and
frequency penalties (over the generated tokens only), then temperature, top-k, top-p and min-p. Sampling is on when asked for (`do_sample`) or implied by a warper (temperature != 1, top_k,
top_p < 1), as in TGI; otherwise the choice is greedy.

The candidates are the wafer's top-k only (the full vocabulary never leaves the wafer), so top-p and
sampling renormalise over those k. The reported logprob is the model's own, unaffected by the
penalty or the warpers: logit - logsumexp over the whole vocabulary.

Each request owns a `Sampler` with its own seeded generator, so a seed gives the same tokens whatever
else shares the batch. The requests of a step that need no history (no penalty, nothing banned)
choose together, as array operations over the step's rows: `greedy_batch` and `sample_batch` (one
draw from each request's generator, as `choose` draws); the others choose one at a time.

The sampler is total: the parameters are bounded to what the arithmetic carries (temperature and
repetition penalty in [1e-4, 1e4], finite), the warpers work on logits shifted so that the best is 0
(a tiny temperature gives the argmax, never NaN), scores the wafer could not compute (NaN) and ids the
tokenizer does not know (a vocabulary padded beyond it) are no candidates, and the best candidate always
survives top-k and top-p. `SamplingError` is left only for a step that offers no usable candidate at all.
"""

from __future__ import annotations

import secrets
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np

from wafer_gpt2.core.steps import StepScores, TokenScores
from wafer_gpt2.errors import WaferGPT2Error

# What the sampler's arithmetic is guaranteed to carry: beyond these bounds a temperature or penalty is
# indistinguishable from greedy or uniform, and 1e-320 (a denormal) overflows a division.
MIN_FACTOR, MAX_FACTOR = 1e-4, 1e4


class InvalidSamplingParam(ValueError):
    """A sampling parameter out of range; `field` names it."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field} must be {message}")
        self.field = field


class SamplingError(WaferGPT2Error, RuntimeError):
    """No candidate of a step can be chosen (every score NaN or outside the tokenizer)."""


@dataclass(frozen=True)
class SamplingParams:
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float = 1.0
    seed: int | None = None
    # vLLM's extras: subtracted from the logits of tokens already generated (once / per occurrence),
    # and the floor, relative to the most likely candidate, below which candidates are dropped.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_p: float = 0.0

    def __post_init__(self) -> None:
        for field in ("temperature", "repetition_penalty"):
            value = getattr(self, field)
            if not MIN_FACTOR <= value <= MAX_FACTOR:  # NaN fails too
                raise InvalidSamplingParam(field, f"between {MIN_FACTOR:g} and {MAX_FACTOR:g}, got {value}")
        if self.top_k is not None and self.top_k < 1:
            raise InvalidSamplingParam("top_k", f"> 0, got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise InvalidSamplingParam("top_p", f"in (0, 1], got {self.top_p}")
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise InvalidSamplingParam("seed", f"an unsigned 64-bit integer, got {self.seed}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:  # NaN fails too
                raise InvalidSamplingParam(name, f"between -2 and 2, got {value}")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidSamplingParam("min_p", f"between 0 and 1, got {self.min_p}")

    @property
    def sampling(self) -> bool:
        """Sample (rather than take the argmax) when asked or when a warper implies it (TGI's rule)."""
        return (
            self.do_sample
            or self.temperature != 1.0
            or self.top_k is not None
            or (self.top_p is not None and self.top_p < 1.0)
        )


# The batched choosers a request's tokens go to (`Sampler.batched`): none (`choose`, one request at a
# time: a penalty reads its history), `greedy_batch`, `sample_batch`.
BATCH_NONE, BATCH_GREEDY, BATCH_SAMPLING = 0, 1, 2


class Sampler:
    """One request's token chooser. `seed` is the seed in use (None when greedy); ids at or above
    `vocab_size` (the tokenizer's, when the model's vocabulary is padded beyond it) are never chosen."""

    def __init__(self, params: SamplingParams, vocab_size: int | None = None) -> None:
        self.params = params
        self.vocab_size = vocab_size
        self.seed: int | None = None
        if params.sampling:
            self.seed = params.seed if params.seed is not None else secrets.randbits(64)
            self._rng = np.random.default_rng(self.seed)
        # With no penalty the choice reads no history, so a whole step's requests choose at once
        # (`greedy_batch`, `sample_batch`) when nothing is banned. Read per token; the parameters are
        # frozen, so it is worked out once.
        no_penalty = (
            params.repetition_penalty == 1.0
            and params.presence_penalty == 0.0
            and params.frequency_penalty == 0.0
        )
        self.batched = BATCH_NONE if not no_penalty else BATCH_SAMPLING if params.sampling else BATCH_GREEDY

    def distribution(
        self,
        scores: TokenScores,
        history: Sequence[int],
        output: Sequence[int] = (),
        banned: Collection[int] = (),
    ) -> tuple[np.ndarray, np.ndarray]:
        """(candidate ids, their probabilities) after penalties and warpers; greedy gives one candidate.
        Never empty, never NaN; SamplingError when the wafer offered no usable candidate.

        `history` is prompt + generated ids, `output` the generated ones; `banned` ids are never chosen
        (vLLM's min_tokens holds back end-of-text that way), unless they are all the candidates there are."""
        p = self.params
        ids = np.asarray(scores.topk_ids, dtype=np.int64)
        logits = np.asarray(scores.topk_logits, dtype=np.float64)
        usable = ~np.isnan(logits)
        if self.vocab_size is not None:
            usable &= ids < self.vocab_size
        ids, logits = ids[usable], penalize(logits[usable], ids[usable], history, p.repetition_penalty)
        logits = penalize_output(logits, ids, output, p.presence_penalty, p.frequency_penalty)
        if banned:
            allowed = ~np.isin(ids, np.asarray(list(banned), dtype=np.int64))
            if allowed.any():
                ids, logits = ids[allowed], logits[allowed]
        order = np.argsort(-logits, kind="stable")  # the penalty may reorder the candidates
        ids, logits = ids[order], logits[order]
        if not len(ids) or logits[0] == -np.inf:
            raise SamplingError(f"none of the {len(scores.topk_ids)} candidates of this step can be chosen")
        if logits[0] == np.inf:  # overflowed scores: the tied infinite ones share the mass
            ids, logits = ids[logits == np.inf], np.zeros(int(np.count_nonzero(logits == np.inf)))
        if not p.sampling:
            return ids[:1], np.ones(1)

        if p.top_k is not None:
            ids, logits = ids[: p.top_k], logits[: p.top_k]
        # Shifted so the best is 0 before dividing: (x - best) / T is <= 0 (or -inf) for any T > 0, so
        # exp never overflows and the best candidate's weight is exactly 1.
        probs = np.exp((logits - logits[0]) / p.temperature)
        probs /= probs.sum()
        if p.top_p is not None and p.top_p < 1.0:
            # Keep a candidate while the mass of the candidates above it is below top_p (HF's rule:
            # the smallest head of the distribution whose mass reaches top_p); the best always stays.
            mass_above = np.cumsum(probs) - probs
            keep = mass_above < p.top_p
            keep[0] = True
            ids, probs = ids[keep], probs[keep] / probs[keep].sum()
        if p.min_p > 0.0:
            keep = probs >= p.min_p * probs.max()  # relative to the best: exact over the top-k too
            ids, probs = ids[keep], probs[keep] / probs[keep].sum()
        return ids, probs

    def choose(
        self,
        scores: TokenScores,
        history: Sequence[int],
        output: Sequence[int] = (),
        banned: Collection[int] = (),
    ) -> tuple[int, float]:
        """(next token, its logprob under the model's raw distribution)."""
        ids, probs = self.distribution(scores, history, output, banned)
        if len(ids) == 1:
            token = int(ids[0])
        else:
            # One uniform draw per token: the stream of draws depends on the seed alone.
            index = int(np.searchsorted(np.cumsum(probs), self._rng.random() * probs.sum(), side="right"))
            token = int(ids[min(index, len(ids) - 1)])
        raw_logit = float(scores.topk_logits[int(np.flatnonzero(scores.topk_ids == token)[0])])
        return token, scores.logprob(raw_logit)


def penalize_output(
    logits: np.ndarray, ids: np.ndarray, output: Sequence[int], presence: float, frequency: float
) -> np.ndarray:
    """vLLM's presence and frequency penalties: logit - presence * [seen] - frequency * count."""
    if (presence == 0.0 and frequency == 0.0) or not len(output):
        return logits
    tokens, freq = np.unique(np.asarray(output, dtype=np.int64), return_counts=True)
    where = np.minimum(np.searchsorted(tokens, ids), len(tokens) - 1)
    counts = np.where(tokens[where] == ids, freq[where], 0)
    return logits - presence * (counts > 0) - frequency * counts


def penalize(logits: np.ndarray, ids: np.ndarray, history: Sequence[int], penalty: float) -> np.ndarray:
    """HF's repetition penalty on the candidates that already occur in `history`."""
    if penalty == 1.0 or not len(history):
        return logits
    seen = np.isin(ids, np.asarray(list(set(history)), dtype=np.int64))
    penalized = np.where(logits > 0, logits / penalty, logits * penalty)
    return np.where(seen, penalized, logits)


# A batched choice: (token ids, their logprobs float64, chosen: bool) by row; a row not chosen is
# left to `Sampler.choose` (its token and logprob there are meaningless).
Choices = tuple[np.ndarray, np.ndarray, np.ndarray]


def as_picks(choices: Choices) -> list[tuple[int, float] | None]:
    """A batched choice as (token, logprob) per row, None for a row left to `choose`."""
    tokens, logprobs, chosen = choices
    return [
        (token, logprob) if good else None
        for token, logprob, good in zip(tokens.tolist(), logprobs.tolist(), chosen.tolist(), strict=True)
    ]


def greedy_batch(
    scores: StepScores, rows: Sequence[int], vocab_size: int | None
) -> list[tuple[int, float] | None]:
    """`greedy_choices` as (token, logprob) per row, None for a row it leaves to `choose`."""
    return as_picks(greedy_choices(scores, rows, vocab_size))


def greedy_choices(scores: StepScores, rows: Sequence[int], vocab_size: int | None) -> Choices:
    """`Sampler.choose` for plain-greedy requests (no penalty, nothing banned), for the given rows
    (distinct, ascending) of a step's scores at once, in a few array operations: the token and its
    logprob per row, the same as `choose` gives, or not chosen for a row it leaves to `choose` (a NaN
    or unknown id at the top, or no finite candidate: the cases `distribution` filters or refuses)."""
    m = len(rows)
    ids, logits, lse = scores.topk_ids, scores.topk_logits, scores.logsumexp
    if m != len(lse) or (m and rows[-1] != m - 1):  # not every row (rows are distinct): those asked for
        picked = np.asarray(rows, dtype=np.intp)
        ids, logits, lse = ids[picked], logits[picked], lse[picked]
    if not m or not ids.shape[1]:
        return np.zeros(m, dtype=np.int64), np.zeros(m), np.zeros(m, dtype=bool)
    best = logits.argmax(axis=1)  # the first of equal maxima (the stable sort's pick); a NaN wins here
    # np.count_nonzero: a C call, several times cheaper than the reductions any() and all()
    if np.count_nonzero(best):  # some row's best is not its first candidate
        every = np.arange(m)
        tokens = ids[every, best]
        # `choose` reports the logit of the chosen id's first occurrence among the candidates.
        first = (ids == tokens[:, None]).argmax(axis=1)
        top, reported = logits[every, best], logits[every, first]
    else:  # the wafer's order, best first: the usual case, read by slicing
        tokens = ids[:, 0]
        top = reported = logits[:, 0]
    # A usable best is neither NaN nor -inf and a known id; its logprob is the logit minus the
    # log-sum-exp, in float64 (a float32 logit is widened exactly: what `choose` computes).
    chosen = top > -np.inf if vocab_size is None else (top > -np.inf) & (tokens < vocab_size)
    return tokens, np.subtract(reported, lse, dtype=np.float64), chosen


def sample_batch(
    scores: StepScores, rows: Sequence[int], samplers: Sequence[Sampler], vocab_size: int | None
) -> list[tuple[int, float] | None]:
    """`sample_choices` as (token, logprob) per row, None for a row it leaves to `choose`."""
    return as_picks(sample_choices(scores, rows, samplers, vocab_size))


def sample_choices(
    scores: StepScores, rows: Sequence[int], samplers: Sequence[Sampler], vocab_size: int | None
) -> Choices:
    """`Sampler.choose` for sampling requests with no penalty and nothing banned, for the given rows of
    a step's scores at once (`samplers[i]` the request of `rows[i]`): temperature, top-k, top-p and
    min-p as array operations over [rows, k], then one uniform draw from each request's own generator
    where more than one candidate survives (as `choose` draws), so a seed gives the same tokens as one
    row at a time. Not chosen for a row it leaves to `choose` (a candidate `distribution` would filter: a NaN
    or an unknown id; a best that is not finite), whose generator it has not drawn from. Every candidate
    set the warpers keep is a head of the sorted row, so the draws compare against the same running
    sums as `choose`'s."""
    m = len(rows)
    picked = np.asarray(rows, dtype=np.intp)
    raw_ids, raw_logits = scores.topk_ids[picked], scores.topk_logits[picked]
    k = raw_ids.shape[1]
    if not m or not k:
        return np.zeros(m, dtype=np.int64), np.zeros(m), np.zeros(m, dtype=bool)
    ids, logits = raw_ids.astype(np.int64), raw_logits.astype(np.float64)
    usable = ~np.isnan(logits)
    if vocab_size is not None:
        usable &= ids < vocab_size
    order = np.argsort(-logits, axis=1, kind="stable")
    logits, ids = np.take_along_axis(logits, order, 1), np.take_along_axis(ids, order, 1)
    best = logits[:, :1]
    ok = usable.all(axis=1) & np.isfinite(best[:, 0])
    params = [sampler.params for sampler in samplers]
    temperature = np.array([p.temperature for p in params])[:, None]
    top_k = np.array([k if p.top_k is None else p.top_k for p in params])[:, None]
    top_p = np.array([1.0 if p.top_p is None else p.top_p for p in params])
    min_p = np.array([p.min_p for p in params])
    alive = np.arange(k) < top_k
    with np.errstate(invalid="ignore", over="ignore"):  # rows left to `choose` may hold NaN or inf
        probs = np.where(alive, np.exp((logits - best) / temperature), 0.0)
        probs /= probs.sum(axis=1, keepdims=True)
        for warper, active in (("top_p", top_p < 1.0), ("min_p", min_p > 0.0)):
            if not active.any():
                continue
            if warper == "top_p":  # the mass of the candidates above each is below top_p
                keep = np.cumsum(probs, axis=1) - probs < top_p[:, None]
            else:  # at least min_p of the best
                keep = probs >= (min_p * probs.max(axis=1))[:, None]
            keep[:, 0] = True  # the best always stays
            keep |= ~active[:, None]
            alive &= keep
            probs = np.where(alive, probs, 0.0)
            probs = np.where(active[:, None], probs / probs.sum(axis=1, keepdims=True), probs)
    survivors = np.count_nonzero(alive, axis=1)
    draws = np.zeros(m)
    for row in np.flatnonzero(ok & (survivors > 1)).tolist():
        draws[row] = samplers[row]._rng.random()
    # np.searchsorted(cumsum, u * sum, side="right"): how many running sums are at or below the draw
    index = np.count_nonzero(np.cumsum(probs, axis=1) <= (draws * probs.sum(axis=1))[:, None], axis=1)
    index = np.minimum(index, survivors - 1)
    tokens = ids[np.arange(m), index]
    # The logprob is the model's: the logit of the chosen id's first occurrence among the candidates.
    first = (raw_ids == tokens[:, None]).argmax(axis=1)
    logprobs = raw_logits[np.arange(m), first].astype(np.float64) - scores.logsumexp[picked]
    return tokens, logprobs, ok
