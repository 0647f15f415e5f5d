"""The messages between the HTTP process and the engine process, and how they cross the pipe.

Each kind of message is a named tuple below; `KINDS` is the one table of them: the byte that names
the kind on the wire, which way it goes, and, for the two hot kinds, their compact form.

- to the engine: `Submit` (a request, already validated and tokenized), `Cancel`, `Drain`,
  `Shutdown`, `Fault` (the test hook), `Ask` (a question: metrics, KV usage, queue sizes);
- from the engine: `Events` (one step's events), `Shape` (the backend's shape after a load),
  `Status` (the engine's state, also the heartbeat), `Answer`, `Stopped`.

A step's events and a request cross once per step and once per request. Pickled, their records (one
`GeneratedToken` and `TokenEvent` per token, a request's whole token list in its `FinishEvent`) cost
more to pack and unpack than the engine spends choosing and decoding the token: every object is
pickled with its class and rebuilt attribute by attribute. So these two travel as plain tuples,
packed by `marshal` (built-in types only; both ends run the same interpreter), and are rebuilt as the
same records on arrival; the tokens of a step's token events, and of a finish event, travel as
columns. A request whose text the HTTP process makes (no stop sequences) ends as its ids and logprobs
(`IdsFinishEvent`), and a streamed one's tokens without alternatives or prompt logprobs travel as ids
(`StreamedIds`, lists marshal packs as they are; a decode run's steps name their requests once, as
the run's roster): the HTTP process makes their records and text.
Every other message, and an events message with an error in it (rare; an error is an exception with a
class), is pickled (its fields; the kind's byte says which class to rebuild).

On the wire a message is its kind's byte, the form's byte (`MARSHALLED` or `PICKLED`) and the body.
The pipe is private to the server and its own engine process: `marshal`, like `pickle`, is not for
data from anyone else.
"""

from __future__ import annotations

import marshal
import pickle
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields
from functools import partial
from typing import Any, Literal, NamedTuple

from wafer_gpt2.core.steps import BackendError
from wafer_gpt2.engine.kv_slots import KVUsage
from wafer_gpt2.engine.request import (
    Alternative,
    FinishEvent,
    FinishReason,
    GeneratedToken,
    GenerationRequest,
    IdsFinishEvent,
    PromptToken,
    SinkEvent,
    StreamedIds,
    TokenEvent,
    generated_token_of,
    token_event_of,
)
from wafer_gpt2.engine.sampling import SamplingParams
from wafer_gpt2.engine.worker import EngineState

MARSHALLED, PICKLED = b"m", b"p"  # the second byte of every message: the form of its body

# ----- what the messages carry ---------------------------------------------------------------------


@dataclass(frozen=True)
class ShapeReport:
    """What the HTTP process knows of the engine's backend (`wafer_gpt2.core.steps.BackendShape`)."""

    backend: str
    num_slots: int
    context_length: int
    vocab_size: int
    top_k: int
    description: dict

    def describe(self) -> dict:
        return self.description


@dataclass(frozen=True)
class Snapshot:
    """The engine's state as /health, /info and `bench host` read it."""

    state: EngineState
    error: str | None
    fault: str | None
    load_seconds: float | None
    restarts: int
    steps: int
    idle_seconds: float
    kv_usage: KVUsage
    waiting: int
    running: int
    capacity: int
    backend_counters: dict[str, float] = field(default_factory=dict)


Question = Literal["metrics", "kv_usage", "queue_sizes"]  # what `Ask` may ask

# ----- the kinds -----------------------------------------------------------------------------------


class Submit(NamedTuple):
    """Run `request` (the engine's events for it name `request_id`); `stream` False: only its end."""

    request_id: str
    request: GenerationRequest
    stream: bool


class Cancel(NamedTuple):
    """The client went away: end the request and free its slot (no event follows)."""

    request_id: str


class Drain(NamedTuple):
    """Refuse new requests from now on; the running ones finish."""


class Shutdown(NamedTuple):
    """Drain for up to `timeout_s`, fail what is left, stop the engine and then the process."""

    timeout_s: float


class Fault(NamedTuple):
    """The test hook `Engine.inject_fault`, with its arguments."""

    message: str
    steps: int = 1
    reloads: int = 0
    error: type[BaseException] = BackendError


class Ask(NamedTuple):
    """A question; the engine process answers with an `Answer` of the same number."""

    number: int
    question: Question


class Events(NamedTuple):
    """One step's events, by request id, in the order the engine produced them; `streamed`: token events
    as ids (each request's come before its other events: a request has at most one token a step)."""

    events: list[tuple[str, SinkEvent]]
    streamed: list[StreamedIds] | None = None


class Shape(NamedTuple):
    """The shape of the backend a (re)load brought."""

    shape: ShapeReport


class Status(NamedTuple):
    """The engine's state (sent when it changes, and as the heartbeat); `fatal`: why the engine asked
    the server to exit, once it has."""

    snapshot: Snapshot
    fatal: str | None


class Answer(NamedTuple):
    number: int
    answer: Any


class Stopped(NamedTuple):
    """The engine process's last message: nothing more follows."""


ToEngine = Submit | Cancel | Drain | Shutdown | Fault | Ask
FromEngine = Events | Shape | Status | Answer | Stopped
Message = ToEngine | FromEngine


@dataclass(frozen=True)
class Kind:
    """A kind of message: its class, its byte on the wire, its direction and, for a hot kind, its
    compact form (`pack` gives the plain tuple `marshal` packs, or None where the message has a value
    only pickle packs; `unpack` rebuilds the message from it)."""

    type: type
    tag: bytes
    to_engine: bool
    pack: Callable[[Any], tuple | None] | None = None
    unpack: Callable[[tuple], Any] | None = None


def _pack_submit(message: Submit) -> tuple:
    return (message.request_id, _pack_request(message.request), message.stream)


def _unpack_submit(packed: tuple) -> Submit:
    request_id, request, stream = packed
    try:
        return Submit(request_id, _unpack_request(request), stream)
    except Exception as error:  # the constructors' checks (the HTTP process ran them too): a bug
        raise UnreadableRequest(request_id) from error


def _pack_events_message(message: Events) -> tuple | None:
    events = _pack_events(message.events)
    if events is None:
        return None
    streamed = message.streamed
    if streamed is None:
        return events
    return (*events, [(ids.roster, ids.request_ids, ids.ids, ids.logprobs) for ids in streamed])


def _unpack_events_message(packed: tuple) -> Events:
    if len(packed) == 3:
        return Events(_unpack_events(packed))
    return Events(_unpack_events(packed[:3]), [StreamedIds(*ids) for ids in packed[3]])


TO_ENGINE, FROM_ENGINE = True, False

# The one table of the pipe's messages.
KINDS: tuple[Kind, ...] = (
    Kind(Submit, b"s", TO_ENGINE, _pack_submit, _unpack_submit),
    Kind(Cancel, b"c", TO_ENGINE),
    Kind(Drain, b"d", TO_ENGINE),
    Kind(Shutdown, b"x", TO_ENGINE),
    Kind(Fault, b"f", TO_ENGINE),
    Kind(Ask, b"q", TO_ENGINE),
    Kind(Events, b"e", FROM_ENGINE, _pack_events_message, _unpack_events_message),
    Kind(Shape, b"h", FROM_ENGINE),
    Kind(Status, b"t", FROM_ENGINE),
    Kind(Answer, b"a", FROM_ENGINE),
    Kind(Stopped, b"z", FROM_ENGINE),
)
_KIND_OF: dict[type, Kind] = {kind.type: kind for kind in KINDS}
_KIND_BY_TAG: dict[bytes, Kind] = {kind.tag: kind for kind in KINDS}


def encode(message: Message) -> bytes:
    """A message for `Connection.send_bytes`."""
    kind = _KIND_OF[type(message)]
    if kind.pack is not None:
        try:
            packed = kind.pack(message)
            if packed is not None:
                return kind.tag + MARSHALLED + marshal.dumps(packed)
        except ValueError:  # a value marshal cannot pack (a field of a type added later): pickled instead
            pass
    return kind.tag + PICKLED + pickle.dumps(tuple(message), protocol=pickle.HIGHEST_PROTOCOL)


def decode(data: bytes) -> Message:
    """What `encode` was given (records equal to the ones sent). ValueError for bytes that are no
    message of the pipe; `UnreadableRequest` for a request that arrived but cannot be rebuilt."""
    kind = _KIND_BY_TAG.get(data[:1])
    if kind is None:
        raise ValueError(f"not a message of the engine pipe (first byte {bytes(data[:1])!r})")
    form, body = data[1:2], memoryview(data)[2:]
    if form == PICKLED:
        return kind.type(*pickle.loads(body))
    if form != MARSHALLED or kind.unpack is None:
        raise ValueError(f"a {kind.type.__name__} message in an unknown form {bytes(form)!r}")
    return kind.unpack(marshal.loads(body))


def decode_to_engine(data: bytes) -> ToEngine:
    """A message of the HTTP process (in the engine process); ValueError for one that goes the other way."""
    message = decode(data)
    if not isinstance(message, ToEngine):
        raise ValueError(f"a {type(message).__name__} message goes to the HTTP process, not the engine")
    return message


def decode_from_engine(data: bytes) -> FromEngine:
    """A message of the engine process (in the HTTP process); ValueError for one that goes the other way."""
    message = decode(data)
    if not isinstance(message, FromEngine):
        raise ValueError(f"a {type(message).__name__} message goes to the engine, not the HTTP process")
    return message


class UnreadableRequest(ValueError):
    """A request that arrived but could not be rebuilt: the receiver fails it alone, by its id."""

    def __init__(self, request_id: str):
        super().__init__(f"request {request_id} could not be rebuilt")
        self.request_id = request_id


# ----- records as plain tuples ---------------------------------------------------------------------
# The per-token records are named tuples (wafer_gpt2/engine/request.py): packing one is taking its plain tuple
# (marshal packs built-in types only), unpacking it is building the named tuple from that.

_REQUEST_FIELDS = tuple(f.name for f in fields(GenerationRequest))
_SAMPLING_FIELDS = tuple(f.name for f in fields(SamplingParams))
_SAMPLING_AT = _REQUEST_FIELDS.index("sampling")
# A record from its plain tuple, without the named tuple's `_make` (a Python function, a third of the
# unpacking); the sender packed every tuple from a record, so its length is the record's.
_alternative_of = partial(tuple.__new__, Alternative)


def _pack_top(top: tuple[Alternative, ...]) -> tuple:
    return tuple(map(tuple, top))


def _unpack_top(top: tuple) -> tuple[Alternative, ...]:
    return tuple(map(_alternative_of, top))


def _pack_tokens(tokens: tuple[GeneratedToken, ...] | list[GeneratedToken]) -> tuple:
    """Tokens as columns (one tuple per field), the alternatives as plain tuples: built and rebuilt by C
    loops (`zip`, `map`), not a Python call per token."""
    if not tokens:
        return ()
    columns = list(zip(*tokens, strict=True))
    if any(columns[-1]):
        columns[-1] = tuple(map(_pack_top, columns[-1]))
    return tuple(columns)


def _unpack_tokens(columns: tuple) -> Iterator[GeneratedToken]:
    if not columns:
        return iter(())
    if any(columns[-1]):
        columns = (*columns[:-1], tuple(map(_unpack_top, columns[-1])))
    return map(generated_token_of, zip(*columns, strict=True))


def _pack_prefill(prefill: tuple[PromptToken, ...]) -> tuple:
    return tuple((p.id, p.logprob, _pack_top(p.top), p.rank) for p in prefill)


def _unpack_prefill(prefill: tuple) -> tuple[PromptToken, ...]:
    return tuple(PromptToken(p[0], p[1], _unpack_top(p[2]), p[3]) for p in prefill)


def _pack_events(events: list[tuple[str, SinkEvent]]) -> tuple | None:
    """(token events, finish events, ids-only finish events), each packed as tuples; None when an event
    is none of them (an error).

    The token events, most of a step's, travel as columns: their request ids, numbers, tokens (as
    `_pack_tokens` packs them) and prefills. They arrive ahead of the finish events: a request's token
    events all come before its finish event, so each request's own events keep their order."""
    ids: list[str] = []
    numbers: list[int] = []
    tokens: list[GeneratedToken] = []
    prefills: list[tuple] = []
    finishes = []
    ends = []
    for request_id, event in events:
        if type(event) is TokenEvent:
            ids.append(request_id)
            numbers.append(event.number)
            tokens.append(event.token)
            prefills.append(_pack_prefill(event.prefill) if event.prefill else ())
        elif type(event) is FinishEvent:
            finish = (
                event.finish_reason.value,
                event.text,
                event.tail,
                _pack_tokens(event.tokens),
                _pack_prefill(event.prefill),
                event.seed,
                event.input_length,
                event.stop_sequence,
            )
            finishes.append((request_id, finish))
        elif type(event) is IdsFinishEvent:
            top = tuple(map(_pack_top, event.top)) if event.top else ()
            ended = (
                event.finish_reason.value,
                event.ids,
                event.logprobs,
                top,
                _pack_prefill(event.prefill) if event.prefill else (),
                event.seed,
                event.input_length,
                event.streamed,
            )
            ends.append((request_id, ended))
        else:
            return None
    steps = (tuple(ids), tuple(numbers), _pack_tokens(tokens), tuple(prefills)) if ids else ()
    return steps, tuple(finishes), tuple(ends)


def _unpack_events(packed: tuple) -> list[tuple[str, SinkEvent]]:
    steps, finishes, ends = packed
    out: list[tuple[str, SinkEvent]] = []
    if steps:
        ids, numbers, tokens, prefills = steps
        if any(prefills):
            prefills = tuple(_unpack_prefill(p) if p else () for p in prefills)
        built = map(token_event_of, zip(numbers, _unpack_tokens(tokens), prefills, strict=True))
        out = list(zip(ids, built, strict=True))
    for request_id, finish in finishes:
        reason, text, tail, tokens, prefill, seed, input_length, stop_sequence = finish
        event = FinishEvent(
            FinishReason(reason),
            text,
            tail,
            tuple(_unpack_tokens(tokens)),
            _unpack_prefill(prefill),
            seed,
            input_length,
            stop_sequence,
        )
        out.append((request_id, event))
    for request_id, (reason, token_ids, logprobs, top, prefill, seed, input_length, streamed) in ends:
        top = tuple(map(_unpack_top, top)) if top else ()
        ended = IdsFinishEvent(
            FinishReason(reason),
            token_ids,
            logprobs,
            top,
            _unpack_prefill(prefill),
            seed,
            input_length,
            streamed,
        )
        out.append((request_id, ended))
    return out


def _pack_request(request: GenerationRequest) -> tuple:
    values = [getattr(request, name) for name in _REQUEST_FIELDS]
    values[_SAMPLING_AT] = tuple(getattr(request.sampling, name) for name in _SAMPLING_FIELDS)
    return tuple(values)


def _unpack_request(values: tuple) -> GenerationRequest:
    """Through the constructors: the engine process checks what it is asked to run."""
    named = dict(zip(_REQUEST_FIELDS, values, strict=True))
    named["sampling"] = SamplingParams(**dict(zip(_SAMPLING_FIELDS, named["sampling"], strict=True)))
    return GenerationRequest(**named)
