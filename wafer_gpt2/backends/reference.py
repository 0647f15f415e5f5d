"""An `Backend` that runs the NumPy reference forward pass: the service without any wafer.

It answers exactly what the wafer's head region answers (top-k ids and logits, the log-sum-exp over
the whole vocabulary, optionally one target logit), so the service, the simulator and the CSL can all
be checked against it. One step batches every item's GEMMs together; attention runs per slot.
"""

from __future__ import annotations

import numpy as np

from wafer_gpt2.core.steps import BackendError, StepInputs, StepScores, TokenScores
from wafer_gpt2.errors import InvalidInput
from wafer_gpt2.model.forward import KVCache, Segment, forward_hidden, lm_head, logsumexp
from wafer_gpt2.model.params import GPT2Params


def top_k_scores(logits: np.ndarray, k: int, target: int | None = None) -> TokenScores:
    """What the head reports for one row of logits [V]: the k best (best first), lse, target logit."""
    best = np.argpartition(-logits, k - 1)[:k] if k < logits.shape[0] else np.arange(logits.shape[0])
    best = best[np.argsort(-logits[best], kind="stable")]
    return TokenScores(
        topk_ids=best.astype(np.int32),
        topk_logits=logits[best].astype(np.float32),
        logsumexp=float(logsumexp(logits)),
        target_logit=None if target is None else float(logits[target]),
    )


class ReferenceBackend:
    def __init__(
        self, params: GPT2Params, slots: int = 16, context: int | None = None, top_k: int = 64
    ) -> None:
        cfg = params.config
        context = cfg.n_positions if context is None else context
        if slots < 1:
            raise InvalidInput(f"slots must be at least 1, got {slots}")
        if not 0 < context <= cfg.n_positions:
            raise InvalidInput(f"context {context} outside 1..{cfg.n_positions} (the model's n_positions)")
        if not 0 < top_k <= cfg.vocab_size:
            raise InvalidInput(f"top_k {top_k} outside 1..{cfg.vocab_size} (the vocabulary size)")
        self.params = params
        self.num_slots = slots
        self.context_length = context
        self.vocab_size = cfg.vocab_size
        self.top_k = top_k
        self._caches = [KVCache(cfg, context) for _ in range(slots)]

    def step(self, inputs: StepInputs) -> StepScores:
        if not self._caches:
            raise BackendError("the backend is closed")
        inputs.validate(self.num_slots, self.context_length, self.vocab_size)
        items = inputs.items()
        if not items:
            return StepScores.empty(0, self.top_k)

        # Group the items by slot (their order within a slot is already position order).
        by_slot: dict[int, list[int]] = {}
        for index, item in enumerate(items):
            by_slot.setdefault(item.slot, []).append(index)
        for slot, indices in by_slot.items():
            first = items[indices[0]].position
            if first > self._caches[slot].length:
                raise BackendError(
                    f"item {indices[0]}: slot {slot} position {first} leaves a gap "
                    f"(the slot holds {self._caches[slot].length} positions)"
                )

        order = [index for indices in by_slot.values() for index in indices]
        segments = [
            Segment(self._caches[slot], items[indices[0]].position, len(indices))
            for slot, indices in by_slot.items()
        ]
        tokens = np.array([items[index].token for index in order], dtype=np.int64)
        hidden = forward_hidden(self.params, tokens, segments)

        # The LM head only for the rows whose scores somebody asked for.
        results: list[TokenScores | None] = [None] * len(items)
        wanted = [row for row, index in enumerate(order) if items[index].want_scores]
        if wanted:
            logits = lm_head(self.params, hidden[wanted])
            for logits_row, row in zip(logits, wanted, strict=True):
                item = items[order[row]]
                results[order[row]] = top_k_scores(logits_row, self.top_k, item.target)
        return StepScores.of_rows(results)

    def free_slot(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise BackendError(f"slot {slot} outside 0..{self.num_slots - 1}")
        self._caches[slot].reset()

    def reset(self) -> None:
        for cache in self._caches:
            cache.reset()

    def describe(self) -> dict:
        return {
            "backend": "reference",
            "device_type": "reference",
            "dtype": "fp32",  # the NumPy oracle computes in fp32 whatever the plan's dtype would be
            "num_slots": self.num_slots,
            "context_length": self.context_length,
            "vocab_size": self.vocab_size,
            "top_k": self.top_k,
            "plan": {},  # nothing is planned: no wafer
        }

    def close(self) -> None:
        self._caches = []
