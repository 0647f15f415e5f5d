"""A group's persistent batch while its requests decode together, step after step, the plain way.

Once a step of a group's decode items is back and every request of the group goes on with a token
chosen the plain way (`RequestState.plain`: greedy, or sampled with no penalty; no stop string or
token, no alternatives), the group's next steps need nothing of the requests one at a time: each is
the last one's item columns a position further with the chosen tokens, and what a request records of
its token (id, logprob, its position, when it came) is the same for all of them but the values. A
`DecodeRun` keeps that by row (a request's row: its index in `states`), as vLLM V1's persistent input
batch does, so that a step in which no request ends is a few array operations however many requests
it carries. Only the requests that hear of each token with its text made here (streamed, or read from
`EngineCore.step`) still take theirs one at a time, for its text and event; the streamed ones whose sink
makes their text get a step's tokens as one `StreamedIds` per sink (`streamed`; their request ids go
once, as the run's roster, until its membership changes), and all but the heard ones get their tokens
when they leave the run or it ends: as records where their text is made at their end, here; as ids and
logprobs where their sink makes it (no record is made of them).

A request that takes its last token leaves the run, which goes on with the others, condensed (`leave`,
as vLLM V1's persistent batch condenses when a request finishes): its tokens go with it, and the
engine makes its records and ends it after the next step is submitted. The run ends when a request
joins the group (or one leaves it otherwise, or a step of the group is not plain): each request gets
its position and next token at once (`release`), what scheduling needs, and the text-at-end ones their
token records at the next `settle`, which the engine runs after the next step is out (a run's records
for eight requests over thirty steps cost more than a step's whole turnaround, and with two steps in
flight the wafer waits for that turnaround).
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from itertools import repeat

import numpy as np

from wafer_gpt2.core.steps import POSITION, TOKEN
from wafer_gpt2.engine.request import (
    EventSink,
    GeneratedToken,
    RequestState,
    StreamedIds,
    generated_token_of,
)


class DecodeRun:
    def __init__(
        self,
        states: Sequence[RequestState],
        columns: np.ndarray,
        last_at: float,
        ends_at: Sequence[int],
        eos_token_id: int,
        special: Container[int],
    ):
        """`states`: the group's requests, each with the token it chose last (at `last_at`) still to feed;
        `columns`: the run's first step's items, a decode item per row (`next_columns`); `ends_at`: by
        row, the run's step (1: the step `columns` makes) at which the row's request takes its last
        token (by its length, or its KV slot's end)."""
        self.states = list(states)
        # What a step adds to the last one's columns: a position (the tokens are written over).
        self._one_position = np.zeros_like(columns)
        self._one_position[POSITION] = 1
        self.columns = columns  # the next step's items
        self.last_at = last_at
        self.ends_at = list(ends_at)
        self.ending_step = min(ends_at)  # the first step at which a row takes its last token
        self.special = special
        self.eos_token_id = eos_token_id
        # Whether end-of-text ends the row's request (not with ignore_eos).
        self.ends_on_eos = np.array([not state.request.ignore_eos for state in states])
        self._rows_changed()
        self.steps = 0  # tokens recorded per row
        # A step of the run is on the backend: its requests' own `in_flight` flags are not set, per step,
        # but read through the run (`Scheduler.in_flight`); they are set when the run ends meanwhile.
        self.in_flight = False
        # Per step since rows last left, the token and logprob of each row.
        self._tokens: list[np.ndarray] = []
        self._logprobs: list[np.ndarray] = []
        # The steps before rows last left: tokens and logprobs, steps x rows (the rows now).
        self._block: tuple[np.ndarray, np.ndarray] | None = None

    def _rows_changed(self) -> None:
        # Rows whose requests hear of each token with its text made here: the per-request way each step.
        # The others are recorded here until `settle`; of them, the streamed rows (their sink makes their
        # text) by sink: what a step sends them (`EngineCore._run_step`).
        heard: list[tuple[int, RequestState]] = []
        by_sink: dict[EventSink, list[int]] = {}
        for row, state in enumerate(self.states):
            if not (state.text_at_end or state.text_in_front):
                heard.append((row, state))
            elif state.stream and state.sink is not None:
                by_sink.setdefault(state.sink, []).append(row)
        self.heard = heard
        self.quiet = len(self.states) - len(heard)
        self.streamed = [
            StreamedRows(
                sink,
                None if len(rows) == len(self.states) else np.array(rows),
                [self.states[row].id for row in rows],
            )
            for sink, rows in by_sink.items()
        ]
        self.kinds = [state.sampler.batched for state in self.states]
        self._members = {id(state) for state in self.states}

    def holds(self, state: RequestState) -> bool:
        return id(state) in self._members

    def goes_on(self, tokens: np.ndarray) -> bool:
        """Whether every request goes on after the step that chose `tokens` (one per row): none reaches
        its length or its slot's end, none chose an end-of-text that ends it."""
        if self.steps + 1 >= self.ending_step:
            return False
        eos = tokens == self.eos_token_id
        return not np.count_nonzero(eos) or not np.count_nonzero(eos & self.ends_on_eos)

    def ending(self, tokens: np.ndarray) -> np.ndarray:
        """By row, whether the step that chose `tokens` gives the row's request its last token (its
        length, its slot's end, or an end-of-text that ends it)."""
        ends_now = np.array(self.ends_at) <= self.steps + 1
        return ends_now | ((tokens == self.eos_token_id) & self.ends_on_eos)

    def record(self, tokens: np.ndarray, logprobs: np.ndarray, now: float) -> float:
        """A step's tokens (chosen at `now`): the next step's columns move on by a position with them.
        Returns the time since the last step's tokens (each row's latency)."""
        self.steps += 1
        self._tokens.append(tokens)
        self._logprobs.append(logprobs)
        self.columns = _moved_on(self.columns, tokens, self._one_position)
        latency, self.last_at = now - self.last_at, now
        return latency

    def leave(self, leaving: np.ndarray) -> list[tuple[int, RequestState, Recorded]]:
        """The requests of the rows `leaving` (a mask; their last token recorded) leave the run, which
        goes on with the others, condensed (as vLLM V1's persistent batch does when a request
        finishes): each leaving request gets its position now (and when its last token came, if its
        text is made at its end); returned with its row and what the run recorded of it
        (`Recorded.lists`, read after the next step is out). A few array operations: no record per
        request and step is made here."""
        flags = leaving.tolist()
        tokens, logprobs = self._recorded()
        self._tokens, self._logprobs = [], []
        left = []
        for row, leaves in enumerate(flags):
            if leaves:
                state = self.states[row]
                state.computed += self.steps
                state.pending_token = None
                if state.text_at_end or state.text_in_front:  # the heard ones' last token: per request
                    state.last_token_at = self.last_at
                left.append((row, state, Recorded(tokens, logprobs, row)))
        if len(left) == len(flags):  # every request left: nothing goes on
            self.states = []
            self.streamed = []
            return left
        stay = ~leaving
        self._block = (tokens[:, stay], logprobs[:, stay])
        self.states = [state for state, leaves in zip(self.states, flags, strict=True) if not leaves]
        self.columns = self.columns[:, stay]
        self._one_position = self._one_position[:, stay]
        self.ends_on_eos = self.ends_on_eos[stay]
        self.ends_at = [end for end, leaves in zip(self.ends_at, flags, strict=True) if not leaves]
        self.ending_step = min(self.ends_at)
        self._rows_changed()
        return left

    def _recorded(self) -> tuple[np.ndarray, np.ndarray]:
        """The tokens and logprobs recorded so far, steps x rows."""
        if not self._tokens:
            if self._block is None:
                raise RuntimeError("the run has recorded no step")
            return self._block
        tokens, logprobs = np.array(self._tokens), np.array(self._logprobs)
        if self._block is not None:
            tokens = np.concatenate((self._block[0], tokens))
            logprobs = np.concatenate((self._block[1], logprobs))
        return tokens, logprobs

    def release(self) -> bool:
        """The run ends: each request gets its position, its next token to feed and when its last token
        came (what scheduling needs); True when text-at-end requests still have tokens in the run, which
        `settle` gives them (after the next step is out: see `Scheduler.end_run`)."""
        if not self.steps:
            return False
        next_tokens = (self._tokens[-1] if self._tokens else self._recorded()[0][-1]).tolist()
        for state, token in zip(self.states, next_tokens, strict=True):
            state.computed += self.steps
            state.pending_token = token
            state.last_token_at = self.last_at
        return self.quiet > 0

    def settle(self) -> None:
        """After `release`: each text-at-end request gets the tokens the run recorded for it."""
        if not self.steps:
            return
        recorded_ids, recorded_logprobs = self._recorded()
        tokens, logprobs = recorded_ids.T.tolist(), recorded_logprobs.T.tolist()
        for state, ids, values in zip(self.states, tokens, logprobs, strict=True):
            if state.text_in_front:  # their sink makes the text: the ids are all their end needs
                state.ids += ids
                state.logprobs += values
            elif state.text_at_end:  # the records of the text made at their end (`_texts_at_end`)
                state.tokens.extend(recorded_tokens(ids, values, self.special))
        self.steps = 0
        self._tokens, self._logprobs, self._block = [], [], None


class StreamedRows:
    """A run's rows whose requests' sink makes their text (streamed; `rows` None: every row), and what
    a step sends that sink of them (`step`): the rows' request ids go with the first step only, as the
    run's roster (`StreamedIds`), which the rows keep until the run's membership changes."""

    __slots__ = ("_unsent", "rows", "sink")

    def __init__(self, sink: EventSink, rows: np.ndarray | None, request_ids: list[str]) -> None:
        self.sink, self.rows = sink, rows
        self._unsent: list[str] | None = request_ids  # the roster, until a step has sent it

    def step(self, roster: int, tokens: np.ndarray, logprobs: np.ndarray) -> StreamedIds:
        """A step's tokens and logprobs (by row of the run) of these rows, as the roster `roster`."""
        rows = self.rows
        if rows is not None:
            tokens, logprobs = tokens[rows], logprobs[rows]
        request_ids, self._unsent = self._unsent, None
        # As bytes of fixed types (`StreamedIds.columns`): widening the ids or logprobs changes no value.
        ids, values = tokens.astype(np.int64, copy=False), logprobs.astype(np.float64, copy=False)
        return StreamedIds(roster, request_ids, ids.tobytes(), values.tobytes())


class Recorded:
    """What a run recorded of a request that left it: its row of the run's records (steps x rows)."""

    __slots__ = ("_logprobs", "_row", "_tokens")

    def __init__(self, tokens: np.ndarray, logprobs: np.ndarray, row: int) -> None:
        self._tokens, self._logprobs, self._row = tokens, logprobs, row

    def lists(self) -> tuple[list[int], list[float]]:
        """Its tokens and their logprobs, oldest first."""
        return self._tokens[:, self._row].tolist(), self._logprobs[:, self._row].tolist()


def recorded_tokens(ids: list[int], logprobs: list[float], special: Container[int]) -> list[GeneratedToken]:
    """A text-at-end request's token records for its ids and logprobs (no text yet: `_texts_at_end`)."""
    flags = map(special.__contains__, ids)
    return list(map(generated_token_of, zip(ids, repeat(""), repeat(""), logprobs, flags, repeat(()))))


def next_columns(returned: np.ndarray, tokens: Sequence[int]) -> np.ndarray:
    """The decode items of the step after the one whose items are `returned`: a position further on,
    feeding `tokens`."""
    one_position = np.zeros_like(returned)
    one_position[POSITION] = 1
    return _moved_on(returned, tokens, one_position)


def _moved_on(
    columns: np.ndarray, tokens: Sequence[int] | np.ndarray, one_position: np.ndarray
) -> np.ndarray:
    """A step's decode items a position further on (`one_position`: 1 in the POSITION row, 0 elsewhere),
    feeding `tokens`: the next step's items (a new array: the step's own stay with its batch). One add
    and one row written: a copy and an in-place add on a row cost twice that at a few items."""
    moved = columns + one_position
    moved[TOKEN] = tokens
    return moved
