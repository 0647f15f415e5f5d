"""Delivering the engine's results to HTTP clients: waiting for results (cancelling when the
client disconnects), queueing several requests at once, and Server-Sent Events framing.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse as StarletteJSONResponse

from service.engine import Engine
from service.errors import ServiceError
from service.middleware import error_body
from service.request import ErrorEvent, FinishEvent, GenerationRequest, RequestState, TokenEvent
from weights import tokenizer


async def events(sequence: RequestState) -> AsyncIterator[TokenEvent | FinishEvent | ErrorEvent]:
    while True:
        event = await sequence.events.get()
        yield event
        if not isinstance(event, TokenEvent):
            return


async def last_event(sequence: RequestState) -> FinishEvent | ErrorEvent:
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


async def wait_for_results(
    request: Request, engine: Engine, sequences: list[RequestState]
) -> list[FinishEvent]:
    """The final event of each request; a client that disconnects cancels them all."""
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


def submit_all(engine: Engine, requests: list[GenerationRequest]) -> list[RequestState]:
    """Queue every request or none (a refusal cancels the ones already queued)."""
    sequences: list[RequestState] = []
    try:
        for request in requests:
            sequences.append(engine.submit(request))
    except ServiceError:
        for sequence in sequences:
            engine.cancel(sequence)
        raise
    return sequences


async def openai_sse(
    engine: Engine,
    sequences: list[RequestState],
    path: str,
    render: Callable[[int, TokenEvent | FinishEvent], list[bytes]],
    usage_chunk: Callable[[int], bytes | None],
) -> AsyncIterator[bytes]:
    """The frame every OpenAI stream shares: the events of all choices as they come, each turned into
    chunks by `render(position, event)`; then `usage_chunk(completion_tokens)` (when it gives one) and
    always `data: [DONE]`. An error ends the stream with an error event (then `[DONE]`); a client that
    goes away cancels the choices still running."""
    merged: asyncio.Queue = asyncio.Queue()

    async def pump(position: int, sequence: RequestState) -> None:
        async for event in events(sequence):
            await merged.put((position, event))

    pumps = [asyncio.create_task(pump(i, sequence)) for i, sequence in enumerate(sequences)]
    remaining, completion_tokens = len(sequences), 0
    try:
        while remaining:
            position, event = await merged.get()
            if isinstance(event, ErrorEvent):
                yield sse(error_body(event.error, path))
                break
            if isinstance(event, FinishEvent):
                remaining -= 1
                completion_tokens += len(event.tokens)
            for chunk in render(position, event):
                yield chunk
        else:
            usage = usage_chunk(completion_tokens)
            if usage is not None:
                yield usage
        yield sse("[DONE]")
    finally:
        for task in pumps:
            task.cancel()
        for sequence in sequences:
            engine.cancel(sequence)  # a no-op for those that finished


class JSONResponse(StarletteJSONResponse):
    """JSON as UTF-8, except that text the client sent with lone surrogates (valid JSON escapes, not
    valid Unicode) is echoed back as the same escapes instead of failing to encode."""

    def render(self, content: object) -> bytes:
        try:
            return super().render(content)
        except UnicodeEncodeError:
            return json.dumps(content, allow_nan=False, separators=(",", ":")).encode("ascii")


def sse(data: dict | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


def token_string(token: int) -> str:
    """A token's own text (bytes that are not a whole character show as U+FFFD)."""
    return tokenizer.decode([token])
