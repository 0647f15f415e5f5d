"""Choosing the next token from what the wafer returns: its top-k (ids, logits) and the log-sum-exp.

The semantics follow Hugging Face's `generate` and TGI: the repetition penalty first (positive logits
of tokens already seen are divided by it, negative ones multiplied), then vLLM's presence and
frequency penalties (over the generated tokens only), then temperature, top-k, top-p and min-p. Sampling is on when asked for (`do_sample`) or implied by a warper (temperature != 1, top_k,
top_p < 1), as in TGI; otherwise the choice is greedy.

The candidates are the wafer's top-k only (the full vocabulary never leaves the wafer), so top-p and
sampling renormalise over those k. The reported logprob is the model's own, unaffected by the
penalty or the warpers: logit - logsumexp over the whole vocabulary.

Each request owns a `Sampler` with its own seeded generator, so a seed gives the same tokens whatever
else shares the batch.

The sampler is total: the parameters are bounded to what the arithmetic carries (temperature and
repetition penalty in [1e-4, 1e4], finite), the warpers work on logits shifted so that the best is 0
(a tiny temperature gives the argmax, never NaN), scores the wafer could not compute (NaN) and ids the
tokenizer does not know (a vocabulary padded beyond it) are no candidates, and the best candidate always
survives top-k and top-p. `SamplingError` is left only for a step that offers no usable candidate at all.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np

from wafer_gpt2.core.steps import TokenScores
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
        # Greedy with no penalty: the choice is the best usable candidate, which `greedy_batch` finds for
        # a whole step at once. Read per token; the parameters are frozen, so it is worked out once.
        self.plain_greedy = (
            not params.sampling
            and params.repetition_penalty == 1.0
            and params.presence_penalty == 0.0
            and params.frequency_penalty == 0.0
        )

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


def greedy_batch(rows: Sequence[TokenScores], vocab_size: int | None) -> list[tuple[int, float] | None]:
    """`Sampler.choose` for plain-greedy requests (no penalty, nothing banned), a whole step's rows at
    once: (token, its logprob) per row, the same as `choose` gives, or None for a row it leaves to
    `choose` (a NaN or unknown id at the top, or no finite candidate: the cases `distribution` filters
    or refuses). One `argmax` per row: stacking the rows into one array has a fixed cost larger than
    the per-row path's at any batch the engine runs."""
    chosen: list[tuple[int, float] | None] = []
    for row in rows:
        logits, ids = row.topk_logits, row.topk_ids
        if not len(logits) or len(ids) != len(logits):
            chosen.append(None)
            continue
        best = int(logits.argmax())  # the first of equal maxima (the stable sort's pick); a NaN wins here
        top, token = float(logits.item(best)), int(ids.item(best))
        if math.isnan(top) or top == -math.inf or (vocab_size is not None and token >= vocab_size):
            chosen.append(None)
            continue
        if best and token in ids[:best]:
            # `choose` reports the logit of the chosen id's first occurrence among the candidates.
            top = float(logits[int((ids[:best] == token).argmax())])
        chosen.append((token, row.logprob(top)))
    return chosen
