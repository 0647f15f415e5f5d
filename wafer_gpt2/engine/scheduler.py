"""Continuous batching: which requests run, and what each engine step carries.

Requests wait in a bounded FIFO queue until a KV slot is free; admission happens at step boundaries,
so a new request joins the running batch without waiting for the batch to finish. Each step carries:
1. one decode item per running request that has finished its prompt (its last sampled token), then
2. prompt tokens of requests still prefilling, in admission order, chunked to what is left of the
   per-step token budget, so a long prompt never stalls the decodes of the others.

A backend that takes several steps at a time (a pipelined wafer) gets the running requests in as many
groups (micro-batches, as in pipeline-parallel serving): a request's group is its KV slot modulo the
number of groups, and a step carries the ready requests of one group with no step in flight. While one
group's step computes, another's is chosen and sent, and the wafer's layer pipeline takes items from
both back to back; a group's requests return together and go out together, so steps keep their size
(a step of whatever happened to be ready would shrink to a few items, each paying a whole step's host
work). One step of every request would leave nothing ready to send until it returned.

The groups persist across steps (vLLM V1's persistent input batch): each keeps its running requests in
admission order, and once a step of the decode items of all of them is back (plain requests: greedy
or sampled without penalties, no stop string) and every one of them goes on, or once a step (a
prefill's) has chosen the next token of every one of them, the engine keeps the group as a
`DecodeRun` (`keep`): its next steps are that step's item columns moved on, and what they
choose is recorded by row, not a walk over its requests. A request that takes its last token leaves
the run, which goes on with the others (`leave`); admitting into a group, or another way out of it,
ends the run (`end_run`: the requests get what it kept of them, their token records at `settle`).

Not thread-safe: the engine calls it under its own lock.
"""

from __future__ import annotations

import time
from collections import deque

import numpy as np

from wafer_gpt2.core.steps import HAS_TARGET, WANT_SCORES, StepInputs
from wafer_gpt2.engine.decode_run import DecodeRun, Recorded
from wafer_gpt2.engine.failures import Overloaded
from wafer_gpt2.engine.kv_slots import KVSlotManager
from wafer_gpt2.engine.request import RequestState, RequestStatus
from wafer_gpt2.errors import InvalidInput


def _slot(sequence: RequestState) -> int:
    """A running request's KV slot (admission gave it one)."""
    if sequence.slot is None:
        raise RuntimeError(f"running request {sequence.id} holds no KV slot")
    return sequence.slot


class StepBatch:
    """A step's items and the requests they belong to. Treated as immutable; a plain class with slots,
    because a frozen dataclass's construction (a `object.__setattr__` call per field) costs as much as
    the rest of a decode run's step building, and every step builds one."""

    __slots__ = ("group", "inputs", "owners", "plain", "run")

    def __init__(
        self,
        inputs: StepInputs,
        owners: list[RequestState],
        group: int = 0,
        plain: bool = False,
        run: DecodeRun | None = None,
    ) -> None:
        self.inputs = inputs
        self.owners = owners  # owners[i] is the request of item i
        self.group = group  # the group whose requests it carries
        # Every item is the decode item of a request whose token `EngineCore` chooses in its plain way
        # (greedy or sampled with no penalty, nothing banned, no stop string or token, no alternatives:
        # `RequestState.plain`), and the step carries its whole group.
        self.plain = plain
        self.run = run  # the group's run it was made from (`Scheduler.keep`)

    def __len__(self) -> int:
        return len(self.owners)


class Scheduler:
    def __init__(self, slots: KVSlotManager, max_queue: int, step_token_budget: int, groups: int = 1):
        if groups < 1:
            raise InvalidInput(f"groups must be at least 1, got {groups}")
        if step_token_budget < slots.num_slots:
            raise InvalidInput(
                f"step_token_budget ({step_token_budget}) must be at least the number of KV slots "
                f"({slots.num_slots}): every running request decodes one token per step"
            )
        self.slots = slots
        self.max_queue = max_queue
        self.step_token_budget = step_token_budget
        self.waiting: deque[RequestState] = deque()
        self.running: list[RequestState] = []
        self._held: dict[RequestState, int] = {}  # slots of ended requests whose step is in flight
        self.groups = groups
        self._members: list[list[RequestState]] = [[] for _ in range(groups)]  # running, by group
        self._in_flight = [False] * groups  # a step of the group is on the backend
        # A group's run of plain decode steps (`keep`); None: its next step is built from its requests.
        self._runs: list[DecodeRun | None] = [None] * groups
        # Runs that ended with tokens still to give their text-at-end requests (`end_run`, `settle`).
        self._unsettled: list[DecodeRun] = []

    @property
    def capacity(self) -> int:
        """Requests the engine holds at most: one per slot running, `max_queue` more waiting."""
        return self.slots.num_slots + self.max_queue

    def add(self, sequence: RequestState) -> None:
        if len(self.waiting) + len(self.running) >= self.capacity:
            raise Overloaded(
                f"the server is at capacity ({len(self.running)} requests running, {len(self.waiting)} "
                f"queued, queue limit {self.max_queue}); retry later"
            )
        self.waiting.append(sequence)

    def remove(self, sequence: RequestState) -> int | None:
        """Take a request out, whatever its state; returns the KV slot it held (already released). A
        request with items in a step still in flight keeps its slot until that step is back
        (`step_returned`): a new request must not get the slot while the wafer still writes it."""
        slot = sequence.slot
        if sequence.status is RequestStatus.WAITING:
            self.waiting.remove(sequence)
        elif sequence.status is RequestStatus.RUNNING:
            self.running.remove(sequence)
            group = sequence.group
            self.end_run_of(sequence)  # not when it left the run (`DecodeRun.leave`)
            self._members[group].remove(sequence)
            if slot is not None and sequence.in_flight:
                self._held[sequence] = slot
                slot = None
            elif slot is not None:
                self.slots.free(slot)
        sequence.status = RequestStatus.FINISHED
        sequence.slot = None
        return slot

    def step_returned(self, batch: StepBatch) -> list[int]:
        """A step is back: its requests may be scheduled again; the slots of those that ended while it
        ran are released now (returned, to be freed on the backend too)."""
        owners = batch.owners
        if owners:
            self._in_flight[batch.group] = False
        run = batch.run
        if run is not None and run.in_flight:  # a run's step, and the run went on: none of them ended
            run.in_flight = False
            return []
        if not self._held:  # the usual case: nobody ended while the step ran
            for sequence in owners:
                sequence.in_flight = False
            return []
        released = []
        for sequence in owners:
            sequence.in_flight = False
            slot = self._held.pop(sequence, None)
            if slot is not None:
                self.slots.free(slot)
                released.append(slot)
        return released

    def admit(self) -> list[RequestState]:
        """Give free slots to waiting requests, oldest first."""
        admitted = []
        while self.waiting:
            sequence = self.waiting[0]
            slot = self.slots.allocate(sequence.id, sequence.request.tokens_needed)
            if slot is None:
                break
            self.waiting.popleft()
            sequence.slot = slot
            sequence.status = RequestStatus.RUNNING
            sequence.admitted_at = time.monotonic()
            self.running.append(sequence)
            group = sequence.group = slot % self.groups
            self.end_run(group)
            self._members[group].append(sequence)
            admitted.append(sequence)
        return admitted

    def build_step(self) -> StepBatch:
        """The next step's items, from the requests with none in a step still in flight (a
        `PipelinedBackend` runs several: one takes what became ready while another computes); with
        several groups, those of the first group that has no step in flight and a request to step.
        The step's columns are the group's run's (`keep`) or gathered as lists and made arrays once
        (`StepInputs`)."""
        group = 0
        if self.groups > 1:
            group = next((g for g, busy in enumerate(self._in_flight) if not busy and self._steppable(g)), -1)
            if group < 0:
                return StepBatch(StepInputs.of_fields((), (), (), (), ()), [])
            self._in_flight[group] = True
        members = self._members[group]
        run = self._runs[group]
        if run is not None:  # the group's last step, moved on: every member decodes, none in flight
            run.in_flight = True  # its members are in flight through it (`in_flight`)
            return StepBatch(StepInputs(run.columns), run.states, group, plain=True, run=run)
        slots: list[int] = []
        positions: list[int] = []
        tokens: list[int] = []
        owners: list[RequestState] = []
        prefilling: list[RequestState] = []  # in admission order, as `running`
        plain = True
        for sequence in members:
            if sequence.in_flight:
                plain = False
                continue
            if sequence.computed < len(sequence.request.prompt_ids):  # `prefilling`, without the call
                prefilling.append(sequence)
            elif sequence.pending_token is not None:
                slots.append(_slot(sequence))
                positions.append(sequence.computed)
                tokens.append(sequence.pending_token)
                owners.append(sequence)
                sequence.in_flight = True
                plain = plain and sequence.plain
            else:
                plain = False
        decodes = len(owners)
        flags = [WANT_SCORES] * decodes
        targets = [0] * decodes

        budget = self.step_token_budget - decodes
        for sequence in prefilling:
            if budget <= 0:
                break
            sequence.in_flight = True
            prompt = sequence.prompt
            start = sequence.computed
            stop = min(len(prompt), start + budget)
            n = stop - start
            slots += [_slot(sequence)] * n
            positions += range(start, stop)
            tokens += prompt[start:stop]
            # With prompt logprobs every prompt token but the last asks for the logit of the next one
            # (the wafer returns it exactly: its logprob); the last asks for the scores of the first
            # generated token.
            last = stop == len(prompt)
            if sequence.request.prompt_logprobs:
                flags += [WANT_SCORES | HAS_TARGET] * n
                targets += prompt[start + 1 : stop + 1]
                if last:
                    flags[-1] = WANT_SCORES
                    targets.append(0)
            else:
                flags += [0] * n
                targets += [0] * n
                if last:
                    flags[-1] = WANT_SCORES
            owners += [sequence] * n
            budget -= n
        if not owners and self.groups > 1:
            self._in_flight[group] = False
        inputs = StepInputs.of_fields(slots, positions, tokens, flags, targets)
        return StepBatch(inputs, owners, group, plain=plain and not prefilling and decodes > 0)

    def _steppable(self, group: int) -> bool:
        """Whether a request of `group` has an item to step (a token to feed or prompt left)."""
        return self._runs[group] is not None or any(
            s.pending_token is not None or s.computed < len(s.prompt) for s in self._members[group]
        )

    def unchanged(self, batch: StepBatch) -> bool:
        """Whether `batch`'s group is as the batch found it: the same requests, no run."""
        return self._runs[batch.group] is None and batch.owners == self._members[batch.group]

    def keep(self, group: int, run: DecodeRun) -> None:
        """The group goes on as `run` (its requests, all decoding the plain way, `unchanged` since the
        step `run` starts from): its next steps are the run's."""
        self._runs[group] = run

    def ready_to_run(self, group: int, count: int) -> list[RequestState] | None:
        """The group's `count` requests when it could go on as a run now (`keep`): it has none, and each
        of them decodes the plain way, with its next token to feed and no item in flight; else None."""
        members = self._members[group]
        if len(members) != count or not count or self._runs[group] is not None:
            return None
        for sequence in members:
            if (
                sequence.in_flight
                or not sequence.plain
                or sequence.pending_token is None
                or sequence.computed < len(sequence.request.prompt_ids)
            ):
                return None
        return members

    @staticmethod
    def decode_columns(sequences: list[RequestState]) -> np.ndarray:
        """The item columns of a step of one decode item per request (its next token to feed)."""
        n = len(sequences)
        tokens = [sequence.pending_token or 0 for sequence in sequences]  # (each has one: `ready_to_run`)
        positions = [sequence.computed for sequence in sequences]
        slots = [_slot(sequence) for sequence in sequences]
        return StepInputs.of_fields(slots, positions, tokens, [WANT_SCORES] * n, [0] * n).columns

    def run(self, group: int) -> DecodeRun | None:
        """The group's run (None when its next step is built from its requests)."""
        return self._runs[group]

    def end_run(self, group: int) -> None:
        """The group's run, if any, ends: its requests get their positions and next tokens now
        (`DecodeRun.release`), and the text-at-end ones the tokens it recorded at the next `settle`,
        which the engine calls before it reads them: an admission ends a run just before its group's
        next step is built, and that step need not wait for the records."""
        run = self._runs[group]
        if run is not None:
            self._runs[group] = None
            if run.release():
                self._unsettled.append(run)
            if run.in_flight:  # its step is still on the backend: each request's own flag says so now
                run.in_flight = False
                for sequence in run.states:
                    sequence.in_flight = True

    def end_run_of(self, sequence: RequestState) -> None:
        """End the run of the request's group if the request is one of its rows (`end_run`)."""
        run = self._runs[sequence.group]
        if run is not None and run.holds(sequence):
            self.end_run(sequence.group)

    def leave(self, group: int, leaving: np.ndarray) -> list[tuple[int, RequestState, Recorded]]:
        """The requests of the group's run's rows `leaving` leave it (`DecodeRun.leave`); the run goes on
        with the others (none: the group has no run)."""
        run = self._runs[group]
        if run is None:
            raise RuntimeError(f"group {group} has no run to leave")
        left = run.leave(leaving)
        if not run.states:
            self._runs[group] = None
        return left

    @property
    def unsettled(self) -> bool:
        return bool(self._unsettled)

    def settle(self) -> None:
        """Give the requests of the runs that ended the tokens the runs recorded (`DecodeRun.settle`)."""
        runs, self._unsettled = self._unsettled, []
        for run in runs:
            run.settle()

    def in_flight(self, sequence: RequestState) -> bool:
        """Whether the request has items in a step the backend has not returned: its own flag, or its
        group's run's (a run's step marks the run, not each of its requests)."""
        if sequence.in_flight:
            return True
        if sequence.status is not RequestStatus.RUNNING:
            return False
        run = self._runs[sequence.group]
        return run is not None and run.in_flight and run.holds(sequence)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)
