"""Delivering the engine's results to HTTP clients: waiting for results (cancelling when the
client disconnects), queueing several requests at once, and Server-Sent Events framing.

Streams write what has arrived in one piece: when several events of a request are waiting (the engine
ran ahead of the event loop), their frames go out as one body chunk, one socket write instead of one
per event. The bytes a client reads are the same; only how they are split into writes differs.
"""

from __future__ import annotations

import asyncio
import json
import json.encoder
from collections.abc import AsyncIterator, Callable, Iterable
from functools import partial
from itertools import repeat
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse as StarletteJSONResponse
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from wafer_gpt2.engine.failures import ServiceError
from wafer_gpt2.engine.request import ErrorEvent, Event, FinishEvent, GenerationRequest, Submitted, TokenEvent
from wafer_gpt2.engine.serving import ServingEngine
from wafer_gpt2.model import tokenizer
from wafer_gpt2.service.connections import WATCH_DISCONNECT, DisconnectWatch
from wafer_gpt2.service.middleware import error_body


async def events(sequence: Submitted) -> AsyncIterator[TokenEvent | FinishEvent | ErrorEvent]:
    while True:
        event = await sequence.events.get()
        yield event
        if not isinstance(event, TokenEvent):
            return


async def event_batches(sequence: Submitted) -> AsyncIterator[list[TokenEvent | FinishEvent | ErrorEvent]]:
    """The request's events, each time as many as have arrived (at least one); the last batch ends with
    the final event."""
    queue = sequence.events
    while True:
        batch = [await queue.get()]
        while not queue.empty():
            batch.append(queue.get_nowait())
        yield batch
        if not isinstance(batch[-1], TokenEvent):
            return


async def last_event(sequence: Submitted) -> FinishEvent | ErrorEvent:
    async for event in events(sequence):
        if not isinstance(event, TokenEvent):
            return event
    raise AssertionError("unreachable")


async def client_gone(request: Request) -> None:
    """Returns when the client disconnects (the body has been read, so only disconnects arrive)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class ClientGone(Exception):
    pass


# Put into a request's event queue when its client disconnects (`_final_event`).
_CLIENT_GONE = object()


async def _final_event(
    engine: ServingEngine, sequence: Submitted, watch: DisconnectWatch
) -> FinishEvent | ErrorEvent:
    """The final event of one request, in the handler's own task: the server's disconnect callback puts
    `_CLIENT_GONE` into the request's queue, so no task reads ASGI `receive` meanwhile."""
    queue = sequence.events
    watch(partial(queue.put_nowait, _CLIENT_GONE))
    try:
        while True:
            event = await queue.get()
            if event is _CLIENT_GONE:
                raise ClientGone()
            if isinstance(event, (FinishEvent, ErrorEvent)):  # a non-streamed request hears no other
                return event
    finally:
        watch(None)
        engine.cancel(sequence)  # a no-op once it finished


async def wait_for_results(
    request: Request, engine: ServingEngine, sequences: list[Submitted]
) -> list[FinishEvent]:
    """The final event of each request; a client that disconnects cancels them all."""
    watch: DisconnectWatch | None = request.scope.get(WATCH_DISCONNECT)
    if watch is not None and len(sequences) == 1:  # the usual case, on this server's own protocol
        result = await _final_event(engine, sequences[0], watch)
        if isinstance(result, ErrorEvent):
            raise result.error
        return [result]
    watcher = asyncio.create_task(client_gone(request))
    waits = [asyncio.create_task(last_event(sequence)) for sequence in sequences]
    try:
        pending: set[asyncio.Task] = set(waits)
        while pending:
            done, pending = await asyncio.wait(pending | {watcher}, return_when=asyncio.FIRST_COMPLETED)
            if watcher in done:
                raise ClientGone()
            pending.discard(watcher)
        results = [task.result() for task in waits]
    finally:
        watcher.cancel()
        for task in waits:
            task.cancel()
        for sequence in sequences:
            engine.cancel(sequence)  # a no-op for those that finished
    finals: list[FinishEvent] = []
    for result in results:
        if isinstance(result, ErrorEvent):
            raise result.error
        finals.append(result)
    return finals


def submit_all(
    engine: ServingEngine, requests: list[GenerationRequest], stream: bool = True
) -> list[Submitted]:
    """Queue every request or none (a refusal cancels the ones already queued); `stream` False: the
    handler reads only the final events (`wait_for_results`)."""
    sequences: list[Submitted] = []
    try:
        for request in requests:
            sequences.append(engine.submit(request, stream))
    except ServiceError:
        for sequence in sequences:
            engine.cancel(sequence)
        raise
    return sequences


async def openai_sse(
    engine: ServingEngine,
    sequences: list[Submitted],
    path: str,
    render: Callable[[int, TokenEvent | FinishEvent], list[bytes]],
    usage_chunk: Callable[[int], bytes | None],
) -> AsyncIterator[bytes]:
    """The frame every OpenAI stream shares: the events of all choices as they come, each turned into
    chunks by `render(position, event)`; then `usage_chunk(completion_tokens)` (when it gives one) and
    always `data: [DONE]`. An error ends the stream with an error event (then `[DONE]`); a client that
    goes away cancels the choices still running."""
    merged: asyncio.Queue = asyncio.Queue()

    async def pump(position: int, sequence: Submitted) -> None:
        async for event in events(sequence):
            await merged.put((position, event))

    async def several() -> AsyncIterator[list[tuple[int, TokenEvent | FinishEvent | ErrorEvent]]]:
        while True:
            batch = [await merged.get()]
            while not merged.empty():
                batch.append(merged.get_nowait())
            yield batch

    # One choice (the usual case) reads its request's queue directly, its events numbered 0 as they are
    # read (no generator of its own: one more hop per chunk); several are merged by pumps.
    single = len(sequences) == 1
    pumps = [] if single else [asyncio.create_task(pump(i, s)) for i, s in enumerate(sequences)]
    remaining, completion_tokens = len(sequences), 0
    batches: AsyncIterator[list[Any]] = event_batches(sequences[0]) if single else several()
    try:
        async for batch in batches:
            out: list[bytes] = []
            numbered: Iterable[tuple[int, Event]] = zip(repeat(0), batch) if single else batch
            for position, event in numbered:
                if isinstance(event, ErrorEvent):
                    out.append(sse(error_body(event.error, path)))
                    remaining = -1
                    break
                if isinstance(event, FinishEvent):
                    remaining -= 1
                    completion_tokens += len(event.tokens)
                out.extend(render(position, event))
            if remaining == 0:
                usage = usage_chunk(completion_tokens)
                if usage is not None:
                    out.append(usage)
            if remaining <= 0:
                out.append(sse("[DONE]"))
                yield b"".join(out)
                break
            yield b"".join(out)
    finally:
        for task in pumps:
            task.cancel()
        for sequence in sequences:
            engine.cancel(sequence)  # a no-op for those that finished


class EventStreamResponse(StreamingResponse):
    """Starlette's StreamingResponse without its anyio task group: the stream is written from the
    request's own task while a plain asyncio task waits for the client to disconnect, and cancels the
    writing when it does (as Starlette's does: the stream's generator then cancels its engine requests).
    The same bytes; the task group, its cancel scopes and a second task per stream cost more than
    writing a short stream's events."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()
        if scope["type"] != "http" or task is None:
            await super().__call__(scope, receive, send)
            return
        gone = False

        def left() -> None:
            nonlocal gone
            gone = True
            task.cancel()

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            left()

        # This server's protocol calls `left` itself; under another server a task reads `receive`.
        server_watch: DisconnectWatch | None = scope.get(WATCH_DISCONNECT)
        if server_watch is not None:
            server_watch(left)
        watcher = None if server_watch is not None else asyncio.get_running_loop().create_task(watch())
        try:
            await self.stream_response(send)
        except asyncio.CancelledError:
            if not gone:
                raise  # cancelled from elsewhere (the server stopping): not ours to swallow
            task.uncancel()  # the client went away: the response ends here, as Starlette's does
        finally:
            if server_watch is not None:
                server_watch(None)
            if watcher is not None:
                watcher.cancel()
        if self.background is not None:
            await self.background()


_COMPACT = json.JSONEncoder(separators=(",", ":"))  # built once: json.dumps with options builds one per call
# `_COMPACT.encode`'s C encoder, built once: `encode` builds it again at every call (a large part of an
# event's encoding). The same output: no indent, no sorting, NaN allowed, no circularity check (the
# events are fresh trees of dicts and lists).
_make_encoder = getattr(json.encoder, "c_make_encoder", None)  # None where the C accelerator is missing
_C_ENCODER = (
    None
    if _make_encoder is None
    else _make_encoder(
        None, _COMPACT.default, json.encoder.encode_basestring_ascii, None, ":", ",", False, False, True
    )
)
# Starlette's `JSONResponse.render` (`json.dumps(..., ensure_ascii=False, allow_nan=False, separators=...)`)
# with its C encoder built once, as `_C_ENCODER` is: Starlette builds one per non-streamed response. The
# same bytes and errors, except that it has no circularity check either: a response is a fresh tree, and
# a circular one would raise RecursionError instead of ValueError.
_C_RESPONSE_ENCODER = (
    None
    if _make_encoder is None
    else _make_encoder(
        None, _COMPACT.default, json.encoder.encode_basestring, None, ":", ",", False, False, False
    )
)


class JSONResponse(StarletteJSONResponse):
    """JSON as UTF-8, except that text the client sent with lone surrogates (valid JSON escapes, not
    valid Unicode) is echoed back as the same escapes instead of failing to encode."""

    def render(self, content: object) -> bytes:
        try:
            if _C_RESPONSE_ENCODER is None or isinstance(content, str):
                return super().render(content)
            return "".join(_C_RESPONSE_ENCODER(content, 0)).encode("utf-8")
        except UnicodeEncodeError:
            return json.dumps(content, allow_nan=False, separators=(",", ":")).encode("ascii")


def compact_json(data: object) -> str:
    """`json.dumps(data, separators=(",", ":"))`."""
    if _C_ENCODER is None or isinstance(data, str):
        return _COMPACT.encode(data)
    return "".join(_C_ENCODER(data, 0))


def sse(data: dict | str) -> bytes:
    payload = data if isinstance(data, str) else compact_json(data)
    return f"data: {payload}\n\n".encode()


def token_string(token: int) -> str:
    """A token's own text (bytes that are not a whole character show as U+FFFD)."""
    return tokenizer.decode([token])
