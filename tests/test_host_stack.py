"""The host stack: the stand-in backends (null, modeled), the whole-step greedy choice, the
hand-built stream frames, and `wafer-gpt2 bench host` end to end (a real server on loopback and its
load generator in a process of its own)."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from wafer_gpt2.backends.registry import BackendOptions, build_backend
from wafer_gpt2.backends.stand_ins import ModeledWaferBackend, NullBackend, modeled_step_seconds
from wafer_gpt2.benchmarks import host as bench_host
from wafer_gpt2.core.steps import BackendError, StepInputs, StepItem, StepScores, TokenScores
from wafer_gpt2.engine.core import EngineCore, TokenizerHooks
from wafer_gpt2.engine.request import (
    Alternative,
    ErrorEvent,
    FinishEvent,
    FinishReason,
    GeneratedToken,
    GenerationRequest,
    PromptToken,
    TokenEvent,
    loop_sink,
)
from wafer_gpt2.engine.sampling import Sampler, SamplingParams, greedy_batch
from wafer_gpt2.model import tokenizer
from wafer_gpt2.plan import build_plan
from wafer_gpt2.service.delivery import sse
from wafer_gpt2.service.openai_chat import chat_chunk_head, chat_content_frame
from wafer_gpt2.service.openai_completions import (
    Choice,
    completion_choice,
    completion_response,
    plain_chunk,
    usage_of,
)
from wafer_gpt2.service.schemas import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatDelta,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    TGIRequest,
    TGIStreamDetails,
    TGIStreamEvent,
    TGIToken,
)
from wafer_gpt2.service.tgi import tgi_final_event, tgi_token_event

# ----- the stand-in backends ---------------------------------------------------------------------


def test_null_backend_answers_every_wanted_item_at_once_and_validates():
    backend = NullBackend(vocab_size=50257, slots=2, context=8, top_k=5)
    items = [StepItem(0, 0, 11, want_scores=False), StepItem(0, 1, 12), StepItem(1, 0, 13, target=7)]
    out = backend.step(StepInputs.of_items(items)).rows()
    assert out[0] is None
    first, scored = out[1], out[2]
    assert first is not None and scored is not None
    assert len(first.topk_ids) == 5 and len(set(first.topk_ids.tolist())) == 5
    assert np.all(np.diff(first.topk_logits) <= 0)  # best first
    assert first.topk_ids[0] != 50256  # never end-of-text first: benchmark streams run their length
    assert scored.target_logit is not None and scored.target_logit < scored.topk_logits[-1]
    # Deterministic in (token, position): the same item gets the same answer.
    again = backend.step(StepInputs.of_items([StepItem(0, 1, 12)])).rows()[0]
    assert again is not None and again.topk_ids.tolist() == first.topk_ids.tolist()
    with pytest.raises(BackendError, match="slot 2 outside"):
        backend.step(StepInputs.of_items([StepItem(2, 0, 1)]))
    with pytest.raises(BackendError, match="position 8 outside"):
        backend.step(StepInputs.of_items([StepItem(0, 8, 1)]))
    backend.close()
    with pytest.raises(BackendError, match="closed"):
        backend.step(StepInputs.of_items([StepItem(0, 0, 1)]))


@pytest.fixture(scope="module")
def two_replica_plan(small_config):
    """A small plan with 2 replicas of 2 slots (planning takes seconds: built once)."""
    return build_plan(small_config, slots=2, context=32, replicas=2)


def test_modeled_step_time_streams_items_through_each_replica(two_replica_plan):
    plan = two_replica_plan
    clock = 1.1e9
    first = plan.decode_cycles / clock
    assert modeled_step_seconds(plan, []) == 0.0
    assert modeled_step_seconds(plan, [0]) == pytest.approx(first)
    # Two items of replica 0 follow each other a slowest-stage apart ...
    assert modeled_step_seconds(plan, [0, 1]) == pytest.approx(first + plan.bottleneck_cycles / clock)
    # ... while one item on each replica runs side by side.
    assert modeled_step_seconds(plan, [0, 2]) == pytest.approx(first)


def test_modeled_backend_takes_the_modeled_time_and_says_modeled(two_replica_plan):
    plan = two_replica_plan
    assert ModeledWaferBackend(plan).timer_late_s >= 0  # measured at construction
    backend = ModeledWaferBackend(plan, timer_late_s=0.0)  # sleeps the whole modeled time
    items = [StepItem(slot, 0, 100 + slot) for slot in range(4)]
    modeled = modeled_step_seconds(plan, [item.slot for item in items])
    start = time.perf_counter()
    out = backend.step(StepInputs.of_items(items))
    took = time.perf_counter() - start
    assert out.count == 4 and out.index.tolist() == [0, 1, 2, 3]
    assert took >= modeled
    assert backend.modeled_busy_s == pytest.approx(modeled)
    assert backend.overshoot_s == pytest.approx(took - modeled, abs=0.05)
    described = backend.describe()
    assert described["backend"] == "modeled" and "modeled" in described["device_type"]
    assert described["plan"]["decode_cycles"] == plan.decode_cycles
    assert set(described) == {
        "backend",
        "device_type",
        "dtype",
        "num_slots",
        "context_length",
        "vocab_size",
        "top_k",
        "plan",
    }


def test_modeled_backend_decodes_the_records_the_null_backend_answers_with(two_replica_plan):
    """The modeled stand-in goes through the host program's wire (each replica's message encoded, the
    scored items' records decoded): what comes back equals the null backend's answers (lse and target
    logit in float32, as the records carry them), the target logit only where asked, nothing for an item
    that wants no scores, on both replicas and in step order. It refuses and counts steps as the null
    backend does."""
    plan = two_replica_plan
    modeled = ModeledWaferBackend(plan, timer_late_s=0.0)
    null = NullBackend(plan.config.vocab_size, slots=4, context=32, top_k=plan.top_k)
    items = [
        StepItem(2, 0, 464, want_scores=False),
        StepItem(0, 0, 11, target=7),
        StepItem(3, 0, 12),
        StepItem(2, 1, 13, target=50256),
        StepItem(1, 0, 14),
    ]
    got, expected = (
        modeled.step(StepInputs.of_items(items)).rows(),
        null.step(StepInputs.of_items(items)).rows(),
    )
    assert got[0] is None and expected[0] is None
    for ours, theirs in zip(got[1:], expected[1:], strict=True):
        assert ours is not None and theirs is not None
        np.testing.assert_array_equal(ours.topk_ids, theirs.topk_ids)
        np.testing.assert_array_equal(ours.topk_logits, theirs.topk_logits)
        assert type(ours.logsumexp) is float and ours.logsumexp == float(np.float32(theirs.logsumexp))
        assert (ours.target_logit is None) == (theirs.target_logit is None)
        if ours.target_logit is not None:
            assert ours.target_logit == float(np.float32(theirs.target_logit))
    assert (modeled.steps, modeled.items) == (null.steps, null.items) == (1, 5)
    assert modeled.stand_in_cpu_s > 0  # the records it built, the wafer's side: left out of host figures
    with pytest.raises(BackendError, match="item 0: slot 4 outside 0..3"):
        modeled.step(StepInputs.of_items([StepItem(4, 0, 1)]))
    modeled.close()
    with pytest.raises(BackendError, match="closed"):
        modeled.step(StepInputs.of_items([StepItem(0, 1, 1)]))


@pytest.mark.slow
def test_backends_build_the_stand_ins_by_name(small_params):
    null = build_backend("null", small_params, BackendOptions(slots=3, context=16, top_k=8))
    assert null.describe()["backend"] == "null" and null.num_slots == 3 and null.top_k == 8
    modeled = build_backend("modeled", small_params, BackendOptions(slots=2, context=16, top_k=8))
    assert modeled.describe()["backend"] == "modeled" and modeled.num_slots == 2


# ----- the whole-step greedy choice ---------------------------------------------------------------


def _row(ids, logits, lse=0.0) -> TokenScores:
    return TokenScores(np.array(ids, dtype=np.int32), np.array(logits, dtype=np.float32), lse)


def test_greedy_batch_chooses_what_choose_does():
    rows = [
        _row([5, 6, 7], [3.0, 2.0, 1.0], 4.0),
        _row([5, 6, 7], [1.0, 3.0, 3.0], 4.5),  # not sorted; a tie: the first of the maxima
        _row([9, 8, 7], [np.inf, np.inf, 0.0]),  # overflowed scores: the first infinite one
        _row([99, 6, 7], [3.0, 2.0, 1.0]),  # the best id unknown to the tokenizer: left to choose
        _row([5, 6, 7], [np.nan, 2.0, 1.0]),  # NaN: left to choose
        _row([5, 6, 7], [-np.inf, -np.inf, -np.inf]),  # nothing choosable: left to choose (which raises)
        _row([5, 6, 5], [1.0, 2.0, 3.0], 2.5),  # an id twice: the logit of its first occurrence
    ]
    scores = StepScores.of_rows(rows)
    picks = greedy_batch(scores, range(len(rows)), vocab_size=50)
    assert picks[3] is None and picks[4] is None and picks[5] is None
    for row, pick in zip(rows, picks, strict=True):
        if pick is not None:
            assert pick == Sampler(SamplingParams(), vocab_size=50).choose(row, [])
    assert picks[6] == (5, 1.0 - 2.5)
    # Some of the step's rows only (the others are not plain greedy): the same picks for those.
    assert greedy_batch(scores, [1, 3, 6], vocab_size=50) == [picks[1], picks[3], picks[6]]
    assert greedy_batch(StepScores.empty(0), [], 50) == []


def test_engine_gives_the_same_tokens_with_and_without_the_batched_choice():
    """Greedy requests chosen together (greedy_batch) and the same requests with a penalty of exactly
    1.0 set otherwise equal go through the same path; requests with a real penalty choose alone. Both
    kinds share steps here, and each matches a run of its own."""
    hooks = TokenizerHooks(tokenizer.token_bytes, 50256, {50256: "<|endoftext|>"}, 50257)

    def run(requests: list[GenerationRequest]) -> list[list[int]]:
        core = EngineCore(NullBackend(50257, slots=4, context=64), hooks, max_queue=8, step_token_budget=64)
        states = [core.add(request) for request in requests]
        while core.has_work():
            core.step()
        return [[token.id for token in state.tokens] for state in states]

    prompt = tuple(tokenizer.encode("Hello there, wafer"))
    plain = GenerationRequest(prompt, 12)
    penalised = GenerationRequest(prompt, 12, sampling=SamplingParams(repetition_penalty=1.3))
    sampled = GenerationRequest(prompt, 12, sampling=SamplingParams(do_sample=True, seed=7))
    mixed = run([plain, penalised, sampled, plain])
    assert mixed == [run([plain])[0], run([penalised])[0], run([sampled])[0], run([plain])[0]]
    assert len(mixed[0]) == 12


def test_step_scores_rows_parts_and_malformed_answers():
    """A step's scores as arrays: rows in item order whatever order its parts (a replica's message each)
    come in, a per-item view of each row, and shapes that do not agree refused as a backend fault."""
    rows = [
        _row([1, 2], [2.0, 1.0], 3.0),
        None,
        _row([4, 5], [0.5, 0.25], 1.0),
        _row([7, 8], [1.0, 0.0], 2.0),
    ]
    whole = StepScores.of_rows(rows)
    assert whole.count == 4 and whole.index.tolist() == [0, 2, 3] and whole.row_of_item() == [0, -1, 1, 2]
    parts = [StepScores.of_rows([None, None, rows[2], rows[3]]), StepScores.of_rows([rows[0]])]
    joined = StepScores.concat(parts, 4)
    for name in ("index", "topk_ids", "topk_logits", "logsumexp", "has_target"):
        np.testing.assert_array_equal(getattr(joined, name), getattr(whole, name))
    view = joined.rows()
    assert (
        view[1] is None and view[2] is not None and view[2].logsumexp == 1.0 and view[2].target_logit is None
    )
    assert StepScores.empty(3, 2).rows() == [None, None, None]
    with pytest.raises(BackendError, match="malformed step scores"):
        StepScores(
            1,
            whole.index,
            whole.topk_ids,
            whole.topk_logits,
            whole.logsumexp,
            whole.target_logit,
            whole.has_target,
        )


def test_a_step_answer_missing_a_wanted_row_fails_that_request_alone():
    """A backend that returns no row for an item that wanted one: its request ends with an error, the
    others in the step go on."""

    class DropsSlotOne(NullBackend):
        def step(self, inputs):
            full = super().step(inputs)
            keep = [j for j, index in enumerate(full.index.tolist()) if inputs.slot[index] != 1]
            return StepScores(full.count, *(column[keep] for column in full.arrays()))

    hooks = TokenizerHooks(tokenizer.token_bytes, 50256, {50256: "<|endoftext|>"}, 50257)
    core = EngineCore(DropsSlotOne(50257, slots=2, context=64), hooks, max_queue=8, step_token_budget=64)
    good, bad = (core.add(GenerationRequest((464, 2068), 4, ignore_eos=True)) for _ in range(2))
    events = []
    while core.has_work():
        events += core.step()
    assert len(good.tokens) == 4 and not bad.tokens
    assert any(state is bad and not isinstance(event, FinishEvent) for state, event in events)


# ----- hand-built frames equal the models' dumps --------------------------------------------------


def tgi_alternatives_model(top: tuple[Alternative, ...], special: dict[int, str]) -> list[TGIToken]:
    return [
        TGIToken(id=a.id, text=tokenizer.decode([a.id]), logprob=a.logprob, special=a.id in special)
        for a in top
    ]


def test_tgi_token_event_is_the_models_dump():
    special = {50256: "<|endoftext|>"}
    for top in ((), (Alternative(50256, -0.5), Alternative(11, -1.25))):
        token = GeneratedToken(id=11, text=",", released=", x", logprob=-0.125, special=False, top=top)
        event = TokenEvent(number=3, token=token)
        expected = TGIStreamEvent(
            index=3,
            token=TGIToken(id=11, text=", x", logprob=-0.125, special=False),
            top_tokens=tgi_alternatives_model(top, special),
        ).model_dump()
        built = tgi_token_event(event, special)
        assert built == expected
        assert json.dumps(built) == json.dumps(expected)  # same keys in the same order


@pytest.mark.parametrize("finish", [None, "stop", "length"])
@pytest.mark.parametrize("content", ["", "plain", 'é "quoted"\n\ttab \U0001f642'])
def test_chat_content_frame_is_the_models_dump(finish, content):
    expected = ChatCompletionChunk(
        id="chatcmpl-1",
        created=5,
        model='gpt2 "x"',
        choices=[ChatChunkChoice(index=2, delta=ChatDelta(content=content), finish_reason=finish)],
    ).model_dump(exclude_none=False)
    head = chat_chunk_head("chatcmpl-1", 5, 'gpt2 "x"')
    assert chat_content_frame(head, 2, content, finish) == sse(expected)


@pytest.mark.parametrize("details", [False, True])
@pytest.mark.parametrize("full_text", [False, True])
def test_tgi_final_event_is_the_models_dump(details, full_text):
    special = {50256: "<|endoftext|>"}
    body = TGIRequest(inputs="Say", parameters={"details": details, "return_full_text": full_text})
    for top in ((), (Alternative(50256, -0.5), Alternative(11, -1.25))):
        tokens = (
            GeneratedToken(id=11, text=",", released=",", logprob=-0.125, special=False),
            GeneratedToken(id=50256, text="", released="", logprob=-2.5, special=True, top=top),
        )
        event = FinishEvent(FinishReason.EOS, " hi,", " tail", tokens, (), 7, 3, None)
        expected = TGIStreamEvent(
            index=2,
            token=TGIToken(id=50256, text=" tail", logprob=-2.5, special=True),
            top_tokens=tgi_alternatives_model(top, special),
            generated_text=("Say hi," if full_text else " hi,"),
            details=TGIStreamDetails(finish_reason="eos_token", generated_tokens=2, seed=7, input_length=3)
            if details
            else None,
        ).model_dump()
        built = tgi_final_event(event, body, special)
        assert json.dumps(built) == json.dumps(expected)  # the same keys in the same order, the same values


@pytest.mark.parametrize(
    ("finish", "stop_reason"), [(None, None), ("stop", "\n"), ("stop", 13), ("length", None)]
)
def test_plain_chunk_is_the_models_dump(finish, stop_reason):
    expected = CompletionResponse(
        id="cmpl-1",
        created=5,
        model="gpt2",
        choices=[CompletionChoice(index=2, text="é", finish_reason=finish, stop_reason=stop_reason)],
    ).model_dump(exclude_none=False)
    built = plain_chunk("cmpl-1", 5, "gpt2", 2, "é", finish, stop_reason)
    assert json.dumps(built) == json.dumps(expected)


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"echo": True, "n": 2},
        {"stop": ["\n"], "stop_token_ids": [13], "n": 2},  # four choices: the EOS one ends on token 13
        {"logprobs": 1},
        {"logprobs": 2, "echo": True},
        {"prompt_logprobs": 1},
    ],
)
def test_completion_response_is_the_models_dump(fields):
    """The non-streamed response built directly is the pydantic models' dump, byte for byte once encoded."""
    body = CompletionRequest(prompt=["Say", "Go on"], max_tokens=2, **fields)
    top = (Alternative(11, -0.5), Alternative(13, -1.25))
    prefill = (PromptToken(50, None), PromptToken(60, -0.75, top, 2))
    tokens = (
        GeneratedToken(id=11, text=",", released=",", logprob=-0.125, special=False, top=top),
        GeneratedToken(id=13, text="é", released="é", logprob=-2.5, special=False, top=top),
    )
    ends = [
        FinishEvent(FinishReason.LENGTH, ",é", "", tokens, prefill, None, 2, None),
        FinishEvent(FinishReason.STOP, ",", "", tokens, prefill, None, 2, "\n"),
        FinishEvent(FinishReason.EOS, ",é", "", tokens, prefill, None, 2, None),
    ]
    choices = [Choice(index, (50, 60), "Say it") for index in range(len(body.prompt) * body.n)]
    finals = [ends[index % len(ends)] for index in range(len(choices))]
    expected = CompletionResponse(
        id="cmpl-1",
        created=5,
        model="gpt2",
        choices=[
            completion_choice(body, choice, final) for choice, final in zip(choices, finals, strict=True)
        ],
        usage=usage_of(choices, sum(len(final.tokens) for final in finals), body.n),
    ).model_dump()
    built = completion_response(body, choices, finals, "gpt2", "cmpl-1", 5)
    assert json.dumps(built) == json.dumps(expected)


def _run_to_the_end(core: EngineCore, requests: list[tuple[GenerationRequest, bool]]) -> list[list]:
    """Each (request, stream) added to `core` with an event loop's sink, stepped until none is left:
    the events each request received."""
    import asyncio

    async def main() -> list[list]:
        loop = asyncio.get_running_loop()
        states = [core.add(core.new_request(r, loop_sink(loop), stream=stream)) for r, stream in requests]
        while core.has_work():
            core.step()
        await asyncio.sleep(0)  # the step's events are delivered by one callback on the loop
        drained = []
        for state in states:
            events = []
            while not state.events.empty():
                events.append(state.events.get_nowait())
            drained.append(events)
        return drained

    return asyncio.run(main())


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_non_streaming_requests_get_only_their_final_event(small_params, skip_special_tokens):
    """A request submitted with stream=False hears nothing until its final event (which carries every
    token); a streaming one hears every token. The final events are equal: the non-streamed request's
    text, made in one pass when it ends, is the text the streamed one got token by token."""
    hooks = TokenizerHooks(tokenizer.token_bytes, 50256, {50256: "<|endoftext|>"}, 50257)
    core = EngineCore(NullBackend(50257, slots=2, context=32), hooks, max_queue=4, step_token_budget=32)

    request = GenerationRequest((1, 2, 3), 20, skip_special_tokens=skip_special_tokens)
    plain_events, streamed_events = _run_to_the_end(core, [(request, False), (request, True)])
    assert len(plain_events) == 1 and isinstance(plain_events[0], FinishEvent)
    assert len(plain_events[0].tokens) == 20
    assert [type(e) for e in streamed_events] == [TokenEvent] * 19 + [FinishEvent]
    assert plain_events[0] == streamed_events[-1] and plain_events[0].text


@pytest.mark.parametrize("stream", [True, False])
def test_a_token_that_cannot_be_detokenized_fails_its_request_alone(stream):
    """Streamed (text token by token) or not (text in one pass at its end): the request whose token's
    bytes cannot be read ends with an error event, its slot freed; the other one finishes."""

    def token_bytes(token: int) -> bytes:
        if token == poisoned:
            raise KeyError(token)
        return tokenizer.token_bytes(token)

    backend = NullBackend(50257, slots=2, context=32)
    first = backend.answer(StepInputs.of_items([StepItem(0, 0, 7)])).topk_ids[0, 0]
    poisoned = int(first)  # the first token the request with prompt (7,) is given
    hooks = TokenizerHooks(token_bytes, 50256, {50256: "<|endoftext|>"}, 50257)
    core = EngineCore(backend, hooks, max_queue=4, step_token_budget=32)

    requests = [(GenerationRequest((7,), 4), stream), (GenerationRequest((1, 2), 4), stream)]
    bad_events, good_events = _run_to_the_end(core, requests)
    assert isinstance(bad_events[-1], ErrorEvent) and len(bad_events) == 1
    assert isinstance(good_events[-1], FinishEvent) and len(good_events[-1].tokens) == 4
    assert core.scheduler.slots.counts()[0] == 0  # both slots free again


# ----- bench host end to end ----------------------------------------------------------------------


@pytest.mark.slow
def test_bench_host_runs_end_to_end_at_a_tiny_size():
    cells, labels = bench_host.measure(
        ["null", "modeled"],
        [2],
        list(bench_host.ROUTES),
        new_tokens=4,
        seconds=0.4,
        warmup_s=0.1,
        log=lambda _: None,
    )
    assert len(cells) == 2 * len(bench_host.ROUTES)
    for cell in cells:
        assert cell.errors == 0 and cell.tokens_per_s > 0, cell
        assert cell.ceiling is not None and cell.ceiling.tokens_per_s > 0
        assert cell.server_us_per_token > 0
        if cell.backend == "modeled":
            assert cell.utilisation is not None and 0 < cell.utilisation <= 1.05
        else:
            assert cell.utilisation is None
    assert "modeled" in labels["modeled 2"]
    assert bench_host.summary_line(cells).startswith("bench host summary:")


@pytest.mark.slow
def test_bench_host_measures_the_engine_in_a_process_of_its_own():
    """The engine process's CPU counts towards the server's, and its modeled busy time reaches the
    benchmark through the engine's state reports; the engine process builds a modeled wafer that takes
    two steps at a time, as asked (tests/test_engine_pipelined.py has what the engine does with it)."""
    cells, labels = bench_host.measure(
        ["modeled"],
        [2],
        ["generate"],
        new_tokens=4,
        seconds=0.6,
        warmup_s=0.1,
        log=lambda _: None,
        engine_process=True,
        steps_in_flight=2,
    )
    assert "2 step(s) in flight" in labels["modeled 2"]
    (cell,) = cells
    assert cell.errors == 0 and cell.tokens_per_s > 0 and cell.server_us_per_token > 0, cell
    assert cell.utilisation is not None and 0 < cell.utilisation <= 1.05, cell


def test_the_report_keeps_the_host_section_when_it_is_regenerated():
    from tools.report import KEPT_BEGIN, KEPT_END, keep_sections

    old = f"# Report\n\nold figures\n\n{KEPT_BEGIN}\n## Host\n\nmeasured by hand\n{KEPT_END}\n\n## Reproduce\n\nold\n"
    new = "# Report\n\nnew figures\n\n## Reproduce\n\nnew\n"
    kept = keep_sections(old, new)
    assert kept.index("new figures") < kept.index("## Host") < kept.index("## Reproduce\n\nnew")
    assert "old figures" not in kept and kept.count("## Host") == 1
    assert keep_sections("# nothing kept\n", new) == new


# ----- the lean path of the generation routes, and its helpers -------------------------------------


def _without_ids(data):
    """OpenAI's `id` and `created` differ between any two responses."""
    if isinstance(data, dict):
        return {k: _without_ids(v) for k, v in data.items() if k not in ("id", "created")}
    if isinstance(data, list):
        return [_without_ids(v) for v in data]
    return data


def test_the_lean_path_answers_as_fastapi_does():
    """The generation routes with `application/json` take the lean path (wafer_gpt2/service/hot_routes.py); with a
    content type FastAPI parses the same but the lean path leaves to it, FastAPI's path. Both give the
    same status, headers and body, for answers, stream events and errors alike."""
    from tests.service_harness import running_server
    from wafer_gpt2.settings import ServerSettings

    settings = ServerSettings(backend="null", model_id="gpt2", max_concurrent_requests=2, max_queue=4)
    cases = [
        ("/generate", {"inputs": "Hello there", "parameters": {"max_new_tokens": 5, "details": True}}),
        (
            "/generate",
            {"inputs": "Hello", "parameters": {"max_new_tokens": 5, "decoder_input_details": True}},
        ),
        ("/generate_stream", {"inputs": "Hello there", "parameters": {"max_new_tokens": 4}}),
        ("/v1/completions", {"prompt": "Hello", "max_tokens": 4, "temperature": 0, "logprobs": 2}),
        ("/v1/completions", {"prompt": "Hello", "max_tokens": 4, "stream": True, "seed": 3}),
        ("/generate", {"inputs": "Hello", "parameters": {"max_new_tokens": 10**6}}),  # a ServiceError
        ("/v1/completions", {"prompt": "Hello", "max_tokens": 4, "model": "nope"}),  # another
        ("/generate", {"inputs": "Hello", "parameters": {"max_new_tokens": "many"}}),  # not the model
        (
            "/v1/completions",
            {"prompt": "Hello", "unknown_field": 1, "max_tokens": 2, "seed": 5},
        ),  # ignored, said so
    ]
    with running_server(settings, lambda: NullBackend(50257, slots=2, context=64)) as running:
        with running.client() as client:
            for path, body in cases:
                answers = []
                for content_type in ("application/json", "application/json;charset=utf-8"):
                    response = client.post(
                        path,
                        content=json.dumps(body),
                        headers={"content-type": content_type, "x-request-id": "given-1"},
                    )
                    headers = {k: v for k, v in response.headers.items() if k != "date"}
                    text: object = response.text
                    if path == "/v1/completions" and body.get("stream"):
                        text = [
                            _without_ids(json.loads(f[6:])) if f.startswith("data: {") else f
                            for f in response.text.split("\n")
                            if f
                        ]
                    elif path == "/v1/completions" and response.status_code == 200:
                        text = _without_ids(response.json())
                    answers.append((response.status_code, headers, text))
                assert answers[0] == answers[1], (path, body)
        # A body that is not JSON goes to FastAPI, which reports it as before.
        with running.client() as client:
            response = client.post(
                "/generate", content=b"{not json", headers={"content-type": "application/json"}
            )
            assert response.status_code == 422 and "error" in response.json()


def test_the_lean_path_refuses_and_fails_as_fastapi_does(monkeypatch, caplog):
    """The guards' refusals (a missing or wrong key, a body over the limit, declared or chunked) and a
    bug in a route: the same status, schema and headers on the lean path as on FastAPI's; the bug is
    logged under a reference the client is given, on both."""
    from tests.service_harness import running_server
    from wafer_gpt2.service.routes import tgi_routes
    from wafer_gpt2.settings import ServerSettings

    settings = ServerSettings(
        backend="null", model_id="gpt2", max_concurrent_requests=2, api_key="k3y", max_body_bytes=200
    )
    good = json.dumps({"inputs": "Hello", "parameters": {"max_new_tokens": 2}}).encode()
    big = json.dumps({"inputs": "x" * 300}).encode()
    key = {"authorization": "Bearer k3y"}
    cases = [
        ("/generate", good, {}),
        (
            "/v1/completions",
            json.dumps({"prompt": "Hi", "max_tokens": 2}).encode(),
            {"authorization": "Bearer no"},
        ),
        ("/generate", big, key),
        ("/generate_stream", [big[:150], big[150:]], key),  # chunked: no content-length
        ("/generate", good, key),  # the route's bug, below
    ]

    def bug(*args, **kwargs):
        raise RuntimeError("a bug in the route")

    monkeypatch.setattr(tgi_routes, "tgi_generation_request", bug)
    with running_server(settings, lambda: NullBackend(50257, slots=2, context=64)) as running:
        for path, body, headers in cases:
            answers = []
            for content_type in ("application/json", "application/json;charset=utf-8"):
                content = body if isinstance(body, bytes) else iter(body)
                # A connection each: uvicorn closes one whose app raised after answering.
                with running.client() as client, caplog.at_level("ERROR"):
                    response = client.post(
                        path,
                        content=content,
                        headers={"content-type": content_type, "x-request-id": "r-7", **headers},
                    )
                data = response.json()
                message = data["error"] if isinstance(data["error"], str) else data["error"]["message"]
                if response.status_code == 500:
                    reference = message.split("reference ")[1].split(";")[0]
                    assert any(reference in r.getMessage() for r in caplog.records), reference
                    message = message.replace(reference, "REF")
                kept = {k: v for k, v in response.headers.items() if k not in ("date", "content-length")}
                answers.append((response.status_code, kept, message))
            assert answers[0] == answers[1], (path, answers)
            assert answers[0][0] in (401, 413, 500), answers[0]


def test_observe_all_is_observe_one_by_one():
    from prometheus_client import CollectorRegistry, Histogram

    from wafer_gpt2.engine.metrics import DURATION_BUCKETS, observe_all

    values = [0.0005, 0.001, 0.0011, 0.3, 7.0, 500.0, 0.001]
    one, bulk = (Histogram(n, "h", buckets=DURATION_BUCKETS, registry=CollectorRegistry()) for n in "ab")
    for value in values:
        one.observe(value)
    observe_all(bulk, values)
    samples = [
        [(s.name[1:], s.labels, s.value) for s in h.collect()[0].samples if "created" not in s.name]
        for h in (one, bulk)
    ]
    assert samples[0][:-1] == samples[1][:-1]  # every bucket and the count
    assert samples[0][-1][2] == pytest.approx(samples[1][-1][2])  # the sum, up to the order of additions


def test_observe_all_repeated_is_observe_times():
    from prometheus_client import CollectorRegistry, Histogram

    from wafer_gpt2.engine.metrics import DURATION_BUCKETS, observe_all

    values, repeated = [0.0005, 0.3], [(0.001, 3), (7.0, 1), (0.3, 2)]
    one, bulk = (Histogram(n, "h", buckets=DURATION_BUCKETS, registry=CollectorRegistry()) for n in "ab")
    for value in values + [value for value, times in repeated for _ in range(times)]:
        one.observe(value)
    observe_all(bulk, values, repeated)
    samples = [
        [(s.name[1:], s.labels, s.value) for s in h.collect()[0].samples if "created" not in s.name]
        for h in (one, bulk)
    ]
    assert samples[0][:-1] == samples[1][:-1]  # every bucket and the count
    assert samples[0][-1][2] == pytest.approx(samples[1][-1][2])


def test_compact_json_is_json_dumps():
    from wafer_gpt2.service.delivery import compact_json

    for data in [
        {"a": [1, 2.5, None, True, "é\u2028\ud800"], "b": {"c": float("nan")}},
        [],
        "text",
        {"x": -0.0},
    ]:
        assert compact_json(data) == json.dumps(data, separators=(",", ":"))


def test_hand_formatted_frames_are_the_encoded_dicts():
    """The token frames formatted directly (tgi_token_frame, plain_chunk_frame) are byte for byte the
    dicts' SSE frames, whatever the text, logprob and flags."""
    from wafer_gpt2.service.delivery import sse
    from wafer_gpt2.service.openai_completions import chunk_head, plain_chunk, plain_chunk_frame
    from wafer_gpt2.service.tgi import tgi_token_frame

    texts = ["", " hello", 'é\u2028"\\\n\t\x00', "\ud800", "<|endoftext|>"]
    for text in texts:
        for logprob in [-1.2345678, 0.0, -0.0, -1e-300, -5e-324, 1e22, float("nan"), float("-inf")]:
            for special in (True, False):
                for top in ((), (Alternative(5, -2.0),)):
                    event = TokenEvent(3, GeneratedToken(42, text, text, logprob, special, top))
                    assert tgi_token_frame(event, {50256: "x"}) == sse(tgi_token_event(event, {50256: "x"}))
    for completion_id, created, model in [("cmpl-abc", 1795766152, "gpt2"), ("cmpl-é", 0, 'we"ird\u2028')]:
        head = chunk_head(completion_id, created, model)
        for text in texts:
            for finish in [None, "length", "stop"]:
                for index in (0, 3):
                    expected = sse(plain_chunk(completion_id, created, model, index, text, finish, None))
                    assert plain_chunk_frame(head, index, text, finish) == expected
