"""The load generator of `wafer-gpt2 bench host`: many keep-alive HTTP/1.1 connections over raw sockets,
in a process of its own, so that its work is never the service's.

Each connection sends the same request again and again for a window of time and counts what comes
back: for a stream, its `data:` events as they arrive (the token events; the closing `[DONE]` and a
usage chunk are not tokens), for a plain response the tokens it was asked to carry. Parsing is the
least that is safe (headers, Content-Length or chunked framing, counting a byte pattern), so one core of
this process takes hundreds of thousands of events per second; `replay_server` gives the same client a
trivial endpoint that replays a recorded response at once, and its rate there is the client's ceiling.
"""

from __future__ import annotations

import asyncio
import os
import resource
import time
from dataclasses import dataclass

TERMINAL_CHUNK = b"0\r\n\r\n"  # chunked encoding's last chunk (a data chunk ends in \n\n\r\n)


@dataclass(frozen=True)
class LoadJob:
    """What one run sends: `request` (raw bytes) over `connections` connections for `seconds` after a
    `warmup_s`; `tokens_per_response`: what a plain response counts; `events_not_tokens`: events per
    stream that are not tokens (OpenAI's [DONE])."""

    host: str
    port: int
    request: bytes
    connections: int
    seconds: float
    warmup_s: float
    stream: bool
    tokens_per_response: int
    events_not_tokens: int = 0


@dataclass(frozen=True)
class LoadResult:
    tokens: int  # tokens received inside the window
    responses: int  # responses completed inside the window
    window_s: float
    cpu_s: float  # this process's CPU time inside the window
    errors: int  # responses that were not 200, or streams with the wrong number of events
    first_error: str = ""

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.window_s if self.window_s else 0.0


class _Counter:
    def __init__(self, start: float, end: float) -> None:
        self.start, self.end = start, end
        self.tokens = self.responses = self.errors = 0
        self.first_error = ""

    def add_tokens(self, n: int) -> None:
        if self.start <= time.perf_counter() < self.end:
            self.tokens += n

    def add_response(self) -> None:
        if self.start <= time.perf_counter() < self.end:
            self.responses += 1

    def error(self, what: str) -> None:
        self.errors += 1
        self.first_error = self.first_error or what[:300]


async def _connection(job: LoadJob, counter: _Counter, stop_at: float) -> None:
    reader, writer = await asyncio.open_connection(job.host, job.port)
    try:
        while time.perf_counter() < stop_at:
            writer.write(job.request)
            head = await reader.readuntil(b"\r\n\r\n")
            status = head[9:12]
            lower = head.lower()
            if b"transfer-encoding: chunked" in lower:
                events = await _read_chunked(reader, counter, job)
            else:
                at = lower.index(b"content-length:") + 15
                length = int(lower[at : lower.index(b"\r\n", at)])
                body = await reader.readexactly(length)
                events = body.count(b"data:")
                if job.stream:
                    counter.add_tokens(max(0, events - job.events_not_tokens))
            if status != b"200":
                counter.error(f"status {status.decode()}: {head[:200]!r}")
                continue
            if job.stream:
                tokens = events - job.events_not_tokens
                if tokens != job.tokens_per_response:
                    counter.error(
                        f"a stream carried {tokens} token events, expected {job.tokens_per_response}"
                    )
            else:
                counter.add_tokens(job.tokens_per_response)
            counter.add_response()
    finally:
        writer.close()


async def _read_chunked(reader: asyncio.StreamReader, counter: _Counter, job: LoadJob) -> int:
    """Read a chunked body to its end, counting `data:` events as they arrive; the events seen."""
    seen = 0
    tail = b""
    pending_not_tokens = job.events_not_tokens
    while True:
        data = await reader.read(65536)
        if not data:
            raise ConnectionError("the server closed the connection inside a response")
        # Each event arrives in one chunk of the server's; a split `data:` is caught by the overlap.
        window = tail[-4:] + data
        events = window.count(b"data:")
        seen += events
        if job.stream:
            # [DONE] is the stream's last event: count every event as a token now and take the
            # non-token ones back when the stream ends.
            counter.add_tokens(events)
        tail = window
        if window.endswith(TERMINAL_CHUNK) and (len(window) < 7 or window[-7:-5] == b"\r\n"):
            if job.stream and pending_not_tokens:
                counter.add_tokens(-pending_not_tokens)
            return seen


async def _run(job: LoadJob) -> LoadResult:
    now = time.perf_counter()
    start, end = now + job.warmup_s, now + job.warmup_s + job.seconds
    counter = _Counter(start, end)
    tasks = [asyncio.ensure_future(_connection(job, counter, end)) for _ in range(job.connections)]
    await asyncio.sleep(max(0.0, start - time.perf_counter()))
    cpu0 = _cpu()
    await asyncio.sleep(max(0.0, end - time.perf_counter()))
    cpu1 = _cpu()
    # Responses in flight at the end finish (their tokens are outside the window); then the sockets close.
    done, pending = await asyncio.wait(tasks, timeout=30.0)
    for task in pending:
        task.cancel()
    for task in done:
        if task.exception() is not None:
            counter.error(f"{type(task.exception()).__name__}: {task.exception()}")
    return LoadResult(
        counter.tokens, counter.responses, job.seconds, cpu1 - cpu0, counter.errors, counter.first_error
    )


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _new_loop() -> asyncio.AbstractEventLoop:
    import uvloop  # a run dependency; imported here so that building the CLI's parser does not load it

    return uvloop.new_event_loop()


def run_job(job: LoadJob) -> LoadResult:
    loop = _new_loop()
    try:
        return loop.run_until_complete(_run(job))
    finally:
        loop.close()


def client_process(connection) -> None:
    """The client process: run each LoadJob it is sent and answer ("ok", LoadResult) or ("error",
    message); None ends it."""
    connection.send(("ready", os.getpid()))
    while (job := connection.recv()) is not None:
        try:
            connection.send(("ok", run_job(job)))
        except Exception as error:  # reported to the benchmark, which raises it there
            connection.send(("error", f"{type(error).__name__}: {error}"))


# ----- the trivial endpoint: the client's ceiling ------------------------------------------------------


class _Replay(asyncio.Protocol):
    """Answers every request on the connection with the same recorded bytes, at once."""

    def __init__(self, response: bytes) -> None:
        self.response = response
        self.buffer = b""

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while True:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buffer[:end].lower()
            at = head.find(b"content-length:")
            length = 0 if at < 0 else int(head[at + 15 :].split(b"\r\n", 1)[0])
            if len(self.buffer) < end + 4 + length:
                return
            self.buffer = self.buffer[end + 4 + length :]
            self.transport.write(self.response)


def replay_server(connection) -> None:
    """A process serving recorded responses on 127.0.0.1: it is sent (response bytes) and answers
    ("ready", port); None ends it."""
    loop = _new_loop()
    asyncio.set_event_loop(loop)
    response = connection.recv()
    server = loop.run_until_complete(loop.create_server(lambda: _Replay(response), "127.0.0.1", 0))
    connection.send(("ready", server.sockets[0].getsockname()[1]))
    loop.add_reader(connection.fileno(), loop.stop)  # anything (or EOF) from the benchmark ends it
    loop.run_forever()
    server.close()
    loop.close()


def record_response(host: str, port: int, request: bytes, timeout_s: float = 60.0) -> bytes:
    """One whole response to `request` as raw bytes (for the replay server), over a fresh connection."""
    import socket

    with socket.create_connection((host, port), timeout=timeout_s) as sock:
        sock.sendall(request)
        data = b""
        while True:
            part = sock.recv(65536)
            if not part:
                return data
            data += part
            end = data.find(b"\r\n\r\n")
            if end < 0:
                continue
            head = data[:end].lower()
            if b"transfer-encoding: chunked" in head:
                if data.endswith(TERMINAL_CHUNK) and data[-7:-5] == b"\r\n":
                    return data
            else:
                at = head.index(b"content-length:") + 15
                length = int(head[at:].split(b"\r\n", 1)[0])
                if len(data) >= end + 4 + length:
                    return data
