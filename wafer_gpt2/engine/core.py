"""The engine core: synchronous continuous batching over one backend (vLLM's `LLMEngine`).

`add` queues a request, `step` runs one step (drop cancelled and timed-out requests, admit waiting ones
into free KV slots, run the decode items of running requests and the prompt chunks of new ones
together, sample, detokenize, check stops) and returns the events it produced, `abort` ends a request at
the next step boundary. A request created with an event sink (the server's event loop, the engine
process's pipe) gets its events there instead, once per step. Every decode loop in the tree drives it:
the server's worker thread (`wafer_gpt2/engine/worker.py`, which adds the thread, reload, drain,
watchdog and fault hooks), `wafer-gpt2 generate` and the benchmarks.

Not thread-safe: the worker calls it under its own lock, and runs the backend's step (`execute`)
outside it so that requests can arrive and the watchdog can act while the wafer computes.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from wafer_gpt2.core.steps import (
    POSITION,
    SLOT,
    WANT_SCORES,
    Backend,
    BackendError,
    StepInputs,
    StepScores,
    TokenScores,
    steps_in_flight,
)
from wafer_gpt2.engine.decode_run import DecodeRun, Recorded, next_columns, recorded_tokens
from wafer_gpt2.engine.detokenizer import NO_TEXT, IncrementalDetokenizer
from wafer_gpt2.engine.failures import RequestFailed, RequestTimedOut, RequestValidationFailed, ServiceError
from wafer_gpt2.engine.kv_slots import KVSlotManager
from wafer_gpt2.engine.metrics import ServiceMetrics
from wafer_gpt2.engine.request import (
    ONE_STEP,
    Alternative,
    ErrorEvent,
    Event,
    EventSink,
    FinishEvent,
    FinishReason,
    GeneratedToken,
    GenerationRequest,
    IdsFinishEvent,
    PromptToken,
    RequestState,
    RequestStatus,
    SinkEvent,
    StreamedIds,
    TokenEvent,
    generated_token_of,
    token_event_of,
)
from wafer_gpt2.engine.sampling import (
    BATCH_GREEDY,
    BATCH_NONE,
    BATCH_SAMPLING,
    Choices,
    Sampler,
    as_picks,
    greedy_choices,
    sample_choices,
)
from wafer_gpt2.engine.scheduler import Scheduler, StepBatch

log = logging.getLogger(__name__)

REQUEST_FAILED_MESSAGE = (
    "the server could not choose or decode the next token of this request, which was ended; "
    "other requests are not affected (the server log has the details)"
)

Output = tuple[RequestState, Event]  # an event and the request it belongs to
SinkOutput = tuple[RequestState, SinkEvent]  # the same, for a sink (`EventSink.makes_text`)


# Keys of the requests' deadline entries (`EngineCore._reap`), unique across engines: a request handed
# from one engine to another keeps none that the new one could confuse with its own.
_DEADLINE_KEYS = itertools.count()
# Numbers of the decode runs' rosters (`StreamedIds`), one per engine and group, unique across engines:
# a receiver that hears two engines keeps each one's rosters apart.
_ROSTER_NUMBERS = itertools.count()


@dataclass(frozen=True)
class TokenizerHooks:
    """What the engine needs from the tokenizer: bytes per token, and which ids are special."""

    token_bytes: Callable[[int], bytes]
    eos_token_id: int
    special_names: dict[int, str]
    vocab_size: int | None = None  # ids at or above it are unknown to the tokenizer: never emitted
    # A token's text when its bytes are whole UTF-8 characters, else None: the detokenizer's fast path.
    token_text: Callable[[int], str | None] | None = None


def gpt2_tokenizer_hooks() -> TokenizerHooks:
    """The hooks of GPT-2's tokenizer (`wafer_gpt2.model.tokenizer`), as the server's engine uses them."""
    from wafer_gpt2.model import tokenizer

    return TokenizerHooks(
        token_bytes=tokenizer.token_bytes,
        eos_token_id=tokenizer.EOT_ID,
        special_names={tokenizer.EOT_ID: tokenizer.EOT_TEXT},
        vocab_size=tokenizer.VOCAB_SIZE,
        token_text=tokenizer.whole_token_texts().__getitem__,
    )


def _wanted(scores: StepScores, row: int) -> TokenScores:
    """An item's scores (its `row`) where the item wanted them (a decode item, a prompt's last or scored
    token), as a per-item view."""
    if row < 0:
        raise BackendError("the backend returned no scores for an item that wanted them")
    return scores.row(row)


def _items_read(inputs: StepInputs) -> np.ndarray:
    """The items of a step whose results `EngineCore._apply` reads: those that asked for scores, and
    the last of each slot's. Another item is a prompt token that only moves its request's position
    on, which the slot's next item of the step does too (a slot's items are consecutive positions)."""
    slots = inputs.columns[SLOT]
    last = np.empty(len(slots), dtype=bool)
    np.not_equal(slots[1:], slots[:-1], out=last[:-1])
    last[-1:] = True
    return np.flatnonzero(last | inputs.want_scores)


def shown(request: GenerationRequest, special: bool, ending: bool) -> bool:
    """Whether a generated token adds its text to the output: a special token not when special tokens
    are skipped, an ending token (end-of-text, a stop token) only with include_stop_str_in_output (vLLM)."""
    return (not special or not request.skip_special_tokens) and (
        not ending or request.include_stop_str_in_output
    )


def texts_at_end(
    request: GenerationRequest,
    detokenizer: IncrementalDetokenizer,
    ids: Sequence[int],
    logprobs: Sequence[float],
    special: Sequence[bool],
    top: Sequence[tuple[Alternative, ...]],
    finish: FinishReason,
) -> list[GeneratedToken]:
    """A text-at-end request's token records with their text, made in one pass of its (fresh)
    detokenizer: the text each would have got token by token (`EngineCore._complete`; only the last
    token can have ended it)."""
    if not ids:
        return []
    last = len(ids) - 1
    skipped = request.skip_special_tokens and any(special)
    hidden = {i for i, s in enumerate(special) if s} if skipped else set()
    if not shown(request, special[last], ending=finish is FinishReason.EOS):
        hidden.add(last)
    if hidden:
        texts = iter(detokenizer.add_all([t for i, t in enumerate(ids) if i not in hidden]))
        pieces = ["" if i in hidden else next(texts) for i in range(len(ids))]
    else:
        pieces = detokenizer.add_all(ids)
    columns = zip(ids, pieces, pieces, logprobs, special, top, strict=True)
    return list(map(generated_token_of, columns))


def text_in_front(request: GenerationRequest, makes_text: bool) -> bool:
    """Whether the receiver of `request`'s events makes its text (`RequestState.text_in_front`), given
    whether its sink makes text: not with stop sequences, which are found in the text as it is made."""
    return makes_text and not request.stop_sequences


class FrontText:
    """The receiver's side of a request whose text it makes (`RequestState.text_in_front`, `EventSink.
    makes_text`): the records, text and events the engine would have made, from the ids it sent. A
    streamed request's token events (`token`, `token_event`) then its end (`finish`); a text-at-end
    request's end alone (`finish_event_of`)."""

    __slots__ = ("_detokenizer", "_hide_special", "_request", "_special", "tokens")

    def __init__(self, request: GenerationRequest, tokenizer: TokenizerHooks):
        self._request = request
        self._special = tokenizer.special_names
        self._hide_special = request.skip_special_tokens
        self._detokenizer = IncrementalDetokenizer(
            tokenizer.token_bytes, (), request.include_stop_str_in_output, tokenizer.token_text
        )
        self.tokens: list[GeneratedToken] = []  # the records of the token events made so far

    def token(
        self,
        token: int,
        logprob: float,
        top: tuple[Alternative, ...] = (),
        prefill: tuple[PromptToken, ...] = (),
    ) -> TokenEvent:
        """A token event's record and text (`EngineCore._complete`'s: a token with an event never ends
        its request, so only a skipped special token adds no text; without stop sequences all of a
        token's text is released with it)."""
        special = token in self._special
        text = "" if special and self._hide_special else self._detokenizer.add_unstopped(token)
        record = generated_token_of((token, text, text, logprob, special, top))
        tokens = self.tokens
        tokens.append(record)
        return token_event_of((len(tokens), record, prefill))

    def token_event(self, event: TokenEvent) -> TokenEvent:
        """The engine's token event (its record without text) with its text."""
        record = event.token
        return self.token(record.id, record.logprob, record.top, event.prefill)

    def finish(self, event: IdsFinishEvent) -> FinishEvent:
        """The `FinishEvent` the engine would have made where it sent `event`: the records of its ids
        (after the token events' ones), and the whole text."""
        if event.streamed != len(self.tokens):
            raise ValueError(f"the end follows {event.streamed} token events, not {len(self.tokens)}")
        ids = event.ids
        special = list(map(self._special.__contains__, ids))
        top = event.top or ((),) * len(ids)
        detokenizer = self._detokenizer
        rest = texts_at_end(
            self._request, detokenizer, ids, event.logprobs, special, top, event.finish_reason
        )
        return FinishEvent(
            finish_reason=event.finish_reason,
            text=detokenizer.text,
            tail="",  # nothing is held back without stop sequences
            tokens=(*self.tokens, *rest),
            prefill=event.prefill,
            seed=event.seed,
            input_length=event.input_length,
            stop_sequence=None,
        )


def finish_event_of(
    event: IdsFinishEvent, request: GenerationRequest, tokenizer: TokenizerHooks
) -> FinishEvent:
    """The `FinishEvent` the engine would have made for `request` (a text-at-end one) where it sent
    `event` instead: its tokens' records and text, made by the receiver (`EventSink.makes_text`)."""
    return FrontText(request, tokenizer).finish(event)


def alternatives(scores: TokenScores, n: int, vocab_size: int | None = None) -> tuple[Alternative, ...]:
    """The n best candidates the wafer returned that the tokenizer knows, with the model's logprobs."""
    if n <= 0:
        return ()
    known = (
        Alternative(int(token), scores.logprob(logit))
        for token, logit in zip(scores.topk_ids, scores.topk_logits, strict=True)
        if vocab_size is None or token < vocab_size
    )
    return tuple(itertools.islice(known, n))


class EngineCore:
    def __init__(
        self,
        backend: Backend,
        tokenizer: TokenizerHooks,
        max_queue: int,
        step_token_budget: int,
        metrics: ServiceMetrics | None = None,
    ):
        self._tokenizer = tokenizer
        self._max_queue = max_queue
        self._step_token_budget = step_token_budget
        self.metrics = metrics if metrics is not None else ServiceMetrics("wafer-gpt2")
        self.steps = 0
        self._outputs: list[Output] = []
        # Events for requests with a sink, handed over once per step (one call per sink per step instead
        # of one per token): what `_flush` sends.
        self._pending: dict[EventSink, list[SinkOutput]] = {}
        # The tokens of streamed requests whose sink makes their text, as ids, by sink, in the order they
        # were chosen; and those of a deferred step, sent with its deferred work.
        self._streamed: dict[EventSink, list[StreamedIds]] = {}
        self._deferred_ids: dict[EventSink, list[StreamedIds]] = {}
        self._rosters: dict[int, int] = {}  # by group: the number of its runs' rosters (`StreamedIds`)
        # Overlap: with `finish(defer=True)` a chosen token whose request cannot end on its
        # text (no stop sequences) is only recorded; the rest (detokenizing, the event, the metrics, the
        # end) is `complete_deferred`'s, which the worker runs while the backend computes the next step.
        self._deferring = False
        self._deferred: list[tuple[RequestState, StepScores, int, int, float, float]] = []
        # Text-at-end requests whose last token a decode run recorded (they left it, `_run_step`): their
        # records and end wait for `complete_deferred` too, with what the run recorded and how they end.
        self._ending: list[tuple[RequestState, Recorded, FinishReason]] = []
        self._backend_busy = False  # a step is running: slots freed now reach the backend after it
        self._free_later: list[int] = []
        self._tokens_uncounted = 0  # generated tokens not yet added to the metrics' counter (`_flush`)
        # Token latencies (first token, later ones) not yet in the histograms: observed at `_flush`, in bulk.
        self._latencies: tuple[list[float], list[float]] = ([], [])
        # Later-token latencies a decode run's step gives all its rows at once: (latency, tokens).
        self._repeated_latencies: list[tuple[float, int]] = []
        self._gauged: tuple | None = None  # what the gauges were last set from (`record_gauges`)
        # What `_reap` ends at a step boundary, kept aside so that it looks at those requests only, not
        # at every request each step: the cancelled ones, and a heap of (deadline, key) of those with a
        # timeout, soonest first, the key finding the request in `_timed` while it is not finished (an
        # ended request leaves `_timed` at once, so the heap keeps no finished request alive; its
        # entry is dropped when reached).
        self._cancelled: list[RequestState] = []
        self._deadlines: list[tuple[float, int]] = []
        self._timed: dict[int, RequestState] = {}
        self.backend: Backend | None = backend
        # The running requests are stepped in as many groups as the backend takes steps at a time.
        self.scheduler: Scheduler = self._new_scheduler(backend)
        self.record_gauges()

    # ----- the backend ----------------------------------------------------------------------------

    def attach(self, backend: Backend) -> None:
        """Serve on `backend` (a fresh one after a reload): fresh KV slots, the queue kept."""
        self.scheduler.settle()
        scheduler = self._new_scheduler(backend)
        scheduler.waiting.extend(self.scheduler.waiting)
        self.backend, self.scheduler = backend, scheduler
        self._free_later = []  # slots of the old backend
        self.record_gauges()

    def _new_scheduler(self, backend: Backend) -> Scheduler:
        slots = KVSlotManager(backend.num_slots, backend.context_length)
        budget = max(self._step_token_budget, slots.num_slots)
        return Scheduler(slots, self._max_queue, budget, groups=steps_in_flight(backend))

    def detach(self) -> Backend | None:
        """Stop using the backend (it failed or hangs): requests that end now free no wafer slot."""
        backend, self.backend = self.backend, None
        return backend

    # ----- requests --------------------------------------------------------------------------------

    def new_request(
        self, request: GenerationRequest, sink: EventSink | None = None, stream: bool = True
    ) -> RequestState:
        """A request's engine state (not yet queued); `sink`: where its events go (None: `step()`'s
        result); `stream` False: its handler waits for the final event only, so no token events are
        sent to the sink (and, without stop sequences, its text is made only when it ends: by the sink's
        receiver where it makes text, `EventSink.makes_text`)."""
        text_at_end = sink is not None and not stream and not request.stop_sequences
        sampler = Sampler(request.sampling, vocab_size=self._tokenizer.vocab_size)
        # A sink that does not say makes none.
        in_front = text_in_front(request, getattr(sink, "makes_text", False))
        return RequestState(
            stream=stream,
            text_at_end=text_at_end,
            text_in_front=in_front,
            plain=sampler.batched != BATCH_NONE
            and not (
                request.stop_sequences or request.min_tokens or request.top_n_tokens or request.stop_token_ids
            ),
            request=request,
            # Its text is made here or nowhere (the receiver's detokenizer makes it: `FrontText`).
            detokenizer=NO_TEXT
            if in_front
            else IncrementalDetokenizer(
                self._tokenizer.token_bytes,
                request.stop_sequences,
                request.include_stop_str_in_output,
                self._tokenizer.token_text,
            ),
            sampler=sampler,
            sink=sink,
        )

    def add(self, request: GenerationRequest | RequestState) -> RequestState:
        """Queue a request (Overloaded when the queue is full)."""
        state = request if isinstance(request, RequestState) else self.new_request(request)
        needed = state.request.tokens_needed
        if not self.scheduler.slots.fits(needed):  # the API checked; never trust twice
            raise RequestValidationFailed(
                f"the request needs {needed} KV positions; a slot holds {self.scheduler.slots.context_length}"
            )
        self.scheduler.add(state)
        if state.cancelled:  # aborted before it was queued
            self._cancelled.append(state)
        deadline = state.deadline
        if deadline is not None:
            if len(self._deadlines) > 2 * self.scheduler.capacity:  # mostly requests that ended in time
                self._deadlines = [entry for entry in self._deadlines if entry[1] in self._timed]
                heapq.heapify(self._deadlines)
            if state.deadline_key is not None:  # filed before (keys are unique across engines)
                self._timed.pop(state.deadline_key, None)
            key = state.deadline_key = next(_DEADLINE_KEYS)
            self._timed[key] = state
            heapq.heappush(self._deadlines, (deadline, key))
        self.metrics.record_arrival(len(state.request.prompt_ids))
        self.record_gauges()
        return state

    def abort(self, state: RequestState) -> None:
        """The client went away: the request leaves at the next step boundary (its slot with it)."""
        if state.status is RequestStatus.FINISHED or state.cancelled:
            return
        state.cancelled = True
        state.cancelled_at_step = self.steps
        self._cancelled.append(state)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # ----- one step --------------------------------------------------------------------------------

    def step(self) -> list[Output]:
        """Schedule, run and apply one step; the events it produced (none when there is no work)."""
        batch = self.schedule()
        if not batch:
            return self.take_outputs()
        try:
            results = self.execute(batch)
        except BaseException:
            self._step_returned(batch)  # not run: its requests may be stepped again (a caller may retry)
            raise
        return self.finish(batch, results)

    def schedule(self) -> StepBatch:
        """At a step boundary: drop cancelled and timed-out requests, admit waiting ones, batch (the
        requests with no item in a step still in flight: a `PipelinedBackend` may run several)."""
        self.release_slots()  # no step runs now: slots of requests that ended during one go free
        self._reap()
        self.scheduler.admit()
        batch = self.scheduler.build_step()
        self.record_gauges()
        self._flush()
        if not batch:  # idle: the figures queued for the metrics go in now, not at the next render
            self.metrics.fold()
        return batch

    def execute(self, batch: StepBatch, backend: Backend | None = None) -> StepScores:
        """Run the batch on the backend. The worker calls this outside its lock, naming the backend it
        took under the lock (the watchdog may detach it meanwhile)."""
        runner = backend or self.backend
        if runner is None:  # detached (failed or hung) and the caller named none
            raise BackendError("no backend is attached to run the step")
        started = time.monotonic()
        results = runner.step(batch.inputs)
        self.metrics.record_step(time.monotonic() - started, len(batch))
        return results

    def finish(self, batch: StepBatch, results: StepScores, defer: bool = False) -> list[Output]:
        """Apply a step's results: sample, detokenize, check stops; the events produced since the last
        call (including those of requests that ended at the boundary). `defer`: leave what the next step
        does not need to `complete_deferred` (the worker runs it while the backend computes)."""
        self.steps += 1
        if self.scheduler.unsettled:  # runs that ended at the boundary: their requests' tokens first
            self.scheduler.settle()
        self._deferring = defer
        try:
            self._apply(batch, results)
        finally:
            self._deferring = False
        self.record_gauges()
        self._flush()
        return self.take_outputs()

    def complete_deferred(self, backend_busy: bool = False) -> bool:
        """Finish the tokens `finish(defer=True)` only chose: detokenize, emit, end the requests whose
        token ended them. `backend_busy`: a step may run meanwhile, so freed slots reach the backend only
        at the next `schedule` (backends are not thread-safe). False when there was nothing to do."""
        if not (self._deferred or self._ending or self._deferred_ids or self.scheduler.unsettled):
            return False
        self.scheduler.settle()
        deferred, self._deferred = self._deferred, []
        ending, self._ending = self._ending, []
        for sink, streamed in self._deferred_ids.items():
            self._streamed.setdefault(sink, []).extend(streamed)
        self._deferred_ids = {}
        self._backend_busy = backend_busy
        try:
            for state, recorded, finish in ending:
                if state.status is RequestStatus.RUNNING:  # else ended meanwhile (cancelled, timed out)
                    self._end_recorded(state, recorded, finish)
            for state, scores, row, token, logprob, chosen_at in deferred:
                if state.status is not RequestStatus.RUNNING:
                    continue  # ended meanwhile (cancelled, timed out, failed): its token is dropped
                try:
                    self._complete(state, scores, row, token, logprob, chosen_at)
                except Exception:
                    self._request_failed(state)
        finally:
            self._backend_busy = False
        self.record_gauges()
        self._flush()
        return True

    @property
    def has_deferred(self) -> bool:
        return bool(self._deferred or self._ending or self._deferred_ids or self.scheduler.unsettled)

    def release_slots(self) -> None:
        """After a step: free on the backend the slots of requests that ended while it ran."""
        slots, self._free_later = self._free_later, []
        for slot in slots:
            self._free_on_backend(slot, None)

    def take_outputs(self) -> list[Output]:
        outputs, self._outputs = self._outputs, []
        return outputs

    def end_all(self, error: ServiceError, states: Iterable[RequestState] | None = None) -> None:
        """End requests with `error` (default: every queued and running one)."""
        if states is None:
            states = [*self.scheduler.running, *self.scheduler.waiting]
        for state in list(states):
            self._end(state, error=error)
        self._flush()

    def record_gauges(self) -> None:
        """Set the queue and KV gauges, when they changed: this runs several times a step, and setting
        eight gauges (a lock each) costs more than the step's bookkeeping for a few tokens."""
        scheduler = self.scheduler
        slots = scheduler.slots
        held, reserved = slots.counts()
        state = (len(scheduler.waiting), len(scheduler.running), slots, held, reserved)
        if state == self._gauged:
            return
        self._gauged = state
        self.metrics.record_scheduler_state(state[0], state[1], held, slots.num_slots, reserved)

    # ----- inside a step boundary ------------------------------------------------------------------

    def _reap(self) -> None:
        """End the cancelled requests and those past their deadline; one with items in a step still on
        the backend ends once that step is back (a later boundary)."""
        if self._cancelled:
            cancelled, self._cancelled = self._cancelled, []
            for state in cancelled:
                if state.status is RequestStatus.FINISHED:
                    continue
                if state.status is RequestStatus.WAITING and state not in self.scheduler.waiting:
                    continue  # not queued here (yet): `add` files it again
                if self.scheduler.in_flight(state):
                    self._cancelled.append(state)
                    continue
                self._end(state, error=None)
                self.metrics.record_failure("cancelled")
                self.metrics.wafer_cancel_latency_steps.observe(self.steps - state.cancelled_at_step)
        deadlines = self._deadlines
        if not deadlines:
            return
        now = time.monotonic()
        in_flight = []
        while deadlines and now > deadlines[0][0]:
            entry = heapq.heappop(deadlines)
            late = self._timed.get(entry[1])
            if late is None or late.status is RequestStatus.FINISHED:  # it ended in time
                continue
            if self.scheduler.in_flight(late):
                in_flight.append(entry)
                continue
            limit = late.request.timeout_s
            self._end(late, error=RequestTimedOut(f"the request did not finish within {limit:g} s"))
        for entry in in_flight:
            heapq.heappush(deadlines, entry)

    def _apply(self, batch: StepBatch, results: StepScores) -> None:
        self._step_returned(batch)
        if results.count != len(batch):
            raise BackendError(f"the backend returned results for {results.count} items, not {len(batch)}")
        if batch.plain and results.index.shape[0] == results.count:
            self._apply_plain(batch, results)
            return
        to_sample: list[tuple[RequestState, int]] = []  # (request, its row): at most one per request
        running = RequestStatus.RUNNING
        inputs = batch.inputs
        positions, rows, owners = inputs.columns[POSITION].tolist(), results.row_of_item(), batch.owners
        if results.index.shape[0] < results.count:  # prompt tokens nobody asked scores of
            read = _items_read(inputs).tolist()
            positions = [positions[i] for i in read]
            rows = [rows[i] for i in read]
            owners = [owners[i] for i in read]
        for position, row, state in zip(positions, rows, owners, strict=True):
            if state.status is not running:
                continue  # it finished on an earlier item of this step
            if row >= 0 and position >= len(state.request.prompt_ids):
                # A decode item (most of a step): `_apply_item`'s decode branch, without the call.
                state.computed = position + 1
                state.pending_token = None
                to_sample.append((state, row))
                continue
            try:
                if self._apply_item(position, results, row, state):
                    to_sample.append((state, row))
            except Exception:
                self._request_failed(state)
        kinds = [
            state.sampler.batched if state.generated() >= state.request.min_tokens else BATCH_NONE
            for state, _ in to_sample
        ]
        states, rows = [state for state, _ in to_sample], [row for _, row in to_sample]
        picks = as_picks(self._choose_batched(results, states, rows, kinds))
        for (state, row), pick in zip(to_sample, picks, strict=True):
            try:
                self._sample(state, results, row, pick)
            except Exception:
                self._request_failed(state)
        if states:
            self._start_run(batch.group, states)

    def _start_run(self, group: int, sampled: list[RequestState]) -> None:
        """After a step that chose the next token of every request of `group` (`sampled`: those it chose
        for), each to go on the plain way: the group goes on as a run (`DecodeRun`) from its next step,
        which would otherwise take each request's token one at a time before forming it (`_apply_plain`)."""
        scheduler = self.scheduler
        states = scheduler.ready_to_run(group, len(sampled))
        if states is None:
            return
        running = RequestStatus.RUNNING
        if any(state.status is not running for state in sampled):
            return  # one ended: another of the group may have had no token chosen here
        # A deferred token (`_sample`) is not yet among its request's tokens.
        chosen = 1 if self._deferring else 0
        context = scheduler.slots.context_length
        ends_at = [
            min(state.request.max_new_tokens - state.generated() - chosen, context - state.computed)
            for state in states
        ]
        if min(ends_at) < 2:
            # One takes its last token at the run's first step: the run would shrink at once, which
            # costs more than that step taken a request at a time (`_apply_plain`, which forms no run
            # where a request ends).
            return
        tokenizer = self._tokenizer
        run = DecodeRun(
            states,
            scheduler.decode_columns(states),
            time.monotonic(),
            ends_at,
            tokenizer.eos_token_id,
            tokenizer.special_names,
        )
        scheduler.keep(group, run)

    def _apply_plain(self, batch: StepBatch, results: StepScores) -> None:
        """A plain step's results (`StepBatch.plain`: a decode item, and so a scored row, per request,
        each request choosing greedily or sampling with no penalty and no stop string): the tokens
        chosen over the whole step at once (the greedy ones, then the sampling ones, as `_apply` does).
        A step of a group's run (`DecodeRun`) in which every request goes on is recorded by the run, in
        a few array operations; only the requests that hear of each token take theirs one at a time
        (`_run_step`). Otherwise, in one loop, what `_apply` and `_sample` do for such a request: one
        whose text is made at its end or by its sink records its token here (`_complete`'s work for it;
        a streamed one's id goes to its sink with the step's, `StreamedIds`), another streamed one's
        token is completed as `_sample` does, a row the batched choices leave alone and a token
        that ends its request take the general way. When every request goes on, the group goes on as
        a run."""
        owners = batch.owners
        run = batch.run
        if run is not None and run is not self.scheduler.run(batch.group):
            run = None  # it ended while its step ran (a request ended or joined): each on its own
        kinds = run.kinds if run is not None else [state.sampler.batched for state in owners]
        choices = self._choose_batched(results, owners, range(len(owners)), kinds)
        now = time.monotonic()
        if run is not None:
            ids, logprobs, chosen = choices
            if np.count_nonzero(chosen) == len(owners):
                leaving = None if run.goes_on(ids) else run.ending(ids)
                self._run_step(run, batch.group, results, ids, logprobs, now, leaving)
                return
            self.scheduler.end_run(batch.group)  # one of them chooses alone
            self.scheduler.settle()  # what follows reads their tokens
        picks = as_picks(choices)
        eos, special = self._tokenizer.eos_token_id, self._tokenizer.special_names
        context = self.scheduler.slots.context_length
        first, later = self._latencies
        chosen_ids: list[int] = []
        # By row, the step of a run from here at which the row's request takes its last token.
        ends_at: list[int] = []
        recorded = 0  # tokens recorded here (text at the end, or made by the sink), for the metrics
        streamed: dict[EventSink, StreamedIds] = {}  # the tokens of streamed ones whose sink makes text
        running = RequestStatus.RUNNING
        for row, (state, pick) in enumerate(zip(owners, picks, strict=True)):
            if state.status is not running:
                continue  # ended while its step ran (the engine failed it, or stopped)
            state.computed += 1  # a decode item's position is the request's `computed`
            state.pending_token = None
            request = state.request
            generated = len(state.ids) if state.text_in_front else len(state.tokens)
            if (
                pick is None
                or (pick[0] == eos and not request.ignore_eos)
                or generated + 1 >= request.max_new_tokens
                or state.computed >= context
            ):  # chosen alone, or it ends: the general way (which defers an end while deferring)
                try:
                    self._sample(state, results, row, pick)
                except Exception:
                    self._request_failed(state)
                continue
            token, logprob = pick
            chosen_ids.append(token)
            ends_at.append(min(request.max_new_tokens - generated - 1, context - state.computed))
            if state.text_at_end or state.text_in_front:
                (later if generated else first).append(now - (state.last_token_at or state.arrived_at))
                state.last_token_at = now
                if state.text_in_front:
                    state.ids.append(token)
                    state.logprobs.append(logprob)
                else:  # its text is made at its end, here: of records
                    state.tokens.append(generated_token_of((token, "", "", logprob, token in special, ())))
                state.pending_token = token
                recorded += 1
                if state.stream:  # its token event: the sink makes it of the id
                    sink = state.sink
                    assert sink is not None  # the sink makes its text
                    sent = streamed.get(sink)
                    if sent is None:
                        sent = streamed[sink] = StreamedIds(ONE_STEP, [], [], [])
                    sent.request_ids.append(state.id)  # type: ignore[union-attr]  # a list: ONE_STEP
                    sent.ids.append(token)  # type: ignore[union-attr]  # lists: ONE_STEP
                    sent.logprobs.append(logprob)  # type: ignore[union-attr]  # lists: ONE_STEP
            elif self._deferring:  # its next item goes now, its text and event after the next submit
                state.pending_token = token
                self._deferred.append((state, results, row, token, logprob, now))
            else:
                try:
                    self._complete(state, results, row, token, logprob, now)
                except Exception:
                    self._request_failed(state)
        self._tokens_uncounted += recorded
        for sink, sent in streamed.items():
            self._send_ids(sink, sent)
        if len(chosen_ids) == len(owners) and self.scheduler.unchanged(batch):
            columns = next_columns(batch.inputs.columns, chosen_ids)
            self.scheduler.keep(batch.group, DecodeRun(owners, columns, now, ends_at, eos, special))

    def _run_step(
        self,
        run: DecodeRun,
        group: int,
        results: StepScores,
        tokens: np.ndarray,
        logprobs: np.ndarray,
        now: float,
        leaving: np.ndarray | None = None,
    ) -> None:
        """A step of `run`, each request with its token of `tokens`: the run records them; the streamed
        requests whose sink makes their text get the step's ids (`StreamedIds`, in the order of the
        run's roster), the requests that hear of each token take theirs one at a time (`_hear`). Every
        token's latency is the time since the last step's (none is a first token: each request had one).
        `leaving`: by row, whether the token is the request's last: those requests leave the run, which
        goes on with the others (`DecodeRun.leave`); the text-at-end ones get their records and end with
        the deferred work (`_ending`), so that no run's records are made between a step's return and
        the next submit."""
        latency = run.record(tokens, logprobs, now)
        heard, counted = run.heard, run.quiet
        left = self.scheduler.leave(group, leaving) if leaving is not None else ()
        if run.streamed:  # (after `leave`) the rows that go on: a leaving one's last token goes with its end
            on_tokens, on_logprobs = (
                (tokens, logprobs) if leaving is None else (tokens[~leaving], logprobs[~leaving])
            )
            roster = self._rosters.get(group)
            if roster is None:
                roster = self._rosters[group] = next(_ROSTER_NUMBERS)
            for rows in run.streamed:
                self._send_ids(rows.sink, rows.step(roster, on_tokens, on_logprobs))
        ids: list[int] = tokens.tolist() if heard or left else []
        if heard:
            values = logprobs.tolist()
            if self._deferring:  # their next items go now, their text and events after the next submit
                self._deferred += [(state, results, row, ids[row], values[row], now) for row, state in heard]
            else:
                counted += self._hear(heard, results, ids, values, now, leaving)
        eos = self._tokenizer.eos_token_id
        for row, state, recorded in left:
            if state.text_at_end or state.text_in_front:
                ends_on = ids[row] == eos and not state.request.ignore_eos
                finish = FinishReason.EOS if ends_on else FinishReason.LENGTH
                if self._deferring:
                    self._ending.append((state, recorded, finish))
                else:
                    self._end_recorded(state, recorded, finish)
        if counted:
            self._repeated_latencies.append((latency, counted))
            self._tokens_uncounted += counted

    def _end_recorded(self, state: RequestState, recorded: Recorded, finish: FinishReason) -> None:
        """A text-at-end request that left a run with its last token: its records, then its end (no
        records where the receiver makes them: the run's ids go with its end)."""
        try:
            ids, logprobs = recorded.lists()
            if state.text_in_front:
                self._end(state, finish=finish, recorded=(ids, logprobs))
                return
            state.tokens.extend(recorded_tokens(ids, logprobs, self._tokenizer.special_names))
            self._end(state, finish=finish)
        except Exception:
            self._request_failed(state)

    def _hear(
        self,
        heard: list[tuple[int, RequestState]],
        results: StepScores,
        ids: list[int],
        values: list[float],
        now: float,
        leaving: np.ndarray | None,
    ) -> int:
        """`_complete` for the requests of a run that hear of each token (`heard`: their rows), lean where
        the token does not end its request (a plain request has no stop string or token and no
        alternatives, and its token is never its first: no prompt logprobs to send); the tokens so
        heard (the metrics count them with the run's)."""
        special = self._tokenizer.special_names
        pending, outputs = self._pending, self._outputs
        ends = leaving.tolist() if leaving is not None else None
        lean = 0
        for row, state in heard:
            token = ids[row]
            if ends is not None and ends[row]:  # its last token: the general way, which ends it
                try:
                    self._complete(state, results, row, token, values[row], now)
                except Exception:
                    self._request_failed(state)
                continue
            is_special = token in special
            try:
                if is_special and state.request.skip_special_tokens:
                    text = ""
                else:  # a plain request has no stop string: its text is released as it comes
                    text = state.detokenizer.add_unstopped(token)
            except Exception:
                self._request_failed(state)
                continue
            lean += 1
            state.last_token_at = now
            generated = generated_token_of((token, text, text, values[row], is_special, ()))
            state.tokens.append(generated)
            event = token_event_of((len(state.tokens), generated, ()))
            sink = state.sink
            (outputs if sink is None else pending.setdefault(sink, [])).append((state, event))
        return lean

    def _choose_batched(
        self, results: StepScores, states: list[RequestState], rows: Sequence[int], kinds: list[int]
    ) -> Choices:
        """The token and logprob of each request of `states` (its scores: that entry of `rows`) whose
        kind (`Sampler.batched`) lets it choose with the others, in a few array operations for the whole
        step: the greedy ones, then the sampling ones (each with its own generator); not chosen where
        it chooses alone (BATCH_NONE, a row the batch leaves alone, a malformed step: every request
        then chooses alone and fails alone)."""
        vocab_size = self._tokenizer.vocab_size
        m = len(states)
        # All greedy, the usual step (counted: a kind equal to the one counted is the same small int,
        # and `in` would compare each of the others by value, twice over).
        if kinds.count(BATCH_GREEDY) == len(kinds):
            try:
                return greedy_choices(results, rows, vocab_size)
            except Exception:
                return np.zeros(m, dtype=np.int64), np.zeros(m), np.zeros(m, dtype=bool)
        tokens, logprobs, chosen = np.zeros(m, dtype=np.int64), np.zeros(m), np.zeros(m, dtype=bool)
        for kind in (BATCH_GREEDY, BATCH_SAMPLING):
            at = [i for i, k in enumerate(kinds) if k == kind]
            if not at:
                continue
            taken = [rows[i] for i in at]
            try:
                if kind == BATCH_GREEDY:
                    got = greedy_choices(results, taken, vocab_size)
                else:
                    got = sample_choices(results, taken, [states[i].sampler for i in at], vocab_size)
            except Exception:
                continue
            tokens[at], logprobs[at], chosen[at] = got
        return tokens, logprobs, chosen

    def _step_returned(self, batch: StepBatch) -> None:
        """`batch` is off the backend: its requests may be stepped again, and the slots of those that
        ended while it ran are free now, on the backend too."""
        for slot in self.scheduler.step_returned(batch):
            self._free_on_backend(slot, None)

    def _request_failed(self, state: RequestState) -> None:
        # Choosing or detokenizing this request's token failed: a fault of this request (its
        # parameters, its text), not of the wafer. It ends alone; the others and the model go on.
        log.exception(
            "request %s failed while its token was chosen or detokenized",
            state.id,
            extra={"request_id": state.id},
        )
        if state.status is not RequestStatus.FINISHED:
            self._end(state, error=RequestFailed(REQUEST_FAILED_MESSAGE))

    def _apply_item(self, position: int, scores: StepScores, row: int, state: RequestState) -> bool:
        """The result of the item at `position` of `state` (`row` of the step's scores, -1 for none):
        prompt logprobs while prefilling (the item's target is the next prompt token); True when the next
        token is to be chosen from it (the prompt's last or a decode item)."""
        state.computed = position + 1
        prompt = state.prompt
        if position < len(prompt):
            request = state.request
            if request.prompt_logprobs:
                if position == 0:
                    state.prefill.append(PromptToken(prompt[0], None))
                if position < len(prompt) - 1:
                    target = prompt[position + 1]
                    view = _wanted(scores, row)
                    if view.target_logit is None:
                        raise BackendError("the backend returned no logit for a prompt token's target")
                    logprob = view.logprob(view.target_logit)
                    n = request.top_n_tokens if request.prompt_top_n is None else request.prompt_top_n
                    ranks = np.flatnonzero(view.topk_ids == target)
                    rank = int(ranks[0]) + 1 if len(ranks) else None
                    top = alternatives(view, n, self._tokenizer.vocab_size)
                    state.prefill.append(PromptToken(target, logprob, top, rank))
            if position < len(prompt) - 1:
                return False
            if request.max_new_tokens == 0:
                # Scoring (OpenAI echo with max_tokens 0): done with the prefill, no decode step.
                self._end(state, finish=FinishReason.LENGTH)
                return False
        else:
            state.pending_token = None
        if row < 0:
            raise BackendError("the backend returned no scores for an item that wanted them")
        return True

    def _sample(
        self, state: RequestState, scores: StepScores, row: int, pick: tuple[int, float] | None = None
    ) -> None:
        """Choose the next token from `row` of the step's scores (`pick`: already chosen by
        `greedy_batch`), detokenize, check stops."""
        token, logprob = pick if pick is not None else self._choose(state, scores.row(row))
        chosen_at = time.monotonic()
        request = state.request
        if self._deferring and not request.stop_sequences:
            # Only the id decides whether this request goes on (end-of-text, a stop token, the length):
            # the next step gets its item now, the rest waits for complete_deferred.
            ends = (
                (token == self._tokenizer.eos_token_id and not request.ignore_eos)
                or token in request.stop_token_ids
                or state.generated() + 1 >= request.max_new_tokens
                or state.computed >= self.scheduler.slots.context_length
            )
            state.pending_token = None if ends else token
            self._deferred.append((state, scores, row, token, logprob, chosen_at))
            return
        self._complete(state, scores, row, token, logprob, chosen_at)

    def _choose(self, state: RequestState, scores: TokenScores) -> tuple[int, float]:
        """The sampler's choice for a request `greedy_batch` left alone."""
        request = state.request
        early = state.generated() < request.min_tokens  # min_tokens: no end yet
        ends = request.stop_token_ids | (
            frozenset() if request.ignore_eos else {self._tokenizer.eos_token_id}
        )
        banned = ends if early else ()
        p = state.sampler.params
        # The penalties read the history only when they are on: building it is O(length) per token.
        history = state.history() if p.repetition_penalty != 1.0 else ()
        output = state.output_ids() if p.presence_penalty or p.frequency_penalty else ()
        return state.sampler.choose(scores, history, output, banned)

    def _complete(
        self, state: RequestState, scores: StepScores, row: int, token: int, logprob: float, now: float
    ) -> None:
        """A chosen token's text, event and end (`now`: when it was chosen; `row`: its scores')."""
        request, tokenizer = state.request, self._tokenizer
        generated = len(state.ids) if state.text_in_front else len(state.tokens)
        early = generated < request.min_tokens  # min_tokens: no end yet
        self._latencies[1 if generated else 0].append(now - (state.last_token_at or state.arrived_at))
        self._tokens_uncounted += 1
        state.last_token_at = now

        eos = token == tokenizer.eos_token_id and not request.ignore_eos
        stop_token = token in request.stop_token_ids
        special = token in tokenizer.special_names
        if state.text_at_end or state.text_in_front:
            text, released, stop = "", "", None  # `_texts_at_end` or the sink gives it its text
        elif shown(request, special, eos or stop_token):
            text, released, stop = state.detokenizer.add(token, check_stops=not early)
        else:
            text, released, stop = "", "", None  # special and ending tokens add nothing to the text
        top = (
            alternatives(scores.row(row), request.top_n_tokens, tokenizer.vocab_size)
            if request.top_n_tokens
            else ()
        )
        record: GeneratedToken | None = None  # none for a text-in-front one unless an event needs it
        if state.text_in_front:  # its end carries the ids (`_ids_finish`), and the alternatives
            state.ids.append(token)
            state.logprobs.append(logprob)
            if request.top_n_tokens:
                record = generated_token_of((token, text, released, logprob, special, top))
                state.tokens.append(record)
        else:
            record = generated_token_of((token, text, released, logprob, special, top))
            state.tokens.append(record)

        if eos or stop_token:
            self._end(state, finish=FinishReason.EOS)
        elif stop is not None:
            self._end(state, finish=FinishReason.STOP)
        elif generated + 1 >= request.max_new_tokens or state.computed >= self.scheduler.slots.context_length:
            self._end(state, finish=FinishReason.LENGTH)
        else:
            state.pending_token = token
            if state.stream or state.sink is None:  # a non-streamed request hears only its end (`_emit`)
                prefill = tuple(state.prefill) if not generated else ()
                if state.text_in_front and not (top or prefill):  # its sink makes the event of the id
                    self._stream_id(state, token, logprob)
                else:
                    if record is None:  # a text-in-front one's first token with prompt logprobs
                        record = generated_token_of((token, text, released, logprob, special, top))
                    self._emit(state, token_event_of((generated + 1, record, prefill)))

    def _end(
        self,
        state: RequestState,
        finish: FinishReason | None = None,
        error: ServiceError | None = None,
        recorded: tuple[list[int], list[float]] | None = None,
    ) -> None:
        """The one way out of the engine: release the slot (scheduler and wafer), report, notify.
        `recorded`: a text-in-front request's last tokens (ids, logprobs) that have no records."""
        if state.deadline_key is not None:
            self._timed.pop(state.deadline_key, None)
        if state.status is RequestStatus.RUNNING:
            self.scheduler.end_run_of(state)  # what a run kept of the request is its own again
        if self.scheduler.unsettled:
            self.scheduler.settle()
        if finish is not None and state.text_at_end and not state.text_in_front:
            # While the request still runs: a failure to detokenize fails it (`_request_failed`).
            self._texts_at_end(state, finish)
        slot = self.scheduler.remove(state)
        if slot is not None:
            if self._backend_busy:
                self._free_later.append(slot)
            else:
                self._free_on_backend(slot, state)
        now = time.monotonic()
        if finish is not None:
            admitted = state.admitted_at or now
            self.metrics.record_success(
                "stop" if finish is not FinishReason.LENGTH else "length",
                queue_s=admitted - state.arrived_at,
                inference_s=now - admitted,
                generated_tokens=state.generated() + (len(recorded[0]) if recorded else 0),
            )
            if state.text_in_front and state.sink is not None:
                self._pending.setdefault(state.sink, []).append(
                    (state, self._ids_finish(state, finish, recorded))
                )
                return
            tail = state.detokenizer.flush() if finish is not FinishReason.STOP else ""
            self._emit(
                state,
                FinishEvent(
                    finish_reason=finish,
                    text=state.detokenizer.text,
                    tail=tail,
                    tokens=tuple(state.tokens),
                    prefill=tuple(state.prefill),
                    seed=state.sampler.seed,
                    input_length=len(state.prompt),
                    stop_sequence=state.detokenizer.stop_sequence,
                ),
            )
        elif error is not None:
            self.metrics.record_failure(error.metric_reason)
            error.counted = True  # the API's error handler must not count it again
            self._emit(state, ErrorEvent(error))

    def _texts_at_end(self, state: RequestState, finish: FinishReason) -> None:
        """A text-at-end request's tokens get their text now (`texts_at_end`)."""
        tokens = state.tokens
        if not tokens:
            return
        ids, _, _, logprobs, special, top = zip(*tokens, strict=True)
        state.tokens = texts_at_end(state.request, state.detokenizer, ids, logprobs, special, top, finish)

    @staticmethod
    def _ids_finish(
        state: RequestState, finish: FinishReason, recorded: tuple[list[int], list[float]] | None
    ) -> IdsFinishEvent:
        """A text-in-front request's end: its tokens' ids and logprobs (then `recorded`'s), for the
        receiver to make the text of (`FrontText`); a streamed one's after those its token events
        carried: its last (a token with an event never ends its request)."""
        ids, logprobs = state.ids, state.logprobs
        if recorded is not None:
            ids, logprobs = ids + recorded[0], logprobs + recorded[1]
        streamed = max(len(ids) - 1, 0) if state.stream else 0
        ids, logprobs = ids[streamed:], logprobs[streamed:]  # copies: the event outlives nothing here
        top: tuple[tuple[Alternative, ...], ...] = ()
        if state.request.top_n_tokens:  # its tokens' records (a run records no alternatives, but a
            # request that asks for them is never plain)
            top = tuple(token.top for token in state.tokens[streamed:])
            top += ((),) * (len(ids) - len(top))
        prefill = tuple(state.prefill)
        return IdsFinishEvent(
            finish, ids, logprobs, top, prefill, state.sampler.seed, len(state.prompt), streamed
        )

    def _free_on_backend(self, slot: int, state: RequestState | None) -> None:
        if self.backend is None:
            return
        try:
            self.backend.free_slot(slot)
        except Exception:
            log.exception("freeing slot %d failed", slot, extra={"request_id": state.id if state else "-"})

    def _emit(self, state: RequestState, event: Event) -> None:
        """To the request's sink when it has one (the server; sent at the step's end by `_flush`), else to
        `step()`'s result."""
        sink = state.sink
        if sink is None:
            self._outputs.append((state, event))
        elif state.stream or not isinstance(event, TokenEvent):
            self._pending.setdefault(sink, []).append((state, event))

    def _flush(self) -> None:
        """Hand the events of this step to their sinks, one call per sink; count the step's tokens in the
        metrics."""
        if self._tokens_uncounted:
            first, later = self._latencies
            self.metrics.record_step_tokens(self._tokens_uncounted, first, later, self._repeated_latencies)
            self._tokens_uncounted = 0
            self._latencies = ([], [])
            self._repeated_latencies = []
        if not (self._pending or self._streamed):
            return
        pending, self._pending = self._pending, {}
        if not self._streamed:
            for sink, events in pending.items():
                sink.hand_over(events)
            return
        streamed, self._streamed = self._streamed, {}
        for sink, events in pending.items():
            sink.hand_over(events, streamed.pop(sink, None))
        for sink, ids in streamed.items():
            sink.hand_over([], ids)

    def _send_ids(self, sink: EventSink, ids: StreamedIds) -> None:
        """Token events as ids to their sink, with the step's events or its deferred work, after those
        chosen before them."""
        if not ids.ids:
            return
        (self._deferred_ids if self._deferring else self._streamed).setdefault(sink, []).append(ids)

    def _stream_id(self, state: RequestState, token: int, logprob: float) -> None:
        """One token event of a streamed request whose sink makes its text, as its id (`_send_ids`): with
        the last ids going to the sink where those name their requests (`ONE_STEP`)."""
        sink = state.sink
        assert sink is not None  # its sink makes its text
        outgoing = (self._deferred_ids if self._deferring else self._streamed).setdefault(sink, [])
        last = outgoing[-1] if outgoing else None
        if last is None or last.roster != ONE_STEP:
            last = StreamedIds(ONE_STEP, [], [], [])
            outgoing.append(last)
        last.request_ids.append(state.id)  # type: ignore[union-attr]  # a list: ONE_STEP
        last.ids.append(token)  # type: ignore[union-attr]  # lists: ONE_STEP
        last.logprobs.append(logprob)  # type: ignore[union-attr]  # lists: ONE_STEP


def bare_greedy(backend: Backend, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """The bare-backend baseline the benchmarks time the core against (`bench`, `bench service`'s
    direct mode): equal-length prompts in slots 0.., all in one step, then one step per new token,
    each slot taking the wafer's top-1 id. No scheduler, sampler, detokenizer or stop check: it is what
    a step costs with nothing of the engine around it, so it must not run through the core."""
    n, batch = len(prompts[0]), len(prompts)
    slots = list(range(batch))
    prefill = StepInputs.of_fields(
        [slot for slot in slots for _ in range(n)],
        list(range(n)) * batch,
        [token for prompt in prompts for token in prompt],
        ([0] * (n - 1) + [WANT_SCORES]) * batch,
        [0] * (n * batch),
    )
    scores = backend.step(prefill)
    generated: list[list[int]] = [[] for _ in prompts]
    for step in range(new_tokens):
        tokens = scores.topk_ids[:, 0].tolist()
        for out, token in zip(generated, tokens, strict=True):
            out.append(token)
        if step + 1 < new_tokens:
            decode = StepInputs.of_fields(
                slots, [n + step] * batch, tokens, [WANT_SCORES] * batch, [0] * batch
            )
            scores = backend.step(decode)
            if len(scores.index) != batch:
                raise BackendError("the backend returned no scores for an item that wanted them")
    return generated
