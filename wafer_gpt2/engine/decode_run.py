"""A group's persistent batch while its requests decode together, step after step, the plain way.

Once a step of a group's decode items is back and every request of the group goes on with a token
chosen the plain way (`RequestState.plain`: greedy, or sampled with no penalty; no stop string or
token, no alternatives), the group's next steps need nothing of the requests one at a time: each is
the last one's item columns a position further with the chosen tokens, and what a request records of
its token (id, logprob, its position, when it came) is the same for all of them but the values. A
`DecodeRun` keeps that by row (a request's row: its index in `states`), as vLLM V1's persistent input
batch does, so that a step in which no request ends is a few array operations however many requests
it carries. Only the requests that hear of each token (streamed, or read from `EngineCore.step`) still
take theirs one at a time, for its text and event; the others (their text made at the end) get their
tokens when the run ends (`settle`): when a request ends, one joins or leaves the group, or a step of
the group is not plain.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from itertools import repeat

import numpy as np

from wafer_gpt2.core.steps import POSITION, TOKEN
from wafer_gpt2.engine.request import RequestState, generated_token_of


class DecodeRun:
    def __init__(
        self,
        states: Sequence[RequestState],
        returned: np.ndarray,
        tokens: Sequence[int],
        last_at: float,
        ending_step: int,
        eos_token_id: int,
        special: Container[int],
    ):
        """`states`: the group's requests, each at its state after the step that started the run
        (`returned`, its item columns), in which each chose its token of `tokens` at `last_at`;
        `ending_step`: the run's first step (1: the step `columns` makes) at which one of them takes its
        last token (by its length, or its KV slot's end)."""
        self.states = list(states)
        # What a step adds to the last one's columns: a position (the tokens are written over).
        self._one_position = np.zeros_like(returned)
        self._one_position[POSITION] = 1
        self.columns = _moved_on(returned, tokens, self._one_position)  # the next step's items
        self.last_at = last_at
        self.ending_step = ending_step
        self.special = special
        self.eos_token_id = eos_token_id
        # Whether end-of-text ends the row's request (not with ignore_eos).
        self.ends_on_eos = np.array([not state.request.ignore_eos for state in states])
        # Rows whose requests hear of each token: their tokens take the per-request way each step.
        self.heard = [(row, state) for row, state in enumerate(states) if not state.text_at_end]
        self.quiet = len(states) - len(self.heard)  # the others: recorded here until `settle`
        self.kinds = [state.sampler.batched for state in states]
        self.steps = 0  # tokens recorded per row
        # A step of the run is on the backend: its requests' own `in_flight` flags are not set, per step,
        # but read through the run (`Scheduler.in_flight`); they are set when the run ends meanwhile.
        self.in_flight = False
        self._tokens: list[np.ndarray] = []  # per step: the token of each row
        self._logprobs: list[np.ndarray] = []

    def goes_on(self, tokens: np.ndarray) -> bool:
        """Whether every request goes on after the step that chose `tokens` (one per row): none reaches
        its length or its slot's end, none chose an end-of-text that ends it."""
        if self.steps + 1 >= self.ending_step:
            return False
        eos = tokens == self.eos_token_id
        return not np.count_nonzero(eos) or not np.count_nonzero(eos & self.ends_on_eos)

    def record(self, tokens: np.ndarray, logprobs: np.ndarray, now: float) -> float:
        """A step's tokens (chosen at `now`), none ending its request: the next step's columns move on
        by a position with them. Returns the time since the last step's tokens (each row's latency)."""
        self.steps += 1
        self._tokens.append(tokens)
        self._logprobs.append(logprobs)
        self.columns = _moved_on(self.columns, tokens, self._one_position)
        latency, self.last_at = now - self.last_at, now
        return latency

    def settle(self) -> None:
        """The run ends: each request gets what the run kept of it (its tokens, unless it took them one
        at a time; its position; its next token to feed; when its last token came)."""
        if not self.steps:
            return
        tokens = np.stack(self._tokens, axis=1).tolist()
        logprobs = np.stack(self._logprobs, axis=1).tolist()
        special = self.special
        for state, ids, values in zip(self.states, tokens, logprobs, strict=True):
            state.computed += self.steps
            state.pending_token = ids[-1]
            state.last_token_at = self.last_at
            if state.text_at_end:  # their text is made when the request ends (`_texts_at_end`)
                flags = map(special.__contains__, ids)
                columns = zip(ids, repeat(""), repeat(""), values, flags, repeat(()))
                state.tokens.extend(map(generated_token_of, columns))
        self.steps = 0
        self._tokens, self._logprobs = [], []


def _moved_on(
    columns: np.ndarray, tokens: Sequence[int] | np.ndarray, one_position: np.ndarray
) -> np.ndarray:
    """A step's decode items a position further on (`one_position`: 1 in the POSITION row, 0 elsewhere),
    feeding `tokens`: the next step's items (a new array: the step's own stay with its batch). One add
    and one row written: a copy and an in-place add on a row cost twice that at a few items."""
    moved = columns + one_position
    moved[TOKEN] = tokens
    return moved
