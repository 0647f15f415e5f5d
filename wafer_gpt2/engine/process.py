"""The engine in a process of its own (vLLM's split of the API server from the engine core).

In one process the HTTP event loop and the engine's worker take turns on one GIL: with a backend
that answers at once, the server holds the GIL nearly all the time and uses one core of two. Here
the engine (`wafer_gpt2/engine/worker.py`, unchanged: worker, reload, watchdog, drain) runs in a spawned
process, and the HTTP process talks to it over a pipe (the messages, typed, in
`wafer_gpt2/engine/messages.py`):

- to the engine: `Submit` (the request's id, the `GenerationRequest`, whether it streams), `Cancel`,
  `Drain`, `Shutdown`, `Fault` (the test hook), `Ask` (metrics, KV usage, queue sizes);
- from the engine: each step's events in one `Events` message (the engine core hands a step's events
  to the requests' sink in one call, `_PipeSink` here), the engine's state whenever it changes and at
  least every quarter of the heartbeat deadline (`Status`: the heartbeat), the backend's `Shape`,
  `Answer`s, and `Stopped` last.

Requests and step events cross in a compact form (plain tuples packed by marshal), the rest pickled.
The text of a request without stop sequences is made here, in the HTTP process
(`EngineProcess._deliver_events`, `FrontText`), not on the engine's thread (`_PipeSink.makes_text`):
a non-streamed one ends as its ids and logprobs (`IdsFinishEvent`); a streamed one's token events
come without text, as ids where they carry no alternatives or prompt logprobs (`StreamedIds`; a decode
run's steps in the order of its roster, sent once), and its end as its last id.
The engine process's reader hands each request to the worker without taking the engine's lock
(`Engine.submit_nowait`); `_Book` keeps the requests by id for cancellations. In the HTTP process the
server's event loop reads the pipe itself (`FrameReader`), so the loop has no thread to share the GIL
with and puts each step's events into its requests' queues directly; it writes the pipe without ever
blocking (`PipeOutbox`: what the pipe cannot take waits there, bounded).

`EngineProcess` has the surface the API uses of an `Engine`. A request is refused in the HTTP process
(synchronously, as the in-process engine does) when the last known state is not READY, or when the
requests it has sent and not yet seen end reach the engine's capacity (slots plus queue). The engine
checks again: a refusal there arrives as the request's error event.

The backend lives in the engine process; the HTTP process sees its shape (`ShapeReport`: what the
request limits and /info read). The engine's metrics are recorded there: /metrics asks for their
samples and merges them with this process's own (`ServiceMetrics.render`; without an answer within
`answer_timeout_s`, only this process's own series); `kv_usage` and `queue_sizes` are asked too (a
round trip each, off the event loop that reads the answers), the rest is read from the last state
report.

The HTTP process watches the engine process without relying on it: a process silent past its heartbeat
deadline (stopped, hung) is UNRESPONSIVE until it reports again, and the requests it holds end at their
own deadline on this side; a process that dies is started again in place, up to a limit (see
`EngineProcess`).

The engine process is spawned (nothing of this process's threads or locks is inherited), so the
backend factory must be picklable, and a script that starts a server this way needs the usual
`if __name__ == "__main__":` guard.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import multiprocessing
import os
import signal
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, assert_never

from wafer_gpt2 import logs
from wafer_gpt2.core.steps import Backend
from wafer_gpt2.engine import heap
from wafer_gpt2.engine import messages as engine_messages
from wafer_gpt2.engine.core import (
    FrontText,
    TokenizerHooks,
    finish_event_of,
    gpt2_tokenizer_hooks,
    text_in_front,
)
from wafer_gpt2.engine.failures import Overloaded, RequestTimedOut, ServiceError, Unavailable
from wafer_gpt2.engine.kv_slots import KVUsage
from wafer_gpt2.engine.messages import (
    Answer,
    Ask,
    Cancel,
    Drain,
    Events,
    Fault,
    FromEngine,
    Question,
    Shape,
    ShapeReport,
    Shutdown,
    Snapshot,
    Status,
    Stopped,
    Submit,
    ToEngine,
)
from wafer_gpt2.engine.metrics import Family, ServiceMetrics
from wafer_gpt2.engine.request import (
    ErrorEvent,
    Event,
    FinishEvent,
    GenerationRequest,
    IdsFinishEvent,
    RequestState,
    RequestStatus,
    Rosters,
    SinkEvent,
    StreamedIds,
    Submitted,
    TokenEvent,
    new_request_id,
)
from wafer_gpt2.engine.worker import BackendFactory, Engine, EngineState, request_failed
from wafer_gpt2.settings import ServerSettings

log = logging.getLogger(__name__)

STATUS_PERIOD_S = 0.02  # how often the engine process looks for a change of state to report
# The engine process reports its state at least this many times per heartbeat deadline, changed or not,
# and the HTTP process looks as often for a report that is overdue.
HEARTBEATS_PER_TIMEOUT = 4
# Counters a stand-in backend keeps (`wafer_gpt2/backends/stand_ins.py`), reported with the state for `bench host`.
BACKEND_COUNTERS = ("modeled_busy_s", "overshoot_s", "stand_in_cpu_s")
# The states a drain turns into DRAINING (the engine's own `begin_drain` rule).
ACCEPTING = (EngineState.READY, EngineState.LOADING, EngineState.RELOADING)


@dataclass(eq=False)
class RemoteRequest:
    """The HTTP side of a request the engine process runs: its id and its events' queue."""

    id: str
    stream: bool
    loop: asyncio.AbstractEventLoop
    request: GenerationRequest  # what its end's text is made by (`finish_event_of`)
    front: FrontText | None = None  # streamed, its text made here: its token events' text so far
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    finished: bool = False
    timeout_s: float | None = None  # the request's own (queue and generation)
    deadline: float | None = None  # monotonic: when the HTTP side ends it if the engine is silent


@dataclass(frozen=True)
class EngineOptions:
    """What the engine process builds its `Engine` from (picklable: it crosses a spawn)."""

    backend_factory: BackendFactory
    model_id: str
    max_queue: int
    step_token_budget: int
    step_timeout_s: float
    step_timeout_per_item_s: float
    freeze_heap: bool = (
        False  # settle the engine process's heap after each load (`wafer_gpt2/engine/heap.py`)
    )
    # (level, format) of the HTTP process's `wafer_gpt2.logs.configure`, repeated in the engine process.
    log_config: tuple[str, str] | None = None
    # `ServerSettings`' engine_* fields: the heartbeat, the outbox, answers, restarts.
    heartbeat_timeout_s: float = ServerSettings.engine_heartbeat_timeout_s
    outbox_limit: int = ServerSettings.engine_outbox_limit
    answer_timeout_s: float = ServerSettings.engine_answer_timeout_s
    restart_limit: int = ServerSettings.engine_restart_limit
    restart_window_s: float = ServerSettings.engine_restart_window_s

    @property
    def heartbeat_period_s(self) -> float:
        return self.heartbeat_timeout_s / HEARTBEATS_PER_TIMEOUT

    @classmethod
    def of(cls, settings: ServerSettings, backend_factory: BackendFactory) -> EngineOptions:
        return cls(
            backend_factory,
            model_id=settings.model_id,
            max_queue=settings.max_queue,
            step_token_budget=settings.step_token_budget,
            step_timeout_s=settings.step_timeout_s,
            step_timeout_per_item_s=settings.step_timeout_per_item_s,
            freeze_heap=settings.freeze_heap,
            log_config=logs.configured,
            heartbeat_timeout_s=settings.engine_heartbeat_timeout_s,
            outbox_limit=settings.engine_outbox_limit,
            answer_timeout_s=settings.engine_answer_timeout_s,
            restart_limit=settings.engine_restart_limit,
            restart_window_s=settings.engine_restart_window_s,
        )

    def engine(self, metrics: ServiceMetrics, on_fatal: Callable[[str], None] | None) -> Engine:
        """The engine these options describe (in this process)."""
        return Engine(
            self.backend_factory,
            gpt2_tokenizer_hooks(),
            metrics,
            max_queue=self.max_queue,
            step_token_budget=self.step_token_budget,
            on_fatal=on_fatal,
            step_timeout_s=self.step_timeout_s,
            step_timeout_per_item_s=self.step_timeout_per_item_s,
        )


# ----- the engine process ----------------------------------------------------------------------------


class _Book:
    """The engine process's requests by id, for cancellations. A request is filed by the engine's worker
    at its next step boundary (`Engine.submit_nowait`); a cancellation that arrives before that is kept
    and applied when it is filed. Touched by the pipe's reader and the worker: one small lock."""

    def __init__(self, send: Callable[[FromEngine], None], cancel: Callable[[RequestState], None]):
        self._send = send
        self._cancel = cancel
        self._lock = threading.Lock()
        self._filed: dict[str, RequestState] = {}
        self._unfiled: set[str] = set()  # handed to the engine, not filed yet
        self._cancel_when_filed: set[str] = set()

    def arrived(self, request_id: str) -> None:
        with self._lock:
            self._unfiled.add(request_id)

    def filed(self, request_id: str, outcome: RequestState | ServiceError) -> None:
        """The request is queued (the worker, under the engine's lock), or refused (there, or on the
        pipe's reader when the engine refused it as it was handed over)."""
        with self._lock:
            self._unfiled.discard(request_id)
            cancel = request_id in self._cancel_when_filed
            self._cancel_when_filed.discard(request_id)
            if (
                isinstance(outcome, RequestState)
                and outcome.status is not RequestStatus.FINISHED
                and not cancel
            ):
                self._filed[request_id] = outcome
        if isinstance(outcome, ServiceError):  # sent outside the book's lock: a full pipe must not hold it
            self._send(Events([(request_id, ErrorEvent(outcome))]))
        elif cancel:
            self._cancel(outcome)

    def to_cancel(self, request_id: str) -> RequestState | None:
        """The request to cancel now, forgotten here (a cancelled request ends without an event); None
        when it is not filed yet (it will be cancelled when it is) or is gone."""
        with self._lock:
            if request_id in self._unfiled:
                self._cancel_when_filed.add(request_id)
                return None
            return self._filed.pop(request_id, None)

    def ended(self, request_ids: list[str]) -> None:
        with self._lock:
            for request_id in request_ids:
                self._filed.pop(request_id, None)


class _PipeSink:
    """The engine process's requests' `EventSink`: a step's events leave for the HTTP process as one
    `Events` message, and the requests that ended are forgotten by the book. The HTTP process makes
    the text of the requests without stop sequences (`makes_text`: the engine sends their ids)."""

    makes_text = True

    def __init__(self, send: Callable[[FromEngine], None], book: _Book):
        self._send = send
        self._book = book

    def hand_over(
        self, events: list[tuple[RequestState, SinkEvent]], streamed: list[StreamedIds] | None = None
    ) -> None:
        out = [(state.id, event) for state, event in events]
        self._book.ended([state.id for state, event in events if type(event) is not TokenEvent])
        self._send(Events(out, streamed))

    def wait_for_turn(self, timeout_s: float) -> None:
        """Nothing to wait for: the receiver, the HTTP process's event loop, has a GIL of its own."""


def _shape(backend: Backend) -> ShapeReport:
    return ShapeReport(
        backend=str(getattr(backend, "backend", "")),
        num_slots=backend.num_slots,
        context_length=backend.context_length,
        vocab_size=backend.vocab_size,
        top_k=backend.top_k,
        description=backend.describe(),
    )


def _snapshot(engine: Engine, backend: Backend | None) -> Snapshot:
    waiting, running = engine.queue_sizes()
    return Snapshot(
        state=engine.state,
        error=engine.error,
        fault=engine.fault,
        load_seconds=engine.load_seconds,
        restarts=engine.restarts,
        steps=engine.steps,
        idle_seconds=round(engine.idle_seconds, 3),
        kv_usage=engine.kv_usage(),
        waiting=waiting,
        running=running,
        capacity=engine.capacity,
        backend_counters={
            name: float(getattr(backend, name)) for name in BACKEND_COUNTERS if hasattr(backend, name)
        },
    )


def _current_backend(engine: Engine) -> Backend | None:
    try:
        return engine.backend
    except Unavailable:
        return None


class FrameReader:
    """`multiprocessing.Connection`'s messages, every whole one that has arrived at one read: the HTTP
    process's event loop reads the engine's pipe when it is readable (never blocking), the engine
    process's reader waits for the HTTP process's (`wait`). A frame is a big-endian length (4 bytes;
    -1 and then 8 bytes for a message of 2 GiB or more) and the message's bytes, as
    `Connection.send_bytes` writes them. The pipe's socket is read through a duplicate of its
    descriptor (MSG_DONTWAIT where it must not block), so the connection stays blocking for writers."""

    READ_BYTES = 1 << 20

    def __init__(self, fileno: int):
        self._socket = socket.socket(fileno=os.dup(fileno))
        self._buffer = bytearray()

    @property
    def fileno(self) -> int:
        return self._socket.fileno()

    def read(self, wait: bool = False) -> list[bytes] | None:
        """The whole messages that have arrived (none is possible unless `wait`: then it waits for
        one); None once the pipe is closed."""
        while True:
            try:
                data = self._socket.recv(self.READ_BYTES, 0 if wait else socket.MSG_DONTWAIT)
            except BlockingIOError:
                return []
            except OSError:
                return None
            if not data:
                return None
            messages = self._split(data)
            if messages or not wait:
                return messages

    def _split(self, data: bytes) -> list[bytes]:
        buffer = self._buffer
        buffer += data
        messages: list[bytes] = []
        start = 0
        while len(buffer) - start >= 4:
            (size,) = _LENGTH.unpack_from(buffer, start)
            head = 4
            if size == -1:
                if len(buffer) - start < 12:
                    break
                (size,) = _LONG_LENGTH.unpack_from(buffer, start + 4)
                head = 12
            end = start + head + size
            if len(buffer) < end:
                break
            messages.append(bytes(buffer[start + head : end]))
            start = end
        del buffer[:start]
        return messages

    def close(self) -> None:
        self._socket.close()


_LENGTH = struct.Struct("!i")
_LONG_LENGTH = struct.Struct("!Q")


def engine_main(connection, options: EngineOptions) -> None:
    """The engine process: serve the HTTP process's messages until `shutdown` (or the pipe closes)."""
    # A Ctrl-C reaches the whole process group: the HTTP process drains and then stops this one.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if options.log_config is not None:
        logs.configure(*options.log_config)
    send_lock = threading.Lock()

    def send(message: FromEngine) -> None:
        with send_lock:
            connection.send_bytes(engine_messages.encode(message))

    fatal: list[str] = []
    metrics = ServiceMetrics(options.model_id)
    engine = options.engine(metrics, on_fatal=fatal.append)
    book = _Book(send, engine.cancel)
    sink = _PipeSink(send, book)
    engine.start()
    stopped = threading.Event()

    def report_status() -> None:
        """Every STATUS_PERIOD_S: the engine's state when it changed (and, as a heartbeat, every
        `heartbeat_period_s` even when it did not), the backend's shape when a (re)load brought a new
        one."""
        last: Snapshot | None = None
        last_sent = 0.0
        described: Backend | None = None
        while not stopped.is_set():
            try:
                backend = _current_backend(engine)
                if backend is not None and backend is not described:
                    if options.freeze_heap:
                        heap.settle()  # the new backend's objects; the old one's can go
                    send(Shape(_shape(backend)))
                    described = backend
                snapshot = _snapshot(engine, backend)
                now = time.monotonic()
                if snapshot != last or now - last_sent >= options.heartbeat_period_s:
                    send(Status(snapshot, fatal[-1] if fatal else None))
                    last, last_sent = snapshot, now
            except (OSError, ValueError):
                return  # the pipe is closed
            except Exception:
                log.exception("the engine process could not report the engine's state")
            stopped.wait(STATUS_PERIOD_S)

    threading.Thread(target=report_status, name="wafer-engine-status", daemon=True).start()
    # Every message that has arrived is read and handled at one hold of the GIL: read one by one, the
    # reader let go of the GIL at every read and then had to win it back from the stepping worker, and
    # the requests it handed over reached the worker a few per step.
    reader = FrameReader(connection.fileno())
    serving = True
    try:
        while serving:
            frames = reader.read(wait=True)
            if frames is None:
                break  # the HTTP process is gone
            for raw in frames:
                try:
                    message = engine_messages.decode_to_engine(raw)
                except engine_messages.UnreadableRequest as unreadable:  # a bug: it fails alone (500)
                    failed = request_failed(unreadable.request_id)
                    send(Events([(unreadable.request_id, ErrorEvent(failed))]))
                    continue
                except Exception:  # a message that does not decode: a bug, logged; the engine goes on
                    log.exception("could not read a message from the HTTP process")
                    continue
                serving = _serve_message(message, engine, book, sink, metrics, send)
                if not serving:
                    break
    finally:
        stopped.set()
        try:
            send(Status(_snapshot(engine, _current_backend(engine)), fatal[-1] if fatal else None))
            send(Stopped())
        except (OSError, ValueError):
            pass
        reader.close()
        connection.close()


def _serve_message(
    message: ToEngine,
    engine: Engine,
    book: _Book,
    sink: _PipeSink,
    metrics: ServiceMetrics,
    send: Callable[[FromEngine], None],
) -> bool:
    """One message of the HTTP process, in the engine process; False after `Shutdown`."""
    match message:
        case Submit(request_id, request, stream):
            book.arrived(request_id)
            engine.submit_nowait(request, stream, sink, request_id, book.filed)
        case Cancel(request_id):
            cancelled = book.to_cancel(request_id)
            if cancelled is not None:
                engine.cancel(cancelled)
        case Drain():
            engine.begin_drain()
        case Fault(text, steps, reloads, error):
            engine.inject_fault(text, steps, reloads, error)
        case Ask(number, question):
            send(Answer(number, _answer(question, engine, metrics)))
        case Shutdown(timeout_s):
            engine.shutdown(timeout_s)
            return False
        case _:
            assert_never(message)
    return True


def _answer(question: Question, engine: Engine, metrics: ServiceMetrics) -> Any:
    if question == "metrics":
        return metrics.samples()
    if question == "kv_usage":
        return engine.kv_usage()
    if question == "queue_sizes":
        return engine.queue_sizes()
    assert_never(question)


# ----- the HTTP process ------------------------------------------------------------------------------


def _frame(payload: bytes) -> bytes:
    """`payload` framed as `Connection.send_bytes` frames it (what `FrameReader` reads)."""
    size = len(payload)
    if size > 0x7FFFFFFF:
        return _LENGTH.pack(-1) + _LONG_LENGTH.pack(size) + payload
    return _LENGTH.pack(size) + payload


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


class PipeOutbox:
    """The HTTP process's messages to the engine process, written without ever blocking the event loop.
    A message goes straight into the pipe when the pipe has room (the usual case); otherwise it waits
    here and the event loop writes it once the pipe is writable. At most `limit` messages wait before a
    `bounded` one (a request, a question) is refused: an engine process that stops reading costs the
    server that much memory, never its event loop. Cancellations and the lifecycle's messages are never
    refused (each cancellation frees a KV slot; there are at most as many as requests in flight). Any
    thread may put; the pipe's socket is written through a duplicate of its descriptor with
    MSG_DONTWAIT, as `FrameReader` reads it."""

    def __init__(self, fileno: int, loop: asyncio.AbstractEventLoop, limit: int):
        self._socket = socket.socket(fileno=os.dup(fileno))
        self._loop = loop
        self._limit = limit
        self._lock = threading.Lock()
        self._pending: collections.deque[bytes | memoryview] = collections.deque()
        self._watching = False  # the event loop writes the pending messages when the pipe has room
        self._closed = False

    @property
    def waiting(self) -> int:
        """Messages waiting for the pipe to have room."""
        return len(self._pending)

    def put(self, payload: bytes, bounded: bool = True) -> bool:
        """Send `payload` (or keep it until the pipe has room); False when `bounded` and `limit`
        messages wait already. OSError when the pipe is closed."""
        frame = _frame(payload)
        with self._lock:
            if self._closed:
                raise BrokenPipeError("the engine process's pipe is closed")
            pending = self._pending
            if pending:  # after those that wait: the engine reads the messages in order
                if bounded and len(pending) >= self._limit:
                    return False
                pending.append(frame)
                return True
            sent = self._write(frame)
            if sent < len(frame):
                pending.append(memoryview(frame)[sent:])
                self._watch()
        return True

    def _write(self, data: bytes | memoryview) -> int:
        try:
            return self._socket.send(data, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return 0

    def _watch(self) -> None:
        """(The lock is held.) Have the event loop write what waits once the pipe has room."""
        if self._watching:
            return
        self._watching = True
        try:
            if _running_loop() is self._loop:
                self._loop.add_writer(self._socket.fileno(), self._flush)
            else:
                self._loop.call_soon_threadsafe(self._watch_on_loop)
        except RuntimeError:  # the event loop is gone: nothing will be written any more
            self._watching = False

    def _watch_on_loop(self) -> None:
        with self._lock:
            if self._closed or not self._pending:
                self._watching = False
                return
            self._loop.add_writer(self._socket.fileno(), self._flush)

    def _flush(self) -> None:
        """(On the event loop, when the pipe has room.) Write what waits, as much as fits."""
        with self._lock:
            pending = self._pending
            try:
                while pending:
                    head = pending[0]
                    sent = self._write(head)
                    if sent < len(head):
                        pending[0] = memoryview(head)[sent:]
                        return
                    pending.popleft()
            except OSError:
                pending.clear()  # the engine process is gone: its end is handled where its pipe is read
            self._loop.remove_writer(self._socket.fileno())
            self._watching = False

    def close(self) -> None:
        """Drop what waits and close (on the event loop when it runs: its writer is removed first)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._pending.clear()
        if self._loop.is_closed() or _running_loop() is self._loop:
            self._close_socket()
            return
        try:
            self._loop.call_soon_threadsafe(self._close_socket)
        except RuntimeError:
            self._close_socket()

    def _close_socket(self) -> None:
        if self._watching and not self._loop.is_closed():
            self._loop.remove_writer(self._socket.fileno())
        self._watching = False
        self._socket.close()


@dataclass(eq=False)
class _Link:
    """One engine process and the HTTP process's ends of its pipe."""

    process: Any  # multiprocessing's process object
    connection: Any  # multiprocessing's Connection: it owns the pipe's descriptor
    outbox: PipeOutbox
    _closing: threading.Lock = field(default_factory=threading.Lock)

    def close(self) -> None:
        """Close the HTTP process's ends (once: shutdown and the process's end may both get here)."""
        with self._closing:
            self.outbox.close()
            self.connection.close()


def _initial_snapshot() -> Snapshot:
    return Snapshot(EngineState.LOADING, None, None, None, 0, 0, 0.0, KVUsage(0, 0, 0, 0), 0, 0, 0)


class EngineProcess:
    """The API's engine when the engine runs in a process of its own (`Engine`'s surface).

    Beside the engine's own reports this side keeps three facts of its own. The heartbeat: the engine
    process reports at least every `heartbeat_period_s`; one silent past `heartbeat_timeout_s` (stopped,
    hung) is shown as UNRESPONSIVE, with 503 for new requests, and the requests it holds end at their
    deadline here (its own deadline check runs in the silent process); a report brings it back. The
    outbox (`PipeOutbox`): what the engine process has not read yet, bounded. Restarts: an engine
    process that dies is started again in place (RELOADING until it is ready) up to `restart_limit`
    times within `restart_window_s`; one more death and the server is told to exit (`on_fatal`)."""

    def __init__(
        self,
        options: EngineOptions,
        metrics: ServiceMetrics,
        on_fatal: Callable[[str], None] | None = None,
    ):
        self._options = options
        self.metrics = metrics  # the HTTP process's own (guards, failures); the engine's are over there
        self._on_fatal = on_fatal
        self._context = multiprocessing.get_context("spawn")
        self._link: _Link | None = None  # the current engine process (`start`)
        self._life = threading.Lock()  # starting an engine process, against shutdown
        self._join_lock = threading.Lock()
        self._changed = threading.Condition()
        self._reported = _initial_snapshot()  # the current engine process's last report
        self._snapshot = self._reported  # what the API reads: the report as this process sees it
        self._shape: ShapeReport | None = None
        self._requests: dict[str, RemoteRequest] = {}
        # The engine's rosters of streamed requests (`StreamedIds`): their requests found once per roster.
        self._rosters: Rosters[RemoteRequest] = Rosters(self._requests.get)
        self._tokenizer: TokenizerHooks = gpt2_tokenizer_hooks()  # the engine's: the same text
        self._ids = itertools.count(1)
        self._asked: set[int] = set()  # questions waiting for their answer (`_ask`)
        self._answers: dict[int, Any] = {}
        self._stopped = False  # no engine process runs, nor will
        self._draining = False  # set by `begin_drain`: no state report makes it accept requests again
        self._shutting_down = False  # set by `shutdown`: the engine process's end is expected
        self._fatal_told = False  # `on_fatal` is called once
        self._loop: asyncio.AbstractEventLoop | None = None  # the event loop that reads the pipe (`start`)
        self._heard: float | None = None  # when the current engine process last reported (monotonic)
        self._silent: str | None = None  # why it is taken for stopped or hung, while it is
        self._restarting: str | None = None  # why the current engine process was started, until it is ready
        self._deaths: collections.deque[float] = collections.deque()  # when engine processes died
        self._restarts_before = 0  # reloads and restarts before the current engine process
        self._outbox_full = False  # logged once while the outbox stays full
        self._restarts_counter = metrics.track_engine_process(
            up=lambda: 1.0 if self._up() else 0.0,
            outbox=lambda: float(self._link.outbox.waiting) if self._link is not None else 0.0,
        )

    # ----- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine process. Its messages are read on the calling event loop (the server's),
        not by a thread of this process's own: such a thread took the GIL at every message, and the
        loop waited for it after each socket write and tokenization that let go of it."""
        self._loop = loop = asyncio.get_running_loop()
        with self._life:
            self._link = link = self._launch(loop)
        self._read(link)
        loop.call_later(self._options.heartbeat_period_s, self._check_heartbeat)

    def _launch(self, loop: asyncio.AbstractEventLoop) -> _Link:
        """Start an engine process (any thread; `_life` is held)."""
        connection, child = self._context.Pipe()
        process = self._context.Process(
            target=engine_main, args=(child, self._options), name="wafer-engine", daemon=True
        )
        process.start()
        child.close()
        return _Link(process, connection, PipeOutbox(connection.fileno(), loop, self._options.outbox_limit))

    def _read(self, link: _Link) -> None:
        """(On the event loop.) Read `link`'s pipe on this loop."""
        assert self._loop is not None
        frames = FrameReader(link.connection.fileno())
        self._loop.add_reader(frames.fileno, self._readable, link, frames)

    def _send(self, message: ToEngine, bounded: bool = False) -> bool:
        """Hand `message` to the engine process (False: `bounded` and the outbox is full; OSError: no
        engine process reads)."""
        link = self._link
        if link is None:
            raise BrokenPipeError("the engine process is not started")
        return link.outbox.put(engine_messages.encode(message), bounded)

    def _readable(self, link: _Link, reader: FrameReader) -> None:
        """(On the event loop.) The engine's messages that arrived: events to their requests' queues,
        state to `_snapshot`."""
        frames = reader.read()
        ended = frames is None  # the pipe closed
        for raw in frames or ():
            try:
                message = engine_messages.decode_from_engine(raw)
            except Exception:  # a message that does not decode: a bug, logged; the pipe goes on
                log.exception("could not read a message from the engine process")
                continue
            try:
                if not self._handle(message):
                    ended = True  # the engine said it stopped: nothing more comes
                    break
            except Exception:  # a bug here must not end the only reader of the engine's messages
                log.exception("could not handle the engine process's %s message", type(message).__name__)
        if ended:
            assert self._loop is not None
            self._loop.remove_reader(reader.fileno)
            reader.close()
            self._link_lost(link)

    def _handle(self, message: FromEngine) -> bool:
        """One message from the engine process; False when it says it stopped."""
        match message:
            case Events(events, streamed):
                self._deliver_events(events, streamed)
            case Shape(shape):
                self._shape = shape
            case Status(snapshot, fatal):
                self._heard_status(snapshot, fatal)
            case Answer(number, answer):
                with self._changed:
                    if number in self._asked:  # not one whose asker gave up waiting
                        self._answers[number] = answer
                        self._changed.notify_all()
            case Stopped():
                return False
            case _:
                assert_never(message)
        return True

    def _heard_status(self, snapshot: Snapshot, fatal: str | None) -> None:
        silent = self._silent
        with self._changed:
            self._heard = time.monotonic()
            self._silent = None
            if snapshot.state is EngineState.READY:
                self._restarting = None
            self._reported = snapshot
            self._refresh()
        if silent is not None:
            log.warning("the engine process reports again")
        if fatal is not None and not self._fatal_told and self._on_fatal is not None:
            self._fatal_told = True
            self._on_fatal(fatal)

    def _refresh(self) -> None:
        """(`_changed` is held.) What the API reads: the engine's report, as this side knows it."""
        snapshot = self._reported
        state = snapshot.state
        if state in (EngineState.FAILED, EngineState.STOPPED):
            pass
        elif self._draining and state in ACCEPTING:
            snapshot = _with_state(snapshot, EngineState.DRAINING)  # reported before our drain arrived
        elif self._silent is not None:
            snapshot = _with_state(snapshot, EngineState.UNRESPONSIVE, fault=self._silent)
        elif self._restarting is not None and state is not EngineState.READY:
            snapshot = _with_state(snapshot, EngineState.RELOADING, fault=self._restarting)
        self._snapshot = snapshot
        self._changed.notify_all()

    def _deliver_events(
        self, events: list[tuple[str, SinkEvent]], streamed: list[StreamedIds] | None = None
    ) -> None:
        """(On the event loop.) A step's events into their requests' queues, with the text made here of
        the requests whose text the engine does not make (`FrontText`)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RemoteRequest, Event]]] = {}
        requests = self._requests
        made: Event
        for ids in streamed or ():  # each request's token comes before its other events
            try:
                members = self._rosters.members(ids)
            except ValueError:  # a bug: these tokens are lost, the message's other events are not
                log.exception("could not tell whose tokens the engine process sent")
                continue
            tokens, logprobs = ids.columns()
            for remote, token, logprob in zip(members, tokens, logprobs, strict=True):
                if remote is None or remote.finished:
                    continue  # cancelled and forgotten
                try:
                    made = remote.front.token(token, logprob)  # type: ignore[union-attr]  # None: a bug
                except Exception:
                    made = self._text_failed(remote)
                by_loop.setdefault(remote.loop, []).append((remote, made))
        for request_id, event in events:
            remote = requests.get(request_id)
            if remote is None:
                continue  # cancelled and forgotten
            if type(event) is TokenEvent:
                made = event
                if remote.front is not None:
                    try:
                        made = remote.front.token_event(event)
                    except Exception:
                        made = self._text_failed(remote)
            else:
                remote.finished = True
                del requests[request_id]
                made = self._finish_of(remote, event) if type(event) is IdsFinishEvent else event  # type: ignore[assignment]
            by_loop.setdefault(remote.loop, []).append((remote, made))
        self._put_by_loop(by_loop)

    def _finish_of(self, remote: RemoteRequest, event: IdsFinishEvent) -> FinishEvent | ErrorEvent:
        """(On the event loop.) The end the engine sent as ids, with its records and text made here."""
        try:
            if remote.front is not None:
                return remote.front.finish(event)
            return finish_event_of(event, remote.request, self._tokenizer)
        except Exception:  # a bug: this request fails alone (500, a log reference)
            log.exception("could not make the text of request %s", remote.id, extra={"request_id": remote.id})
            return ErrorEvent(request_failed(remote.id))

    def _text_failed(self, remote: RemoteRequest) -> ErrorEvent:
        """(On the event loop.) A streamed token's text could not be made here (a bug): the request fails
        alone (500, a log reference), and the engine drops it."""
        log.exception("could not make the text of request %s", remote.id, extra={"request_id": remote.id})
        self.cancel(remote)
        return ErrorEvent(request_failed(remote.id))

    def _hand_over(self, items: list[tuple[RemoteRequest, Event]]) -> None:
        """(On the event loop.) Each event into its request's queue, on the request's event loop."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RemoteRequest, Event]]] = {}
        for remote, event in items:
            by_loop.setdefault(remote.loop, []).append((remote, event))
        self._put_by_loop(by_loop)

    def _put_by_loop(
        self, by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RemoteRequest, Event]]]
    ) -> None:
        for loop, items in by_loop.items():
            if loop is self._loop:
                _put_events(items)  # this loop reads the pipe: its requests' queues are at hand
                continue
            try:
                loop.call_soon_threadsafe(_put_events, items)
            except RuntimeError:
                pass  # the event loop is gone

    def _fail_requests(self, error: ServiceError) -> None:
        """(On the event loop.) Every request held ends with `error`."""
        leftover = list(self._requests.values())
        self._requests.clear()
        self._rosters.clear()
        for remote in leftover:
            remote.finished = True
        self._hand_over([(remote, ErrorEvent(error)) for remote in leftover])
        with self._changed:
            self._changed.notify_all()  # wake wait_drained

    # ----- the heartbeat ---------------------------------------------------------------------------

    def _check_heartbeat(self) -> None:
        """(On the event loop, every `heartbeat_period_s`.) An engine process silent past its deadline is
        taken for stopped or hung; while it is, the requests it holds end at their own deadline here."""
        assert self._loop is not None
        if self._shutting_down:
            return
        self._loop.call_later(self._options.heartbeat_period_s, self._check_heartbeat)
        heard, link = self._heard, self._link
        if self._outbox_full and link is not None and link.outbox.waiting < self._options.outbox_limit:
            self._outbox_full = False
            log.warning("the engine process reads its pipe again")
        if heard is None or link is None or self._stopped:
            return  # not started reporting yet, or gone (its end is handled where its pipe is read)
        silent_for = time.monotonic() - heard
        timeout = self._options.heartbeat_timeout_s
        if self._silent is None:
            if silent_for <= timeout:
                return
            reason = (
                f"the engine process (pid {link.process.pid}) has not reported within its "
                f"{timeout:g} s heartbeat deadline: it is stopped or hung"
            )
            with self._changed:
                self._silent = reason
                self._refresh()
            log.error("%s; /health answers 503 until it reports again", reason)
        self._end_overdue(silent_for)

    def _end_overdue(self, silent_for: float) -> None:
        """(On the event loop, the engine process silent.) Requests past their deadline end with 504 and
        are cancelled (the cancellation waits in the outbox: a resumed engine frees their slots)."""
        now = time.monotonic()
        overdue = [r for r in self._requests.values() if r.deadline is not None and now >= r.deadline]
        ended: list[tuple[RemoteRequest, Event]] = []
        for remote in overdue:
            del self._requests[remote.id]
            remote.finished = True
            error = RequestTimedOut(
                f"the request did not finish within {remote.timeout_s:g} s: the engine process has not "
                f"reported for {silent_for:.1f} s (stopped or hung)"
            )
            ended.append((remote, ErrorEvent(error)))
            self._send_quietly(Cancel(remote.id))
        self._hand_over(ended)

    def _up(self) -> bool:
        return (
            self._link is not None and not self._stopped and self._silent is None and self._heard is not None
        )

    # ----- an engine process's end -----------------------------------------------------------------

    def _link_lost(self, link: _Link) -> None:
        """(On the event loop.) The engine process's pipe closed: it stopped as asked, or it died."""
        if link is not self._link:
            return
        link.outbox.close()
        with self._changed:
            self._heard = self._silent = None
            if not self._shutting_down and self._reported.state not in (
                EngineState.FAILED,
                EngineState.STOPPED,
            ):
                # Refused at once from here on: nobody reads this pipe any more.
                self._restarting = "the engine process ended unexpectedly"
                self._reported = _with_state(self._reported, EngineState.LOADING)
            self._refresh()
        # It waits for the process to exit: not on the event loop.
        threading.Thread(
            target=self._engine_gone, args=(link,), name="wafer-engine-gone", daemon=True
        ).start()

    def _engine_gone(self, link: _Link) -> None:
        """(A thread of its own.) The engine process's pipe closed; what is still waiting ends with 503.
        One that ended without being asked to is started again, unless too many died lately: then the
        engine is failed and the server told to exit."""
        self._join(link.process, 5.0)
        link.close()
        if self._shutting_down or self._reported.state is EngineState.FAILED:  # failed: it said why
            with self._changed:
                self._stopped = True
                if self._reported.state is not EngineState.FAILED:
                    self._reported = _with_state(self._reported, EngineState.STOPPED)
                self._refresh()
            error = (
                Unavailable("the server shut down before this request finished")
                if self._shutting_down
                else self.unavailable()
            )
            self._on_loop(self._fail_requests, error)
            return
        now = time.monotonic()
        window = self._options.restart_window_s
        deaths = self._deaths
        deaths.append(now)
        while now - deaths[0] > window:
            deaths.popleft()
        died = f"the engine process ended unexpectedly (exit code {link.process.exitcode})"
        if len(deaths) > self._options.restart_limit:
            self._give_up(f"{died}, {len(deaths)} times within {window:g} s: it is not started again")
            return
        with self._changed:
            self._restarting = f"{died}; it is being started again"
            self._restarts_before += self._reported.restarts + 1
            self._refresh()
        log.error("%s", self._restarting)
        self._on_loop(
            self._fail_requests, Unavailable(f"{died}; it is being started again, retry the request")
        )
        self._restart()

    def _restart(self) -> None:
        """(A thread of its own.) Start a fresh engine process in place of the one that died."""
        loop = self._loop
        assert loop is not None
        try:
            with self._life:
                if self._shutting_down:
                    return
                link = self._launch(loop)
                self._link = link
        except Exception as exc:
            log.exception("could not start the engine process again")
            self._give_up(f"the engine process could not be started again: {type(exc).__name__}: {exc}")
            return
        self._restarts_counter.inc()
        log.warning("engine process started again (pid %s): the model is being loaded", link.process.pid)
        self._on_loop(self._read, link)

    def _give_up(self, fatal: str) -> None:
        """No engine process will serve again: every request ends with 503 and the server is told to exit
        (`on_fatal`, once)."""
        log.error("%s", fatal)
        with self._changed:
            self._stopped = True
            self._reported = _with_state(self._reported, EngineState.FAILED, error=fatal)
            self._refresh()
        self._on_loop(self._fail_requests, self.unavailable())
        if not self._fatal_told and self._on_fatal is not None:
            self._fatal_told = True
            self._on_fatal(fatal)

    def _on_loop(self, function: Callable, *args) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(function, *args)
        except RuntimeError:
            pass  # the event loop is gone

    def wait_ready(self, timeout: float) -> bool:
        with self._changed:
            loading = (EngineState.LOADING, EngineState.RELOADING)
            self._changed.wait_for(lambda: self._snapshot.state not in loading, timeout)
            return self._snapshot.state is EngineState.READY

    def begin_drain(self) -> None:
        with self._changed:
            self._draining = True
            self._refresh()
        self._send_quietly(Drain())

    def wait_drained(self, timeout: float) -> bool:
        with self._changed:
            return self._changed.wait_for(lambda: not self._requests or self._stopped, timeout)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Drain (up to `timeout`), fail what is left with 503, stop the engine process."""
        self.begin_drain()
        with self._life:
            self._shutting_down = True
            link = self._link
        if link is None:
            return
        self._send_quietly(Shutdown(timeout))
        self._join(link.process, timeout + 10.0)
        if link.process.is_alive():
            log.error("the engine process did not stop: terminated")
            link.process.terminate()
            self._join(link.process, 5.0)
        if link.process.is_alive():  # a stopped process keeps SIGTERM pending; SIGKILL is not held
            link.process.kill()
            self._join(link.process, 5.0)
        link.close()

    def inject_fault(
        self,
        message: str = "injected worker fault",
        steps: int = 1,
        reloads: int = 0,
        error: type[BaseException] | None = None,
    ) -> None:
        """`Engine.inject_fault`, in the engine process (`error` None: the engine's default)."""
        self._send(Fault(message, steps, reloads) if error is None else Fault(message, steps, reloads, error))

    def _join(self, process: Any, timeout: float) -> None:
        # One thread at a time: two concurrent joins race for the child's exit status, and the loser
        # sees a process that is still alive.
        with self._join_lock:
            process.join(timeout)

    def _send_quietly(self, message: ToEngine) -> None:
        try:
            self._send(message)
        except (OSError, ValueError):
            pass  # the engine process is gone already

    # ----- what the API reads ----------------------------------------------------------------------

    @property
    def state(self) -> EngineState:
        return self._snapshot.state

    @property
    def ready(self) -> bool:
        return self._snapshot.state is EngineState.READY

    @property
    def error(self) -> str | None:
        return self._snapshot.error

    @property
    def fault(self) -> str | None:
        return self._snapshot.fault

    @property
    def load_seconds(self) -> float | None:
        return self._snapshot.load_seconds

    @property
    def restarts(self) -> int:
        """Reloads after a fault and engine processes started again, since the server started."""
        return self._restarts_before + self._snapshot.restarts

    @property
    def steps(self) -> int:
        return self._snapshot.steps

    @property
    def idle_seconds(self) -> float:
        return self._snapshot.idle_seconds

    @property
    def backend(self) -> ShapeReport:
        """The shape of the engine's backend (raises Unavailable before the first load)."""
        shape = self._shape
        if shape is None:
            raise self.unavailable()
        return shape

    def describe(self) -> dict:
        return self.backend.describe()

    def kv_usage(self) -> KVUsage:
        """Asked of the engine process (a round trip: off the event loop, not for a hot path)."""
        return self._ask("kv_usage", self._snapshot.kv_usage)

    def queue_sizes(self) -> tuple[int, int]:
        """(waiting, running), asked of the engine process (a round trip: off the event loop)."""
        return self._ask("queue_sizes", (self._snapshot.waiting, self._snapshot.running))

    def unavailable(self) -> Unavailable:
        snapshot = self._snapshot
        state = snapshot.state
        final = state in (EngineState.FAILED, EngineState.STOPPED)
        if state is EngineState.RELOADING and self._restarting is not None:
            reason = f"{self._restarting}; retry shortly"
        elif state is EngineState.UNRESPONSIVE:
            reason = f"{snapshot.fault}; retry shortly"
        else:
            reason = {
                EngineState.LOADING: "the model is still being uploaded; retry shortly",
                EngineState.RELOADING: "the wafer worker is reloading the model after a failure; retry shortly",
                EngineState.DRAINING: "the server is shutting down and accepts no new requests",
                EngineState.STOPPED: "the server has shut down",
                EngineState.FAILED: f"the engine failed and cannot serve: {snapshot.error}",
            }.get(state, "the engine is not ready")
        return Unavailable(reason, final=final)

    def submit(self, request: GenerationRequest, stream: bool = True) -> RemoteRequest:
        snapshot = self._snapshot
        if snapshot.state is not EngineState.READY:
            raise self.unavailable()
        if len(self._requests) >= snapshot.capacity:
            raise Overloaded(
                f"the server is at capacity ({len(self._requests)} requests running or queued, "
                f"queue limit {self._options.max_queue}); retry later"
            )
        timeout = request.timeout_s
        remote = RemoteRequest(
            new_request_id(),
            stream,
            asyncio.get_running_loop(),
            request,
            # The engine process's sink makes text (`_PipeSink.makes_text`): the rule the engine applies.
            front=FrontText(request, self._tokenizer) if stream and text_in_front(request, True) else None,
            timeout_s=timeout,
            deadline=None if timeout is None else time.monotonic() + timeout,
        )
        self._requests[remote.id] = remote
        try:
            sent = self._send(Submit(remote.id, request, stream), bounded=True)
        except (OSError, ValueError):
            del self._requests[remote.id]
            raise self.unavailable() from None
        if not sent:
            del self._requests[remote.id]
            if not self._outbox_full:
                self._outbox_full = True
                log.error(
                    "the engine process does not read its pipe: %d messages wait; new requests get 503",
                    self._options.outbox_limit,
                )
            raise Unavailable(
                f"the engine process is not reading its pipe: {self._options.outbox_limit} messages "
                "wait for it already; retry shortly"
            )
        return remote

    def cancel(self, remote: Submitted) -> None:
        if not isinstance(remote, RemoteRequest):
            raise TypeError(f"not a request of this engine: {remote!r}")
        if remote.finished:
            return
        remote.finished = True
        self._requests.pop(remote.id, None)
        self._send_quietly(Cancel(remote.id))

    def _ask(self, what: Question, otherwise: Any) -> Any:
        """The engine process's answer to `what` (a round trip over the pipe); `otherwise` when it is
        silent, gone, its outbox full, or it does not answer within `answer_timeout_s`. Never on the
        event loop that reads the pipe: the answer could not arrive while it waits (RuntimeError)."""
        running = _running_loop()
        if running is not None and running is self._loop:
            raise RuntimeError(
                f"asking the engine process for {what} on the event loop that reads its answers"
            )
        if not self._up():
            return otherwise
        number = next(self._ids)
        with self._changed:
            self._asked.add(number)
        try:
            try:
                if not self._send(Ask(number, what), bounded=True):
                    return otherwise
            except (OSError, ValueError):
                return otherwise
            with self._changed:
                self._changed.wait_for(
                    lambda: number in self._answers or self._stopped, self._options.answer_timeout_s
                )
                return self._answers.pop(number, otherwise)
        finally:
            with self._changed:
                self._asked.discard(number)
                self._answers.pop(number, None)

    def metric_samples(self) -> list[Family] | None:
        """The engine process's metrics (`ServiceMetrics.samples`; blocks: call it off the event loop);
        None when it does not answer (silent, gone, restarting, or too slow)."""
        return self._ask("metrics", None)

    @property
    def pid(self) -> int | None:
        """The engine process's id (`bench host` adds its CPU time to the server's)."""
        link = self._link
        return None if link is None else link.process.pid

    @property
    def process(self) -> Any:
        """The current engine process (multiprocessing's object)."""
        return None if self._link is None else self._link.process

    @property
    def backend_counters(self) -> dict[str, float]:
        """The backend's counters (a stand-in's modeled busy time), as of the last state report."""
        return self._snapshot.backend_counters


def _put_events(items: list[tuple[RemoteRequest, Event]]) -> None:
    for remote, event in items:
        remote.events.put_nowait(event)


def _with_state(snapshot: Snapshot, state: EngineState, **changes: Any) -> Snapshot:
    return Snapshot(**{**vars(snapshot), "state": state, **changes})
