"""Steps in flight on a pipelined backend. The modeled wafer takes a step while another
computes (each replica's pipeline takes items a slowest stage apart); the engine submits the next step
from what became ready while one is in flight, and every request gets what it gets one step at a time;
a request never has items in two steps in flight, and the slot of one that ended while its step was in
flight is not given away before that step is back; a failed step fails the requests in flight and the
engine reloads; a hung submit is caught by the watchdog, and its abandoned worker leaves quietly; a step
the backend refused leaves its requests ready to step again."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from wafer_gpt2.backends.stand_ins import (
    ModeledWaferBackend,
    NullBackend,
    modeled_step_seconds,
    pipelined_span,
)
from wafer_gpt2.benchmarks.host import twin_factory
from wafer_gpt2.core.steps import BackendError, StepInputs, StepItem, steps_in_flight
from wafer_gpt2.engine.core import EngineCore, gpt2_tokenizer_hooks
from wafer_gpt2.engine.decode_run import DecodeRun, next_columns
from wafer_gpt2.engine.detokenizer import NO_TEXT, IncrementalDetokenizer
from wafer_gpt2.engine.failures import GenerationFailed, StepTimedOut
from wafer_gpt2.engine.kv_slots import KVSlotManager
from wafer_gpt2.engine.metrics import ServiceMetrics
from wafer_gpt2.engine.request import (
    ErrorEvent,
    FinishEvent,
    GenerationRequest,
    RequestState,
    RequestStatus,
    TokenEvent,
)
from wafer_gpt2.engine.sampling import Sampler, SamplingParams
from wafer_gpt2.engine.scheduler import Scheduler
from wafer_gpt2.engine.worker import Engine
from wafer_gpt2.errors import InvalidInput
from wafer_gpt2.model import tokenizer
from wafer_gpt2.plan import build_plan


@pytest.fixture(scope="module")
def plan(small_config):
    """2 replicas of 2 slots (planning takes seconds: built once)."""
    return build_plan(small_config, slots=2, context=32, replicas=2)


# ----- the modeled wafer's pipeline ----------------------------------------------------------------


def test_a_step_submitted_behind_another_enters_each_pipeline_after_it():
    free = [0.0, 0.0]
    # Replica 0 takes 3 items at 0, 1 and 2 (a slowest stage of 1 apart); the last is out at 2 + 10.
    assert pipelined_span(0.0, free, [3, 0], decode_s=10.0, bottleneck_s=1.0) == (0.0, 12.0)
    assert free == [3.0, 0.0]
    # Submitted at 1: replica 0's items enter behind the others (3, 4), replica 1's at once.
    assert pipelined_span(1.0, free, [2, 1], decode_s=10.0, bottleneck_s=1.0) == (1.0, 14.0)
    assert free == [5.0, 2.0]
    # Once the pipelines are empty, a step spans what `modeled_step_seconds` says.
    assert pipelined_span(20.0, free, [2, 0], decode_s=10.0, bottleneck_s=1.0) == (20.0, 31.0)
    assert pipelined_span(40.0, free, [0, 0], decode_s=10.0, bottleneck_s=1.0) == (40.0, 40.0)


def test_the_modeled_wafer_takes_steps_in_flight_oldest_first_and_checks_the_contract(plan):
    backend = ModeledWaferBackend(plan, timer_late_s=0.0, steps_in_flight=2)
    assert steps_in_flight(backend) == 2 and steps_in_flight(NullBackend(50257)) == 1
    assert backend.describe()["plan"]["steps_in_flight"] == 2
    assert twin_factory(backend)().steps_in_flight == 2  # what `bench host`'s engine process builds
    first = [StepItem(0, 0, 100), StepItem(1, 0, 101)]
    second = [StepItem(2, 0, 102)]
    backend.submit(StepInputs.of_items(first))
    with pytest.raises(BackendError, match=r"slots \[1\] have items in a step still in flight"):
        backend.submit(StepInputs.of_items([StepItem(1, 1, 5)]))
    backend.submit(StepInputs.of_items(second))
    with pytest.raises(BackendError, match="slot 1 has items in a step still in flight"):
        backend.free_slot(1)
    with pytest.raises(BackendError, match="2 steps are in flight already"):
        backend.submit(StepInputs.of_items([StepItem(3, 0, 5)]))
    with pytest.raises(BackendError, match="collect them first"):
        backend.step(StepInputs.of_items([StepItem(3, 0, 5)]))
    null = NullBackend(plan.config.vocab_size, slots=4, context=32, top_k=plan.top_k)
    for items in (first, second):  # oldest first, the null backend's answers
        got, expected = backend.collect(), null.step(StepInputs.of_items(items))
        assert got.topk_ids.tolist() == expected.topk_ids.tolist()
        assert got.index.tolist() == expected.index.tolist()
    with pytest.raises(BackendError, match="no step is in flight"):
        backend.collect()
    # Side by side on two replicas: busy for the first step's span at least, not for both spans summed
    # unless the second came that late (the union of the spans is what counts).
    alone = modeled_step_seconds(plan, [0, 1])
    assert backend.modeled_busy_s >= alone - 1e-9
    with pytest.raises(InvalidInput, match="steps_in_flight must be at least 1"):
        ModeledWaferBackend(plan, timer_late_s=0.0, steps_in_flight=0)


# ----- the scheduler ----------------------------------------------------------------------------------


def _state(prompt: int, new_tokens: int = 4) -> RequestState:
    return RequestState(
        request=GenerationRequest(tuple(range(100, 100 + prompt)), new_tokens),
        detokenizer=IncrementalDetokenizer(tokenizer.token_bytes),
        sampler=Sampler(SamplingParams()),
    )


def test_a_request_in_flight_is_not_stepped_again_and_keeps_its_slot_until_its_step_is_back():
    scheduler = Scheduler(KVSlotManager(1, 64), max_queue=2, step_token_budget=8)
    first, second = _state(3), _state(2)
    scheduler.add(first)
    scheduler.add(second)
    scheduler.admit()
    step = scheduler.build_step()
    assert step.owners == [first] * 3 and first.in_flight
    assert not scheduler.build_step()  # its prompt is on the backend: nothing to add
    # It ends (cancelled, failed) while its step computes: the wafer still writes its slot.
    assert scheduler.remove(first) is None and first.status is RequestStatus.FINISHED
    assert scheduler.admit() == []  # the slot is not given to the next request yet
    assert scheduler.step_returned(step) == [0]  # back: the slot is free again
    assert scheduler.admit() == [second] and second.slot == 0


def test_a_pipelined_backend_gets_the_running_requests_in_groups_one_step_each():
    # Five requests on slots 0..4, two steps at a time: group 0 holds slots 0, 2 and 4, group 1 slots
    # 1 and 3. A step carries one group with no step in flight; what returns goes out together again.
    scheduler = Scheduler(KVSlotManager(5, 64), max_queue=0, step_token_budget=16, groups=2)
    states = [_state(1) for _ in range(4)] + [_state(2)]
    for state in states:
        scheduler.add(state)
    scheduler.admit()
    assert [state.slot for state in states] == [0, 1, 2, 3, 4]
    first = scheduler.build_step()
    assert first.owners == [states[0], states[2], states[4], states[4]]  # the last one's whole prompt
    second = scheduler.build_step()
    assert second.owners == [states[1], states[3]]
    assert not scheduler.build_step()  # both groups in flight
    scheduler.step_returned(second)
    for state in (states[1], states[3]):
        state.computed, state.pending_token = 1, 7
    # Group 1 is back (group 0 still computes): it goes out whole.
    assert scheduler.build_step().owners == [states[1], states[3]]


def test_one_group_steps_every_ready_request_at_once():
    # A backend that takes one step at a time: every ready request in one step.
    scheduler = Scheduler(KVSlotManager(5, 64), max_queue=0, step_token_budget=16)
    states = [_state(1) for _ in range(4)] + [_state(2)]
    for state in states:
        scheduler.add(state)
    scheduler.admit()
    states[0].computed, states[0].pending_token = 1, 7
    states[1].computed, states[1].pending_token = 1, 8
    step = scheduler.build_step()
    assert step.owners == states[:2] + states[2:4] + [states[4]] * 2  # two decodes, then the prompts
    assert step.inputs.fields[:3] == [[0, 1, 2, 3, 4, 4], [1, 1, 0, 0, 0, 1], [7, 8, 100, 100, 100, 101]]


def _two_plain_requests_after_a_step(slots: int, max_queue: int):
    """A scheduler with two plain requests decoding in one group, their first decode step back and
    recorded as the engine records it (tokens 61 and 62 chosen at 1.0): (scheduler, states, step)."""
    scheduler = Scheduler(KVSlotManager(slots, 64), max_queue=max_queue, step_token_budget=8)
    states = [_state(2, new_tokens=8), _state(2, new_tokens=8)]
    for state in states:
        state.plain = state.text_at_end = True
        scheduler.add(state)
    scheduler.admit()
    for state in states:
        state.computed, state.pending_token = 2, 50
    step = scheduler.build_step()
    scheduler.step_returned(step)
    for state in states:
        state.computed, state.pending_token, state.last_token_at = 3, None, 1.0
    return scheduler, states, step


def test_a_group_that_goes_on_whole_steps_next_from_its_run():
    # Two plain requests decoding in one group: after their step is back and both go on, the group goes
    # on as a run: its next step is that step's columns a position further with the chosen tokens, what
    # the run records is the requests' own once it ends, and an admission ends it.
    scheduler, states, step = _two_plain_requests_after_a_step(slots=3, max_queue=1)
    assert step.plain and step.run is None and step.inputs.fields[:3] == [[0, 1], [2, 2], [50, 50]]
    assert scheduler.unchanged(step)
    eot = tokenizer.EOT_ID
    run = DecodeRun(states, next_columns(step.inputs.columns, [61, 62]), 1.0, [3, 2], eot, {eot})
    scheduler.keep(step.group, run)
    kept = scheduler.build_step()
    assert kept.plain and kept.run is run and kept.owners == states
    assert all(scheduler.in_flight(state) for state in states)  # through the run, not their own flags
    assert kept.inputs.fields == [[0, 1], [3, 3], [61, 62], [1, 1], [0, 0]]
    scheduler.step_returned(kept)
    assert not any(scheduler.in_flight(state) for state in states)
    assert not run.goes_on(np.array([70, eot]))  # an end-of-text ends the second request
    assert run.goes_on(np.array([70, 71]))
    assert run.record(np.array([70, 71]), np.array([-1.0, -2.0]), 1.5) == 0.5
    assert not run.goes_on(np.array([72, 73]))  # its second step: one takes its last token
    assert not any(state.tokens for state in states)  # the run holds them until it ends
    late = _state(1)
    scheduler.add(late)
    scheduler.admit()  # the group changed: the run ends, its next step is built from its requests
    assert scheduler.run(0) is None
    assert [(s.computed, s.pending_token, s.last_token_at) for s in states] == [(4, 70, 1.5), (4, 71, 1.5)]
    # The text-at-end requests' records are made at the next settle (after the next step is out).
    assert scheduler.unsettled and not any(state.tokens for state in states)
    scheduler.settle()
    assert not scheduler.unsettled
    assert [(t.id, t.logprob, t.special) for t in states[1].tokens] == [(71, -2.0, False)]
    step = scheduler.build_step()
    assert not step.plain and step.owners == [*states, late]
    assert step.inputs.fields[:3] == [[0, 1, 2], [4, 4, 0], [70, 71, 100]]


def test_a_run_that_ends_while_its_step_is_in_flight_leaves_each_request_in_flight():
    # A run's step marks the run, not each of its requests: when the run ends before its step is back
    # (a request leaves), each request is in flight on its own, so one that ends keeps its slot until
    # the step is back, and the others are not stepped again meanwhile.
    scheduler, states, step = _two_plain_requests_after_a_step(slots=2, max_queue=0)
    eot = tokenizer.EOT_ID
    scheduler.keep(
        step.group, DecodeRun(states, next_columns(step.inputs.columns, [61, 62]), 1.0, [5, 5], eot, {eot})
    )
    kept = scheduler.build_step()
    assert not any(state.in_flight for state in states)
    assert all(scheduler.in_flight(state) for state in states)
    assert scheduler.remove(states[0]) is None  # the run ends; the slot is held while the step is out
    assert scheduler.run(0) is None and states[1].in_flight and scheduler.in_flight(states[1])
    assert not scheduler.build_step().owners  # the other is not stepped again before the step is back
    assert scheduler.step_returned(kept) == [0]
    assert not states[1].in_flight and not scheduler.in_flight(states[1])


def test_a_request_that_takes_its_last_token_leaves_the_run_and_the_others_go_on():
    # Rows persist: a request that ends leaves its group's run, which goes on with the others
    # condensed, instead of ending and handing every request what it kept.
    scheduler, states, step = _two_plain_requests_after_a_step(slots=3, max_queue=1)
    eot = tokenizer.EOT_ID
    run = DecodeRun(states, next_columns(step.inputs.columns, [61, 62]), 1.0, [4, 2], eot, {eot})
    scheduler.keep(step.group, run)
    for tokens, logprobs, now in (([70, 71], [-1.0, -2.0], 1.5), ([72, 73], [-3.0, -4.0], 2.0)):
        scheduler.step_returned(scheduler.build_step())
        chosen = np.array(tokens)
        run.record(chosen, np.array(logprobs), now)
    assert run.ending(chosen).tolist() == [False, True]  # the second takes its last token (2 steps)
    kept = scheduler.build_step()  # the run's step is out when the request leaves (the engine's order)
    left = scheduler.leave(step.group, np.array([False, True]))
    assert [(row, state, recorded.lists()) for row, state, recorded in left] == [
        (1, states[1], ([71, 73], [-2.0, -4.0]))
    ]
    assert (states[1].computed, states[1].pending_token, states[1].last_token_at) == (5, None, 2.0)
    assert scheduler.run(0) is run and run.states == [states[0]] and run.ending_step == 4
    assert not scheduler.in_flight(states[1]) and scheduler.in_flight(states[0])
    assert scheduler.remove(states[1]) == 1  # not in the step in flight: its slot is free at once
    assert scheduler.run(0) is run and not scheduler.unsettled
    scheduler.step_returned(kept)
    assert scheduler.build_step().inputs.fields[:3] == [[0], [5], [72]]  # the stayer, a position on
    run.record(np.array([74]), np.array([-5.0]), 2.5)  # a step of the condensed run
    assert not states[0].tokens and states[0].computed == 3  # the run still holds its tokens
    late = _state(1)
    scheduler.add(late)
    scheduler.admit()  # a request joins: the run ends, the stayer's records come at the next settle
    assert scheduler.run(0) is None and (states[0].computed, states[0].pending_token) == (6, 74)
    scheduler.settle()
    assert [(t.id, t.logprob) for t in states[0].tokens] == [(70, -1.0), (72, -3.0), (74, -5.0)]


def _finals(loop: Loop, states: list[RequestState]) -> list[bool]:
    return [
        bool(loop.events.get(state.id)) and isinstance(loop.events[state.id][-1], FinishEvent)
        for state in states
    ]


def _run_requests_of_different_lengths(stream: bool) -> tuple[list, int]:
    """Requests of different lengths through `EngineCore` with the work deferred at each `finish`
    (`complete_deferred` after it): their outcomes; the times a request left the group's run while
    the run went on. Checks that a request that ends gets its records and its end with the deferred
    work, not at the `finish` of its last step (which the next submit waits for)."""
    core = EngineCore(
        NullBackend(50257, slots=4, context=64), gpt2_tokenizer_hooks(), max_queue=4, step_token_budget=16
    )
    loop = Loop()
    lengths = (5, 9, 7, 12)
    states = [
        core.add(core.new_request(GenerationRequest((100 + n, 101), n, ignore_eos=True), loop, stream))
        for n in lengths
    ]
    went_on = 0
    while core.has_work():
        batch = core.schedule()
        if not batch:
            core.complete_deferred()
            continue
        results = core.execute(batch)
        records, run = [len(state.tokens) for state in states], core.scheduler.run(0)
        core.finish(batch, results, defer=True)
        at_finish, finals_at_finish = [len(state.tokens) for state in states], _finals(loop, states)
        core.complete_deferred()
        ended = [now and not then for now, then in zip(_finals(loop, states), finals_at_finish, strict=True)]
        for i in np.flatnonzero(ended):
            assert at_finish[i] == records[i], "a request's records were made at its last step's finish"
        went_on += any(ended) and run is not None and core.scheduler.run(0) is run
    outcomes = [_outcome(loop.events[state.id])[1:] for state in states]
    assert [len(tokens) for tokens, _, _ in outcomes] == list(lengths)
    return outcomes, went_on


def test_requests_that_leave_a_run_end_with_the_deferred_work_and_keep_their_outputs():
    # Text-at-end requests (not streamed) get their records from the run, streamed ones token by
    # token: the same tokens and text; the run goes on when a request leaves it.
    quiet, quiet_went_on = _run_requests_of_different_lengths(stream=False)
    streamed, streamed_went_on = _run_requests_of_different_lengths(stream=True)
    assert quiet == streamed
    assert quiet_went_on >= 2 and streamed_went_on >= 2


@pytest.mark.parametrize("defer", [False, True])
def test_a_group_goes_on_as_a_run_from_the_step_that_chose_all_its_first_tokens(defer: bool):
    # The prefill step chose every request's first token: the next step is already the run's (no step
    # takes the tokens one request at a time first), its items each request's token to feed.
    core = EngineCore(
        NullBackend(50257, slots=4, context=64), gpt2_tokenizer_hooks(), max_queue=4, step_token_budget=16
    )
    loop = Loop()
    states = [
        core.add(core.new_request(GenerationRequest((100 + n, 101), n, ignore_eos=True), loop, False))
        for n in (6, 9)
    ]
    batch = core.schedule()
    core.finish(batch, core.execute(batch), defer=defer)
    run = core.scheduler.run(0)
    assert run is not None and run.states == states and run.ends_at == [5, 8]
    core.complete_deferred()
    first = [state.tokens[0].id for state in states]
    assert run.columns[1].tolist() == [2, 2] and run.columns[2].tolist() == first
    assert core.scheduler.build_step().run is run
    # One that takes its last token at the run's first step: no run yet (it would leave it at once).
    core = EngineCore(
        NullBackend(50257, slots=4, context=64), gpt2_tokenizer_hooks(), max_queue=4, step_token_budget=16
    )
    for n in (2, 9):
        core.add(core.new_request(GenerationRequest((7, 8), n, ignore_eos=True), loop, False))
    batch = core.schedule()
    core.finish(batch, core.execute(batch), defer=defer)
    assert core.scheduler.run(0) is None


def test_a_request_whose_sink_makes_its_text_has_no_detokenizer_of_its_own():
    class FrontSink(Loop):
        makes_text = True

    core = EngineCore(
        NullBackend(50257, slots=4, context=64), gpt2_tokenizer_hooks(), max_queue=4, step_token_budget=16
    )
    state = core.new_request(GenerationRequest((7, 8), 3), FrontSink(), True)
    assert state.text_in_front and state.detokenizer is NO_TEXT
    with pytest.raises(RuntimeError):  # the shared one takes no token
        state.detokenizer.add_unstopped(7)
    assert core.new_request(GenerationRequest((7, 8), 3), Loop(), True).detokenizer is not NO_TEXT


# ----- the engine -----------------------------------------------------------------------------------


class Loop:
    """An `EventSink` that collects each request's events."""

    def __init__(self) -> None:
        self.events: dict[str, list] = {}
        self.ended = threading.Semaphore(0)

    def wait_for_turn(self, timeout_s: float) -> None:
        pass

    def hand_over(self, events) -> None:
        for state, event in events:
            self.events.setdefault(state.id, []).append(event)
            if not isinstance(event, TokenEvent):
                self.ended.release()

    def wait(self, requests: int, timeout: float = 30.0) -> None:
        for _ in range(requests):
            assert self.ended.acquire(timeout=timeout), "a request did not end"


def _engine(
    plan, in_flight: int, submits: list[int], hang: threading.Event | None = None, **limits
) -> Engine:
    class Counting(ModeledWaferBackend):  # records how many steps were in flight at each submit
        def submit(self, inputs):
            submits.append(len(self._in_flight))
            if hang is not None and len(submits) == 1:
                hang.wait(10)  # the first submit hangs until the test lets it go
            super().submit(inputs)

    return _started(lambda: Counting(plan, timer_late_s=0.0, steps_in_flight=in_flight), **limits)


def _started(factory, **limits) -> Engine:
    """A running engine over the backends `factory` builds."""
    engine = Engine(
        factory, gpt2_tokenizer_hooks(), ServiceMetrics("test"), max_queue=16, step_token_budget=64, **limits
    )
    engine.start()
    assert engine.wait_ready(30)
    return engine


def _outcome(events: list) -> tuple:
    final = events[-1]
    assert isinstance(final, FinishEvent), final
    streamed = [event.token.id for event in events if isinstance(event, TokenEvent)]
    return streamed, [t.id for t in final.tokens], final.text, final.finish_reason


def test_the_core_ends_cancelled_and_late_requests_at_a_step_boundary_and_leaves_the_others():
    # `_reap` looks only at the requests set aside for it: the cancelled ones (one aborted before it was
    # queued too), and those with a deadline once it has passed; the others run to their length.
    core = EngineCore(
        NullBackend(50257, slots=4, context=64), gpt2_tokenizer_hooks(), max_queue=4, step_token_budget=16
    )
    late = core.add(GenerationRequest((100, 101), 8, timeout_s=1e-9))
    timely = core.add(GenerationRequest((100, 101), 8, timeout_s=3600.0))
    plain = core.add(GenerationRequest((100, 101), 8))
    early = core.new_request(GenerationRequest((100, 101), 8))
    core.abort(early)
    core.add(early)
    events = core.step()
    ended = [(state, type(event)) for state, event in events if not isinstance(event, TokenEvent)]
    assert ended == [(late, ErrorEvent)]
    assert early.status is RequestStatus.FINISHED and not any(state is early for state, _ in events)
    core.abort(plain)
    while core.has_work():
        events += core.step()
    finals = {state: event for state, event in events if not isinstance(event, TokenEvent)}
    assert set(finals) == {late, timely} and isinstance(finals[timely], FinishEvent)
    assert len(timely.tokens) == 8 and plain.status is RequestStatus.FINISHED


def test_steps_in_flight_give_every_request_what_one_step_at_a_time_gives(plan):
    # Six requests on four slots: the last two are admitted while other steps compute.
    requests = [
        GenerationRequest(tuple(range(200, 200 + n)), new, ignore_eos=True)
        for n, new in ((3, 6), (5, 9), (1, 4), (7, 7), (2, 8), (4, 5))
    ]
    outcomes = {}
    for in_flight in (1, 2):
        submits: list[int] = []
        engine, loop = _engine(plan, in_flight, submits), Loop()
        try:
            states = [
                engine.submit(request, stream=index % 2 == 0, sink=loop)
                for index, request in enumerate(requests)
            ]
            loop.wait(len(requests))
        finally:
            engine.shutdown(5)
        outcomes[in_flight] = [_outcome(loop.events[state.id]) for state in states]
        assert max(submits) == in_flight - 1  # 1: never two at a time; 2: steps did overlap
    assert outcomes[2] == outcomes[1]
    for (streamed, tokens, text, _), request, index in zip(outcomes[2], requests, range(6), strict=True):
        assert len(tokens) == request.max_new_tokens and text
        assert streamed == (tokens[:-1] if index % 2 == 0 else [])  # the last one comes with the end


def test_a_failed_step_in_flight_fails_its_requests_and_the_engine_reloads(plan):
    submits: list[int] = []
    engine, loop = _engine(plan, 2, submits), Loop()
    try:
        long = GenerationRequest((464, 2068), 28, ignore_eos=True)
        states = [engine.submit(long, sink=loop) for _ in range(3)]
        engine.inject_fault("injected step fault")
        loop.wait(3)
        for state in states:
            final = loop.events[state.id][-1]
            assert isinstance(final, ErrorEvent) and isinstance(final.error, GenerationFailed)
        assert engine.wait_ready(30) and engine.restarts == 1
        after = engine.submit(GenerationRequest((464,), 3, ignore_eos=True), sink=loop)
        loop.wait(1)
        assert isinstance(loop.events[after.id][-1], FinishEvent)
        assert engine.kv_usage().slots_used == 0  # nothing leaked across the reload
    finally:
        engine.shutdown(5)
    assert np.all(np.array(submits) <= 1)


def test_a_hung_submit_is_caught_by_the_watchdog_and_its_worker_leaves_quietly(plan):
    """A step that hangs on its way in is watched like one in flight: its request fails (504) and a
    fresh worker serves on; when the hung submit returns at last, the abandoned worker leaves without
    touching the new one's watchdog or core (no second restart)."""
    submits: list[int] = []
    hang = threading.Event()
    engine, loop = _engine(plan, 2, submits, hang, step_timeout_s=0.3, step_timeout_per_item_s=0.0), Loop()
    try:
        hung = engine.submit(GenerationRequest((464, 2068), 4, ignore_eos=True), sink=loop)
        loop.wait(1)
        final = loop.events[hung.id][-1]
        assert isinstance(final, ErrorEvent) and isinstance(final.error, StepTimedOut)
        assert engine.wait_ready(30) and engine.restarts == 1
        hang.set()  # the abandoned worker's submit returns (on its closed backend)
        after = engine.submit(GenerationRequest((464,), 6, ignore_eos=True), sink=loop)
        loop.wait(1)
        assert isinstance(loop.events[after.id][-1], FinishEvent)
        assert engine.restarts == 1 and engine.kv_usage().slots_used == 0
    finally:
        hang.set()
        engine.shutdown(5)


def test_a_step_the_backend_refused_leaves_its_requests_ready_to_step_again():
    class FailsOnce(NullBackend):
        failed = False

        def step(self, inputs):
            if not self.failed:
                self.failed = True
                raise BackendError("the wafer refused the step")
            return super().step(inputs)

    core = EngineCore(FailsOnce(50257, slots=2, context=32), gpt2_tokenizer_hooks(), 4, 64)
    state = core.add(GenerationRequest((464, 2068), 3, ignore_eos=True))
    with pytest.raises(BackendError, match="refused"):
        core.step()
    assert not state.in_flight
    events = []
    while core.has_work():  # a caller that retries gets the request through
        events += [event for _, event in core.step()]
    assert isinstance(events[-1], FinishEvent) and len(events[-1].tokens) == 3


# ----- the host program on the simulator ------------------------------------------------------------


def test_the_host_program_keeps_steps_in_flight_and_answers_as_one_step_at_a_time(plan, small_params):
    from wafer_gpt2.host.program import start_model
    from wafer_gpt2.sim import SimRuntime

    pipelined = start_model(plan, SimRuntime(plan), small_params, steps_in_flight=2)
    serial = start_model(plan, SimRuntime(plan), small_params)
    assert steps_in_flight(pipelined) == 2 and steps_in_flight(serial) == 1
    # Two steps on disjoint slots, both replicas, one with a prompt's logprob target.
    first = [StepItem(0, 0, 11), StepItem(0, 1, 12, target=13), StepItem(2, 0, 14)]
    second = [StepItem(1, 0, 21), StepItem(3, 0, 22), StepItem(3, 1, 23)]
    pipelined.submit(StepInputs.of_items(first))
    pipelined.submit(StepInputs.of_items(second))
    with pytest.raises(BackendError, match="2 steps are in flight already"):
        pipelined.submit(StepInputs.of_items([StepItem(1, 1, 5)]))
    with pytest.raises(BackendError, match="slot 0 has items in a step still in flight"):
        pipelined.free_slot(0)
    got = [pipelined.collect(), pipelined.collect()]
    with pytest.raises(BackendError, match="no step is in flight"):
        pipelined.collect()
    for step, scores in zip((first, second), got, strict=True):
        expected = serial.step(StepInputs.of_items(step))
        np.testing.assert_array_equal(scores.index, expected.index)
        np.testing.assert_array_equal(scores.topk_ids, expected.topk_ids)
        np.testing.assert_array_equal(scores.topk_logits, expected.topk_logits)
        np.testing.assert_array_equal(scores.logsumexp, expected.logsumexp)
        np.testing.assert_array_equal(scores.target_logit, expected.target_logit)
    # A slot in a step in flight takes no item of the next one; once collected it goes on.
    pipelined.submit(StepInputs.of_items([StepItem(0, 2, 31)]))
    with pytest.raises(BackendError, match=r"slots \[0\] have items in a step still in flight"):
        pipelined.submit(StepInputs.of_items([StepItem(0, 3, 32)]))
    assert pipelined.collect().count == 1
    pipelined.free_slot(0)
    for backend in (pipelined, serial):
        backend.close()


def test_the_engine_on_the_simulator_gives_the_same_tokens_with_steps_in_flight(
    plan, small_params, monkeypatch
):
    from wafer_gpt2.host.program import WaferGPT2, start_model
    from wafer_gpt2.sim import SimRuntime

    depths: list[int] = []  # steps already in flight at each submit
    submit = WaferGPT2.submit

    def counting(self, items):
        depths.append(len(self._in_flight))
        submit(self, items)

    monkeypatch.setattr(WaferGPT2, "submit", counting)

    requests = [
        GenerationRequest(tuple(range(300, 300 + n)), new, ignore_eos=True)
        for n, new in ((3, 5), (2, 6), (4, 4), (1, 7), (5, 3))
    ]
    outcomes = {}
    for in_flight in (1, 2):
        engine = _started(
            lambda n=in_flight: start_model(plan, SimRuntime(plan), small_params, steps_in_flight=n)
        )
        loop = Loop()
        try:
            states = [engine.submit(request, stream=True, sink=loop) for request in requests]
            loop.wait(len(requests))
        finally:
            engine.shutdown(5)
        outcomes[in_flight] = [_outcome(loop.events[state.id]) for state in states]
        assert max(depths) == in_flight - 1  # 2: the second group's step went out beside the first's
        depths.clear()
    assert outcomes[2] == outcomes[1]
