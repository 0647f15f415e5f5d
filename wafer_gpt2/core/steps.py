"""The contract between the serving engine and whatever runs the model.

One `step` is one trip of a batch of token items through the model (on the wafer: through the
layer pipeline). Items of one slot in one step are consecutive positions of that slot, in order
(prefill is token streaming); items of different slots are independent. After a step, every item's
K/V is in its slot's cache at its position, so a later item of that slot attends to it. A step's
answer is one `StepScores`: the top-k ids and logits, log-sum-exp and asked target logits of every
scored item as arrays.

Implemented by `wafer_gpt2.host.program.WaferGPT2` (simulator, CSL executor and SDK backends),
`wafer_gpt2.backends.reference` (the NumPy reference forward pass, for tests that isolate the service)
and the stand-ins of `wafer_gpt2.backends.stand_ins` (null and modeled, for measuring the host).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple, Protocol

import numpy as np

from wafer_gpt2.errors import WaferGPT2Error


# Built per item per step: a named tuple builds in a fraction of a frozen dataclass's time.
class StepItem(NamedTuple):
    slot: int
    position: int
    token: int
    want_scores: bool = True  # False for prompt tokens whose next-token scores nobody needs
    target: int | None = None  # also return the logit of this token id (prompt logprobs, scoring)


# A StepItem from all five fields as one tuple, by `tuple.__new__` alone: the named tuple's own `__new__`
# is a Python function (the scheduler builds a decode item per running request per step).
step_item_of = partial(tuple.__new__, StepItem)


@dataclass(frozen=True)
class TokenScores:
    """One item's scores, a row of a `StepScores` (`StepScores.row`): what the sampler and the logprob
    reports read of a single item. Never the full vocabulary."""

    topk_ids: np.ndarray  # int32 [k], best first
    topk_logits: np.ndarray  # float32 [k]
    logsumexp: float  # over the whole vocabulary: logprob(i) = logit(i) - logsumexp
    target_logit: float | None = None

    def logprob(self, logit: float) -> float:
        return float(logit) - self.logsumexp


@dataclass(frozen=True, eq=False)
class StepScores:
    """What the head region sends back for one step, as arrays: one row per item that asked for scores
    (`want_scores`), in item order. A step's answer is one object, not an object per item, so that the
    engine chooses every row's token in a few array operations and a backend fills it without a loop
    per item (the host program decodes the wire straight into it).

    `index[j]` is the step's item that row j answers (ascending); `count` the step's items, scored or
    not. The log-sum-exp and target logits are float64 (a wafer sends float32, which they hold exactly;
    the reference computes the log-sum-exp in float64); `has_target[j]` says whether the item asked for a
    target logit (`target_logit[j]` is NaN where it did not)."""

    count: int
    index: np.ndarray  # int64 [n], ascending
    topk_ids: np.ndarray  # int32 [n, k], best first
    topk_logits: np.ndarray  # float32 [n, k]
    logsumexp: np.ndarray  # float64 [n], over the whole vocabulary
    target_logit: np.ndarray  # float64 [n], NaN where no target was asked for
    has_target: np.ndarray  # bool [n]

    def __post_init__(self) -> None:
        n = self.index.shape[0]
        if (
            self.topk_ids.ndim != 2
            or self.topk_ids.shape != self.topk_logits.shape
            or self.topk_ids.shape[0] != n
            or self.logsumexp.shape != (n,)
            or self.target_logit.shape != (n,)
            or self.has_target.shape != (n,)
            or n > self.count
        ):
            raise BackendError(
                f"malformed step scores: {n} rows for {self.count} items, ids {self.topk_ids.shape}, "
                f"logits {self.topk_logits.shape}, lse {self.logsumexp.shape}, "
                f"targets {self.target_logit.shape} / {self.has_target.shape}"
            )

    @classmethod
    def empty(cls, count: int, k: int = 0) -> StepScores:
        """The answer to a step of `count` items none of which asked for scores."""
        return cls(
            count,
            np.zeros(0, dtype=np.int64),
            np.zeros((0, k), dtype=np.int32),
            np.zeros((0, k), dtype=np.float32),
            np.zeros(0, dtype=np.float64),
            np.zeros(0, dtype=np.float64),
            np.zeros(0, dtype=bool),
        )

    @classmethod
    def of_rows(cls, rows: Sequence[TokenScores | None]) -> StepScores:
        """A step's scores from one row per item (None where the item asked for none)."""
        index = [i for i, row in enumerate(rows) if row is not None]
        scored = [row for row in rows if row is not None]
        if not scored:
            return cls.empty(len(rows))
        targets = [row.target_logit for row in scored]
        return cls(
            len(rows),
            np.array(index, dtype=np.int64),
            np.stack([np.asarray(row.topk_ids, dtype=np.int32) for row in scored]),
            np.stack([np.asarray(row.topk_logits, dtype=np.float32) for row in scored]),
            np.array([row.logsumexp for row in scored], dtype=np.float64),
            np.array([np.nan if t is None else t for t in targets], dtype=np.float64),
            np.array([t is not None for t in targets], dtype=bool),
        )

    @classmethod
    def concat(cls, parts: Sequence[StepScores], count: int) -> StepScores:
        """One step's scores from those of its parts (a replica's message each), their `index` already
        the step's: rows in item order."""
        if len(parts) == 1:
            only = parts[0]
            return only if only.count == count else cls(count, *only.arrays())
        if not parts:
            return cls.empty(count)
        columns = [np.concatenate(column) for column in zip(*(part.arrays() for part in parts), strict=True)]
        order = np.argsort(columns[0], kind="stable")
        if not (order[1:] > order[:-1]).all():
            columns = [column[order] for column in columns]
        return cls(count, *columns)

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        return (
            self.index,
            self.topk_ids,
            self.topk_logits,
            self.logsumexp,
            self.target_logit,
            self.has_target,
        )

    def row(self, j: int) -> TokenScores:
        """Row j (the scores of item `index[j]`) as a per-item view."""
        return TokenScores(
            topk_ids=self.topk_ids[j],
            topk_logits=self.topk_logits[j],
            logsumexp=float(self.logsumexp[j]),
            target_logit=float(self.target_logit[j]) if self.has_target[j] else None,
        )

    def row_of_item(self) -> list[int]:
        """For each of the step's items, its row (-1 where it has none)."""
        n = self.index.shape[0]
        if n == self.count:
            return list(range(n))  # every item scored: the index is 0..n-1 (ascending, in range)
        rows = np.full(self.count, -1, dtype=np.int64)
        rows[self.index] = np.arange(n)
        return rows.tolist()

    def rows(self) -> list[TokenScores | None]:
        """One per-item view per item of the step (None where the item asked for no scores): for
        callers that compare or print a step's answers item by item."""
        return [None if j < 0 else self.row(j) for j in self.row_of_item()]


class BackendError(WaferGPT2Error, RuntimeError):
    """The backend could not run a step (a bad item, or a failure of the backend)."""


class BackendShape(Protocol):
    """A backend's shape and description: what the request limits and /info read (read-only)."""

    @property
    def num_slots(self) -> int: ...

    @property
    def context_length(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def top_k(self) -> int: ...

    def describe(self) -> dict:
        """What runs the model, for /info and logs (so that callers never check backend names):
        `backend`, `device_type`, `dtype`, `num_slots`, `context_length`, `vocab_size`, `top_k`, and
        `plan`, the wafer plan in brief ({} where there is none)."""
        ...


class Backend(BackendShape, Protocol):
    def step(self, items: Sequence[StepItem]) -> StepScores:
        """Run one step; the result has a row per item whose want_scores is True."""
        ...

    def free_slot(self, slot: int) -> None:
        """Forget a slot's cache (its positions may be overwritten by the next user)."""
        ...

    def reset(self) -> None:
        """Forget every slot."""
        ...

    def close(self) -> None: ...


class PipelinedBackend(Backend, Protocol):
    """A backend that takes a step while earlier ones are still in flight, as the wafer's layer
    pipeline takes items: the host prepares the next step while the wafer computes one.
    `submit` starts a step and returns at once; `collect` returns the results of the oldest step not yet
    collected, waiting for them. At most `steps_in_flight` steps are submitted and not collected; a slot
    has items in one of them at most (the engine's rule), so steps never depend on each other, and a
    slot freed meanwhile has none in flight. `step(items)` is `submit(items)` then `collect()`."""

    steps_in_flight: int

    def submit(self, items: Sequence[StepItem]) -> None: ...

    def collect(self) -> StepScores: ...


def steps_in_flight(backend: Backend) -> int:
    """How many steps the backend takes at a time (1: `step` only)."""
    return max(1, int(getattr(backend, "steps_in_flight", 1)))


def validate_items(items: Sequence[StepItem], num_slots: int, context_length: int, vocab_size: int) -> None:
    """The checks every backend makes before touching its cache: bad items never reach the wafer."""
    last_position: dict[int, int] = {}
    for index, item in enumerate(items):
        if not 0 <= item.slot < num_slots:
            raise BackendError(f"item {index}: slot {item.slot} outside 0..{num_slots - 1}")
        if not 0 <= item.position < context_length:
            raise BackendError(f"item {index}: position {item.position} outside 0..{context_length - 1}")
        if not 0 <= item.token < vocab_size:
            raise BackendError(f"item {index}: token {item.token} outside 0..{vocab_size - 1}")
        if item.target is not None and not 0 <= item.target < vocab_size:
            raise BackendError(f"item {index}: target {item.target} outside 0..{vocab_size - 1}")
        previous = last_position.get(item.slot)
        if previous is not None and item.position != previous + 1:
            raise BackendError(
                f"item {index}: slot {item.slot} positions in one step must be consecutive "
                f"({previous} then {item.position})"
            )
        last_position[item.slot] = item.position
