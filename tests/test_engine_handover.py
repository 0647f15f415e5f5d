"""How requests and events cross into and out of the engine process without costing the engine its
batch. The pipe's messages (`wafer_gpt2/engine/messages.py`: one table of kinds, the hot ones in a compact
form) give back what was sent;
`Engine.submit_nowait` files a request at the worker's next step boundary, or refuses it as `submit`
would, and never leaves one unanswered; a cancellation that arrives before its request is filed is
applied when it is (`wafer_gpt2.engine.process._Book`)."""

from __future__ import annotations

import marshal
import threading
import time
from decimal import Decimal

import numpy as np
import pytest

from wafer_gpt2.backends.stand_ins import NullBackend
from wafer_gpt2.core.steps import StepScores
from wafer_gpt2.engine.core import EngineCore, FrontText, finish_event_of, gpt2_tokenizer_hooks
from wafer_gpt2.engine.decode_run import StreamedRows
from wafer_gpt2.engine.failures import Overloaded, RequestFailed, ServiceError, Unavailable
from wafer_gpt2.engine.kv_slots import KVUsage
from wafer_gpt2.engine.messages import (
    KINDS,
    MARSHALLED,
    PICKLED,
    Answer,
    Ask,
    Cancel,
    Drain,
    Events,
    Fault,
    FromEngine,
    Shape,
    ShapeReport,
    Shutdown,
    Snapshot,
    Status,
    Stopped,
    Submit,
    ToEngine,
    UnreadableRequest,
    decode,
    decode_from_engine,
    decode_to_engine,
    encode,
)
from wafer_gpt2.engine.metrics import ServiceMetrics
from wafer_gpt2.engine.process import _Book
from wafer_gpt2.engine.request import (
    ONE_STEP,
    Alternative,
    ErrorEvent,
    FinishEvent,
    FinishReason,
    GeneratedToken,
    GenerationRequest,
    IdsFinishEvent,
    PromptToken,
    RequestState,
    Rosters,
    StreamedIds,
    TokenEvent,
)
from wafer_gpt2.engine.sampling import SamplingParams
from wafer_gpt2.engine.worker import Engine, EngineState

# ----- the wire -------------------------------------------------------------------------------------

TOP = (Alternative(11, -0.25), Alternative(12, -1.5))
PREFILL = (PromptToken(464, None), PromptToken(2068, -3.5, TOP, 7), PromptToken(318, -0.5, (), None))
TOKENS = (
    GeneratedToken(11, " a", " a", -0.25, False),
    GeneratedToken(50256, "", "", -0.1, True, TOP),
    GeneratedToken(0xE9, "", "", -2.0, False, ()),  # half a character: no text yet
)


def test_a_steps_events_cross_in_compact_form_and_arrive_equal():
    events = [
        ("req-1.2", TokenEvent(1, TOKENS[0], PREFILL)),
        ("req-3.4", TokenEvent(2, TOKENS[1])),
        (
            "req-5.6",
            FinishEvent(FinishReason.STOP, "a b", " b", TOKENS, PREFILL, 42, 3, "\n\n"),
        ),
        ("req-7.8", FinishEvent(FinishReason.LENGTH, "", "", (), (), None, 1, None)),
    ]
    data = encode(Events(events))
    assert data[:2] == b"e" + MARSHALLED
    message = decode(data)
    assert type(message) is Events and message == Events(events)
    finish = message.events[2][1]
    assert finish.finish_reason is FinishReason.STOP and type(finish.tokens[1].top[0]) is Alternative
    assert all(type(token) is GeneratedToken for token in finish.tokens)
    assert type(message.events[0][1].prefill[1]) is PromptToken


def test_token_events_arrive_ahead_of_finish_events_each_requests_in_its_order():
    events = [
        ("req-1", TokenEvent(4, TOKENS[0])),
        ("req-2", FinishEvent(FinishReason.LENGTH, "a", "", TOKENS[:1], (), None, 1, None)),
        ("req-3", TokenEvent(1, TOKENS[2], PREFILL)),
        ("req-1", TokenEvent(5, TOKENS[1])),
        ("req-1", FinishEvent(FinishReason.EOS, "a b", "", TOKENS, (), 7, 2, None)),
    ]
    arrived = decode_from_engine(encode(Events(events))).events
    assert arrived == [events[i] for i in (0, 2, 3, 1, 4)]


def test_a_request_crosses_through_its_constructors():
    sampling = SamplingParams(do_sample=True, temperature=0.7, top_k=5, top_p=0.9, seed=2**63, min_p=0.1)
    request = GenerationRequest(
        (1, 2, 3),
        16,
        sampling,
        stop_sequences=("\n",),
        stop_token_ids=frozenset({7, 9}),
        prompt_logprobs=True,
        top_n_tokens=3,
        timeout_s=2.5,
        min_tokens=2,
        prompt_top_n=None,
    )
    data = encode(Submit("req-9", request, True))
    assert data[:2] == b"s" + MARSHALLED
    arrived = decode(data)
    assert type(arrived) is Submit and arrived == Submit("req-9", request, True)


def test_other_messages_and_errors_are_pickled():
    error = Overloaded("the server is at capacity; retry later")
    data = encode(Events([("req-1", TokenEvent(1, TOKENS[0])), ("req-2", ErrorEvent(error))]))
    assert data[:2] == b"e" + PICKLED  # an exception has a class: the whole message is pickled
    (_, token), (_, failed) = decode(data).events
    assert token == TokenEvent(1, TOKENS[0])
    assert type(failed.error) is Overloaded and str(failed.error) == str(error)
    assert decode(encode(Ask(3, "kv_usage"))) == Ask(3, "kv_usage")


def test_a_steps_token_ids_cross_compact_or_pickled_with_an_error():
    streamed = [
        StreamedIds(4, ["req-1", "req-2"], [464, 2068], [-0.5, -1.25]),
        StreamedIds(4, None, [318, 257], [-0.75, -2.0]),
        StreamedIds(ONE_STEP, ["req-5"], [11], [-3.5]),
    ]
    ended = IdsFinishEvent(FinishReason.EOS, [50256], [-0.1], (), (), None, 3, streamed=6)
    data = encode(Events([("req-3", ended)], streamed))
    assert data[:2] == b"e" + MARSHALLED
    assert decode(data) == Events([("req-3", ended)], streamed)
    failed = ErrorEvent(Overloaded("the server is at capacity; retry later"))
    arrived = decode(encode(Events([("req-3", failed)], streamed)))
    assert type(arrived) is Events and arrived.streamed == streamed


def test_a_runs_step_crosses_as_its_arrays_bytes_with_the_same_values():
    """A run's step's ids and logprobs cross as bytes (`StreamedRows.step`) and arrive as the values
    `tolist` gave: ids of any integer type, logprobs of float32 or float64, widened without change."""
    tokens = np.array([[464, 7], [2068, 8], [50256, 9]], dtype=np.int32)[:, 0]  # a strided view
    for logprobs in (np.array([-0.1, -2.5e-9, -37.0625]), np.array([-0.1, -3.3, -1e-30], np.float32)):
        rows = StreamedRows(None, None, ["req-1", "req-2", "req-3"])  # type: ignore[arg-type]
        sent = rows.step(4, tokens, logprobs)
        assert type(sent.ids) is bytes and type(sent.logprobs) is bytes
        arrived = decode(encode(Events([], [sent]))).streamed  # type: ignore[union-attr]
        assert arrived is not None
        ids, values = arrived[0].columns()
        assert ids == tokens.tolist() and values == logprobs.tolist()
        assert [type(i) for i in ids] == [int] * 3 and [type(v) for v in values] == [float] * 3
        assert arrived[0].request_ids == ["req-1", "req-2", "req-3"]
        assert rows.step(4, tokens, logprobs).request_ids is None  # the roster goes once
    listed = StreamedIds(ONE_STEP, ["req-5"], [11], [-3.5])
    assert listed.columns() == ([11], [-3.5])


def test_a_rosters_requests_are_found_once_and_its_steps_name_none():
    """The receiver finds a run's requests when its roster arrives, not at each step; a step of tokens
    that name their requests (`ONE_STEP`) is kept for no later one; tokens of a roster that never
    arrived, or that the receiver forgot, are refused, not given to other requests."""
    held = {"req-1": "first", "req-2": "second"}
    looked_up: list[str] = []

    def find(request_id: str) -> str | None:
        looked_up.append(request_id)
        return held.get(request_id)

    rosters: Rosters[str] = Rosters(find)
    members = ["first", None, "second"]  # req-3 is not held (cancelled, forgotten)
    assert rosters.members(StreamedIds(7, ["req-1", "req-3", "req-2"], [1, 2, 3], [-1.0] * 3)) == members
    assert rosters.members(StreamedIds(7, None, [4, 5, 6], [-1.0] * 3)) == members
    assert looked_up == ["req-1", "req-3", "req-2"]
    assert rosters.members(StreamedIds(ONE_STEP, ["req-2"], [7], [-1.0])) == ["second"]
    with pytest.raises(ValueError, match="never arrived"):
        rosters.members(StreamedIds(ONE_STEP, None, [8], [-1.0]))
    with pytest.raises(ValueError, match="never arrived"):
        rosters.members(StreamedIds(8, None, [9], [-1.0]))
    rosters.clear()
    with pytest.raises(ValueError, match="never arrived"):
        rosters.members(StreamedIds(7, None, [10, 11, 12], [-1.0] * 3))


def test_a_value_marshal_cannot_pack_crosses_pickled():
    request = GenerationRequest((1, 2), 4, stop_sequences=("a",))
    odd = GenerationRequest.__new__(GenerationRequest)
    odd.__dict__.update({**vars(request), "stop_sequences": ["a"], "timeout_s": Decimal("1.5")})
    data = encode(Submit("req-1", odd, False))
    assert data[:2] == b"s" + PICKLED and decode(data).request.timeout_s == Decimal("1.5")


def test_a_request_that_cannot_be_rebuilt_is_named_by_its_id():
    request = GenerationRequest((1, 2), 4)
    data = encode(Submit("req-7", request, False))
    request_id, packed, stream = marshal.loads(data[2:])
    fields = list(packed)
    fields[2] = (False, -1.0, *fields[2][2:])  # a temperature the constructor refuses
    broken = b"s" + MARSHALLED + marshal.dumps((request_id, tuple(fields), stream))
    with pytest.raises(UnreadableRequest, match="req-7") as caught:
        decode(broken)
    assert caught.value.request_id == "req-7"


def test_bytes_that_are_no_message_of_the_pipe_are_named():
    with pytest.raises(ValueError, match=r"first byte b'y'"):
        decode(b"y123")
    with pytest.raises(ValueError, match=r"a Cancel message in an unknown form b'\?'"):
        decode(b"c?123")


SNAPSHOT = Snapshot(EngineState.READY, None, None, 1.5, 0, 7, 0.25, KVUsage(2, 16, 40, 1024), 1, 2, 80)
# One message of every kind (the test below checks that none is missing).
EVERY_KIND: list[ToEngine | FromEngine] = [
    Submit("req-1", GenerationRequest((1, 2), 4), True),
    Cancel("req-1"),
    Drain(),
    Shutdown(2.5),
    Fault("injected", 2, 1, SystemExit),
    Ask(4, "queue_sizes"),
    Events([("req-1", TokenEvent(1, TOKENS[0]))]),
    Shape(ShapeReport("null", 4, 64, 50257, 8, {"backend": "null"})),
    Status(SNAPSHOT, "the engine failed"),
    Answer(4, (1, 2)),
    Stopped(),
]


def test_every_kind_crosses_and_arrives_equal_on_its_side_only():
    assert {type(message) for message in EVERY_KIND} == {kind.type for kind in KINDS}
    assert len({kind.tag for kind in KINDS}) == len(KINDS)  # one byte names one kind
    for message in EVERY_KIND:
        data = encode(message)
        arrived = decode(data)
        assert type(arrived) is type(message) and arrived == message, message
        to_engine = isinstance(message, ToEngine)
        assert (type(decode_to_engine(data)) if to_engine else type(decode_from_engine(data))) is type(
            message
        )
        with pytest.raises(ValueError, match="goes to"):
            (decode_from_engine if to_engine else decode_to_engine)(data)


# ----- the hand-over ----------------------------------------------------------------------------------


class Loop:
    """An `EventSink` that collects the events the engine core hands it."""

    def __init__(self) -> None:
        self.events: list = []
        self.done = threading.Event()

    def hand_over(self, events) -> None:
        for state, event in events:
            self.events.append((state.id, event))
            if not isinstance(event, TokenEvent):
                self.done.set()

    def wait_for_turn(self, timeout_s: float) -> None:
        pass


class Filed:
    def __init__(self) -> None:
        self.outcomes: dict[str, RequestState | ServiceError] = {}
        self.arrived = threading.Condition()

    def __call__(self, request_id: str, outcome) -> None:
        with self.arrived:
            self.outcomes[request_id] = outcome
            self.arrived.notify_all()

    def wait(self, request_id: str, timeout: float = 10.0):
        with self.arrived:
            assert self.arrived.wait_for(lambda: request_id in self.outcomes, timeout), request_id
            return self.outcomes[request_id]


def engine(slots: int = 2, max_queue: int = 4) -> Engine:
    built = Engine(
        lambda: NullBackend(50257, slots=slots, context=64, top_k=8),
        gpt2_tokenizer_hooks(),
        ServiceMetrics("test"),
        max_queue=max_queue,
        step_token_budget=64,
    )
    built.start()
    assert built.wait_ready(30)
    return built


REQUEST = GenerationRequest((464, 2068, 318), 6, ignore_eos=True)


def test_a_request_handed_over_is_filed_at_a_step_boundary_and_runs():
    served, loop, filed = engine(), Loop(), Filed()
    try:
        served.submit_nowait(REQUEST, True, loop, "req-a", filed)  # the worker is parked: woken
        state = filed.wait("req-a")
        assert isinstance(state, RequestState) and state.id == "req-a"
        assert loop.done.wait(10)
        assert [type(e).__name__ for _, e in loop.events] == ["TokenEvent"] * 5 + ["FinishEvent"]
        assert loop.events[-1][1].finish_reason is FinishReason.LENGTH
    finally:
        served.shutdown(5)


def test_requests_handed_over_beyond_capacity_or_while_draining_are_refused_as_submit_would():
    served, loop, filed = engine(slots=1, max_queue=1), Loop(), Filed()
    try:
        long = GenerationRequest((464,), 60, ignore_eos=True)
        for name in ("one", "two", "three"):  # 1 slot + 1 queued: the third is over capacity
            served.submit_nowait(long, True, loop, name, filed)
        outcomes = [filed.wait(name) for name in ("one", "two", "three")]
        assert [type(o) for o in outcomes[:2]] == [RequestState, RequestState]
        assert isinstance(outcomes[2], Overloaded)
        served.begin_drain()
        served.submit_nowait(REQUEST, True, loop, "late", filed)
        assert isinstance(filed.wait("late"), Unavailable)
    finally:
        served.shutdown(5)


def test_a_request_handed_over_before_a_drain_is_served():
    served, loop, filed = engine(), Loop(), Filed()
    try:
        with served._cond:  # the worker cannot file it before the drain begins
            served.submit_nowait(REQUEST, True, loop, "before", filed)
            served.begin_drain()
        assert isinstance(filed.wait("before"), RequestState)  # accepted when it was handed over
        assert served.wait_drained(10) and loop.done.is_set()
        assert loop.events[-1][1].finish_reason is FinishReason.LENGTH
    finally:
        served.shutdown(5)


def test_an_engine_that_stopped_refuses_what_is_handed_over_at_once():
    served, loop, filed = engine(), Loop(), Filed()
    served.shutdown(5)
    assert served.state is EngineState.STOPPED
    served.submit_nowait(REQUEST, True, loop, "after", filed)
    refusal = filed.outcomes["after"]  # answered on the caller's thread: no worker is left to do it
    assert isinstance(refusal, Unavailable) and "shut down" in str(refusal)


def test_a_request_the_engine_cannot_queue_fails_alone(monkeypatch):
    served, loop, filed = engine(), Loop(), Filed()
    try:
        core = served._built_core()
        real = core.new_request

        def broken(request, *args):
            if request.max_new_tokens == 5:
                raise KeyError("a bug")
            return real(request, *args)

        monkeypatch.setattr(core, "new_request", broken)
        served.submit_nowait(GenerationRequest((464,), 5), True, loop, "bad", filed)
        served.submit_nowait(REQUEST, True, loop, "good", filed)
        failed = filed.wait("bad")
        assert isinstance(failed, RequestFailed) and "reference" in str(failed)
        assert isinstance(filed.wait("good"), RequestState)
        assert loop.done.wait(10) and served.state is EngineState.READY
    finally:
        served.shutdown(5)


def test_a_cancellation_before_the_request_is_filed_applies_when_it_is():
    served, loop = engine(), Loop()
    sent: list = []
    book = _Book(sent.append, served.cancel)
    try:
        book.arrived("early")
        assert book.to_cancel("early") is None  # not filed yet: remembered
        served.submit_nowait(GenerationRequest((464,), 50, ignore_eos=True), True, loop, "early", book.filed)
        cancelled = served.metrics.tgi_request_failure.labels(err="cancelled")
        deadline = time.monotonic() + 10
        while cancelled._value.get() < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert cancelled._value.get() == 1 and served.queue_sizes() == (0, 0)
        assert len([e for _, e in loop.events if isinstance(e, TokenEvent)]) < 49
        assert sent == []  # a cancelled request ends without an event
        assert book._filed == {} and book._unfiled == set() and book._cancel_when_filed == set()
    finally:
        served.shutdown(5)


def test_a_request_is_forgotten_when_it_ends_or_is_cancelled():
    served, loop = engine(), Loop()
    book = _Book(lambda message: None, served.cancel)
    try:
        book.arrived("r")
        served.submit_nowait(GenerationRequest((464,), 3, ignore_eos=True), True, loop, "r", book.filed)
        assert loop.done.wait(10)
        book.ended(["r"])  # what the engine process's outbox does with a final event
        assert book.to_cancel("r") is None and book._filed == {}
        book.arrived("s")
        served.submit_nowait(GenerationRequest((464,), 50, ignore_eos=True), True, loop, "s", book.filed)
        deadline = time.monotonic() + 10
        while "s" not in book._filed and time.monotonic() < deadline:
            time.sleep(0.005)
        state = book.to_cancel("s")  # filed: cancelled now (a no-op if it ended meanwhile), and forgotten
        assert state is not None and book._filed == {}
    finally:
        served.shutdown(5)


class WaitingBackend(NullBackend):
    """Answers like the null backend after a wait that leaves the GIL free (as a wafer's step does)."""

    def step(self, inputs):
        time.sleep(0.002)
        return super().step(inputs)


def test_the_helper_finishes_tokens_beside_steps_that_wait_and_not_beside_steps_that_compute():
    for factory, overlaps in ((NullBackend, False), (WaitingBackend, True)):
        served = Engine(
            lambda factory=factory: factory(50257, slots=2, context=64, top_k=8),
            gpt2_tokenizer_hooks(),
            ServiceMetrics("test"),
            max_queue=4,
            step_token_budget=64,
        )
        served.start()
        assert served.wait_ready(30)
        loop, filed = Loop(), Filed()
        try:
            served.submit_nowait(GenerationRequest((464,), 12, ignore_eos=True), True, loop, "r", filed)
            assert loop.done.wait(10)
            tokens = [e for _, e in loop.events if isinstance(e, TokenEvent)]
            assert [e.number for e in tokens] == list(range(1, 12))  # the same events either way
            assert (served._helper_cpu_s > 0) is overlaps, factory.__name__
        finally:
            served.shutdown(5)


# ----- text made in the HTTP process ------------------------------------------------------------------

EOT = 50256


class _Eosy(NullBackend):
    """The null backend, with end-of-text as the best candidate at some (slot, position)s."""

    def step(self, inputs):
        scores = self.answer(inputs)
        ids = scores.topk_ids.copy()
        slot, position = inputs.columns[0][scores.index], inputs.columns[1][scores.index]
        ids[((slot * 7 + position) % 11) == 5, 0] = EOT
        return StepScores(
            scores.count,
            scores.index,
            ids,
            scores.topk_logits,
            scores.logsumexp,
            scores.target_logit,
            scores.has_target,
        )


class _Collect(Loop):
    def __init__(self, makes_text: bool) -> None:
        super().__init__()
        self.makes_text = makes_text


TEXT_AT_END = [
    GenerationRequest((464, 2068, 318), 12),
    GenerationRequest((464, 2068), 9, skip_special_tokens=False),
    GenerationRequest((318,), 14, include_stop_str_in_output=True, skip_special_tokens=False),
    GenerationRequest((11, 12, 13), 10, ignore_eos=True),
    GenerationRequest((7, 8), 8, SamplingParams(do_sample=True, temperature=0.9, seed=5), min_tokens=3),
    GenerationRequest((464, 318), 6, top_n_tokens=2, prompt_logprobs=True),
    GenerationRequest((9,), 11, SamplingParams(repetition_penalty=1.3), stop_token_ids=frozenset({11})),
    GenerationRequest((5, 6), 0, prompt_logprobs=True),
]


@pytest.mark.parametrize("groups", [1, 2])
def test_a_sink_that_makes_text_gets_ids_and_makes_the_end_the_engine_would_have_made(groups):
    """A non-streamed request without stop sequences whose sink makes text (the engine process's pipe:
    the HTTP process makes it) ends with its ids and logprobs only (`IdsFinishEvent`), across the pipe in
    its compact form; the `FinishEvent` made of them (`finish_event_of`) is the one the engine makes
    for a sink that does not, whatever ended the request (length, end-of-text, a stop token, a slot's
    end) and whatever it asked (special tokens shown, alternatives, prompt logprobs, sampling)."""
    hooks = gpt2_tokenizer_hooks()
    ends = []
    for sink in (_Collect(makes_text=False), _Collect(makes_text=True)):
        backend = _Eosy(50257, slots=3, context=24, top_k=8)
        backend.steps_in_flight = groups
        core = EngineCore(backend, hooks, max_queue=16, step_token_budget=32)
        states = [core.add(core.new_request(request, sink, stream=False)) for request in TEXT_AT_END]
        assert all(state.text_in_front is sink.makes_text for state in states)
        while core.has_work():
            core.step()
        core.complete_deferred()
        by_id = dict(sink.events)
        assert len(by_id) == len(sink.events) == len(states)
        ends.append([by_id[state.id] for state in states])
        if sink.makes_text:  # no token records in the engine, but where alternatives were asked
            assert [bool(state.tokens) for state in states] == [
                bool(request.top_n_tokens and request.max_new_tokens) for request in TEXT_AT_END
            ]
    made_here, sent = ends
    crossed = decode_from_engine(encode(Events([(str(i), event) for i, event in enumerate(sent)]))).events
    reasons = set()
    for request, here, ids, (_, arrived) in zip(TEXT_AT_END, made_here, sent, crossed, strict=True):
        assert type(ids) is IdsFinishEvent and arrived == ids
        made = finish_event_of(arrived, request, hooks)
        assert made == here
        reasons.add(made.finish_reason)
    assert reasons == {FinishReason.LENGTH, FinishReason.EOS}


STREAMED = [
    *TEXT_AT_END,
    GenerationRequest((464, 2068, 318), 16),
    GenerationRequest((17,), 5, SamplingParams(do_sample=True, temperature=0.8, top_p=0.9, seed=3)),
    GenerationRequest(
        (21, 22), 13, stop_sequences=("hth",), ignore_eos=True
    ),  # its text is made in the engine
    GenerationRequest((30, 31, 32), 20, ignore_eos=True),
    GenerationRequest((40, 41), 7, prompt_logprobs=True),  # a first token's event with no alternatives
]


class _MakesText(Loop):
    """A sink that makes text as the engine process's pipe and the HTTP process do: each hand-over
    crosses the pipe's encoding, and the requests' text is made of the ids (`FrontText`) where the
    engine did not make it."""

    makes_text = True

    def __init__(self) -> None:
        super().__init__()
        self.fronts: dict[str, FrontText] = {}
        self.rosters: Rosters[str] = Rosters(str)  # the members: their request ids
        self.named = 0  # tokens that crossed with their request's id (a roster's first step, `ONE_STEP`)
        self.bare = 0  # tokens that crossed without (a run's later steps)
        self.as_events: set[str] = set()  # requests whose text is made here that got a `TokenEvent`

    def hand_over(self, events, streamed=None) -> None:
        message = decode_from_engine(encode(Events([(state.id, event) for state, event in events], streamed)))
        assert isinstance(message, Events)
        for ids in message.streamed or ():
            assert type(ids) is StreamedIds
            tokens, logprobs = ids.columns()
            if ids.request_ids is None:
                self.bare += len(tokens)
            else:
                self.named += len(tokens)
            for request_id, token, logprob in zip(self.rosters.members(ids), tokens, logprobs, strict=True):
                self.events.append((request_id, self.fronts[request_id].token(token, logprob)))
        for request_id, event in message.events:
            front = self.fronts.get(request_id)
            if front is not None and type(event) is TokenEvent:
                self.as_events.add(request_id)
                event = front.token_event(event)
            elif front is not None and type(event) is IdsFinishEvent:
                event = front.finish(event)
            self.events.append((request_id, event))


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("defer", [False, True])
def test_streamed_requests_whose_sink_makes_text_get_the_events_the_engine_would_have_made(groups, defer):
    """A streamed request without stop sequences whose sink makes text sends its token events without
    text (as ids, `StreamedIds`, where they carry no alternatives or prompt logprobs; a decode run's
    steps without the requests' ids) and its end as its last id; the events the
    receiver makes of them (`FrontText`) are the ones the engine makes for a sink that does not, token
    by token and at the end, whatever ended the request and whatever it asked; a request with stop
    sequences gets its text from the engine either way. With the engine's work deferred (`finish(defer=
    True)`) too, in one group or two."""
    hooks = gpt2_tokenizer_hooks()
    heard = []
    for sink in (Loop(), _MakesText()):
        backend = _Eosy(50257, slots=4, context=24, top_k=8)
        backend.steps_in_flight = groups
        core = EngineCore(backend, hooks, max_queue=16, step_token_budget=32)
        states = [core.add(core.new_request(request, sink, stream=True)) for request in STREAMED]
        assert [state.text_in_front for state in states] == [
            isinstance(sink, _MakesText) and not request.stop_sequences for request in STREAMED
        ]
        if isinstance(sink, _MakesText):
            sink.fronts = {s.id: FrontText(s.request, hooks) for s in states if s.text_in_front}
        while core.has_work():
            batch = core.schedule()
            if batch:
                core.finish(batch, core.execute(batch), defer=defer)
            core.complete_deferred()
        by_request: dict[str, list] = {state.id: [] for state in states}
        for request_id, event in sink.events:
            by_request[request_id].append(event)
        heard.append([by_request[state.id] for state in states])
        if isinstance(sink, _MakesText):  # by ids, a run's steps without their requests' ids; by
            # token events only the tokens with alternatives or prompt logprobs (of requests that have
            # a token event: one that asked for no token has none)
            assert sink.named and sink.bare
            assert sink.as_events and sink.as_events <= {
                s.id
                for s in states
                if s.text_in_front and (s.request.top_n_tokens or s.request.prompt_logprobs)
            }
    made_here, made_there = heard
    assert made_there == made_here
    assert all(type(events[-1]) is FinishEvent for events in made_here)
    assert {FinishReason.LENGTH, FinishReason.EOS} <= {events[-1].finish_reason for events in made_here}
