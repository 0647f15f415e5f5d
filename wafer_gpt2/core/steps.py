"""The contract between the serving engine and whatever runs the model.

One `step` is one trip of a batch of token items through the model (on the wafer: through the
layer pipeline). Items of one slot in one step are consecutive positions of that slot, in order
(prefill is token streaming); items of different slots are independent. After a step, every item's
K/V is in its slot's cache at its position, so a later item of that slot attends to it.

Implemented by `wafer_gpt2.host.program.WaferGPT2` (simulator and SDK backends) and `wafer_gpt2.backends.reference`
(the NumPy reference forward pass, for tests that isolate the service).
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
    """What the head region sends back for one item: never the full vocabulary."""

    topk_ids: np.ndarray  # int32 [k], best first
    topk_logits: np.ndarray  # float32 [k]
    logsumexp: float  # over the whole vocabulary: logprob(i) = logit(i) - logsumexp
    target_logit: float | None = None

    def logprob(self, logit: float) -> float:
        return float(logit) - self.logsumexp


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
    def step(self, items: Sequence[StepItem]) -> list[TokenScores | None]:
        """Run one step; the result has one entry per item (None where want_scores is False)."""
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

    def collect(self) -> list[TokenScores | None]: ...


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
