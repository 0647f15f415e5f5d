"""The engine: a long-lived worker thread that drives the engine core for the life of the server.

The worker builds the backend once (for the wafer backends that is where the model is uploaded) and
then runs the core's steps (`wafer_gpt2/engine/core.py`: scheduling, sampling, detokenizing and stop
checks) for as long as the server lives; each request's events go to its asyncio queue. This module
owns only what a server adds around the core: the thread and its lock, the states /health reports,
reload after a fault, drain at shutdown, the step watchdog and the test hooks that inject faults.

A step that raises (anything but an interrupt: `SystemExit` from deep inside a backend counts as a
fault too) fails the requests that were in flight (424, `generation`); the worker then closes the
backend and builds a fresh one (/health answers 503 meanwhile) and goes on with the queue. If the
worker itself dies (an error outside a step, or an interrupt), the engine never sits silently
stopped: it ends every request, /health answers 503 and `on_fatal` tells the server to exit non-zero.
Shutdown drains: new requests get 503 while the running ones finish, up to a timeout.

A step that never returns is caught by the step watchdog (a thread of its own): each step gets a
deadline, `step_timeout_s` plus `step_timeout_per_item_s` per item of the plan. Past it, the requests in
flight fail (504, `generation`), /health answers 503 `reloading` naming the fault, and a fresh worker
builds a fresh backend and goes on with the queue. The hung worker is abandoned (a Python thread cannot
be killed): its backend is closed from another thread, and when its step returns, if ever, it sees that
it is no longer the current worker and leaves without touching anything.

A backend that takes several steps at a time (`wafer_gpt2.core.steps.PipelinedBackend`: the modeled wafer
of `bench host --steps-in-flight 2`) is driven by `_serve_pipelined`: the next step takes what became
ready while another computes, and the watchdog watches the oldest step in flight.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

from wafer_gpt2.core.steps import Backend, BackendError, PipelinedBackend, steps_in_flight
from wafer_gpt2.engine.core import EngineCore, TokenizerHooks
from wafer_gpt2.engine.failures import (
    GenerationFailed,
    RequestFailed,
    ServiceError,
    StepTimedOut,
    Unavailable,
)
from wafer_gpt2.engine.kv_slots import KVUsage
from wafer_gpt2.engine.metrics import ServiceMetrics
from wafer_gpt2.engine.request import (
    EventSink,
    GenerationRequest,
    RequestState,
    RequestStatus,
    Submitted,
    loop_sink,
)
from wafer_gpt2.engine.scheduler import StepBatch
from wafer_gpt2.logs import log_reference

log = logging.getLogger(__name__)

BackendFactory = Callable[[], Backend]
RELOAD_ATTEMPTS = 3
# A step that leaves the GIL free at least this long (a wafer's wait, not the backend's own computing)
# has the previous step's token work done beside it, on the helper thread: handing it over costs a GIL
# hand-off, which a shorter wait cannot hide. The threshold is low enough that a modeled GPT-2 124M step
# overlaps (it keeps the modeled wafer busier with the engine in its own process), high enough that a
# backend computing on the worker's thread (null, reference) does not. The wait must hold for a few steps
# in a row: one step that measured a wait because the OS preempted the worker (a busy machine) is no
# wafer's wait.
OVERLAP_MIN_WAIT_S = 0.1e-3
OVERLAP_STEPS_IN_A_ROW = 3
# How long `shutdown` waits for the worker after asking it to stop: one step boundary. A worker still
# busy by then (a hung step, a model still loading) is abandoned.
SHUTDOWN_JOIN_S = 5.0


class HelperThread:
    """Runs the worker's side jobs (finishing the previous step's tokens) on a daemon thread of its own
    while the worker waits for the backend. One per worker; a job that fails is logged and dropped (the
    worker redoes what is left under its lock after the step)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, name="wafer-engine-helper", daemon=True).start()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            function, args = job
            try:
                function(*args)
            except Exception:
                log.exception("the engine's helper job failed")

    def run_soon(self, function: Callable, *args) -> None:
        self._jobs.put((function, args))

    def close(self) -> None:
        self._jobs.put(None)


# What `submit_nowait`'s caller hears once the worker filed its request: the state, or the refusal.
Filed = Callable[[str, "RequestState | ServiceError"], None]


@dataclass(frozen=True)
class _Arrival:
    request: GenerationRequest
    stream: bool
    sink: EventSink
    request_id: str
    filed: Filed


def request_failed(request_id: str) -> RequestFailed:
    """(In an exception handler.) A request the engine could not queue, a bug: logged with the
    exception under a reference, which the client's 500 names."""
    reference = log_reference()
    log.exception("could not queue request %s (reference %s)", request_id, reference)
    return RequestFailed(f"the server could not queue this request (reference {reference})")


LOOP_TURN_TIMEOUT_S = 5e-3


def wait_for_sinks(batch: StepBatch) -> None:
    """After a short step that kept the worker computing (a backend that answers at once), when none of
    the step's requests streams: wait until the receivers of its requests' events (their sinks) have had
    a turn. Run back to back, such steps carry a token or two each and take the GIL from the event loop
    that would bring more requests: without the wait, such steps carry a small fraction of the requests
    in flight. A
    step with streams is not waited after: the steps that run on meanwhile put several tokens into each
    stream's next write, and a write per token costs more than the short steps. A step that
    waits for the wafer (or the modeled one's sleep) lets the loop run meanwhile, and is not waited after."""
    sinks = set()
    for state in batch.owners:
        if state.stream:
            return
        if state.sink is not None:
            sinks.add(state.sink)
    for sink in sinks:
        sink.wait_for_turn(LOOP_TURN_TIMEOUT_S)


class EngineState(enum.Enum):
    LOADING = "loading"  # the first upload of the model is under way
    READY = "ready"
    RELOADING = "reloading"  # after a worker failure
    DRAINING = "draining"  # shutting down: running requests finish, new ones are refused
    STOPPED = "stopped"
    FAILED = "failed"  # the model could not be (re)loaded: the server cannot serve
    # An engine process silent past its heartbeat deadline (stopped or hung; `wafer_gpt2/engine/process.py`).
    UNRESPONSIVE = "unresponsive"


def close_quietly(backend: Backend) -> None:
    try:
        backend.close()
    except Exception:
        log.exception("closing the backend failed")


class Engine:
    def __init__(
        self,
        backend_factory: BackendFactory,
        tokenizer: TokenizerHooks,
        metrics: ServiceMetrics,
        max_queue: int,
        step_token_budget: int,
        on_fatal: Callable[[str], None] | None = None,
        step_timeout_s: float = 60.0,
        step_timeout_per_item_s: float = 0.25,
    ):
        self._factory = backend_factory
        self._tokenizer = tokenizer
        self.metrics = metrics
        self._max_queue = max_queue
        self._step_token_budget = step_token_budget
        self._on_fatal = on_fatal
        self._step_timeout_s = step_timeout_s
        self._step_timeout_per_item_s = step_timeout_per_item_s

        lock = threading.RLock()
        self._cond = threading.Condition(lock)
        # The watchdog waits on a condition of its own: notified only when a step's deadline comes before
        # the time it already wakes at, not at every step (a wake-up per step costs the server a thread
        # switch).
        self._watch = threading.Condition(lock)
        self._watch_until = 0.0  # when the watchdog wakes next on its own
        self._state = EngineState.LOADING
        self._core: EngineCore | None = None  # built with the first backend; kept across reloads
        self._stop = False
        self._thread: threading.Thread | None = None
        self._generation = 0  # the current worker's number; a worker abandoned by the watchdog is older
        self._step: tuple[int, float, float] | None = None  # (items, started, deadline) of the running step
        self.error: str | None = None  # why the engine failed, when it did
        self.fault: str | None = None  # the last fault the worker recovers from (shown by /health)
        self.load_seconds: float | None = None
        self.idle_seconds = 0.0  # time the worker waited with no request to step (`bench host` reads it)
        self.restarts = 0
        self._injected_step_faults: list[BaseException] = []
        self._injected_load_faults: list[BaseException] = []
        # Requests handed over without the lock (`submit_nowait`), filed by the worker at its next step
        # boundary; `_parked`: the worker waits for work (set and read under the GIL, see submit_nowait).
        self._arrivals: collections.deque[_Arrival] = collections.deque()
        self._parked = False
        self._helper_cpu_s = 0.0  # CPU time of the helper's jobs (under the lock): not the backend's wait
        self._waits_in_a_row = 0  # steps in a row that left the GIL free for OVERLAP_MIN_WAIT_S or more
        self._loading = False  # the worker is building a backend (read by `shutdown`'s report)

    # ----- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the worker; it uploads the model, then serves. Returns at once (/health says when)."""
        self._start_worker(first=True)
        threading.Thread(target=self._watchdog, name="wafer-step-watchdog", daemon=True).start()

    def _start_worker(self, first: bool) -> None:
        self._thread = threading.Thread(
            target=self._worker, args=(self._generation, first), name="wafer-engine", daemon=True
        )
        self._thread.start()

    @property
    def steps(self) -> int:
        """Steps run so far (across reloads)."""
        return 0 if self._core is None else self._core.steps

    def step_deadline_s(self, items: int) -> float:
        """How long a step of `items` items may run before the watchdog fails it."""
        return self._step_timeout_s + self._step_timeout_per_item_s * items

    @property
    def state(self) -> EngineState:
        return self._state

    @property
    def ready(self) -> bool:
        return self._state is EngineState.READY

    def wait_ready(self, timeout: float) -> bool:
        with self._cond:
            loading = (EngineState.LOADING, EngineState.RELOADING)
            self._cond.wait_for(lambda: self._state not in loading, timeout)
            return self._state is EngineState.READY

    def begin_drain(self) -> None:
        """Refuse new requests (503) from now on; running and queued ones go on."""
        with self._cond:
            if self._state in (EngineState.READY, EngineState.LOADING, EngineState.RELOADING):
                self._set_state(EngineState.DRAINING)

    def wait_drained(self, timeout: float) -> bool:
        """True once no request is queued, running or handed over (or the engine no longer runs)."""
        with self._cond:
            return self._cond.wait_for(
                lambda: self._core is None or not (self._core.has_work() or self._arrivals) or self._stop,
                timeout,
            )

    def shutdown(self, timeout: float = 30.0) -> None:
        """Drain (up to `timeout`), fail what is left with 503, stop the worker, close the backend."""
        self.begin_drain()
        self.wait_drained(timeout)
        with self._cond:
            self._stop = True  # the worker ends what is left (503) at its next step boundary
            self._cond.notify_all()
            self._watch.notify_all()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=SHUTDOWN_JOIN_S)
            if thread.is_alive():
                if self._loading:
                    log.error("the model is still loading at shutdown: the backend is closed once built")
                else:
                    log.error("a step is still running at shutdown: its worker is abandoned")
                with self._cond:
                    self._generation += 1
                    self._set_state(EngineState.STOPPED)
                    self._fail_all(Unavailable("the server shut down before this request finished"))
                    hung = self._core.detach() if self._core is not None else None
                if hung is not None:
                    threading.Thread(target=close_quietly, args=(hung,), daemon=True).start()

    def inject_fault(
        self,
        message: str = "injected worker fault",
        steps: int = 1,
        reloads: int = 0,
        error: type[BaseException] = BackendError,
    ) -> None:
        """Test hook: the next `steps` steps raise `error(message)`, and the next `reloads` backend
        builds after them fail too (exercises recovery and the dead-engine path)."""
        with self._cond:
            self._injected_step_faults.extend(error(message) for _ in range(steps))
            self._injected_load_faults.extend(error(message) for _ in range(reloads))
            self._cond.notify_all()

    # ----- what the API calls (on the event loop) --------------------------------------------------

    @property
    def backend(self) -> Backend:
        """The running backend, for its shape (slots, context length, vocabulary, top-k)."""
        backend = None if self._core is None else self._core.backend
        if backend is None:
            raise self.unavailable()
        return backend

    def submit(
        self,
        request: GenerationRequest,
        stream: bool = True,
        sink: EventSink | None = None,
        request_id: str | None = None,
    ) -> RequestState:
        """Queue a request; its events go to `sink` (default: the running event loop's; `stream` False:
        the final one only). `request_id`: the id it is known by elsewhere (`wafer_gpt2.engine.process`)."""
        sink = sink if sink is not None else loop_sink(asyncio.get_running_loop())
        with self._cond:
            if self._state is not EngineState.READY:
                raise self.unavailable()
            state = self._queue(self._built_core(), request, stream, sink, request_id)
            self._cond.notify_all()
        return state

    def submit_nowait(
        self,
        request: GenerationRequest,
        stream: bool,
        sink: EventSink,
        request_id: str,
        filed: Filed,
    ) -> None:
        """Queue a request without taking the engine's lock: the worker files it at its next step
        boundary, as `submit` would, and calls `filed(request_id, its state or the refusal)` there
        (under the lock). `submit`'s check is made now: a request the engine refuses (loading,
        draining, stopped) is answered at once on this thread, one handed over before a drain is
        served. For a caller that reads requests off a pipe on a thread of the engine's own
        process (`wafer_gpt2.engine.process`): taking the lock per request, it waited for the lock while
        the worker, holding the GIL, ran steps back to back, and the steps carried a fraction of the
        streams in flight."""
        if self._state is not EngineState.READY:  # `submit`'s check, made when the request is handed over
            self._tell_filed(_Arrival(request, stream, sink, request_id, filed), self.unavailable())
            return
        self._arrivals.append(_Arrival(request, stream, sink, request_id, filed))
        # The worker sets `_parked` before it looks at the arrivals (under the lock) and waits: either it
        # sees this one, or it is parked by now and this wakes it. An engine that no longer runs refuses.
        if self._parked or self._state in (EngineState.STOPPED, EngineState.FAILED):
            with self._cond:
                if self._state in (EngineState.STOPPED, EngineState.FAILED):
                    self._refuse_arrivals(self.unavailable())
                self._cond.notify_all()

    def cancel(self, state: Submitted) -> None:
        """The client went away: the request leaves at the next step boundary (its slot with it)."""
        if not isinstance(state, RequestState):
            raise TypeError(f"not a request of this engine: {state!r}")
        if state.status is RequestStatus.FINISHED:
            # Every handler cancels its requests on the way out: one that ended (a terminal status,
            # set under the lock) needs neither the lock nor a wake-up of the worker.
            return
        with self._cond:
            self._built_core().abort(state)
            self._cond.notify_all()

    @property
    def capacity(self) -> int:
        """Requests the engine holds at most (running and queued; 0 before the first load)."""
        core = self._core
        return 0 if core is None else core.scheduler.capacity

    def kv_usage(self) -> KVUsage:
        with self._cond:
            if self._core is None:
                return KVUsage(0, 0, 0, 0)
            return self._core.scheduler.slots.usage()

    def queue_sizes(self) -> tuple[int, int]:
        """(waiting, running)."""
        with self._cond:
            if self._core is None:
                return 0, 0
            return len(self._core.scheduler.waiting), len(self._core.scheduler.running)

    def describe(self) -> dict:
        """What runs the model (`Backend.describe`): backend, dtype, shape, the plan in brief."""
        return self.backend.describe()

    def unavailable(self) -> Unavailable:
        """Why the engine takes no request now; with Retry-After unless it can never serve again."""
        final = self._state in (EngineState.FAILED, EngineState.STOPPED)
        return Unavailable(self._unavailable_reason(), final=final)

    def _unavailable_reason(self) -> str:
        return {
            EngineState.LOADING: "the model is still being uploaded; retry shortly",
            EngineState.RELOADING: "the wafer worker is reloading the model after a failure; retry shortly",
            EngineState.DRAINING: "the server is shutting down and accepts no new requests",
            EngineState.STOPPED: "the server has shut down",
            EngineState.FAILED: f"the engine failed and cannot serve: {self.error}",
        }.get(self._state, "the engine is not ready")

    # ----- the worker thread -----------------------------------------------------------------------

    def _worker(self, generation: int, first: bool) -> None:
        death: BaseException | None = None  # what ended the worker when nobody asked it to stop
        helper = HelperThread()
        try:
            if not self._load(generation, first=first):
                return
            depth = self._steps_in_flight()
            while True:
                if depth > 1:  # a pipelined backend: it serves until the worker stops or recovers
                    if not self._serve_pipelined(generation, depth):
                        return
                    depth = self._steps_in_flight()  # the backend reloaded after a failed step
                    continue
                batch = self._next_batch(generation)
                if batch is None:
                    break
                try:
                    started = time.monotonic()
                    with self._cond:
                        self._watch_step(len(batch), started)
                        core = self._built_core()
                        backend = core.backend  # this worker's, even if the watchdog detaches it
                    if self._injected_step_faults:
                        raise self._injected_step_faults.pop(0)
                    # While the backend computes (a wafer step leaves the GIL free), the helper thread
                    # finishes the previous step's tokens: detokenizing, events, ends.
                    if core.has_deferred:
                        helper.run_soon(self._complete_deferred, generation)
                    stepped, cpu, helped = time.monotonic(), time.thread_time(), self._helper_cpu_s
                    results = core.execute(batch, backend)
                    took = time.monotonic() - stepped
                    computing = time.thread_time() - cpu
                    # A step that kept the worker computing (the GIL held) gave the event loop no turn.
                    held = computing >= 0.5 * took
                    with self._cond:  # the helper's job, when one ran, has finished by now
                        if self._generation != generation:
                            return  # the watchdog gave up on this step: another worker serves now
                        # Deferring pays only where the step waits long enough to hide the hand-over: a
                        # wafer's wait (the simulator's runtime thread's, the stand-in's sleep), not the
                        # worker's own computing (the null and reference backends) nor the helper's job
                        # (which would otherwise make every later step look like a wait).
                        waited = took - computing - (self._helper_cpu_s - helped) >= OVERLAP_MIN_WAIT_S
                        self._waits_in_a_row = self._waits_in_a_row + 1 if waited else 0
                        defer = self._waits_in_a_row >= OVERLAP_STEPS_IN_A_ROW
                        self._step = None
                        core.complete_deferred()  # what the helper did not get to
                        core.finish(batch, results, defer=defer)  # the events went to the event loops
                        self._cond.notify_all()
                    if not defer and held:
                        wait_for_sinks(batch)
                except KeyboardInterrupt:
                    raise  # an interrupt ends the worker (below), it is no backend fault to recover from
                except BaseException as exc:  # any failure of the backend, SystemExit too: recover
                    with self._cond:
                        if self._generation != generation:
                            return  # the abandoned backend was closed under its hung step
                        self._step = None
                    ids = ",".join(dict.fromkeys(state.id for state in batch.owners))
                    log.exception("engine step failed (requests %s)", ids, extra={"request_id": ids})
                    if not self._recover(generation, exc):
                        return
                    depth = self._steps_in_flight()
        except BaseException as exc:  # the worker itself cannot go on: never leave a silent engine
            death = exc
            if self._generation != generation:
                return
            if isinstance(exc, KeyboardInterrupt):
                log.warning("the wafer worker was interrupted: the engine stops")
            else:
                log.exception("the wafer worker died")
        finally:
            helper.close()
            if self._generation == generation:
                self._close_backend()
                self._end_worker(death)

    def _watchdog(self) -> None:
        """Fail a step that runs past its deadline, and restart the backend under a fresh worker."""
        with self._cond:
            while not self._stop and self._state not in (EngineState.STOPPED, EngineState.FAILED):
                step = self._step
                now = time.monotonic()
                if step is None or now < step[2]:
                    timeout = 1.0 if step is None else step[2] - now
                    self._watch_until = now + timeout
                    self._watch.wait(timeout=timeout)
                    continue
                self._abandon_hung_step(*step)

    def _abandon_hung_step(self, items: int, started: float, deadline: float) -> None:
        """(The lock is held.) The running step is hung: fail its requests, start over on a new worker."""
        limit = deadline - started
        self.fault = f"step watchdog: a step of {items} items ran past its {limit:.1f} s deadline"
        log.error("%s; the backend is restarted", self.fault)
        self._generation += 1  # the hung worker is no longer the engine's
        self._step = None
        core = self._built_core()  # a step was running: the first load built it
        hung = core.detach()  # its slots are not freed on a hung backend
        if self._state is EngineState.READY:
            self._set_state(EngineState.RELOADING)
        error = StepTimedOut(
            f"the wafer did not finish a step within {limit:.1f} s (the step watchdog fired); "
            "the backend is being restarted, retry the request"
        )
        core.end_all(error, core.scheduler.running)
        self.restarts += 1
        self.metrics.wafer_engine_restarts_total.inc()
        self.metrics.wafer_engine_step_timeouts_total.inc()
        if hung is not None:
            threading.Thread(target=close_quietly, args=(hung,), name="wafer-close-hung", daemon=True).start()
        self._start_worker(first=False)

    def _end_worker(self, death: BaseException | None) -> None:
        """The worker is ending: fail what is left, and when it ended on its own, tell the server."""
        fatal = None
        with self._cond:
            if death is not None and not isinstance(death, KeyboardInterrupt):
                reference = log_reference()
                log.error("the wafer worker died (reference %s)", reference, exc_info=death)
                # Clients see the reference, the log the exception: no internal text in response bodies.
                self.error = f"the wafer worker died (reference {reference}; the server log has the details)"
                self._set_state(EngineState.FAILED)
                self._fail_all(Unavailable(f"the engine failed and cannot serve: {self.error}", final=True))
                fatal = f"the wafer worker died ({type(death).__name__}: {death}; reference {reference})"
            else:
                if self._state is not EngineState.FAILED:
                    self._set_state(EngineState.STOPPED)
                self._fail_all(Unavailable("the server shut down before this request finished"))
                if death is not None:
                    fatal = "the wafer worker was interrupted (KeyboardInterrupt); the server stops"
        if fatal is not None and self._on_fatal is not None:
            self._on_fatal(fatal)  # the server exits non-zero rather than answer 503 forever

    def _complete_deferred(self, generation: int) -> None:
        """(The helper thread, while a step runs.) Finish the previous step's tokens."""
        with self._cond:
            started = time.thread_time()
            if self._generation == generation and self._core is not None:
                if self._core.complete_deferred(backend_busy=True):
                    self._cond.notify_all()
            self._helper_cpu_s += time.thread_time() - started

    def _steps_in_flight(self) -> int:
        with self._cond:
            backend = None if self._core is None else self._core.backend
            return 1 if backend is None else steps_in_flight(backend)

    def _serve_pipelined(self, generation: int, depth: int) -> bool:
        """The worker's loop over a `PipelinedBackend`: up to `depth` steps in flight. While
        one computes, the next takes what became ready meanwhile (new requests' prompts, the requests of a
        step that returned), so the wafer need not wait for the host between steps. A returned step's
        tokens are chosen at once; their text, events and ends wait until the next step is out
        (`finish(defer=True)`, then `complete_deferred` before the worker waits for the backend), done
        by the worker itself, not the helper thread. The watchdog watches the oldest step. True after a
        failed step was recovered from (the worker goes on), False when the worker ends (stop, abandoned
        by the watchdog, reload failed)."""
        in_flight: collections.deque[tuple[StepBatch, float]] = collections.deque()
        backend: PipelinedBackend | None = None
        while True:
            batch = None
            # Scheduling stays outside the recovered part, as in `_worker`: a fault there is no step's.
            if len(in_flight) < depth:
                batch = self._next_batch(generation, wait=not in_flight)
                if batch is None:
                    return False
            try:
                if batch is not None and batch:
                    with self._cond:
                        if self._generation != generation:
                            return False
                        core = self._built_core()
                        if backend is None:
                            backend = cast(PipelinedBackend, core.backend)
                        if backend is None or core.backend is not backend:
                            raise BackendError("the backend was detached while steps were in flight")
                        in_flight.append((batch, time.monotonic()))
                        self._watch_oldest(in_flight)  # before it is submitted: a submit may hang too
                    if self._injected_step_faults:
                        raise self._injected_step_faults.pop(0)
                    backend.submit(batch.inputs)
                    # While the wafer computes: the text, events and ends of the tokens chosen last.
                    # Requests that end free their slots, so the next step can admit waiting ones.
                    if not self._complete_chosen(generation):
                        return False
                    continue
                if not in_flight or backend is None:
                    continue
                if not self._complete_chosen(generation):
                    return False
                results = backend.collect()
                with self._cond:
                    if self._generation != generation:
                        return False  # the watchdog gave up on this step: another worker serves now
                    batch, submitted = in_flight.popleft()
                    self._watch_oldest(in_flight)
                    core = self._built_core()
                    # From submit to collect: with steps in flight, the wait behind the earlier ones too.
                    core.metrics.record_step(time.monotonic() - submitted, len(batch))
                    # Choose the tokens only: their requests' next step goes out before the rest is done.
                    core.finish(batch, results, defer=True)
                    self._cond.notify_all()
            except KeyboardInterrupt:
                raise
            except BaseException as exc:  # as in `_worker`: a failure of the backend, recovered from
                with self._cond:
                    if self._generation != generation:
                        return False
                    self._step = None
                owners = [state for batch, _ in in_flight for state in batch.owners]
                ids = ",".join(dict.fromkeys(state.id for state in owners)) or "-"
                log.exception("engine step failed (requests %s)", ids, extra={"request_id": ids})
                return self._recover(generation, exc)

    def _complete_chosen(self, generation: int) -> bool:
        """The chosen tokens' text, events and ends (`complete_deferred`); False when this worker was
        abandoned meanwhile (the core is the next worker's now)."""
        with self._cond:
            if self._generation != generation:
                return False
            if self._built_core().complete_deferred():
                self._cond.notify_all()
            return True

    def _watch_oldest(self, in_flight: collections.deque[tuple[StepBatch, float]]) -> None:
        """Point the watchdog at the oldest step in flight (none: nothing to watch)."""
        with self._cond:
            if not in_flight:
                self._step = None
                return
            batch, submitted = in_flight[0]
            self._watch_step(len(batch), submitted)

    def _watch_step(self, items: int, started: float) -> None:
        """(The lock is held.) The watchdog watches a step of `items` items started at `started`."""
        self._step = (items, started, started + self.step_deadline_s(items))
        if self._step[2] < self._watch_until:
            self._watch.notify_all()  # the watchdog must wake before it meant to

    def _next_batch(self, generation: int, wait: bool = True) -> StepBatch | None:
        """Wait for work; None when the worker should stop. `wait` False: an empty batch when there is
        nothing to step now (steps are in flight: their end brings work)."""
        with self._cond:
            while True:
                if self._stop or self._generation != generation:
                    return None
                core = self._built_core()
                self._file_arrivals(core)
                batch = core.schedule()
                if batch or not wait:
                    return batch
                if core.complete_deferred():
                    continue  # requests ended (their slots are free): schedule again
                self._cond.notify_all()  # wake wait_drained
                waited = time.monotonic()
                self._parked = True
                if not self._arrivals:
                    self._cond.wait(timeout=1.0)
                self._parked = False
                self.idle_seconds += time.monotonic() - waited

    def _load(self, generation: int, first: bool) -> bool:
        """Build the backend (upload the model); on failure retry, then give up (FAILED). A backend
        that is built after the engine was shut down, or after `shutdown` abandoned this worker, is
        closed at once: nothing would serve from it or close it later."""
        attempts = 1 if first else RELOAD_ATTEMPTS
        for attempt in range(1, attempts + 1):
            started = time.monotonic()
            log.info("uploading the model to the wafer backend%s", "" if first else f" (attempt {attempt})")
            self._loading = True
            try:
                if self._injected_load_faults:
                    raise self._injected_load_faults.pop(0)
                backend = self._factory()
            except Exception as exc:
                log.error("could not build the backend: %s", exc)
                self.error = f"{type(exc).__name__}: {exc}"
                continue
            finally:
                self._loading = False
            with self._cond:
                stopped = self._stop or self._generation != generation
                if not stopped:
                    if self._core is None:
                        self._core = EngineCore(
                            backend, self._tokenizer, self._max_queue, self._step_token_budget, self.metrics
                        )
                    else:
                        self._core.attach(backend)  # fresh slots, the queue kept
                    self.load_seconds = time.monotonic() - started
                    self.error = None
                    if self._state in (EngineState.LOADING, EngineState.RELOADING):
                        self._set_state(EngineState.READY)
            if stopped:
                log.info("the model finished loading after the engine was shut down: its backend is closed")
                close_quietly(backend)
                return False
            log.info(
                "model ready in %.2f s: %d KV slots x %d positions, top-%d",
                self.load_seconds,
                backend.num_slots,
                backend.context_length,
                backend.top_k,
            )
            return True
        with self._cond:
            self._set_state(EngineState.FAILED)
            self._fail_all(Unavailable(f"the engine failed and cannot serve: {self.error}", final=True))
        if self._on_fatal is not None:
            self._on_fatal(f"the model could not be loaded: {self.error or 'the backend could not be built'}")
        return False

    def _recover(self, generation: int, exc: BaseException) -> bool:
        """A step failed: fail the requests in flight, rebuild the backend, keep the queue."""
        with self._cond:
            if self._state is EngineState.READY:
                self._set_state(EngineState.RELOADING)  # before the failures reach anyone: /health is 503
            reference = log_reference()
            log.error("the wafer worker failed (reference %s): %s: %s", reference, type(exc).__name__, exc)
            details = f"reference {reference}; the server log has the details"
            self.fault = f"the wafer worker failed ({details})"
            message = (
                f"the wafer worker failed while running this request ({details}); "
                "the model is being reloaded, retry the request"
            )
            core = self._built_core()  # a step failed: the first load built it
            core.end_all(GenerationFailed(message), core.scheduler.running)
            self.restarts += 1
            self.metrics.wafer_engine_restarts_total.inc()
        self._close_backend()
        return self._load(generation, first=False)

    def _close_backend(self) -> None:
        backend = self._core.detach() if self._core is not None else None
        if backend is not None:
            close_quietly(backend)

    # ----- (the lock is held) ---------------------------------------------------------------------

    def _built_core(self) -> EngineCore:
        """The core, where only an engine that has loaded gets here (READY, a request, a step)."""
        if self._core is None:
            raise RuntimeError("the engine core is not built: no backend has been loaded")
        return self._core

    def _fail_all(self, error) -> None:
        if self._core is not None:
            self._core.end_all(error)
        self._refuse_arrivals(error)  # handed over without the lock, not filed yet

    def _file_arrivals(self, core: EngineCore) -> None:
        """Queue the requests `submit_nowait` handed over, or refuse them as `submit` would."""
        arrivals = self._arrivals
        while arrivals:
            arrival = arrivals[0]  # taken off once answered: a worker that dies here leaves it to _fail_all
            outcome: RequestState | ServiceError
            try:
                outcome = self._queue(core, arrival.request, arrival.stream, arrival.sink, arrival.request_id)
            except ServiceError as error:
                outcome = error
            except Exception:  # a bug: this request fails (500, a log reference), the engine goes on
                outcome = request_failed(arrival.request_id)
            self._tell_filed(arrival, outcome)
            arrivals.popleft()

    def _queue(
        self,
        core: EngineCore,
        request: GenerationRequest,
        stream: bool,
        sink: EventSink,
        request_id: str | None,
    ) -> RequestState:
        """(The lock is held.) The request's state, queued (Overloaded, RequestValidationFailed)."""
        state = core.new_request(request, sink, stream)
        if request_id is not None:
            state.id = request_id
        return core.add(state)

    def _refuse_arrivals(self, error: ServiceError) -> None:
        arrivals = self._arrivals
        while arrivals:
            self._tell_filed(arrivals.popleft(), error)

    def _tell_filed(self, arrival: _Arrival, outcome: RequestState | ServiceError) -> None:
        try:
            arrival.filed(arrival.request_id, outcome)
        except Exception:  # the caller's bug (or its pipe closed): never the worker's end
            log.exception("could not report request %s as filed", arrival.request_id)

    def _set_state(self, state: EngineState) -> None:
        self._state = state
        self.metrics.wafer_engine_ready.set(1 if state is EngineState.READY else 0)
        self._cond.notify_all()
        self._watch.notify_all()
