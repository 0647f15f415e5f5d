"""Every route over real HTTP against a real uvicorn server (reference backend, tiny random GPT-2)."""

from __future__ import annotations

import functools
import json
import random
import re
import socket
import struct
import time

import httpx
import numpy as np
import pytest
from service_harness import (
    always_end_of_text,
    backend_factory,
    reference_greedy,
    run_concurrently,
    running_server,
    slow_backend,
    sse_events,
    wait_until,
)

from wafer_gpt2.model import tokenizer
from wafer_gpt2.settings import ServerSettings

SLOTS = 4
PROMPT = "The wafer holds every layer"


# Every route twice: the engine on a thread of the server's process, and in a process of its own
# (`serve --engine-process`), where what a client receives must be the same.
@pytest.fixture(scope="module", params=[False, True], ids=["engine-thread", "engine-process"])
def server(small_params, request):
    settings = ServerSettings(
        backend="reference",
        model_id="tiny-gpt2",
        max_concurrent_requests=SLOTS,
        max_queue=8,
        step_token_budget=16,
        engine_process=request.param,
    )
    with running_server(settings, backend_factory("reference", small_params, slots=SLOTS)) as running:
        yield running


@pytest.fixture
def client(server):
    with server.client() as c:
        yield c
    server.wait_idle()  # every test leaves the engine empty: no leaked slot


# ----- health, info, models, metrics ---------------------------------------------------------------


def test_health_info_models_and_metrics(client):
    assert client.get("/health").status_code == 200
    info = client.get("/info").json()
    assert info["model_id"] == "tiny-gpt2"
    assert info["backend"] == "reference"
    assert info["max_concurrent_requests"] == SLOTS and info["kv_slots"] == SLOTS
    assert info["max_total_tokens"] == 128 and info["max_input_tokens"] == 127
    assert info["max_stop_sequences"] == 4 and info["top_k"] == 64
    assert info["engine"]["kv_usage"]["slots_total"] == SLOTS
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "tiny-gpt2"
    assert models["data"][0]["max_model_len"] == 128

    client.post("/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 3}})
    text = client.get("/metrics").text
    for name in (
        "tgi_queue_size",
        "tgi_batch_current_size",
        "tgi_request_duration_bucket",
        "tgi_request_generated_tokens_count",
        'vllm:kv_cache_usage_perc{model_name="tiny-gpt2"}',
        'vllm:num_requests_running{model_name="tiny-gpt2"}',
        'vllm:num_requests_waiting{model_name="tiny-gpt2"}',
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:e2e_request_latency_seconds_count",
        'vllm:request_success_total{model_name="tiny-gpt2",finished_reason="length"}',
        "wafer_kv_slots_total 4",
    ):
        assert name in text, name


# ----- TGI -----------------------------------------------------------------------------------------


def test_generate_matches_the_reference_forward_pass(client, small_params):
    prompt = tokenizer.encode(PROMPT)
    expected_tokens, expected_logprobs, expected_prompt_logprobs = reference_greedy(small_params, prompt, 8)
    body = {
        "inputs": PROMPT,
        "parameters": {"max_new_tokens": 8, "details": True, "decoder_input_details": True},
    }
    response = client.post("/generate", json=body)
    assert response.status_code == 200, response.text
    data = response.json()
    details = data["details"]
    assert [t["id"] for t in details["tokens"]] == expected_tokens
    np.testing.assert_allclose([t["logprob"] for t in details["tokens"]], expected_logprobs, rtol=1e-5)
    assert data["generated_text"] == tokenizer.decode(expected_tokens)
    assert details["finish_reason"] == "length" and details["generated_tokens"] == 8
    assert details["seed"] is None  # greedy
    assert [t["id"] for t in details["prefill"]] == prompt
    assert details["prefill"][0]["logprob"] is None
    np.testing.assert_allclose(
        [t["logprob"] for t in details["prefill"][1:]], expected_prompt_logprobs, rtol=1e-5
    )
    assert "".join(t["text"] for t in details["prefill"]) == PROMPT


def test_stream_carries_the_same_tokens_as_generate(client):
    body = {
        "inputs": PROMPT,
        "parameters": {"max_new_tokens": 6, "details": True, "seed": 7, "do_sample": True},
    }
    whole = client.post("/generate", json=body).json()
    with client.stream("POST", "/generate_stream", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = list(sse_events(response))
    assert [e["index"] for e in events] == [1, 2, 3, 4, 5, 6]
    assert [e["token"]["id"] for e in events] == [t["id"] for t in whole["details"]["tokens"]]
    assert all(e["generated_text"] is None and e["details"] is None for e in events[:-1])
    last = events[-1]
    assert last["generated_text"] == whole["generated_text"] == "".join(e["token"]["text"] for e in events)
    assert last["details"] == {
        "finish_reason": "length",
        "generated_tokens": 6,
        "seed": 7,
        "input_length": len(tokenizer.encode(PROMPT)),
    }


def test_compatibility_route_streams_or_not(client):
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 4}}
    plain = client.post("/", json=body)
    (answer,) = plain.json()  # TGI's `/` answers a one-element array
    assert plain.status_code == 200 and "details" not in answer
    with client.stream("POST", "/", json={**body, "stream": True}) as response:
        events = list(sse_events(response))
    assert events[-1]["generated_text"] == answer["generated_text"]


def test_stop_sequence_is_kept_in_the_text_as_tgi_keeps_it(server, client):
    from huggingface_hub import InferenceClient

    base = client.post(
        "/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 12, "details": True}}
    ).json()
    texts = [t["text"] for t in base["details"]["tokens"]]
    whole = base["generated_text"]
    # A stop made of whole tokens 3 and 4 (TGI's case: the text ends with it), and one that begins in a
    # token and ends inside the next (cut where it ends; the tokens of this model have >= 2 chars).
    k = next(i for i in range(2, 10) if len(texts[i]) >= 2 and len(texts[i + 1]) >= 2)
    for stop in (texts[k] + texts[k + 1], texts[k][-1] + texts[k + 1][:-1]):
        expected = whole[: whole.index(stop) + len(stop)]
        params = {"max_new_tokens": 12, "stop": [stop], "details": True}
        data = client.post("/generate", json={"inputs": PROMPT, "parameters": params}).json()
        assert data["generated_text"] == expected and expected.endswith(stop)
        assert data["details"]["finish_reason"] == "stop_sequence"
        body = {"inputs": PROMPT, "parameters": params}
        with client.stream("POST", "/generate_stream", json=body) as response:
            events = list(sse_events(response))
        assert "".join(e["token"]["text"] for e in events) == expected
        assert events[-1]["generated_text"] == expected
        assert events[-1]["details"]["finish_reason"] == "stop_sequence"
        hf = InferenceClient(base_url=server.url)
        assert hf.text_generation(PROMPT, max_new_tokens=12, stop=[stop]) == expected
        streamed = hf.text_generation(PROMPT, max_new_tokens=12, stop=[stop], stream=True)
        assert "".join(streamed) == expected
    # The OpenAI routes cut it, as vLLM does (unless include_stop_str_in_output).
    stop = texts[k] + texts[k + 1]
    openai = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "stop": [stop]}
    cut = client.post("/v1/completions", json=openai).json()["choices"][0]["text"]
    assert cut == whole[: whole.index(stop)]


def test_full_text_truncate_and_top_tokens(client):
    params = {"max_new_tokens": 3, "return_full_text": True, "details": True, "top_n_tokens": 3}
    data = client.post("/generate", json={"inputs": PROMPT, "parameters": params}).json()
    assert data["generated_text"].startswith(PROMPT)
    for token, top in zip(data["details"]["tokens"], data["details"]["top_tokens"], strict=True):
        assert len(top) == 3 and top[0]["id"] == token["id"]  # greedy: the best candidate
        assert top[0]["logprob"] >= top[1]["logprob"] >= top[2]["logprob"]
    truncated = {"max_new_tokens": 2, "truncate": 2, "details": True, "decoder_input_details": True}
    data = client.post("/generate", json={"inputs": PROMPT, "parameters": truncated}).json()
    assert [t["id"] for t in data["details"]["prefill"]] == tokenizer.encode(PROMPT)[-2:]


@pytest.mark.parametrize(
    "body, message",
    [
        ({"inputs": "", "parameters": {}}, "inputs: cannot be empty"),
        ({"inputs": 42}, "inputs: must be a string, got a number"),
        ({"parameters": {}}, "inputs: Field required"),
        ({"inputs": "x " * 200}, "`inputs` must have at most 127 tokens, given 2"),
        (
            {"inputs": "hi", "parameters": {"max_new_tokens": 0}},
            "parameters.max_new_tokens: must be strictly positive",
        ),
        (
            {"inputs": "hi", "parameters": {"max_new_tokens": 500}},
            "`max_new_tokens` must be between 1 and 127, given 500",
        ),
        (
            {"inputs": "x " * 100, "parameters": {"max_new_tokens": 50}},
            "`inputs` tokens + `max_new_tokens` must be <= 128",
        ),
        (
            {"inputs": "hi", "parameters": {"temperature": 0}},
            "parameters.temperature: must be strictly positive, got 0",
        ),
        (
            {"inputs": "hi", "parameters": {"top_p": 1.0}},
            "parameters.top_p: must be > 0.0 and < 1.0, got 1.0",
        ),
        ({"inputs": "hi", "parameters": {"top_p": 0}}, "parameters.top_p: must be > 0.0 and < 1.0"),
        ({"inputs": "hi", "parameters": {"top_k": 65}}, "`top_k` must be <= 64"),
        (
            {"inputs": "hi", "parameters": {"stop": ["a", "b", "c", "d", "e"]}},
            "at most 4 stop sequences, given 5",
        ),
        (
            {"inputs": "hi", "parameters": {"typical_p": 0.5}},
            "parameters.typical_p: only 1.0 (off) is supported",
        ),
    ],
)
def test_tgi_validation_errors_name_the_problem(client, body, message):
    for route in ("/generate", "/generate_stream"):
        response = client.post(route, json=body)
        assert response.status_code == 422, response.text
        data = response.json()
        assert data["error_type"] == "validation"
        assert message in data["error"], data["error"]


def test_bad_json_and_oversized_body(client, server):
    response = client.post("/generate", content=b"{not json", headers={"content-type": "application/json"})
    assert response.status_code == 422 and "not valid JSON" in response.json()["error"]
    limit = server.server.config.app.state.settings.max_body_bytes
    response = client.post("/generate", json={"inputs": "x" * (limit + 10)})
    assert response.status_code == 413
    assert f"the limit is {limit} bytes" in response.json()["error"]
    response = client.post("/v1/completions", json={"prompt": "x" * (limit + 10)})
    assert response.status_code == 413 and "limit" in response.json()["error"]["message"]


# ----- OpenAI --------------------------------------------------------------------------------------


def test_completions_with_usage_echo_and_logprobs(client):
    body = {
        "model": "tiny-gpt2",
        "prompt": PROMPT,
        "max_tokens": 5,
        "temperature": 0,
        "logprobs": 2,
        "echo": True,
    }
    data = client.post("/v1/completions", json=body).json()
    assert data["object"] == "text_completion" and data["id"].startswith("cmpl-")
    assert data["model"] == "tiny-gpt2"
    n_prompt = len(tokenizer.encode(PROMPT))
    assert data["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": 5, "total_tokens": n_prompt + 5}
    choice = data["choices"][0]
    assert choice["finish_reason"] == "length"
    tgi = client.post(
        "/generate",
        json={
            "inputs": PROMPT,
            "parameters": {"max_new_tokens": 5, "details": True, "decoder_input_details": True},
        },
    ).json()
    assert choice["text"] == PROMPT + tgi["generated_text"]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == n_prompt + 5
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    expected = [t["logprob"] for t in tgi["details"]["prefill"][1:]] + [
        t["logprob"] for t in tgi["details"]["tokens"]
    ]
    np.testing.assert_allclose(lp["token_logprobs"][1:], expected, rtol=1e-6)
    assert lp["text_offset"][:2] == [0, len(tokenizer.decode(tokenizer.encode(PROMPT)[:1]))]
    assert all(len(top) >= 2 for top in lp["top_logprobs"][1:])


def test_completions_stream_ends_with_done_and_usage(client):
    body = {"prompt": [PROMPT, "Hello"], "max_tokens": 4, "n": 2, "seed": 3, "stream": True}
    body["stream_options"] = {"include_usage": True}
    with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        events = list(sse_events(response))
    assert events[-1] == "[DONE]"
    usage = events[-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 16
    assert usage["usage"]["prompt_tokens"] == len(tokenizer.encode(PROMPT)) + len(tokenizer.encode("Hello"))
    texts = {i: "" for i in range(4)}
    finished = set()
    for event in events[:-2]:
        (choice,) = event["choices"]
        texts[choice["index"]] += choice["text"]
        if choice["finish_reason"]:
            finished.add(choice["index"])
    assert finished == {0, 1, 2, 3}
    # Not streamed: the same texts (each choice has its own seed: seed + index).
    whole = client.post("/v1/completions", json={**body, "stream": False, "stream_options": None}).json()
    assert [c["text"] for c in whole["choices"]] == [texts[i] for i in range(4)]


@pytest.mark.parametrize(
    "body, status, param, message",
    [
        ({"prompt": ""}, 400, "prompt", "prompt: cannot be empty"),
        ({"prompt": 5}, 400, "prompt", "must be a non-empty string, a list of strings"),
        ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens", "must be at least 1"),
        (
            {"prompt": "hi", "max_tokens": 200},
            400,
            "max_tokens",
            "'max_tokens' or 'max_completion_tokens' is too large: 200. This model's maximum context length is "
            "128 tokens and your request has 1 input tokens (200 > 128 - 1).",
        ),
        (
            {"prompt": [11] * 128},
            400,
            "prompt",
            "This model's maximum context length is 128 tokens. However, your request has 128 input tokens. "
            "Please reduce the length of the input messages.",
        ),
        ({"prompt": "hi", "temperature": -1}, 400, "temperature", "between 0 and 2"),
        ({"prompt": "hi", "top_p": 1.5}, 400, "top_p", "must be > 0 and <= 1"),
        (
            {"prompt": "hi", "stop": ["x" * 200] * 21},
            400,
            "stop",
            "at most 4000 characters in all, given 4200",
        ),
        ({"prompt": "hi", "n": 9}, 400, "n", "`n` x number of prompts must be <= 8"),
        ({"prompt": [50257]}, 400, "prompt", "token id 50257 is outside"),
        ({"prompt": "hi", "model": "gpt-4"}, 404, "model", "the model `gpt-4` does not exist"),
    ],
)
def test_openai_errors_in_openai_schema(client, body, status, param, message):
    response = client.post("/v1/completions", json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert message in error["message"], error
    assert error["param"] == param
    assert error["type"] in ("invalid_request_error", "not_found_error")


# ----- batching and determinism --------------------------------------------------------------------


def test_seeded_request_is_identical_alone_and_in_a_busy_batch(server, client):
    seeded = {
        "inputs": PROMPT,
        "parameters": {
            "max_new_tokens": 16,
            "seed": 1234,
            "temperature": 0.9,
            "top_p": 0.95,
            "details": True,
        },
    }
    alone = client.post("/generate", json=seeded).json()
    openai_body = {"prompt": PROMPT, "max_tokens": 16, "seed": 99, "temperature": 1.2}
    openai_alone = client.post("/v1/completions", json=openai_body).json()["choices"][0]["text"]
    steps_before = server.engine.steps

    def other(i):
        body = {
            "inputs": f"Request number {i} " * (1 + i % 3),
            "parameters": {"max_new_tokens": 10 + 3 * i, "do_sample": True},
        }
        return lambda: httpx.post(server.url + "/generate", json=body, timeout=60).status_code

    calls = [other(i) for i in range(6)]
    calls.insert(2, lambda: httpx.post(server.url + "/generate", json=seeded, timeout=60).json())
    calls.insert(5, lambda: httpx.post(server.url + "/v1/completions", json=openai_body, timeout=60).json())
    results = run_concurrently(calls)
    busy, openai_busy = results[2], results[5]["choices"][0]["text"]
    assert [r for i, r in enumerate(results) if i not in (2, 5)] == [200] * 6
    assert [t["id"] for t in busy["details"]["tokens"]] == [t["id"] for t in alone["details"]["tokens"]]
    assert busy["generated_text"] == alone["generated_text"]
    assert openai_busy == openai_alone
    # The batch really was shared: fewer steps than tokens generated (one by one needs more than one each).
    generated = 16 + 16 + sum(10 + 3 * i for i in range(6))
    assert server.engine.steps - steps_before < generated


def test_new_requests_join_a_running_batch(server, client):
    """A short request sent while a long one runs finishes first: it joined at a step boundary. The
    short one is sent once the long one is decoding (its first token has arrived), so the order does
    not depend on how fast this machine tokenizes or schedules threads."""
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 120}}
    with client.stream("POST", "/generate_stream", json=body) as response:
        events = sse_events(response)
        next(events)  # the long request is decoding
        short = httpx.post(
            server.url + "/generate",
            json={"inputs": PROMPT, "parameters": {"max_new_tokens": 2}},
            timeout=60,
        )
        assert short.status_code == 200, short.text
        long_still_running = server.engine.kv_usage().slots_used == 1
        list(events)
    assert long_still_running


# ----- cancellation --------------------------------------------------------------------------------


def cancel_latencies(client) -> tuple[dict[str, float], float]:
    """wafer_cancel_latency_steps: cumulative bucket counts by `le`, and the total count."""
    text = client.get("/metrics").text
    buckets = {
        le: float(v) for le, v in re.findall(r'wafer_cancel_latency_steps_bucket\{le="([^"]+)"\} (\S+)', text)
    }
    count = re.search(r"wafer_cancel_latency_steps_count (\S+)", text)
    return buckets, float(count[1]) if count else 0.0


def test_client_disconnect_mid_stream_frees_the_slot_within_one_step(server, client):
    _, before = cancel_latencies(client)
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 120}}
    with client.stream("POST", "/generate_stream", json=body) as response:
        for i, _ in enumerate(sse_events(response)):
            if i == 2:
                assert server.engine.kv_usage().slots_used == 1
                break  # leaving the block closes the connection mid-stream
    server.wait_idle(timeout=5)
    buckets, count = cancel_latencies(client)
    assert count == before + 1
    assert buckets["1"] == count  # every cancellation freed its slot within one step
    failures = client.get("/metrics").text
    assert 'tgi_request_failure{err="cancelled"}' in failures


def test_many_random_disconnects_leave_no_slot_held(server, client):
    rng = random.Random(5)

    def stream_and_leave(events_to_read: int, route: str):
        def call():
            with httpx.Client(base_url=server.url, timeout=60) as c:
                if route == "/v1/completions":
                    body = {"prompt": PROMPT, "max_tokens": 100, "stream": True}
                else:
                    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 100}}
                with c.stream("POST", route, json=body) as response:
                    for i, _ in enumerate(sse_events(response)):
                        if i >= events_to_read:
                            return

        return call

    calls = [
        stream_and_leave(rng.randint(0, 6), rng.choice(["/generate_stream", "/v1/completions"]))
        for _ in range(12)
    ]
    run_concurrently(calls)
    server.wait_idle(timeout=10)
    info = client.get("/info").json()["engine"]["kv_usage"]
    assert info["slots_used"] == 0 and info["tokens_reserved"] == 0
    assert 'vllm:kv_cache_usage_perc{model_name="tiny-gpt2"} 0' in client.get("/metrics").text


@pytest.mark.parametrize("padding", [0, 100_000], ids=["small-body", "body-over-uvicorn-buffer"])
def test_disconnect_during_a_non_streaming_request_cancels_it(server, client, padding):
    """The request is cancelled (not left to run to its end): the server's disconnect callback reaches
    the handler that waits for the final event. The client resets the connection: a plain close looks
    like a half-close (shutdown(SHUT_WR)) to the server, which then writes the response. A body larger
    than uvicorn's read buffer (64 KiB), arriving after the headers, leaves reading paused unless the
    handler's watch resumes it, as ASGI `receive` does."""
    _, before = cancel_latencies(client)
    body = json.dumps({"inputs": PROMPT, "parameters": {"max_new_tokens": 120}}).encode() + b" " * padding
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(
            b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
        )
        time.sleep(0.2)  # the handler starts reading before the body comes
        sock.sendall(body)
        wait_until(lambda: server.engine.kv_usage().slots_used == 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close: RST
    server.wait_idle(timeout=5)
    _, count = cancel_latencies(client)
    assert count == before + 1


# ----- overload and authentication (servers of their own) ------------------------------------------


@pytest.mark.parametrize("engine_process", [False, True], ids=["engine-thread", "engine-process"])
def test_full_queue_answers_429_at_once(small_params, engine_process):
    settings = ServerSettings(
        backend="reference", max_concurrent_requests=1, max_queue=1, engine_process=engine_process
    )
    slow = functools.partial(slow_backend, backend_factory("reference", small_params, slots=1), 0.02)
    with running_server(settings, slow) as running, running.client() as c:
        body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 100}}
        with (
            c.stream("POST", "/generate_stream", json=body) as first,
            c.stream("POST", "/generate_stream", json=body) as second,
        ):
            assert first.status_code == second.status_code == 200  # one running, one queued
            wait_until(lambda: running.engine.queue_sizes() == (1, 1))
            started = time.monotonic()
            refused = c.post("/generate", json=body)
            assert time.monotonic() - started < 1.0
            assert refused.status_code == 429
            assert refused.json()["error_type"] == "overloaded"
            assert "queue limit 1" in refused.json()["error"]
            refused = c.post("/v1/completions", json={"prompt": PROMPT})
            assert refused.status_code == 429 and refused.json()["error"]["type"] == "overloaded_error"
            metrics = c.get("/metrics").text
            # The refusals are counted by the HTTP process, the two requests by the engine (with
            # --engine-process in another process; /metrics merges both).
            assert 'tgi_request_failure{err="overloaded"} 2' in metrics
            assert re.search(r"^tgi_request_count 2$", metrics, re.M), metrics
        running.wait_idle(timeout=10)


def test_api_key_guards_generation_routes(small_params):
    settings = ServerSettings(backend="reference", max_concurrent_requests=1, api_key="s3cret")
    with (
        running_server(settings, backend_factory("reference", small_params, slots=1)) as running,
        running.client() as c,
    ):
        body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 2}}
        assert c.get("/health").status_code == 200  # probes need no key
        missing = c.post("/generate", json=body)
        assert missing.status_code == 401 and missing.json()["error_type"] == "authentication"
        wrong = c.post("/v1/completions", json={"prompt": "hi"}, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
        ok = c.post("/generate", json=body, headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200


# ----- well-known clients --------------------------------------------------------------------------


def test_huggingface_inference_client(server, client):
    from huggingface_hub import InferenceClient
    from huggingface_hub.errors import ValidationError

    hf = InferenceClient(base_url=server.url)
    expected = client.post("/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 5}}).json()
    assert hf.text_generation(PROMPT, max_new_tokens=5) == expected["generated_text"]
    output = hf.text_generation(
        PROMPT, max_new_tokens=5, details=True, decoder_input_details=True, seed=3, do_sample=True
    )
    assert output.details.seed == 3 and output.details.generated_tokens == 5
    assert [t.id for t in output.details.prefill] == tokenizer.encode(PROMPT)
    assert "".join(hf.text_generation(PROMPT, max_new_tokens=5, stream=True)) == expected["generated_text"]
    events = list(hf.text_generation(PROMPT, max_new_tokens=5, stream=True, details=True))
    assert events[-1].generated_text == expected["generated_text"]
    assert events[-1].details.finish_reason == "length"
    with pytest.raises(ValidationError, match="must be strictly positive"):
        hf.text_generation(PROMPT, max_new_tokens=5, temperature=0.0)


def test_openai_client(server, client):
    import openai

    oa = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    completion = oa.completions.create(
        model="tiny-gpt2", prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2
    )
    expected = client.post("/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 5}}).json()
    assert completion.choices[0].text == expected["generated_text"]
    assert completion.usage.completion_tokens == 5
    assert len(completion.choices[0].logprobs.token_logprobs) == 5
    chunks = list(
        oa.completions.create(
            model="tiny-gpt2",
            prompt=PROMPT,
            max_tokens=5,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected["generated_text"]
    assert chunks[-1].usage.total_tokens == len(tokenizer.encode(PROMPT)) + 5
    # Over the context: vLLM's words, which litellm's context-window fallback recognises.
    n_prompt = len(tokenizer.encode(PROMPT))
    with pytest.raises(openai.BadRequestError) as refused:
        oa.completions.create(model="tiny-gpt2", prompt=PROMPT, max_tokens=500)
    assert refused.value.body["message"] == (
        "'max_tokens' or 'max_completion_tokens' is too large: 500. This model's maximum context length is "
        f"128 tokens and your request has {n_prompt} input tokens (500 > 128 - {n_prompt})."
    )
    assert refused.value.param == "max_tokens" and refused.value.status_code == 400


# ----- end of text ---------------------------------------------------------------------------------


def test_end_of_text_and_stop_tokens(small_params):
    """A model rigged to always predict <|endoftext|>: the eos path, ignore_eos, stop_token_ids."""
    rigged = always_end_of_text(small_params)
    settings = ServerSettings(backend="reference", max_concurrent_requests=1, model_id="rigged")
    with (
        running_server(settings, backend_factory("reference", rigged, slots=1)) as running,
        running.client() as c,
    ):
        data = c.post(
            "/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 5, "details": True}}
        ).json()
        assert data["generated_text"] == ""
        assert data["details"]["finish_reason"] == "eos_token" and data["details"]["generated_tokens"] == 1
        assert data["details"]["tokens"][0] | {"logprob": 0} == {
            "id": tokenizer.EOT_ID,
            "text": "<|endoftext|>",
            "logprob": 0,
            "special": True,
        }
        body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0}
        stopped = c.post("/v1/completions", json=body).json()["choices"][0]
        assert stopped["finish_reason"] == "stop" and stopped["stop_reason"] is None and stopped["text"] == ""
        kept_going = c.post("/v1/completions", json={**body, "ignore_eos": True}).json()
        assert kept_going["choices"][0]["finish_reason"] == "length"
        assert kept_going["usage"]["completion_tokens"] == 4
        by_id = c.post(
            "/v1/completions", json={**body, "ignore_eos": True, "stop_token_ids": [tokenizer.EOT_ID]}
        )
        assert by_id.json()["choices"][0]["stop_reason"] == tokenizer.EOT_ID
