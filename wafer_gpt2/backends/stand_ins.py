"""Backends that stand in for the wafer when the host stack itself is measured (`wafer-gpt2 bench host`).

- `NullBackend` (backend `null`): answers every item at once with fixed top-k scores and runs no model,
  so whatever a benchmark measures over it is the host's cost alone.
- `ModeledWaferBackend` (backend `modeled`): the same answers, but each step takes the time the cost
  model gives the plan for that step, so the host is measured against a wafer as fast as the model says
  one is. Around the wafer's time it does the host program's side of the wire as
  `wafer_gpt2.host.program.WaferGPT2.step` does: each replica's input message is encoded before the step starts, and
  the scored items' output records are decoded after it ends (`wafer_gpt2.core.wire`; the records themselves, the
  wafer's side, come from a table built once, their lse and target logit in float32 as a wafer sends
  them). It is labelled modeled everywhere (`describe()`, the benchmark's output): no wafer ran.

Both validate items as every backend does (`StepInputs.validate`), so a host bug that feeds the wafer a bad
item fails here as it would there. The scores are deterministic in (token, position):
the text they produce varies (the detokenizer does real work) and runs repeat exactly.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Sequence

import numpy as np

from wafer_gpt2.core.cost import CLOCK_HZ
from wafer_gpt2.core.steps import POSITION, TOKEN, BackendError, StepInputs, StepScores
from wafer_gpt2.core.wire import decode_scores, encode_scores, step_message
from wafer_gpt2.errors import InvalidInput
from wafer_gpt2.plan.structure import Plan

TABLE = 251  # distinct score rows (a prime: (token + position) cycles through all of them)
# Ids the fixed scores never put first: GPT-2's end-of-text, so a stream never ends early on it.
RESERVED_TOP1 = 50256


def _score_table(vocab_size: int, top_k: int, seed: int = 0) -> StepScores:
    """TABLE fixed rows of top-k scores: distinct ids best first, descending logits, a plausible lse,
    and a target logit below each row's worst (the logit every target gets)."""
    rng = np.random.default_rng(seed)
    ids, logits, lse = [], [], []
    limit = min(vocab_size, RESERVED_TOP1) if vocab_size > RESERVED_TOP1 else vocab_size
    for _ in range(TABLE):
        row_ids = rng.choice(limit, size=min(top_k, limit), replace=False).astype(np.int32)
        row_logits = np.sort(rng.normal(0.0, 2.0, len(row_ids)).astype(np.float32))[::-1].copy()
        ids.append(row_ids)
        logits.append(row_logits)
        lse.append(float(row_logits[0]) + 1.5)  # the rest of the vocabulary holds some mass
    table_logits = np.stack(logits)
    return StepScores(
        count=TABLE,
        index=np.arange(TABLE, dtype=np.int64),
        topk_ids=np.stack(ids),
        topk_logits=table_logits,
        logsumexp=np.array(lse, dtype=np.float64),
        target_logit=table_logits[:, -1].astype(np.float64) - 1.0,
        has_target=np.ones(TABLE, dtype=bool),
    )


class NullBackend:
    """Fixed scores, no model, no time: the host's own cost is all a benchmark over it measures."""

    backend = "null"

    def __init__(self, vocab_size: int, slots: int = 16, context: int = 1024, top_k: int = 64) -> None:
        if slots < 1:
            raise InvalidInput(f"slots must be at least 1, got {slots}")
        if context < 1:
            raise InvalidInput(f"context must be at least 1, got {context}")
        if not 0 < top_k <= vocab_size:
            raise InvalidInput(f"top_k {top_k} outside 1..{vocab_size} (the vocabulary size)")
        self.num_slots = slots
        self.context_length = context
        self.vocab_size = vocab_size
        self.top_k = top_k
        self._table = _score_table(vocab_size, top_k)
        # The target columns of a step that asks for no target (read-only: every answer shares them).
        self._no_targets = (np.zeros(slots, dtype=bool), np.full(slots, np.nan))
        for column in self._no_targets:
            column.flags.writeable = False
        self._closed = False
        self.steps = 0
        self.items = 0

    def answer(self, inputs: StepInputs) -> StepScores:
        """Validate and answer a step (no waiting): what every stand-in returns."""
        self._take(inputs)
        n, table = len(inputs), self._table
        if inputs.decode_only:  # the usual step: every item scored, no target asked, columns shared
            scored = np.arange(n)
            rows = _table_rows(inputs, None)
            if n <= len(self._no_targets[0]):
                asked, targets = (column[:n] for column in self._no_targets)
            else:
                asked, targets = np.zeros(n, dtype=bool), np.full(n, np.nan)
        else:
            scored = np.flatnonzero(inputs.want_scores)
            rows = _table_rows(inputs, scored)
            asked = inputs.has_target[scored]
            targets = np.where(asked, table.target_logit[rows], np.nan)
        return StepScores(
            count=n,
            index=scored,
            topk_ids=table.topk_ids[rows],
            topk_logits=table.topk_logits[rows],
            logsumexp=table.logsumexp[rows],
            target_logit=targets,
            has_target=asked,
        )

    def _take(self, inputs: StepInputs) -> None:
        """Refuse a step the real backends refuse; count it."""
        if self._closed:
            raise BackendError("the backend is closed")
        inputs.validate(self.num_slots, self.context_length, self.vocab_size)
        self.steps += 1
        self.items += len(inputs)

    def step(self, inputs: StepInputs) -> StepScores:
        return self.answer(inputs)

    def free_slot(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise BackendError(f"slot {slot} outside 0..{self.num_slots - 1}")

    def reset(self) -> None:
        pass

    def close(self) -> None:
        self._closed = True

    def describe(self) -> dict:
        return {
            "backend": self.backend,
            "device_type": self.backend,
            "dtype": "none",
            "num_slots": self.num_slots,
            "context_length": self.context_length,
            "vocab_size": self.vocab_size,
            "top_k": self.top_k,
            "plan": {},
        }


def _table_rows(inputs: StepInputs, index: np.ndarray | None) -> np.ndarray:
    """The score table's row of each item `index` (None: every item): deterministic in (token, position)."""
    rows = (inputs.columns[TOKEN] + inputs.columns[POSITION]) % TABLE
    return rows if index is None else rows[index]


def _records_of(table: StepScores) -> np.ndarray:
    """The output records (`wafer_gpt2.core.wire.encode_scores`) of the score table's rows, one row each, with a
    target logit below each row's worst (as `NullBackend.answer` gives it), in float32 as a wafer sends it."""
    logits = table.topk_logits
    return encode_scores(
        np.zeros(len(logits), dtype=np.int64),
        table.topk_ids,
        logits,
        table.logsumexp.astype(np.float32),
        logits[:, -1] - 1.0,
    ).reshape(len(logits), -1)


class _Records:
    """A step's output records as the wafer sends them, per replica's message: the table row of each
    scored item, numbered as the message's items. Built at `collect`, inside the modeled wait; `decode` reads
    them as `wafer_gpt2.host.program.WaferGPT2._collect` does, after the step."""

    def __init__(self, inputs: StepInputs, per_message: list[np.ndarray | None], table: np.ndarray) -> None:
        self.count = len(inputs)
        self.messages = []
        for indices in per_message:  # None: the whole step is one message
            if indices is None:
                message = inputs
                scored = np.arange(self.count) if inputs.decode_only else np.flatnonzero(inputs.want_scores)
            else:
                message = inputs.take(indices)
                scored = np.flatnonzero(message.want_scores)
            if scored.size:
                records = table[_table_rows(message, scored)]
                records[:, 0] = scored
                asked = (
                    np.zeros(scored.size, dtype=bool) if message.decode_only else message.has_target[scored]
                )
                index = None if indices is None else indices[scored]
                self.messages.append((len(message), index, scored, records.reshape(-1), asked))

    def decode(self, k: int) -> StepScores:
        parts = [
            decode_scores(words, k, scored, asked, count=count, index=index)
            for count, index, scored, words, asked in self.messages
        ]
        return StepScores.concat(parts, self.count) if parts else StepScores.empty(self.count, k)


def modeled_step_seconds(plan: Plan, slots_of_items: Sequence[int], clock_hz: float = CLOCK_HZ) -> float:
    """The modeled time of one step with nothing else in flight: each replica streams its items through
    its pipeline, the first after the critical path (decode_cycles), each further one a slowest-stage
    time (bottleneck_cycles) later; replicas run side by side, so the step lasts as long as the busiest
    one (`pipelined_span` from empty pipelines)."""
    _, end = pipelined_span(
        0.0,
        [0.0] * plan.replicas,
        items_per_replica(plan, slots_of_items),
        plan.decode_cycles / clock_hz,
        plan.bottleneck_cycles / clock_hz,
    )
    return end


def items_per_replica(plan: Plan, slots_of_items: Sequence[int]) -> list[int]:
    counts = [0] * plan.replicas
    for slot in slots_of_items:
        counts[slot // plan.slots] += 1
    return counts


def pipelined_span(
    now: float, input_free: list[float], per_replica: Sequence[int], decode_s: float, bottleneck_s: float
) -> tuple[float, float]:
    """(first item in, last result out) of a step submitted at `now` with `per_replica[r]` items on
    replica r, behind the steps in flight: replica r takes its first item when its input is free
    (`input_free[r]`, moved on in place to a slowest-stage time after its last item), the others a
    slowest stage apart, and returns each the critical path after it entered."""
    first, end = float("inf"), now
    for replica, n in enumerate(per_replica):
        if n:
            start = max(now, input_free[replica])
            last_in = start + (n - 1) * bottleneck_s
            input_free[replica] = last_in + bottleneck_s
            first, end = min(first, start), max(end, last_in + decode_s)
    return min(first, end), end


def timer_lateness(seconds: float, times: int = 50) -> float:
    """How late `time.sleep(seconds)` wakes in this process, the median of `times` tries."""
    late = []
    for _ in range(times):
        end = time.perf_counter() + seconds
        time.sleep(seconds)
        late.append(time.perf_counter() - end)
    return max(0.0, statistics.median(late))


class ModeledWaferBackend(NullBackend):
    """The null backend's answers, each step returned after the time the cost model gives it on `plan`
    (modeled, not measured). The wait sleeps, so the host's threads run meanwhile as they would beside
    a real wafer (a spin would hold the GIL). The OS wakes a sleeper late (tens of microseconds, a few
    percent of a step), which a wafer's memcpy would not add: each sleep is shortened by the timer's
    median lateness (`timer_late_s`, measured at construction unless given), so steps end on time on
    average. `overshoot_s` sums how late the steps that left the pipeline empty really ended (negative
    when early): the wafer's idle time while a finished step waited for the host, the wait for the GIL
    and the timer's jitter (a step collected late while a later one is still in flight idles nothing).

    Steps may overlap (`PipelinedBackend`, `steps_in_flight` of them): each replica's pipeline takes an
    item every slowest-stage time (bottleneck_cycles) and returns it the critical path (decode_cycles)
    after it entered, so a step submitted while another is in flight enters behind it. One step at a
    time, that is `modeled_step_seconds`. `modeled_busy_s` is the time at least one item was in a
    pipeline (the union of the steps' modeled spans)."""

    backend = "modeled"

    def __init__(
        self,
        plan: Plan,
        clock_hz: float = CLOCK_HZ,
        timer_late_s: float | None = None,
        steps_in_flight: int = 1,
    ) -> None:
        super().__init__(
            plan.config.vocab_size, slots=plan.slots * plan.replicas, context=plan.context, top_k=plan.top_k
        )
        if steps_in_flight < 1:
            raise InvalidInput(f"steps_in_flight must be at least 1, got {steps_in_flight}")
        self.plan = plan
        self.clock_hz = clock_hz
        self.steps_in_flight = steps_in_flight
        self.modeled_busy_s = 0.0  # time with an item in a pipeline, in all
        self.overshoot_s = 0.0  # how much later than modeled the steps that emptied the pipeline returned
        # CPU seconds of the stand-in's own work, the wafer's side of the wire (the records it sends): not
        # the host's, which `bench host` reports without it.
        self.stand_in_cpu_s = 0.0
        # Summed from the plan's stages and timed once: the stand-in's own bookkeeping is no host cost
        # to measure.
        self._seconds = (plan.decode_cycles / clock_hz, plan.bottleneck_cycles / clock_hz)
        self._input_free = [0.0] * plan.replicas  # when each replica's pipeline takes its next item
        self._busy_until = 0.0  # the end of the latest modeled span
        # (modeled end, slots, (the inputs, each replica's items or None for the whole step)) of each
        # step submitted and not collected, oldest first
        self._in_flight: deque[tuple[float, frozenset[int], tuple[StepInputs, list[np.ndarray | None]]]] = (
            deque()
        )
        self._records = _records_of(self._table)  # the wafer's side of the wire
        self._k = self._table.topk_ids.shape[1]  # the records' k (below top_k for a tiny vocabulary)
        self._slots_in_flight: set[int] = set()
        full_step = modeled_step_seconds(plan, list(range(min(plan.slots, self.num_slots))), clock_hz)
        self.timer_late_s = timer_lateness(full_step) if timer_late_s is None else timer_late_s

    def submit(self, inputs: StepInputs) -> None:
        if len(self._in_flight) >= self.steps_in_flight:
            raise BackendError(f"{len(self._in_flight)} steps are in flight already: collect one first")
        slots = inputs.slot_set
        if busy := slots & self._slots_in_flight:
            raise BackendError(f"slots {sorted(busy)} have items in a step still in flight")
        self._take(inputs)
        per_message: list[np.ndarray | None]  # each replica's items (None: the whole step is one message)
        if self.plan.replicas == 1:
            per_message = [None] if len(inputs) else []
            per_replica = [len(inputs)]
        else:
            replica = inputs.slot // self.plan.slots
            per_message = [np.flatnonzero(replica == r) for r in np.unique(replica).tolist()]
            per_replica = np.bincount(replica, minlength=self.plan.replicas).tolist()
        for indices in per_message:  # the host program's messages, before the wafer starts
            step_message(inputs if indices is None else inputs.take(indices), self.plan.slots)
        now = time.perf_counter()
        decode, bottleneck = self._seconds
        first, end = pipelined_span(now, self._input_free, per_replica, decode, bottleneck)
        self.modeled_busy_s += max(0.0, end - max(first, self._busy_until))
        self._busy_until = max(self._busy_until, end)
        # The wafer's output records are built at collect, inside the modeled wait: the wafer's work,
        # not the host's.
        self._in_flight.append((end, slots, (inputs, per_message)))
        self._slots_in_flight |= slots

    def collect(self) -> StepScores:
        if not self._in_flight:
            raise BackendError("no step is in flight")
        end, slots, (inputs, per_message) = self._in_flight.popleft()
        self._slots_in_flight -= slots
        started = time.thread_time()
        out = _Records(inputs, per_message, self._records)  # the wafer's side, before its step ends
        self.stand_in_cpu_s += time.thread_time() - started
        remaining = end - time.perf_counter() - self.timer_late_s
        if remaining > 0:
            time.sleep(remaining)
        if end >= self._busy_until:  # the pipeline is empty until the host submits again
            self.overshoot_s += time.perf_counter() - end
        return out.decode(self._k)  # the host program reads the records

    def step(self, inputs: StepInputs) -> StepScores:
        if self._in_flight:
            raise BackendError("step() with steps in flight: collect them first")
        self.submit(inputs)
        return self.collect()

    def free_slot(self, slot: int) -> None:
        if slot in self._slots_in_flight:
            raise BackendError(f"slot {slot} has items in a step still in flight: it cannot be freed yet")
        super().free_slot(slot)

    def reset(self) -> None:
        self._in_flight.clear()
        self._slots_in_flight.clear()

    def describe(self) -> dict:
        plan = self.plan.to_json()
        keys = ("version", "arch", "dtype", "objective", "slots", "context", "top_k", "summary")
        return super().describe() | {
            "device_type": "modeled wafer (cost model, no hardware)",
            "dtype": self.plan.dtype,
            "plan": {key: plan[key] for key in keys if key in plan}
            | {
                "modeled_step": "modeled: decode_cycles + (items per replica - 1) x bottleneck_cycles",
                "steps_in_flight": self.steps_in_flight,
                "decode_cycles": self.plan.decode_cycles,
                "bottleneck_cycles": self.plan.bottleneck_cycles,
                "clock_hz": self.clock_hz,
            },
        }
