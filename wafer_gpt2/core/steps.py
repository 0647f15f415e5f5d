"""The contract between the serving engine and whatever runs the model.

One `step` is one trip of a batch of token items through the model (on the wafer: through the
layer pipeline). Items of one slot in one step are consecutive positions of that slot, in order
(prefill is token streaming); items of different slots are independent. After a step, every item's
K/V is in its slot's cache at its position, so a later item of that slot attends to it. A step goes in
as one `StepInputs` (its items' slots, positions, tokens and flags as arrays) and comes back as one
`StepScores`: the top-k ids and logits, log-sum-exp and asked target logits of every scored item as
arrays. Neither is an object per item: the engine builds, checks and encodes a step in a few
operations over whole rows, whatever its size.

Implemented by `wafer_gpt2.host.program.WaferGPT2` (simulator, CSL executor and SDK backends),
`wafer_gpt2.backends.reference` (the NumPy reference forward pass, for tests that isolate the service)
and the stand-ins of `wafer_gpt2.backends.stand_ins` (null and modeled, for measuring the host).
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, NamedTuple, Protocol, TypeVar, overload

import numpy as np

from wafer_gpt2.errors import WaferGPT2Error

# An item's flags (the wire's, `wafer_gpt2.core.wire`): the head reports it; it also asks for the logit of
# its target token id.
WANT_SCORES = 1
HAS_TARGET = 2
NO_TARGET = -1  # `StepInputs.target` of an item that asks for no target logit

# The rows of `StepInputs.columns` (the wire's item words, in order) and their names in errors.
SLOT, POSITION, TOKEN, FLAGS, TARGET = range(5)
FIELDS = 5
_FIELD_NAMES = ("slot", "position", "token", "flags", "target")


_T = TypeVar("_T")


class _made_once(Generic[_T]):
    """A value made from its instance when first read, then an attribute of the instance: what
    `functools.cached_property` does, without the lock Python 3.11's takes on every first read (a
    step's inputs are read this way a few times each step)."""

    def __init__(self, make: Callable[[Any], _T]) -> None:
        self._make = make
        self._name = make.__name__
        self.__doc__ = make.__doc__

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    @overload
    def __get__(self, instance: None, owner: type | None = None) -> _made_once[_T]: ...

    @overload
    def __get__(self, instance: object, owner: type | None = None) -> _T: ...

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        if instance is None:
            return self
        value = instance.__dict__[self._name] = self._make(instance)
        return value


class StepItem(NamedTuple):
    """One item of a step, for code that writes a step by hand (tests, tools, the SDK's checks):
    `StepInputs.of_items` makes the step's arrays of a list of them."""

    slot: int
    position: int
    token: int
    want_scores: bool = True  # False for prompt tokens whose next-token scores nobody needs
    target: int | None = None  # also return the logit of this token id (prompt logprobs, scoring)


class StepInputs:
    """A step's items, in step order: what a backend's `step` takes. One int64 array `columns` [5, n]
    holds them, a row per field in the order of the wire's item words (`wafer_gpt2.core.wire`): SLOT,
    POSITION, TOKEN, FLAGS (WANT_SCORES, HAS_TARGET) and TARGET (the token id whose logit the item
    also asks for; 0 where it asks for none). So a step is built, checked, cut and written as the input
    message in a handful of operations however many items it has (at a few items, a numpy call costs
    what about 50 Python operations do, so the views `slot`, `position`, `token`, `want_scores`,
    `has_target` and `target` are made when first read)."""

    def __init__(self, columns: np.ndarray) -> None:
        if columns.ndim != 2 or columns.shape[0] != FIELDS or columns.dtype != np.int64:
            raise BackendError(
                f"malformed step inputs: columns {columns.dtype} {columns.shape}, expected int64 [{FIELDS}, n]"
            )
        self.columns = columns

    @_made_once
    def fields(self) -> list[list[int]]:
        """The rows as lists (one numpy call): what the checks and the per-item loops read."""
        return self.columns.tolist()

    @_made_once
    def decode_only(self) -> bool:
        """Every item wants scores and none asks for a target (a decode step): the common case, for
        which a backend may skip the masks. Of the flags' row alone: a decode step's checks read no
        other row as a list."""
        flags = self.columns[FLAGS].tolist()
        return flags.count(WANT_SCORES) == len(flags)

    @_made_once
    def slot_set(self) -> frozenset[int]:
        """The slots the items write (as many as the items in a decode step): what the checks and a
        backend's slots-in-flight read, made of the slots' row alone."""
        return frozenset(self.columns[SLOT].tolist())

    @_made_once
    def slot(self) -> np.ndarray:
        return self.columns[SLOT]

    @_made_once
    def position(self) -> np.ndarray:
        return self.columns[POSITION]

    @_made_once
    def token(self) -> np.ndarray:
        return self.columns[TOKEN]

    @_made_once
    def want_scores(self) -> np.ndarray:
        return (self.columns[FLAGS] & WANT_SCORES) != 0

    @_made_once
    def has_target(self) -> np.ndarray:
        return (self.columns[FLAGS] & HAS_TARGET) != 0

    @_made_once
    def target(self) -> np.ndarray:
        """Each item's target token id, NO_TARGET where it asks for none."""
        return np.where(self.has_target, self.columns[TARGET], NO_TARGET)

    def __len__(self) -> int:
        return self.columns.shape[1]

    @classmethod
    def of_fields(
        cls,
        slot: Sequence[int],
        position: Sequence[int],
        token: Sequence[int],
        flags: Sequence[int],
        target: Sequence[int],
    ) -> StepInputs:
        """A step from its rows as equal-length sequences of ints (FLAGS and TARGET as the wire has them).
        Packed by `struct` straight into the columns' memory: numpy's own conversion of lists looks at
        each element's type first and costs over twice as much per item, which a prefill step's
        hundreds of items (and every step built from its requests) pay."""
        n = len(slot)
        if not len(position) == len(token) == len(flags) == len(target) == n:
            raise ValueError(
                f"step rows of different lengths: {[len(row) for row in (slot, position, token, flags, target)]}"
            )
        columns = np.empty((FIELDS, n), dtype=np.int64)
        struct.pack_into(f"={FIELDS * n}q", columns.data, 0, *slot, *position, *token, *flags, *target)
        return cls(columns)

    @classmethod
    def of_items(cls, items: Sequence[StepItem]) -> StepInputs:
        """A step from one `StepItem` per item."""
        if not items:
            return cls.of_fields((), (), (), (), ())
        slot, position, token, want, target = zip(*items, strict=True)
        flags = [
            (WANT_SCORES if w else 0) | (HAS_TARGET if t is not None else 0)
            for w, t in zip(want, target, strict=True)
        ]
        return cls.of_fields(slot, position, token, flags, [0 if t is None else t for t in target])

    def items(self) -> list[StepItem]:
        """One `StepItem` per item: for the backends that run a step item by item."""
        return [
            StepItem(slot, position, token, bool(flags & WANT_SCORES), target if flags & HAS_TARGET else None)
            for slot, position, token, flags, target in zip(*self.fields, strict=True)
        ]

    def take(self, index: np.ndarray) -> StepInputs:
        """The items `index` (in that order): a replica's message, a part of one."""
        return StepInputs(self.columns[:, index])

    def validate(self, num_slots: int, context_length: int, vocab_size: int) -> None:
        """The checks every backend makes before touching its cache: bad items never reach the wafer.
        Raises BackendError naming the first bad item. The ranges are one numpy compare of the columns
        read as unsigned (a negative value reads as one above every limit), where ten `min`/`max`
        calls over the rows cost several times more; the item is looked for only when one is bad."""
        n = len(self)
        if not n:
            return
        limits = (num_slots, context_length, vocab_size, (WANT_SCORES | HAS_TARGET) + 1, vocab_size)
        if np.count_nonzero(np.greater_equal(self.columns.view(np.uint64), _limit_columns(limits, n))):
            for name, values, limit in zip(_FIELD_NAMES, self.fields, limits, strict=True):
                if min(values) < 0 or max(values) >= limit:
                    index = next(i for i, value in enumerate(values) if not 0 <= value < limit)
                    raise BackendError(f"item {index}: {name} {values[index]} outside 0..{limit - 1}")
        if len(self.slot_set) == n:
            return  # one item per slot (a decode step): no order to check
        # A slot's items are consecutive positions, in order: with the items ordered by slot (stably,
        # so each slot's keep their order), each must be one position past the one before it of its slot.
        order = np.argsort(self.columns[SLOT], kind="stable")
        slots, positions = self.columns[SLOT][order], self.columns[POSITION][order]
        bad = (slots[1:] == slots[:-1]) & (positions[1:] != positions[:-1] + 1)
        if np.count_nonzero(bad):
            after = np.flatnonzero(bad) + 1  # in slot order; the first bad item in step order is reported
            first = after[np.argmin(order[after])]
            slot, previous, position = int(slots[first]), int(positions[first - 1]), int(positions[first])
            raise BackendError(
                f"item {int(order[first])}: slot {slot} positions in one step must be consecutive "
                f"({previous} then {position})"
            )


# Per (slots, context, vocabulary, flags, vocabulary) limits: each field's limit repeated along a row
# (uint64), as long as the longest step checked against them: `_limit_columns` slices it.
_limit_rows: dict[tuple[int, ...], np.ndarray] = {}


def _limit_columns(limits: tuple[int, ...], n: int) -> np.ndarray:
    """Each field's limit, a row of `n` per field (the shape of a step's columns), sliced from one array
    per limits (a broadcast compare against a column of limits costs twice the compare)."""
    rows = _limit_rows.get(limits)
    if rows is None or rows.shape[1] < n:
        rows = np.repeat(np.array(limits, dtype=np.uint64)[:, None], max(n, 64), axis=1)
        rows.flags.writeable = False
        _limit_rows[limits] = rows
    return rows[:, :n]


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


class StepScores:
    """What the head region sends back for one step, as arrays: one row per item that asked for scores
    (`want_scores`), in item order. A step's answer is one object, not an object per item, so that the
    engine chooses every row's token in a few array operations and a backend fills it without a loop
    per item (the host program decodes the wire straight into it).

    `index[j]` is the step's item that row j answers (ascending); `count` the step's items, scored or
    not. The log-sum-exp and target logits are float64 (a wafer sends float32, which they hold exactly;
    the reference computes the log-sum-exp in float64); `has_target[j]` says whether the item asked for a
    target logit (`target_logit[j]` is NaN where it did not). Treated as immutable; a plain class with
    slots, because a frozen dataclass's construction costs as much as the numpy calls that fill it and
    every step builds one or more."""

    __slots__ = ("count", "has_target", "index", "logsumexp", "target_logit", "topk_ids", "topk_logits")

    def __init__(
        self,
        count: int,
        index: np.ndarray,  # int64 [n], ascending
        topk_ids: np.ndarray,  # int32 [n, k], best first
        topk_logits: np.ndarray,  # float32 [n, k]
        logsumexp: np.ndarray,  # float64 [n], over the whole vocabulary
        target_logit: np.ndarray,  # float64 [n], NaN where no target was asked for
        has_target: np.ndarray,  # bool [n]
    ) -> None:
        n = index.shape[0]
        if (
            topk_ids.ndim != 2
            or topk_ids.shape != topk_logits.shape
            or topk_ids.shape[0] != n
            or logsumexp.shape != (n,)
            or target_logit.shape != (n,)
            or has_target.shape != (n,)
            or n > count
        ):
            raise BackendError(
                f"malformed step scores: {n} rows for {count} items, ids {topk_ids.shape}, "
                f"logits {topk_logits.shape}, lse {logsumexp.shape}, "
                f"targets {target_logit.shape} / {has_target.shape}"
            )
        self.count = count
        self.index = index
        self.topk_ids = topk_ids
        self.topk_logits = topk_logits
        self.logsumexp = logsumexp
        self.target_logit = target_logit
        self.has_target = has_target

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
    def step(self, inputs: StepInputs) -> StepScores:
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
    slot freed meanwhile has none in flight. `step(inputs)` is `submit(inputs)` then `collect()`."""

    steps_in_flight: int

    def submit(self, inputs: StepInputs) -> None: ...

    def collect(self) -> StepScores: ...


def steps_in_flight(backend: Backend) -> int:
    """How many steps the backend takes at a time (1: `step` only)."""
    return max(1, int(getattr(backend, "steps_in_flight", 1)))
