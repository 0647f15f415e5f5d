"""Fuzzing the HTTP API: no input gets a 5xx, and every refusal is an error a person can read.

Two fuzzers against one real server (the simulator backend, a small model):
- schemathesis reads /openapi.json and sends every operation bodies that fit the schema and bodies that
  break it (wrong types, missing or unknown fields, bytes that are not UTF-8; `inputs` and `prompt` are
  free-form JSON, so they get anything at all). Most of these are refused before the engine.
- hypothesis builds bodies of the right shape whose every field straddles its limits (lengths, ranges,
  odd Unicode with lone surrogates, token ids at the vocabulary's edges, streams and n > 1), so about
  half of them reach the engine and generate.
Every answer must be below 500; every error must come in the route's own JSON error schema with a
message (TGI's `{"error": str, "error_type": str}`, OpenAI's `{"error": {"message", "type", ...}}`);
a stream that started (200) must end normally, never with an error event; and afterwards no request
may be left queued or holding a KV slot. The server's context is short, so generations stay cheap.
"""

from __future__ import annotations

import json

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from service_harness import backend_factory, running_server

from wafer_gpt2.settings import ServerSettings

SLOTS = 4
CONTEXT = 32  # prompt + new tokens: valid requests stay cheap
EXAMPLES_PER_OPERATION = 40  # schemathesis, per operation
BODIES_PER_PROTOCOL = 50  # hypothesis, per protocol
OPENAI_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/detokenize")
# The operations that take a body (the GET routes take no parameters: nothing to fuzz).
OPERATIONS = [
    ("POST", "/generate"),
    ("POST", "/generate_stream"),
    ("POST", "/"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/detokenize"),
]


@pytest.fixture(scope="module")
def server(small_params):
    settings_ = ServerSettings(
        backend="sim", model_id="fuzz", dtype="fp32", max_concurrent_requests=SLOTS, context_length=CONTEXT
    )
    factory = backend_factory("sim", small_params, slots=SLOTS, context=CONTEXT)
    with running_server(settings_, factory) as running:
        yield running


@pytest.fixture(scope="module")
def api_schema(server):
    return schemathesis.openapi.from_url(server.url + "/openapi.json")


def check_error_body(path: str, status: int, text: str) -> None:
    body = json.loads(text)
    where = f"{path} answered {status} with {text[:300]}"
    if path.startswith(OPENAI_PATHS):
        assert isinstance(body.get("error"), dict), where
        assert isinstance(body["error"].get("message"), str) and body["error"]["message"], where
        assert isinstance(body["error"].get("type"), str), where
    else:
        assert isinstance(body.get("error"), str) and body["error"], where
        assert isinstance(body.get("error_type"), str), where


@pytest.mark.parametrize("method, path", OPERATIONS)
def test_no_input_gets_a_server_error(server, api_schema, method, path):
    operation = api_schema[path][method]
    cases = st.one_of(
        operation.as_strategy(generation_mode=GenerationMode.POSITIVE),
        operation.as_strategy(generation_mode=GenerationMode.NEGATIVE),
    )

    @given(case=cases)
    @settings(
        max_examples=EXAMPLES_PER_OPERATION,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    def call(case) -> None:
        response = case.call(base_url=server.url, timeout=30)
        assert response.status_code < 500, (
            f"{method} {path} with body {case.body!r} answered {response.status_code}: {response.text[:500]}"
        )
        if response.status_code >= 400:
            check_error_body(path, response.status_code, response.text)

    call()
    server.wait_idle(timeout=10)  # nothing the fuzzer sent may leave a request queued or a slot held


def test_a_body_that_is_not_utf8_is_refused_in_the_route_schema(server):
    """What schemathesis found first: FastAPI answered such a body with a bare `{"detail": ...}` 400."""
    with server.client() as client:
        for path, status in (("/generate", 422), ("/v1/completions", 400)):
            response = client.post(path, content=b"\xff\xfe{", headers={"content-type": "application/json"})
            assert response.status_code == status, response.text
            check_error_body(path, status, response.text)
            assert "UTF-8" in response.text


# ----- hypothesis: bodies of the right shape, every field near its limits -------------------------

VOCAB = 50257


def mostly(valid: st.SearchStrategy, edges: st.SearchStrategy) -> st.SearchStrategy:
    """Four draws in five from `valid`, the rest from `edges` (values at or just past a limit), so a
    body with a dozen fields still has a fair chance to be served."""
    return st.integers(0, 4).flatmap(lambda i: edges if i == 0 else valid)


# Any code point, lone surrogates included (they travel as JSON escapes such as "\ud800").
ODD_TEXT = st.text(st.characters(exclude_categories=()), max_size=12)
PROMPT_TEXT = mostly(
    st.text(min_size=1, max_size=10),
    st.one_of(ODD_TEXT, st.sampled_from(["", "<|endoftext|>", "é" * 12, "🙂" * 6, "x" * 200])),
)
TEMPERATURE = mostly(st.floats(0.05, 2.0), st.sampled_from([0.0, -1.0, 2.5, 1e-300, 1e308]))
TOP_P = mostly(st.floats(0.05, 0.99), st.sampled_from([0.0, 1.0, 1.5, 1e-300]))
PENALTY = mostly(st.floats(0.5, 2.0), st.sampled_from([0.0, -1.0, 1e-300, 1e308]))
SEED = mostly(st.integers(0, 2**64 - 1), st.sampled_from([-1, 2**64]))
NEW_TOKENS = mostly(st.integers(1, 6), st.sampled_from([-1, 0, CONTEXT, CONTEXT + 1]))
STOPS = mostly(st.lists(st.text(min_size=1, max_size=4), max_size=4), st.lists(ODD_TEXT, max_size=6))
TOKEN_IDS = mostly(
    st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8),
    st.lists(st.integers(-1, VOCAB), max_size=CONTEXT + 1),
)

TGI_PARAMETERS = st.fixed_dictionaries(
    {},
    optional={
        "max_new_tokens": NEW_TOKENS,
        "do_sample": st.booleans(),
        "temperature": TEMPERATURE,
        "top_k": mostly(st.integers(1, 64), st.sampled_from([-1, 0, 65])),
        "top_p": TOP_P,
        "repetition_penalty": PENALTY,
        "seed": SEED,
        "stop": STOPS,
        "details": st.booleans(),
        "decoder_input_details": st.booleans(),
        "top_n_tokens": mostly(st.integers(1, 5), st.sampled_from([-1, 0, 6])),
        "return_full_text": st.booleans(),
        "truncate": mostly(st.integers(1, 8), st.sampled_from([-1, 0, CONTEXT + 1])),
    },
)
TGI_REQUESTS = st.tuples(
    st.sampled_from(["/generate", "/generate_stream", "/"]),
    st.fixed_dictionaries(
        {"inputs": PROMPT_TEXT, "parameters": TGI_PARAMETERS}, optional={"stream": st.booleans()}
    ),
)
OPENAI_REQUESTS = st.tuples(
    st.just("/v1/completions"),
    st.fixed_dictionaries(
        {
            "prompt": st.one_of(
                PROMPT_TEXT,
                st.lists(PROMPT_TEXT, min_size=1, max_size=3),
                TOKEN_IDS,
                st.lists(TOKEN_IDS, min_size=1, max_size=2),
            )
        },
        optional={
            "max_tokens": st.one_of(st.none(), NEW_TOKENS),
            "temperature": TEMPERATURE,
            "top_p": TOP_P,
            "top_k": mostly(st.integers(-1, 64), st.sampled_from([-2, 65])),
            "n": mostly(st.integers(1, 3), st.sampled_from([0, 9])),
            "stream": st.booleans(),
            "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
            "logprobs": mostly(st.one_of(st.none(), st.integers(0, 5)), st.sampled_from([-1, 6])),
            "echo": st.booleans(),
            "stop": st.one_of(st.text(min_size=1, max_size=4), STOPS),
            "stop_token_ids": mostly(st.lists(st.integers(0, VOCAB - 1), max_size=3), st.just([-1, VOCAB])),
            "seed": SEED,
            "repetition_penalty": PENALTY,
            "ignore_eos": st.booleans(),
        },
    ),
)


def check_answer(path: str, body: dict, response: httpx.Response) -> bool:
    """Asserts the answer is sound; True when the request was served (200)."""
    sent = json.dumps(body)[:400]
    assert response.status_code < 500, f"{path} {sent} answered {response.status_code}: {response.text[:400]}"
    if response.status_code >= 400:
        check_error_body(path, response.status_code, response.text)
        return False
    assert response.status_code == 200, f"{path} {sent}: {response.status_code}"
    if not response.headers["content-type"].startswith("text/event-stream"):
        data = response.json()
        if path == "/":
            (data,) = data  # TGI's compatibility route answers a one-element array
        assert "generated_text" in data or "choices" in data, f"{path} {sent}: {response.text[:400]}"
        return True
    events = [line[len("data:") :].strip() for line in response.text.splitlines() if line.startswith("data:")]
    assert events, f"{path} {sent}: an empty stream"
    for event in events:
        if event != "[DONE]":
            assert "error" not in json.loads(event), f"{path} {sent}: the stream failed: {event[:400]}"
    if path == "/v1/completions":
        assert events[-1] == "[DONE]", f"{path} {sent}: the stream did not end with [DONE]"
    else:
        assert json.loads(events[-1])["generated_text"] is not None, f"{path} {sent}: no final event"
    return True


@pytest.mark.parametrize("requests", [TGI_REQUESTS, OPENAI_REQUESTS], ids=["tgi", "openai"])
def test_bodies_near_every_limit_never_get_a_server_error(server, requests):
    served = []
    with server.client(timeout=30) as client:

        @given(request=requests)
        @settings(
            max_examples=BODIES_PER_PROTOCOL,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        def call(request) -> None:
            path, body = request
            # json.dumps escapes lone surrogates (httpx's own encoder would refuse them).
            content = json.dumps(body).encode()
            response = client.post(path, content=content, headers={"content-type": "application/json"})
            served.append(check_answer(path, body, response))

        call()
    server.wait_idle(timeout=10)
    # The strategies are only worth something if a good share of their bodies reach the engine.
    assert sum(served) >= len(served) // 5, f"only {sum(served)} of {len(served)} bodies were served"
