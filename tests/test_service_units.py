"""The service's parts on their own: detokenizer, KV slots, scheduler, metrics, request checks."""

from __future__ import annotations

import asyncio
import dataclasses
import re

import pytest

from wafer_gpt2.engine.detokenizer import IncrementalDetokenizer
from wafer_gpt2.engine.failures import Overloaded, RequestValidationFailed
from wafer_gpt2.engine.kv_slots import KVSlotManager, SlotError
from wafer_gpt2.engine.metrics import ServiceMetrics
from wafer_gpt2.engine.request import GenerationRequest, RequestState, loop_sink
from wafer_gpt2.engine.sampling import Sampler, SamplingParams
from wafer_gpt2.engine.scheduler import Scheduler
from wafer_gpt2.model import tokenizer
from wafer_gpt2.service.validation import CHAT_FIELDS, OPENAI_FIELDS, TGI_FIELDS, Limits, check_request

# ----- detokenizer ---------------------------------------------------------------------------------


def stream(text: str, stops=()) -> tuple[list[str], IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(tokenizer.token_bytes, stops)
    released = []
    for token in tokenizer.encode(text):
        piece = detok.add(token)
        released.append(piece.released)
        if piece.stop_sequence:
            return released, detok
    released.append(detok.flush())
    return released, detok


def test_multibyte_character_split_across_tokens_is_held_until_complete():
    # "🙂" is two tokens, b"\xf0\x9f" and b"\x99\x82": nothing may be released after the first.
    released, detok = stream("🙂 ok")
    assert released == ["", "🙂", " ok", ""]
    assert detok.text == "🙂 ok"
    chinese, _ = stream("你好世界")  # eight tokens, each character split in two
    assert all("\ufffd" not in piece for piece in chinese)
    assert "".join(chinese) == "你好世界"


@pytest.mark.parametrize("token_text", [None, tokenizer.token_text], ids=["decoder", "whole-token-table"])
def test_every_piece_is_what_the_utf8_decoder_gives_and_all_of_it_is_released(token_text):
    """Token by token, whatever the mix (split characters, bytes that can never be valid, a whole token
    right after an unfinished character): each piece is what the UTF-8 decoder gives for the token,
    and what is released adds up to the text (a piece goes out whole when nothing was held back). With
    the table of whole tokens' texts (the engine's), a whole token skips the decoder only while the
    decoder holds no bytes."""
    import codecs
    import random

    split = tokenizer.encode("🙂你好")  # characters split across tokens
    never_valid = [token for token in range(256) if tokenizer.token_bytes(token) in (b"\xff", b"\x80")]
    pool = tokenizer.encode("plain text, naïve café ") + split + never_valid
    rng = random.Random(5)
    for _ in range(200):
        tokens = [rng.choice(pool) for _ in range(rng.randrange(1, 12))]
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        detok = IncrementalDetokenizer(tokenizer.token_bytes, token_text=token_text)
        released = []
        for token in tokens:
            piece = detok.add(token)
            assert piece.text == decoder.decode(tokenizer.token_bytes(token)), tokens
            released.append(piece.released)
        assert "".join(released) + detok.flush() == detok.text


@pytest.mark.parametrize("token_text", [None, tokenizer.token_text], ids=["decoder", "whole-token-table"])
def test_adding_tokens_all_at_once_gives_each_the_text_it_gets_one_at_a_time(token_text):
    """`add_all` (a request whose text is made when it ends) against `add`, token by token, on the same
    mixes as above, in one call or two (the decoder may hold an unfinished character between them)."""
    import random

    pool = tokenizer.encode("plain text, naïve café 🙂你好") + [t for t in range(256) if t % 37 == 0]
    rng = random.Random(7)
    for _ in range(200):
        tokens = [rng.choice(pool) for _ in range(rng.randrange(1, 12))]
        one = IncrementalDetokenizer(tokenizer.token_bytes, token_text=token_text)
        expected = [one.add(token).text for token in tokens]
        cut = rng.randrange(len(tokens) + 1)
        both = IncrementalDetokenizer(tokenizer.token_bytes, token_text=token_text)
        assert both.add_all(tokens[:cut]) + both.add_all(tokens[cut:]) == expected, tokens
        assert both.text == one.text and both.flush() == one.flush() == ""
    with pytest.raises(RuntimeError, match="one at a time"):
        IncrementalDetokenizer(tokenizer.token_bytes, ["END"]).add_all([1])


@pytest.mark.parametrize("token_text", [None, tokenizer.token_text], ids=["decoder", "whole-token-table"])
def test_adding_a_token_without_stop_sequences_gives_the_text_add_gives_and_releases(token_text):
    """`add_unstopped` (a streamed plain request's token) against `add`: the same text, all released."""
    import random

    pool = tokenizer.encode("plain text, naïve café 🙂你好") + [t for t in range(256) if t % 37 == 0]
    rng = random.Random(11)
    for _ in range(200):
        tokens = [rng.choice(pool) for _ in range(rng.randrange(1, 12))]
        one = IncrementalDetokenizer(tokenizer.token_bytes, token_text=token_text)
        other = IncrementalDetokenizer(tokenizer.token_bytes, token_text=token_text)
        for token in tokens:
            added = one.add(token)
            assert other.add_unstopped(token) == added.text == added.released, tokens
        assert other.text == one.text and other.flush() == one.flush() == ""
    with pytest.raises(RuntimeError, match="by `add`"):
        IncrementalDetokenizer(tokenizer.token_bytes, ["END"]).add_unstopped(1)


def test_unfinished_character_at_the_end_is_dropped_not_sent_broken():
    detok = IncrementalDetokenizer(tokenizer.token_bytes)
    assert detok.add(tokenizer.encode("🙂")[0]).released == ""
    assert detok.flush() == ""
    assert detok.text == ""


def test_stop_sequence_ending_inside_a_token_is_cut_and_never_released():
    # " END" is one token; the stop "EN" ends inside it.
    released, detok = stream("the END of it", stops=["EN"])
    assert "".join(released) == "the "
    assert detok.text == "the "
    assert detok.stop_sequence == "EN"


def test_stop_sequence_spanning_tokens_is_held_back_then_dropped():
    released, detok = stream(" hello\n\nworld", stops=["\n\n"])
    assert released == [" hello", "", ""]  # the first "\n" is held: it may begin the stop
    assert detok.text == " hello"


def test_text_that_only_looks_like_a_stop_prefix_is_released_later():
    released, detok = stream("the END of it", stops=["END!"])
    assert released[1] == " "  # " END" could begin "END!": "END" is held
    assert "".join(released) == "the END of it"
    assert detok.stop_sequence is None


def test_earliest_stop_wins():
    _, detok = stream("the END of it", stops=["of", "END"])
    assert detok.text == "the " and detok.stop_sequence == "END"


# ----- KV slots ------------------------------------------------------------------------------------


def test_slots_allocate_free_and_report_usage():
    slots = KVSlotManager(num_slots=2, context_length=100)
    a = slots.allocate("a", 30)
    b = slots.allocate("b", 50)
    assert {a, b} == {0, 1}
    assert slots.allocate("c", 10) is None
    usage = slots.usage()
    assert (usage.slots_used, usage.tokens_reserved, usage.tokens_capacity, usage.fraction) == (
        2,
        80,
        200,
        1.0,
    )
    slots.free(a)
    assert slots.usage().slots_used == 1
    with pytest.raises(SlotError, match="slot 0 is not held"):
        slots.free(a)
    with pytest.raises(SlotError, match="needs 101 positions; a slot holds 100"):
        slots.allocate("d", 101)
    assert slots.free_all() == [b]
    assert slots.usage().slots_used == 0


# ----- scheduler -----------------------------------------------------------------------------------


LOOP = asyncio.new_event_loop()  # a RequestState's events go to a loop's sink; none runs in these tests


@pytest.fixture(scope="module", autouse=True)
def close_loop():
    yield
    LOOP.close()


def make_sequence(prompt_len: int, max_new: int = 4, prompt_logprobs: bool = False) -> RequestState:
    request = GenerationRequest(
        prompt_ids=tuple(range(100, 100 + prompt_len)),
        max_new_tokens=max_new,
        prompt_logprobs=prompt_logprobs,
    )
    return RequestState(
        request=request,
        detokenizer=IncrementalDetokenizer(tokenizer.token_bytes),
        sampler=Sampler(SamplingParams()),
        sink=loop_sink(LOOP),
    )


def test_step_carries_decodes_first_and_chunks_prefill_to_the_budget():
    scheduler = Scheduler(KVSlotManager(3, 64), max_queue=1, step_token_budget=8)
    running = make_sequence(3)
    scheduler.add(running)
    scheduler.admit()
    running.computed, running.pending_token = 3, 7  # prefilled, with a sampled token to feed

    long_prompt = make_sequence(20, prompt_logprobs=True)
    scheduler.add(long_prompt)
    assert scheduler.admit() == [long_prompt]
    plan = scheduler.build_step()

    items = plan.inputs.items()
    assert items[0].slot == running.slot and items[0].position == 3 and items[0].token == 7
    prefill = items[1:]
    assert len(prefill) == 7  # the budget of 8 minus the decode
    assert [item.position for item in prefill] == list(range(7))
    assert all(item.target == long_prompt.prompt[item.position + 1] for item in prefill)
    assert plan.owners == [running] + [long_prompt] * 7


def test_only_the_last_prompt_token_wants_scores_without_prompt_logprobs():
    scheduler = Scheduler(KVSlotManager(1, 64), max_queue=0, step_token_budget=64)
    sequence = make_sequence(5)
    scheduler.add(sequence)
    scheduler.admit()
    plan = scheduler.build_step()
    assert [item.want_scores for item in plan.inputs.items()] == [False] * 4 + [True]
    assert all(item.target is None for item in plan.inputs.items())


def test_queue_is_bounded_and_refuses_at_once():
    scheduler = Scheduler(KVSlotManager(1, 64), max_queue=1, step_token_budget=8)
    scheduler.add(make_sequence(2))
    scheduler.add(make_sequence(2))
    with pytest.raises(Overloaded, match="queue limit 1"):
        scheduler.add(make_sequence(2))


def test_remove_releases_the_slot_in_every_state():
    scheduler = Scheduler(KVSlotManager(1, 64), max_queue=2, step_token_budget=8)
    first, second = make_sequence(2), make_sequence(2)
    scheduler.add(first)
    scheduler.add(second)
    scheduler.admit()
    assert scheduler.remove(second) is None  # still waiting: no slot
    assert scheduler.remove(first) == 0
    assert scheduler.slots.usage().slots_used == 0 and not scheduler.has_work()


# ----- request checks ------------------------------------------------------------------------------

LIMITS = Limits(
    context_length=64,
    max_input_tokens=63,
    max_input_chars=63 * 66,
    max_truncated_input_chars=1_000_000,
    max_new_tokens=63,
    max_stop_sequences=4,
    max_stop_length=20,
    top_k=16,
    max_top_n_tokens=5,
    max_logprobs=16,  # the server's 20, cut to the wafer's 16 candidates
    vocab_size=50257,
)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"prompt_ids": ()}, "`inputs` must contain at least one token"),
        ({"prompt_ids": (1,) * 64}, "`inputs` must have at most 63 tokens, given 64"),
        ({"max_new_tokens": 64}, "`max_new_tokens` must be between 1 and 63, given 64"),
        ({"prompt_ids": (1,) * 40, "max_new_tokens": 30}, "`inputs` tokens + `max_new_tokens` must be <= 64"),
        ({"stop_sequences": ("a", "b", "c", "d", "e")}, "at most 4 stop sequences, given 5"),
        ({"sampling": SamplingParams(top_k=17)}, "`top_k` must be <= 16"),
        ({"top_n_tokens": 6}, "`top_n_tokens` must be <= 5, given 6"),
        ({"prompt_ids": (50257,)}, "token id 50257 is outside 0..50256"),
    ],
)
def test_check_request_names_the_limit(changes, message):
    request = GenerationRequest(**{"prompt_ids": (1, 2), "max_new_tokens": 4, **changes})
    with pytest.raises(RequestValidationFailed, match=re.escape(message)):
        check_request(request, LIMITS, TGI_FIELDS)


@pytest.mark.parametrize(
    ("names", "changes", "field"),
    [
        (OPENAI_FIELDS, {"top_n_tokens": 17}, "logprobs"),
        (OPENAI_FIELDS, {"top_n_tokens": 2, "prompt_top_n": 17}, "prompt_logprobs"),
        (CHAT_FIELDS, {"top_n_tokens": 17}, "top_logprobs"),
        (CHAT_FIELDS, {"prompt_top_n": 17}, "prompt_logprobs"),
    ],
)
def test_logprobs_are_bounded_by_the_wafers_candidates(names, changes, field):
    check_request(GenerationRequest(prompt_ids=(1,), max_new_tokens=1, top_n_tokens=16), LIMITS, names)
    request = GenerationRequest(**{"prompt_ids": (1,), "max_new_tokens": 1, **changes})
    with pytest.raises(RequestValidationFailed) as refused:
        check_request(request, LIMITS, names)
    assert refused.value.param == field
    assert refused.value.message.startswith(
        f"`{field}` must be between 0 and 16 (the server's --max-logprobs"
    )
    assert "16 candidates the wafer returns per token), given 17" in refused.value.message


def test_serve_takes_max_logprobs():
    from wafer_gpt2.cli.main import build_parser
    from wafer_gpt2.cli.serve_command import settings_from_args
    from wafer_gpt2.errors import UserError

    parser = build_parser()
    assert settings_from_args(parser.parse_args(["serve"]), "m").max_logprobs == 20  # vLLM's default
    assert settings_from_args(parser.parse_args(["serve", "--max-logprobs", "8"]), "m").max_logprobs == 8
    with pytest.raises(UserError, match="--max-logprobs must be at least 0"):
        settings_from_args(parser.parse_args(["serve", "--max-logprobs", "-1"]), "m")


def test_openai_routes_refuse_requests_over_the_context_in_vllms_words():
    request = GenerationRequest(prompt_ids=(1,) * 60, max_new_tokens=10)
    with pytest.raises(RequestValidationFailed) as refused:
        check_request(request, LIMITS, OPENAI_FIELDS)
    assert refused.value.param == "max_tokens" and refused.value.message == (
        "'max_tokens' or 'max_completion_tokens' is too large: 10. This model's maximum context length is 64 "
        "tokens and your request has 60 input tokens (10 > 64 - 60)."
    )
    with pytest.raises(RequestValidationFailed) as refused:
        check_request(GenerationRequest(prompt_ids=(1,) * 64, max_new_tokens=1), LIMITS, CHAT_FIELDS)
    assert refused.value.param == "messages" and refused.value.message == (
        "This model's maximum context length is 64 tokens. However, your request has 64 input tokens. "
        "Please reduce the length of the input messages."
    )
    # A --max-input-tokens below the context is named beside it.
    lower = dataclasses.replace(LIMITS, max_input_tokens=32)
    with pytest.raises(RequestValidationFailed) as refused:
        check_request(GenerationRequest(prompt_ids=(1,) * 40, max_new_tokens=1), lower, OPENAI_FIELDS)
    assert refused.value.message.startswith(
        "This model's maximum context length is 64 tokens and this server takes at most 32 input tokens. "
        "However, your request has 40 input tokens."
    )


# ----- metrics -------------------------------------------------------------------------------------


def test_figures_folded_in_bulk_render_as_one_by_one():
    """Arrivals, successes and steps reach prometheus-client in bulk (at FOLD_EVERY and at every
    render): what renders equals recording each figure alone, also while a fold is pending."""
    from wafer_gpt2.engine.metrics import FOLD_EVERY

    def record_alone(metrics: ServiceMetrics, i: int) -> None:
        metrics.tgi_request_count.inc()
        metrics.tgi_request_input_length.observe(i % 40)
        metrics._child(metrics.vllm_prompt_tokens_total).inc(i % 40)
        total, tokens = 0.01 * (i % 7) + 0.3 * (i % 3), i % 5
        metrics.tgi_request_success.inc()
        for h, v in [
            (metrics.tgi_request_duration, total),
            (metrics.tgi_request_queue_duration, 0.01 * (i % 7)),
            (metrics.tgi_request_inference_duration, 0.3 * (i % 3)),
            (metrics.tgi_request_generated_tokens, tokens),
            (metrics._child(metrics.vllm_e2e_request_latency_seconds), total),
            (metrics.tgi_batch_forward_duration, 0.002 * (i % 9)),
            (metrics.tgi_batch_next_size, i % 17),
        ]:
            h.observe(v)
        if tokens:
            metrics.tgi_request_mean_time_per_token_duration.observe(0.3 * (i % 3) / tokens)
        metrics._child(metrics.vllm_request_success_total, "length" if i % 2 else "stop").inc()

    folded, alone = ServiceMetrics("gpt2"), ServiceMetrics("gpt2")
    for count in (FOLD_EVERY + 3, 5):  # one fold on the way, the rest at render
        for i in range(count):
            folded.record_arrival(i % 40)
            folded.record_success("length" if i % 2 else "stop", 0.01 * (i % 7), 0.3 * (i % 3), i % 5)
            folded.record_step(0.002 * (i % 9), i % 17)
            record_alone(alone, i)
        # rel: the sums, added in another order
        assert rendered_values(folded) == pytest.approx(rendered_values(alone), rel=1e-12)


def rendered_values(metrics: ServiceMetrics) -> dict[str, float]:
    lines = [line.rsplit(" ", 1) for line in metrics.render().splitlines() if not line.startswith("#")]
    return {sample: float(value) for sample, value in lines}


def test_metrics_exposition_format():
    metrics = ServiceMetrics("gpt2")
    metrics.record_arrival(12)
    metrics.record_step_tokens(1, first=[0.02], later=[])
    metrics.record_success("length", queue_s=0.01, inference_s=0.2, generated_tokens=4)
    metrics.record_failure("overloaded")
    text = metrics.render()
    assert "# TYPE tgi_request_failure counter" in text
    assert 'tgi_request_failure{err="overloaded"} 1' in text
    assert 'vllm:request_success_total{model_name="gpt2",finished_reason="length"} 1' in text
    assert 'vllm:time_to_first_token_seconds_bucket{model_name="gpt2",le="0.025"} 1' in text
    assert 'vllm:time_to_first_token_seconds_count{model_name="gpt2"} 1' in text
    assert "tgi_request_input_length_sum 12" in text
    # Every sample line is `name{labels} value` with a valid metric name.
    for line in text.splitlines():
        if not line.startswith("#"):
            assert re.fullmatch(r"[a-zA-Z_:][a-zA-Z0-9_:]*(\{[^}]*\})? [-+0-9.eInf]+", line), line
