"""One request's life inside the engine: what it asked for, how far it got, what it produced.

`GenerationRequest` is what the API hands the engine after validation and tokenization. `RequestState` is
the engine core's per-request state (slot, positions fed to the wafer, generated tokens, detokenizer,
sampler). Its events (`TokenEvent` per token, then one `FinishEvent` or `ErrorEvent`) are returned by
`EngineCore.step`; under the server they go, once per step, to the request's `EventSink` instead: an
event loop's (`LoopSink`: into the request's asyncio queue on that loop), or the engine process's pipe.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Generic, NamedTuple, Protocol, TypeVar

from wafer_gpt2 import logs
from wafer_gpt2.engine.detokenizer import IncrementalDetokenizer
from wafer_gpt2.engine.failures import ServiceError
from wafer_gpt2.engine.sampling import Sampler, SamplingParams


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: tuple[int, ...]
    max_new_tokens: int  # 0: only the prefill runs (scoring the prompt); the request ends after it
    sampling: SamplingParams = SamplingParams()
    stop_sequences: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    prompt_logprobs: bool = False  # TGI `decoder_input_details`, OpenAI `echo` + `logprobs`
    top_n_tokens: int = 0  # alternatives reported per generated token
    timeout_s: float | None = None  # queue + generation
    # vLLM's extras: end-of-text, stop tokens and stop strings count only after `min_tokens` tokens;
    # a matched stop string (or stop token's text) stays in the output; special tokens show as text.
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    prompt_top_n: int | None = None  # alternatives per prompt token (None: top_n_tokens)

    @property
    def tokens_needed(self) -> int:
        """The KV positions the request is refused without: prompt plus every token it may generate
        (TGI's max_total_tokens rule; the last generated token is never written, which leaves no gap)."""
        return len(self.prompt_ids) + self.max_new_tokens


# The records built per token (an alternative, a generated or prompt token) are named tuples: one is
# built per token on the engine's worker and again where the engine process's messages arrive, and a
# named tuple builds in a fraction of a frozen dataclass's time.


class Alternative(NamedTuple):
    id: int
    logprob: float


class GeneratedToken(NamedTuple):
    id: int
    text: str  # what this token added to the text (complete characters only; "" for special/stop tokens)
    released: str  # text sent to streaming clients with this token (after stop-sequence hold-back)
    logprob: float
    special: bool
    top: tuple[Alternative, ...] = ()


class PromptToken(NamedTuple):
    id: int
    logprob: float | None  # None for the first prompt token (nothing predicts it)
    top: tuple[Alternative, ...] = ()  # the model's best candidates at this position
    rank: int | None = None  # 1 = the model's favourite; None: not among the wafer's top-k candidates


class FinishReason(enum.StrEnum):
    LENGTH = "length"
    EOS = "eos_token"
    STOP = "stop_sequence"


class TokenEvent(NamedTuple):  # built per streamed token, twice with the engine process: a record
    number: int  # 1-based, among the generated tokens (TGI's `index`; a tuple's `index` is a method)
    token: GeneratedToken
    prefill: tuple[PromptToken, ...] = ()  # on the first event only: the prompt logprobs, when asked


# A TokenEvent (a GeneratedToken) from all its fields as one tuple, by `tuple.__new__` alone: the named
# tuple's own `__new__` is a Python function that builds the tuple twice, and this runs per token.
token_event_of = partial(tuple.__new__, TokenEvent)
generated_token_of = partial(tuple.__new__, GeneratedToken)


@dataclass(slots=True)  # built per request, twice with the engine process: not frozen (a frozen
class FinishEvent:  # dataclass sets each field through object.__setattr__, a call each); never modified
    finish_reason: FinishReason
    text: str  # the whole generated text, stop sequence stripped
    tail: str  # text released only now (held back until the end)
    tokens: tuple[GeneratedToken, ...]
    prefill: tuple[PromptToken, ...]
    seed: int | None
    input_length: int
    stop_sequence: str | None


@dataclass(slots=True)
class IdsFinishEvent:
    """The end of a request whose receiver makes its text (`RequestState.text_in_front`): what the engine
    chose, as ids and logprobs, without token records or text. The receiver turns it into the
    `FinishEvent` the engine would have made (`wafer_gpt2.engine.core.FrontText`), as vLLM V1's
    output processor detokenizes in the front process: the engine's thread, the wafer's critical path,
    does not. A streamed request's end carries only the tokens after the `streamed` ones its token
    events carried (its last)."""

    finish_reason: FinishReason
    ids: list[int]
    logprobs: list[float]
    top: tuple[tuple[Alternative, ...], ...]  # by token; () when the request asked for none
    prefill: tuple[PromptToken, ...]
    seed: int | None
    input_length: int
    streamed: int = 0


Member = TypeVar("Member")  # what a receiver keeps of a request (`Rosters`)

# The roster of a `StreamedIds` whose requests go together once only (not a run's: the receiver keeps
# nothing of it for later steps).
ONE_STEP = -1


@dataclass(slots=True)
class StreamedIds:
    """Token events of streamed requests whose receiver makes their text (`RequestState.text_in_front`)
    that carry no alternatives or prompt logprobs (a request's first token among them): by token, its
    id and logprob, in the order of the requests of the roster `roster`. The receiver makes each token's
    record, text and `TokenEvent` (`FrontText.token`), so that the engine's thread does no per-token
    work for them beyond choosing and recording.

    A roster is a decode run's streamed requests of one sink (one number per engine and group), sent
    once: with the run's first step and again when its membership changes (`request_ids`); its other
    steps carry the tokens alone (`request_ids` None), in the same order. Other tokens (a first token,
    a step that is no run's) name their requests each time (`ONE_STEP`)."""

    roster: int
    request_ids: list[str] | None
    # A run's step's as its arrays' bytes (native int64 and float64, `columns`): no Python int or float
    # per token is made, or packed, on the engine's side; other tokens' as the lists they were built in.
    ids: list[int] | bytes
    logprobs: list[float] | bytes

    def columns(self) -> tuple[list[int], list[float]]:
        """The tokens' ids and logprobs, by token (the same values the engine's arrays held)."""
        ids, logprobs = self.ids, self.logprobs
        if isinstance(ids, bytes) and isinstance(logprobs, bytes):
            values = memoryview(logprobs).cast("d").tolist()  # floats, though typed as ints
            return memoryview(ids).cast("q").tolist(), values  # type: ignore[return-value]
        assert isinstance(ids, list) and isinstance(logprobs, list)  # both of one kind
        return ids, logprobs


class Rosters(Generic[Member]):
    """The receiver's side of `StreamedIds`' rosters: each roster's members, found by request id
    (`find`; None: one it no longer holds) once, when the roster arrives, not at every step."""

    __slots__ = ("_find", "_rosters")

    def __init__(self, find: Callable[[str], Member | None]):
        self._find = find
        self._rosters: dict[int, list[Member | None]] = {}

    def members(self, streamed: StreamedIds) -> list[Member | None]:
        """The members of `streamed`'s tokens, by token (ValueError: a roster that never arrived)."""
        request_ids = streamed.request_ids
        if request_ids is not None:
            members = list(map(self._find, request_ids))
            if streamed.roster != ONE_STEP:
                self._rosters[streamed.roster] = members
            return members
        kept = self._rosters.get(streamed.roster)
        if kept is None:
            raise ValueError(f"tokens of roster {streamed.roster}, which never arrived")
        return kept

    def clear(self) -> None:
        """Forget every roster (their sender is gone: a new one names its own)."""
        self._rosters.clear()


@dataclass(frozen=True)
class ErrorEvent:
    error: ServiceError


# What a request's queue gets; an engine's sink may also get an `IdsFinishEvent` (`EventSink.makes_text`).
Event = TokenEvent | FinishEvent | ErrorEvent
SinkEvent = Event | IdsFinishEvent


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_request_numbers = itertools.count(1)


def new_request_id() -> str:
    """Named after the HTTP request it serves (when there is one), so its log lines can be found."""
    http = logs.request_id.get()
    return f"req-{next(_request_numbers)}" if http == logs.NO_REQUEST else f"{http}.{next(_request_numbers)}"


@dataclass(eq=False)
class RequestState:
    request: GenerationRequest
    detokenizer: IncrementalDetokenizer
    sampler: Sampler
    sink: EventSink | None = None  # where its events go; None: a synchronous caller reads `step()`'s
    stream: bool = True  # False: the handler waits for the final event only (no token events are sent)
    # Its tokens get their text in one pass when it ends (`IncrementalDetokenizer.add_all`), not one at
    # a time: nobody reads the text before then (no token events, no stop sequence to find in it).
    text_at_end: bool = False
    # A request without stop sequences whose sink makes the text (`EventSink.makes_text`): its tokens
    # never get text here. Text at the end: it ends with an `IdsFinishEvent` (no records either, for
    # those of a run it left last: its end carries them as ids). Streamed: its token events go with empty
    # text, as ids where they carry no alternatives or prompt logprobs (`StreamedIds`), and its end as
    # its last id.
    text_in_front: bool = False
    # Its events' queue (`events`), made when first read: an engine process's requests never read it.
    _events: asyncio.Queue | None = field(default=None, repr=False)
    id: str = field(default_factory=new_request_id)
    status: RequestStatus = RequestStatus.WAITING
    slot: int | None = None
    computed: int = 0  # positions whose K/V are in the slot
    pending_token: int | None = None  # sampled but not yet fed to the wafer
    # It has items in a step the backend has not returned yet; a decode run's step marks the run instead
    # (`Scheduler.in_flight` reads both).
    in_flight: bool = False
    group: int = 0  # the scheduler's group of running requests it belongs to (its slot's)
    # Its tokens are chosen the plain way (`EngineCore._apply_plain`): greedy or sampled with no
    # penalty, nothing banned, no stop token or string, no alternatives.
    plain: bool = False
    # Its tokens: their records where its text is made here; where its sink makes it (`text_in_front`)
    # their ids and logprobs (`ids`, `logprobs`; a run's at its end, `DecodeRun.settle`), which its end
    # carries, and records only where it asked for alternatives (its end carries theirs).
    tokens: list[GeneratedToken] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    prefill: list[PromptToken] = field(default_factory=list)
    cancelled: bool = False
    cancelled_at_step: int = 0  # the engine's step count when the cancellation arrived
    deadline_key: int | None = None  # its entry among the engine's deadlines (`EngineCore._reap`)
    arrived_at: float = field(default_factory=time.monotonic)
    admitted_at: float | None = None
    last_token_at: float | None = None

    @property
    def events(self) -> asyncio.Queue:
        """Where an event loop's sink puts its events (`deliver`), which its handler reads."""
        events = self._events
        if events is None:
            events = self._events = asyncio.Queue()
        return events

    @property
    def prompt(self) -> tuple[int, ...]:
        return self.request.prompt_ids

    @property
    def prefilling(self) -> bool:
        return self.computed < len(self.prompt)

    @property
    def deadline(self) -> float | None:
        timeout = self.request.timeout_s
        return None if timeout is None else self.arrived_at + timeout

    def history(self) -> list[int]:
        """Prompt and generated ids: what the repetition penalty looks at."""
        return [*self.prompt, *self.output_ids()]

    def generated(self) -> int:
        """How many tokens it has chosen (those of a run it is in once the run ends)."""
        return len(self.ids) if self.text_in_front else len(self.tokens)

    def output_ids(self) -> list[int]:
        """The ids of the tokens it has chosen."""
        return self.ids if self.text_in_front else [token.id for token in self.tokens]


class Submitted(Protocol):
    """A request as the API holds it once an engine took it (`RequestState`, or the HTTP side of one
    in an engine process): its events arrive on `events` (`TokenEvent`s, then one final event)."""

    @property
    def events(self) -> asyncio.Queue: ...


def deliver(events: list[tuple[RequestState, SinkEvent]]) -> None:
    """On the event loop: put a step's events into their requests' queues (the core's one call per step)."""
    for state, event in events:
        state.events.put_nowait(event)


class EventSink(Protocol):
    """Where the engine sends the events of the requests that name it, from the engine's worker thread.
    Two kinds: an event loop's (`LoopSink`, the server in this process) and the engine process's pipe to
    the HTTP process (`wafer_gpt2.engine.process`). A sink whose `makes_text` is True makes the text of
    its requests without stop sequences itself (`RequestState.text_in_front`; one without the attribute
    does not): it gets their ends as `IdsFinishEvent`s and the streamed ones' tokens, but those with
    alternatives or prompt logprobs, as `StreamedIds`."""

    makes_text: bool

    def hand_over(
        self, events: list[tuple[RequestState, SinkEvent]], streamed: list[StreamedIds] | None = None
    ) -> None:
        """One step's events of this sink's requests, in the order they happened (one call per step);
        `streamed`: token events as ids (`StreamedIds`), each request's before its other events."""
        ...

    def wait_for_turn(self, timeout_s: float) -> None:
        """Return once the receiver has had a turn to run, or after `timeout_s`. The worker calls it after
        a short step that held the GIL throughout, so that a receiver sharing this process's GIL can
        bring more requests before the next step; a receiver that does not share it returns at once."""
        ...


class LoopSink:
    """An asyncio event loop as an `EventSink`: a step's events go into their requests' queues in one
    call on the loop. One per loop (`loop_sink`): the engine makes one call per sink and step. It holds
    its loop weakly, as `loop_sink`'s table does: a loop that is gone has nobody listening."""

    __slots__ = ("_loop",)
    makes_text = False  # its requests' queues get whole `FinishEvent`s

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = weakref.ref(loop)

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        return self._loop()

    def hand_over(
        self, events: list[tuple[RequestState, SinkEvent]], streamed: list[StreamedIds] | None = None
    ) -> None:  # `streamed`: never (it makes no text)
        loop = self._loop()
        if loop is None:
            return
        try:
            loop.call_soon_threadsafe(deliver, events)
        except RuntimeError:
            pass  # the event loop is closed (server stopped): nobody is listening any more

    def wait_for_turn(self, timeout_s: float) -> None:
        loop = self._loop()
        if loop is None:
            return
        turned = threading.Lock()  # released by the loop's turn: a plain lock is the cheapest wait
        turned.acquire()
        try:
            loop.call_soon_threadsafe(turned.release)
        except RuntimeError:
            return  # the loop is closed
        turned.acquire(timeout=timeout_s)


_loop_sinks: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopSink] = weakref.WeakKeyDictionary()
_loop_sinks_lock = threading.Lock()


def loop_sink(loop: asyncio.AbstractEventLoop) -> LoopSink:
    """The sink of `loop`'s requests (the same one for every request on it)."""
    sink = _loop_sinks.get(loop)
    if sink is None:
        with _loop_sinks_lock:
            sink = _loop_sinks.setdefault(loop, LoopSink(loop))
    return sink
