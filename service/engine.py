"""The engine: a long-lived worker that owns the wafer for the life of the server.

The worker thread builds the executor once (for the wafer backends that is where the model is uploaded)
and then runs steps for as long as the server lives: at each step boundary it drops cancelled and
timed-out requests (freeing their KV slots), admits waiting requests, runs one step with the prompt
chunks of new requests and the decode items of running ones together, samples, detokenizes, and hands
each request's tokens to its asyncio queue. Requests that finish leave the batch at once.

A step that raises (anything but an interrupt: `SystemExit` from deep inside a backend counts as a
fault too) fails the requests that were in flight (424, `generation`); the worker then closes the
executor and builds a fresh one (/health answers 503 meanwhile) and goes on with the queue. If the
worker itself dies (an error outside a step, or an interrupt), the engine never sits silently
stopped: it ends every request, /health answers 503 and `on_fatal` tells the server to exit non-zero.
Shutdown drains: new requests get 503 while the running ones finish, up to a timeout.

A step that never returns is caught by the step watchdog (a thread of its own): each step gets a
deadline, `step_timeout_s` plus `step_timeout_per_item_s` per item of the plan. Past it, the requests in
flight fail (504, `generation`), /health answers 503 `reloading` naming the fault, and a fresh worker
builds a fresh executor and goes on with the queue. The hung worker is abandoned (a Python thread cannot
be killed): its executor is closed from another thread, and when its step returns, if ever, it sees that
it is no longer the current worker and leaves without touching anything.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from service.detokenizer import IncrementalDetokenizer
from service.errors import (
    GenerationFailed,
    RequestFailed,
    RequestTimedOut,
    RequestValidationFailed,
    ServiceError,
    StepTimedOut,
    Unavailable,
)
from service.kv_slots import KVSlotManager, KVUsage
from service.metrics import ServiceMetrics
from service.sampling import Sampler
from service.scheduler import Scheduler, StepPlan
from service.sequence import (
    Alternative,
    ErrorEvent,
    FinishEvent,
    FinishReason,
    GeneratedToken,
    GenerationRequest,
    PromptToken,
    Sequence,
    State,
    TokenEvent,
)
from wafer.executor import Executor, ExecutorError, StepItem, TokenScores

log = logging.getLogger("wafer_gpt2.engine")

ExecutorFactory = Callable[[], Executor]
REQUEST_FAILED_MESSAGE = (
    "the server could not choose or decode the next token of this request, which was ended; "
    "other requests are not affected (the server log has the details)"
)
RELOAD_ATTEMPTS = 3
# What /info shows of a wafer plan (its regions and routes are for `wafer-gpt2 plan`, not for /info).
PLAN_SUMMARY_KEYS = (
    "version",
    "arch",
    "dtype",
    "objective",
    "slots",
    "context",
    "top_k",
    "fabric",
    "kernel",
    "summary",
)


class EngineState(enum.Enum):
    LOADING = "loading"  # the first upload of the model is under way
    READY = "ready"
    RELOADING = "reloading"  # after a worker failure
    DRAINING = "draining"  # shutting down: running requests finish, new ones are refused
    STOPPED = "stopped"
    FAILED = "failed"  # the model could not be (re)loaded: the server cannot serve


@dataclass(frozen=True)
class TokenizerHooks:
    """What the engine needs from the tokenizer: bytes per token, and which ids are special."""

    token_bytes: Callable[[int], bytes]
    eos_token_id: int
    special_names: dict[int, str]
    vocab_size: int | None = None  # ids at or above it are unknown to the tokenizer: never emitted


def alternatives(scores: TokenScores, n: int, vocab_size: int | None = None) -> tuple[Alternative, ...]:
    """The n best candidates the wafer returned that the tokenizer knows, with the model's logprobs."""
    known = (
        Alternative(int(token), scores.logprob(logit))
        for token, logit in zip(scores.topk_ids, scores.topk_logits, strict=True)
        if vocab_size is None or token < vocab_size
    )
    return tuple(itertools.islice(known, n))


def close_quietly(executor: Executor) -> None:
    try:
        executor.close()
    except Exception:
        log.exception("closing the executor failed")


class Engine:
    def __init__(
        self,
        executor_factory: ExecutorFactory,
        tokenizer: TokenizerHooks,
        metrics: ServiceMetrics,
        max_queue: int,
        step_token_budget: int,
        on_fatal: Callable[[str], None] | None = None,
        step_timeout_s: float = 60.0,
        step_timeout_per_item_s: float = 0.25,
    ):
        self._factory = executor_factory
        self._tokenizer = tokenizer
        self.metrics = metrics
        self._max_queue = max_queue
        self._step_token_budget = step_token_budget
        self._on_fatal = on_fatal
        self._step_timeout_s = step_timeout_s
        self._step_timeout_per_item_s = step_timeout_per_item_s

        self._cond = threading.Condition()
        self._state = EngineState.LOADING
        self._executor: Executor | None = None
        self._scheduler: Scheduler | None = None
        self._stop = False
        self._thread: threading.Thread | None = None
        self._generation = 0  # the current worker's number; a worker abandoned by the watchdog is older
        self._step: tuple[int, float, float] | None = None  # (items, started, deadline) of the running step
        self.error: str | None = None  # why the engine failed, when it did
        self.fault: str | None = None  # the last fault the worker recovers from (shown by /health)
        self.load_seconds: float | None = None
        self.restarts = 0
        self.steps = 0
        self._injected_step_faults: list[BaseException] = []
        self._injected_load_faults: list[BaseException] = []

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
        """True once no request is queued or running (or the engine no longer runs)."""
        with self._cond:
            return self._cond.wait_for(
                lambda: self._scheduler is None or not self._scheduler.has_work() or self._stop, timeout
            )

    def shutdown(self, timeout: float = 30.0) -> None:
        """Drain (up to `timeout`), fail what is left with 503, stop the worker, close the executor."""
        self.begin_drain()
        self.wait_drained(timeout)
        with self._cond:
            self._stop = True  # the worker ends what is left (503) at its next step boundary
            self._cond.notify_all()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5.0)  # one step boundary; a step still running by then is hung
            if thread.is_alive():
                log.error("a step is still running at shutdown: its worker is abandoned")
                with self._cond:
                    self._generation += 1
                    self._set_state(EngineState.STOPPED)
                    self._fail_all(Unavailable("the server shut down before this request finished"))
                    hung, self._executor = self._executor, None
                if hung is not None:
                    threading.Thread(target=close_quietly, args=(hung,), daemon=True).start()

    def inject_fault(
        self,
        message: str = "injected worker fault",
        steps: int = 1,
        reloads: int = 0,
        error: type[BaseException] = ExecutorError,
    ) -> None:
        """Test hook: the next `steps` steps raise `error(message)`, and the next `reloads` executor
        builds after them fail too (exercises recovery and the dead-engine path)."""
        with self._cond:
            self._injected_step_faults.extend(error(message) for _ in range(steps))
            self._injected_load_faults.extend(error(message) for _ in range(reloads))
            self._cond.notify_all()

    # ----- what the API calls (on the event loop) --------------------------------------------------

    @property
    def executor(self) -> Executor:
        """The running executor, for its shape (slots, context length, vocabulary, top-k)."""
        if self._executor is None:
            raise self.unavailable()
        return self._executor

    def submit(self, request: GenerationRequest) -> Sequence:
        sequence = Sequence(
            request=request,
            detokenizer=IncrementalDetokenizer(
                self._tokenizer.token_bytes, request.stop_sequences, request.include_stop_str_in_output
            ),
            sampler=Sampler(request.sampling, vocab_size=self._tokenizer.vocab_size),
            loop=asyncio.get_running_loop(),
        )
        with self._cond:
            if self._state is not EngineState.READY:
                raise self.unavailable()
            if not self._scheduler.slots.fits(request.tokens_needed):  # the API checked; never trust twice
                raise RequestValidationFailed(
                    f"the request needs {request.tokens_needed} KV positions; a slot holds "
                    f"{self._scheduler.slots.context_length}"
                )
            self._scheduler.add(sequence)
            self.metrics.record_arrival(len(request.prompt_ids))
            self._record_gauges()
            self._cond.notify_all()
        return sequence

    def cancel(self, sequence: Sequence) -> None:
        """The client went away: the request leaves at the next step boundary (its slot with it)."""
        with self._cond:
            if sequence.state is State.FINISHED:
                return
            sequence.cancelled = True
            sequence.cancelled_at_step = self.steps
            self._cond.notify_all()

    def kv_usage(self) -> KVUsage:
        with self._cond:
            if self._scheduler is None:
                return KVUsage(0, 0, 0, 0)
            return self._scheduler.slots.usage()

    def queue_sizes(self) -> tuple[int, int]:
        """(waiting, running)."""
        with self._cond:
            if self._scheduler is None:
                return 0, 0
            return len(self._scheduler.waiting), len(self._scheduler.running)

    def describe(self) -> dict:
        """The wafer plan in brief (the wafer backends carry one; the reference backend has none)."""
        plan = getattr(self._executor, "plan", None)
        if plan is None or not hasattr(plan, "to_json"):
            return {}
        data = plan.to_json()
        return {key: data[key] for key in PLAN_SUMMARY_KEYS if key in data}

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
        try:
            if not self._load(first=first):
                return
            while True:
                plan = self._next_plan(generation)
                if plan is None:
                    break
                try:
                    started = time.monotonic()
                    with self._cond:
                        self._step = (len(plan), started, started + self.step_deadline_s(len(plan)))
                        executor = self._executor  # this worker's, even if the watchdog replaces it
                        self._cond.notify_all()  # the watchdog waits for this deadline now
                    if self._injected_step_faults:
                        raise self._injected_step_faults.pop(0)
                    results = executor.step(plan.items)
                    self.metrics.record_step(time.monotonic() - started, len(plan))
                    with self._cond:
                        if self._generation != generation:
                            return  # the watchdog gave up on this step: another worker serves now
                        self._step = None
                        self.steps += 1
                        self._apply(plan, results)
                        self._record_gauges()
                        self._cond.notify_all()
                except KeyboardInterrupt:
                    raise  # an interrupt ends the worker (below), it is no backend fault to recover from
                except BaseException as exc:  # any failure of the backend, SystemExit too: recover
                    with self._cond:
                        if self._generation != generation:
                            return  # the abandoned executor was closed under its hung step
                        self._step = None
                    log.exception("engine step failed")
                    if not self._recover(exc):
                        return
        except BaseException as exc:  # the worker itself cannot go on: never leave a silent engine
            death = exc
            if self._generation != generation:
                return
            if isinstance(exc, KeyboardInterrupt):
                log.warning("the wafer worker was interrupted: the engine stops")
            else:
                log.exception("the wafer worker died")
        finally:
            if self._generation == generation:
                self._close_executor()
                self._end_worker(death)

    def _watchdog(self) -> None:
        """Fail a step that runs past its deadline, and restart the backend under a fresh worker."""
        with self._cond:
            while not self._stop and self._state not in (EngineState.STOPPED, EngineState.FAILED):
                step = self._step
                now = time.monotonic()
                if step is None or now < step[2]:
                    self._cond.wait(timeout=1.0 if step is None else step[2] - now)
                    continue
                self._abandon_hung_step(*step)

    def _abandon_hung_step(self, items: int, started: float, deadline: float) -> None:
        """(The lock is held.) The running step is hung: fail its requests, start over on a new worker."""
        limit = deadline - started
        self.fault = f"step watchdog: a step of {items} items ran past its {limit:.1f} s deadline"
        log.error("%s; the backend is restarted", self.fault)
        self._generation += 1  # the hung worker is no longer the engine's
        self._step = None
        hung, self._executor = self._executor, None  # its slots are not freed on a hung executor
        if self._state is EngineState.READY:
            self._set_state(EngineState.RELOADING)
        error = StepTimedOut(
            f"the wafer did not finish a step within {limit:.1f} s (the step watchdog fired); "
            "the backend is being restarted, retry the request"
        )
        for sequence in list(self._scheduler.running):
            self._end(sequence, error=error)
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
                self.error = f"the wafer worker died ({type(death).__name__}: {death})"
                self._set_state(EngineState.FAILED)
                self._fail_all(Unavailable(f"the engine failed and cannot serve: {self.error}", final=True))
                fatal = self.error
            else:
                if self._state is not EngineState.FAILED:
                    self._set_state(EngineState.STOPPED)
                self._fail_all(Unavailable("the server shut down before this request finished"))
                if death is not None:
                    fatal = "the wafer worker was interrupted (KeyboardInterrupt); the server stops"
        if fatal is not None and self._on_fatal is not None:
            self._on_fatal(fatal)  # the server exits non-zero rather than answer 503 forever

    def _next_plan(self, generation: int) -> StepPlan | None:
        """Wait for work; None when the worker should stop."""
        with self._cond:
            while True:
                if self._stop or self._generation != generation:
                    return None
                self._reap()
                self._scheduler.admit()
                plan = self._scheduler.build_step()
                self._record_gauges()
                if plan.items:
                    return plan
                self._cond.notify_all()  # wake wait_drained
                self._cond.wait(timeout=1.0)

    def _load(self, first: bool) -> bool:
        """Build the executor (upload the model); on failure retry, then give up (FAILED)."""
        attempts = 1 if first else RELOAD_ATTEMPTS
        for attempt in range(1, attempts + 1):
            started = time.monotonic()
            log.info("uploading the model to the wafer backend%s", "" if first else f" (attempt {attempt})")
            try:
                if self._injected_load_faults:
                    raise self._injected_load_faults.pop(0)
                executor = self._factory()
            except Exception as exc:
                log.error("could not build the executor: %s", exc)
                self.error = f"{type(exc).__name__}: {exc}"
                continue
            with self._cond:
                self._executor = executor
                slots = KVSlotManager(executor.num_slots, executor.context_length)
                self._scheduler = self._scheduler_for(slots)
                self.load_seconds = time.monotonic() - started
                self.error = None
                if self._state in (EngineState.LOADING, EngineState.RELOADING):
                    self._set_state(EngineState.READY)
                self._record_gauges()
            log.info(
                "model ready in %.2f s: %d KV slots x %d positions, top-%d",
                self.load_seconds,
                executor.num_slots,
                executor.context_length,
                executor.top_k,
            )
            return True
        with self._cond:
            self._set_state(EngineState.FAILED)
            self._fail_all(Unavailable(f"the engine failed and cannot serve: {self.error}", final=True))
        if self._on_fatal is not None:
            self._on_fatal(
                f"the model could not be loaded: {self.error or 'the executor could not be built'}"
            )
        return False

    def _scheduler_for(self, slots: KVSlotManager) -> Scheduler:
        """A scheduler over fresh slots that keeps the requests still queued from before a reload."""
        scheduler = Scheduler(slots, self._max_queue, max(self._step_token_budget, slots.num_slots))
        if self._scheduler is not None:
            scheduler.waiting.extend(self._scheduler.waiting)
        return scheduler

    def _recover(self, exc: BaseException) -> bool:
        """A step failed: fail the requests in flight, rebuild the executor, keep the queue."""
        with self._cond:
            if self._state is EngineState.READY:
                self._set_state(EngineState.RELOADING)  # before the failures reach anyone: /health is 503
            self.fault = f"the wafer worker failed ({type(exc).__name__}: {exc})"
            message = (
                f"the wafer worker failed while running this request ({type(exc).__name__}: {exc}); "
                "the model is being reloaded, retry the request"
            )
            for sequence in list(self._scheduler.running):
                self._end(sequence, error=GenerationFailed(message))
            self.restarts += 1
            self.metrics.wafer_engine_restarts_total.inc()
        self._close_executor()
        return self._load(first=False)

    def _close_executor(self) -> None:
        executor, self._executor = self._executor, None
        if executor is not None:
            close_quietly(executor)

    # ----- inside a step boundary (the lock is held) -----------------------------------------------

    def _reap(self) -> None:
        now = time.monotonic()
        for sequence in [*self._scheduler.running, *self._scheduler.waiting]:
            if sequence.cancelled:
                self._end(sequence, error=None)
                self.metrics.record_failure("cancelled")
                self.metrics.wafer_cancel_latency_steps.observe(self.steps - sequence.cancelled_at_step)
            elif sequence.deadline is not None and now > sequence.deadline:
                limit = sequence.request.timeout_s
                self._end(sequence, error=RequestTimedOut(f"the request did not finish within {limit:g} s"))

    def _apply(self, plan: StepPlan, results: list[TokenScores | None]) -> None:
        if len(results) != len(plan.items):
            raise ExecutorError(f"the executor returned {len(results)} results for {len(plan.items)} items")
        for item, scores, sequence in zip(plan.items, results, plan.owners, strict=True):
            if sequence.state is not State.RUNNING:
                continue  # it finished on an earlier item of this step
            try:
                self._apply_item(item, scores, sequence)
            except Exception:
                # Choosing or detokenizing this request's token failed: a fault of this request (its
                # parameters, its text), not of the wafer. It ends alone; the others and the model go on.
                log.exception("request %s failed while its token was chosen or detokenized", sequence.id)
                if sequence.state is not State.FINISHED:
                    self._end(sequence, error=RequestFailed(REQUEST_FAILED_MESSAGE))

    def _apply_item(self, item: StepItem, scores: TokenScores | None, sequence: Sequence) -> None:
        """One item's result: prompt logprobs while prefilling, then the next token."""
        sequence.computed = item.position + 1
        prompt = sequence.prompt
        if item.position < len(prompt):
            request = sequence.request
            if request.prompt_logprobs:
                if item.position == 0:
                    sequence.prefill.append(PromptToken(prompt[0], None))
                if item.target is not None:
                    logprob = scores.logprob(scores.target_logit)
                    n = request.top_n_tokens if request.prompt_top_n is None else request.prompt_top_n
                    ranks = np.flatnonzero(scores.topk_ids == item.target)
                    rank = int(ranks[0]) + 1 if len(ranks) else None
                    top = alternatives(scores, n, self._tokenizer.vocab_size)
                    sequence.prefill.append(PromptToken(item.target, logprob, top, rank))
            if item.position < len(prompt) - 1:
                return
            if request.max_new_tokens == 0:
                # Scoring (OpenAI echo with max_tokens 0): done with the prefill, no decode step.
                self._end(sequence, finish=FinishReason.LENGTH)
                return
        else:
            sequence.pending_token = None
        self._sample(sequence, scores)

    def _sample(self, sequence: Sequence, scores: TokenScores) -> None:
        request = sequence.request
        generated = len(sequence.tokens)
        early = generated < request.min_tokens  # min_tokens: no end yet
        ends = request.stop_token_ids | (
            frozenset() if request.ignore_eos else {self._tokenizer.eos_token_id}
        )
        banned = ends if early else ()
        output = [t.id for t in sequence.tokens]
        token, logprob = sequence.sampler.choose(scores, sequence.history(), output, banned)
        now = time.monotonic()
        first = not sequence.tokens
        self.metrics.record_token(now - (sequence.last_token_at or sequence.arrived_at), first)
        sequence.last_token_at = now

        eos = token == self._tokenizer.eos_token_id and not request.ignore_eos
        stop_token = token in request.stop_token_ids
        special = token in self._tokenizer.special_names
        shown = not special or not request.skip_special_tokens
        if eos or stop_token:
            shown = shown and request.include_stop_str_in_output  # an ending token's text is cut (vLLM)
        if shown:
            piece = sequence.detokenizer.add(token, check_stops=not early)
            text, released, stop = piece.text, piece.released, piece.stop_sequence
        else:
            text, released, stop = "", "", None  # special and ending tokens add nothing to the text
        top = alternatives(scores, request.top_n_tokens, self._tokenizer.vocab_size)
        sequence.tokens.append(GeneratedToken(token, text, released, logprob, special, top))

        if eos or stop_token:
            self._end(sequence, finish=FinishReason.EOS)
        elif stop is not None:
            self._end(sequence, finish=FinishReason.STOP)
        elif (
            len(sequence.tokens) >= request.max_new_tokens
            or sequence.computed >= self._scheduler.slots.context_length
        ):
            self._end(sequence, finish=FinishReason.LENGTH)
        else:
            sequence.pending_token = token
            index = len(sequence.tokens)
            prefill = tuple(sequence.prefill) if index == 1 else ()
            sequence.emit(TokenEvent(index, sequence.tokens[-1], prefill))

    def _end(
        self, sequence: Sequence, finish: FinishReason | None = None, error: ServiceError | None = None
    ) -> None:
        """The one way out of the engine: release the slot (scheduler and wafer), report, notify."""
        slot = self._scheduler.remove(sequence)
        if slot is not None and self._executor is not None:
            try:
                self._executor.free_slot(slot)
            except Exception:
                log.exception("freeing slot %d failed", slot)
        now = time.monotonic()
        if finish is not None:
            tail = sequence.detokenizer.flush() if finish is not FinishReason.STOP else ""
            admitted = sequence.admitted_at or now
            self.metrics.record_success(
                "stop" if finish is not FinishReason.LENGTH else "length",
                queue_s=admitted - sequence.arrived_at,
                inference_s=now - admitted,
                generated_tokens=len(sequence.tokens),
            )
            sequence.emit(
                FinishEvent(
                    finish_reason=finish,
                    text=sequence.detokenizer.text,
                    tail=tail,
                    tokens=tuple(sequence.tokens),
                    prefill=tuple(sequence.prefill),
                    seed=sequence.sampler.seed,
                    input_length=len(sequence.prompt),
                    stop_sequence=sequence.detokenizer.stop_sequence,
                )
            )
        elif error is not None:
            self.metrics.record_failure(error.metric_reason)
            error.counted = True  # the API's error handler must not count it again
            sequence.emit(ErrorEvent(error))

    def _fail_all(self, error: ServiceError) -> None:
        if self._scheduler is None:
            return
        for sequence in [*self._scheduler.running, *self._scheduler.waiting]:
            self._end(sequence, error=error)

    def _set_state(self, state: EngineState) -> None:
        self._state = state
        self.metrics.wafer_engine_ready.set(1 if state is EngineState.READY else 0)
        self._cond.notify_all()

    def _record_gauges(self) -> None:
        scheduler = self._scheduler
        if scheduler is not None:
            self.metrics.record_scheduler_state(
                len(scheduler.waiting), len(scheduler.running), scheduler.slots.usage()
            )
