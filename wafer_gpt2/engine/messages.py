"""The hot messages between the HTTP process and the engine process, in a compact form (issue 18).

A step's events (`("events", [(request id, event), ...])`) and a request (`("submit", id, request,
stream)`) cross the pipe once per step and once per request. Pickled, their records (one
`GeneratedToken` and `TokenEvent` per token, a request's whole token list in its `FinishEvent`) cost
more to pack and unpack than the engine spends choosing and decoding the token: every object is
pickled with its class and rebuilt attribute by attribute. Here they travel as plain tuples, packed by
`marshal` (built-in types only; both ends run the same interpreter), and are rebuilt as the same
records on arrival; the tokens of a step's token events, and of a finish event, travel as columns.
Every other message, and an events message with an error in it (rare; an error is an exception with
a class), is pickled as before.

The pipe is private to the server and its own engine process: `marshal`, like `pickle`, is not for
data from anyone else.
"""

from __future__ import annotations

import marshal
import pickle
from collections.abc import Iterator
from dataclasses import fields
from functools import partial

from wafer_gpt2.engine.request import (
    Alternative,
    Event,
    FinishEvent,
    FinishReason,
    GeneratedToken,
    GenerationRequest,
    PromptToken,
    TokenEvent,
    generated_token_of,
    token_event_of,
)
from wafer_gpt2.engine.sampling import SamplingParams

MARSHALLED, PICKLED = b"m", b"p"  # the first byte of every message


def encode(message: tuple) -> bytes:
    """A message for `Connection.send_bytes`."""
    kind = message[0]
    try:
        if kind == "events":
            packed = _pack_events(message[1])
            if packed is not None:
                return MARSHALLED + marshal.dumps(("events", packed))
        elif kind == "submit":
            _, request_id, request, stream = message
            return MARSHALLED + marshal.dumps(("submit", request_id, _pack_request(request), stream))
    except ValueError:  # a value marshal cannot pack (a field of a type added later): pickled instead
        pass
    return PICKLED + pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def decode(data: bytes) -> tuple:
    """What `encode` was given (records equal to the ones sent)."""
    tag, body = data[:1], memoryview(data)[1:]
    if tag == PICKLED:
        return pickle.loads(body)
    if tag != MARSHALLED:
        raise ValueError(f"not a message of the engine pipe (first byte {bytes(tag)!r})")
    message = marshal.loads(body)
    kind = message[0]
    if kind == "events":
        return ("events", _unpack_events(message[1]))
    if kind == "submit":
        _, request_id, request, stream = message
        try:
            return ("submit", request_id, _unpack_request(request), stream)
        except Exception as error:  # the constructors' checks (the HTTP process ran them too): a bug
            raise UnreadableRequest(request_id) from error
    raise ValueError(f"unknown marshalled message {kind!r}")


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


def _pack_events(events: list[tuple[str, Event]]) -> tuple | None:
    """(token events, finish events), each packed as tuples; None when an event is neither (an error).

    The token events, most of a step's, travel as columns: their request ids, numbers, tokens (as
    `_pack_tokens` packs them) and prefills. They arrive ahead of the finish events: a request's token
    events all come before its finish event, so each request's own events keep their order."""
    ids: list[str] = []
    numbers: list[int] = []
    tokens: list[GeneratedToken] = []
    prefills: list[tuple] = []
    finishes = []
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
        else:
            return None
    steps = (tuple(ids), tuple(numbers), _pack_tokens(tokens), tuple(prefills)) if ids else ()
    return steps, tuple(finishes)


def _unpack_events(packed: tuple) -> list[tuple[str, Event]]:
    steps, finishes = packed
    out: list[tuple[str, Event]] = []
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
