"""Parameters as vLLM and TGI take them, over real HTTP: unknown fields are ignored with a warning,
neutral values of knobs this server lacks are accepted, and vLLM's cheap extras work."""

from __future__ import annotations

import numpy as np
import pytest
from service_harness import always_end_of_text, backend_factory, running_server, sse_events

from wafer_gpt2.model import tokenizer
from wafer_gpt2.settings import ServerSettings

PROMPT = "The wafer holds every layer"
MESSAGES = [{"role": "user", "content": PROMPT}]


@pytest.fixture(scope="module")
def server(small_params):
    settings = ServerSettings(
        backend="reference", model_id="tiny-gpt2", max_concurrent_requests=4, max_queue=8
    )
    with running_server(settings, backend_factory("reference", small_params, slots=4)) as running:
        yield running


@pytest.fixture(scope="module")
def eos_server(small_params):
    """A model that always predicts <|endoftext|>."""
    settings = ServerSettings(backend="reference", model_id="rigged", max_concurrent_requests=2)
    factory = backend_factory("reference", always_end_of_text(small_params), slots=2)
    with running_server(settings, factory) as running:
        yield running


@pytest.fixture
def client(server):
    with server.client() as c:
        yield c
    server.wait_idle()


def complete(client, **fields) -> dict:
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, **fields}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


# ----- unknown fields and neutral values -----------------------------------------------------------


def test_unknown_fields_are_ignored_and_named_in_a_header(client, caplog):
    tgi = {"inputs": PROMPT, "parameters": {"max_new_tokens": 3, "temprature": 0.5}, "options": {}}
    plain = client.post("/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 3}}).json()
    for route in ("/generate", "/"):
        response = client.post(route, json=tgi)
        assert response.status_code == 200, response.text
        assert response.headers["x-ignored-fields"] == "options, parameters.temprature"
    with client.stream("POST", "/generate_stream", json=tgi) as response:
        assert response.headers["x-ignored-fields"] == "options, parameters.temprature"
        assert list(sse_events(response))[-1]["generated_text"] == plain["generated_text"]
    body = {"prompt": PROMPT, "max_tokens": 3, "use_beam_search": False, "stream_options": None}
    response = client.post("/v1/completions", json={**body, "priority": 0})
    assert response.headers["x-ignored-fields"] == "use_beam_search, priority"
    chat = {"messages": MESSAGES, "max_tokens": 2, "store": False, "stream": True}
    chat["stream_options"] = {"include_usage": True, "future_option": 1}
    with client.stream("POST", "/v1/chat/completions", json=chat) as response:
        assert response.status_code == 200
        assert response.headers["x-ignored-fields"] == "store, stream_options.future_option"
    assert "ignored unknown fields: use_beam_search, priority" in caplog.text
    # Known fields only: no header.
    known = {"prompt": PROMPT, "max_tokens": 3, "stream_options": None}
    assert "x-ignored-fields" not in client.post("/v1/completions", json=known).headers


def test_tgi_neutral_values_are_accepted_and_others_refused(client, server):
    from huggingface_hub import InferenceClient

    neutral = {
        "typical_p": 1.0,
        "frequency_penalty": 0.0,
        "top_n_tokens": 0,
        "best_of": 1,
        "watermark": False,
    }
    expected = client.post("/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 4}}).json()
    data = client.post("/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 4, **neutral}})
    assert data.status_code == 200 and data.json() == expected
    hf = InferenceClient(base_url=server.url)
    text = hf.text_generation(PROMPT, max_new_tokens=4, typical_p=1.0, frequency_penalty=0.0, watermark=False)
    assert text == expected["generated_text"]
    for field, value, message in (
        ("typical_p", 0.5, "only 1.0 (off) is supported"),
        ("typical_p", 1.5, "must be > 0.0 and <= 1.0"),
        ("frequency_penalty", 0.5, "frequency_penalty on /v1/completions"),
        ("grammar", {"type": "json", "value": {}}, "is not supported"),
    ):
        response = client.post("/generate", json={"inputs": PROMPT, "parameters": {field: value}})
        assert response.status_code == 422, response.text
        assert (
            response.json()["error"].startswith(f"parameters.{field}: {message}") or message in response.text
        )


@pytest.mark.parametrize(
    "fields, param, message",
    [
        ({"presence_penalty": 2.5}, "presence_penalty", "between -2 and 2"),
        ({"frequency_penalty": -3}, "frequency_penalty", "between -2 and 2"),
        ({"logit_bias": {"11": 5}}, "logit_bias", "not supported"),
        ({"min_p": 1.5}, "min_p", "between 0 and 1"),
        ({"min_tokens": -1}, "min_tokens", "0 or more"),
        ({"min_tokens": 9, "max_tokens": 8}, "min_tokens", "`min_tokens` must be <= `max_tokens`"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "at least 1"),
        ({"prompt_logprobs": 21}, "prompt_logprobs", "between 0 and 20"),
        ({"prompt_logprobs": -1}, "prompt_logprobs", "0 or more"),
        ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs", "not available when streaming"),
        ({"include_stop_str_in_output": "yes"}, "include_stop_str_in_output", "valid boolean"),
    ],
)
def test_openai_extras_refuse_bad_values_naming_the_field(client, fields, param, message):
    for route, base in (
        ("/v1/completions", {"prompt": PROMPT}),
        ("/v1/chat/completions", {"messages": MESSAGES}),
    ):
        response = client.post(route, json={**base, "max_tokens": 8, **fields})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param and message in error["message"], error


def test_openai_neutral_values_are_accepted(client):
    expected = complete(client)["choices"][0]["text"]
    neutral = {
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "logit_bias": {},
        "suffix": "",
        "best_of": 1,
        "min_p": 0.0,
        "min_tokens": 0,
        "user": "someone",
        "skip_special_tokens": True,
    }
    assert complete(client, **neutral)["choices"][0]["text"] == expected


# ----- vLLM's extras -------------------------------------------------------------------------------


def test_min_p_one_keeps_only_the_best_candidate(client):
    greedy = complete(client, max_tokens=12)["choices"][0]["text"]
    sampled = complete(client, max_tokens=12, temperature=1.5, seed=3, min_p=1.0)["choices"][0]["text"]
    assert sampled == greedy


def test_frequency_and_presence_penalties_break_repetition(client):
    def repeats(**fields) -> int:
        data = complete(client, max_tokens=40, logprobs=0, **fields)
        tokens = data["choices"][0]["logprobs"]["tokens"]
        return len(tokens) - len(set(tokens))

    plain = repeats()
    assert plain > 10  # the tiny random model repeats itself a lot
    assert repeats(frequency_penalty=2.0) < plain
    assert repeats(presence_penalty=2.0) < plain


def test_truncate_prompt_tokens_keeps_the_last_tokens(client):
    ids = tokenizer.encode(PROMPT)
    data = complete(client, max_tokens=2, truncate_prompt_tokens=2, echo=True)
    assert data["usage"]["prompt_tokens"] == 2
    assert data["choices"][0]["text"].startswith(tokenizer.decode(ids[-2:]))
    assert complete(client, max_tokens=2, truncate_prompt_tokens=-1)["usage"]["prompt_tokens"] == len(ids)


def test_truncation_lets_through_a_prompt_longer_than_any_that_fits(client):
    """The character cap lets through, when the request truncates, a text it would refuse otherwise."""
    cap = 127 * tokenizer.longest_token_chars()  # the small model: 127 prompt tokens of 128 positions
    text = "word " * (cap // 5 + 100)  # over the cap; about 2,000 tokens
    ids = tokenizer.encode(text)
    assert len(text) > cap and len(ids) > 127
    tgi = {
        "inputs": text,
        "parameters": {"max_new_tokens": 1, "details": True, "decoder_input_details": True},
    }
    refused = client.post("/generate", json=tgi)
    assert refused.status_code == 422 and f"at most {cap} characters" in refused.json()["error"]
    tgi["parameters"]["truncate"] = 8
    prefill = client.post("/generate", json=tgi).json()["details"]["prefill"]
    assert [t["id"] for t in prefill] == ids[-8:]

    refused = client.post("/v1/completions", json={"prompt": text, "max_tokens": 1})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt", refused.text
    data = complete(client, prompt=[text, text], max_tokens=1, truncate_prompt_tokens=8, echo=True)
    assert data["usage"]["prompt_tokens"] == 16
    assert data["choices"][0]["text"].startswith(tokenizer.decode(ids[-8:]))

    chat = {"messages": [{"role": "user", "content": text}], "max_tokens": 1}
    refused = client.post("/v1/chat/completions", json=chat)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "messages", refused.text
    answer = client.post("/v1/chat/completions", json={**chat, "truncate_prompt_tokens": 8})
    assert answer.status_code == 200 and answer.json()["usage"]["prompt_tokens"] == 8, answer.text


def test_logprobs_up_to_twenty_as_vllm(server, client):
    import openai

    oa = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    completion = oa.completions.create(
        model="tiny-gpt2", prompt=PROMPT, max_tokens=3, temperature=0, logprobs=20, echo=True
    )
    tops = completion.choices[0].logprobs.top_logprobs
    n_prompt = len(tokenizer.encode(PROMPT))
    # Twenty alternatives, and the token itself when it is not among them (a prompt token may not be).
    assert tops[0] is None and all(len(top) in (20, 21) for top in tops[1:]), [len(t or ()) for t in tops]
    assert len(tops) == n_prompt + 3 and all(len(top) == 20 for top in tops[n_prompt:])  # greedy
    chat = oa.chat.completions.create(
        model="tiny-gpt2", messages=MESSAGES, max_tokens=3, temperature=0, logprobs=True, top_logprobs=20
    )
    assert [len(token.top_logprobs) for token in chat.choices[0].logprobs.content] == [20] * 3
    data = complete(client, max_tokens=1, prompt_logprobs=20)
    assert all(len(entry) >= 20 for entry in data["choices"][0]["prompt_logprobs"][1:])
    for route, body, field in (
        ("/v1/completions", {"prompt": PROMPT, "logprobs": 21}, "logprobs"),
        ("/v1/completions", {"prompt": PROMPT, "prompt_logprobs": 21}, "prompt_logprobs"),
        (
            "/v1/chat/completions",
            {"messages": MESSAGES, "logprobs": True, "top_logprobs": 21},
            "top_logprobs",
        ),
    ):
        refused = client.post(route, json=body)
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["param"] == field and f"`{field}` must be between 0 and 20" in error["message"], error


def test_prompt_logprobs_match_tgi_prefill(client):
    ids = tokenizer.encode(PROMPT)
    tgi = client.post(
        "/generate",
        json={
            "inputs": PROMPT,
            "parameters": {"max_new_tokens": 1, "details": True, "decoder_input_details": True},
        },
    ).json()["details"]["prefill"]
    data = complete(client, max_tokens=1, prompt_logprobs=2)
    prompt_logprobs = data["choices"][0]["prompt_logprobs"]
    assert len(prompt_logprobs) == len(ids) and prompt_logprobs[0] is None
    for position, (entry, expected) in enumerate(zip(prompt_logprobs[1:], tgi[1:], strict=True), start=1):
        chosen = entry[str(ids[position])]
        np.testing.assert_allclose(chosen["logprob"], expected["logprob"], rtol=1e-6)
        assert chosen["decoded_token"] == tokenizer.decode([ids[position]])
        ranked = sorted((v for v in entry.values() if v["rank"] is not None), key=lambda v: v["rank"])
        assert [v["rank"] for v in ranked][:2] == [1, 2]
        assert ranked[0]["logprob"] >= chosen["logprob"]
    chat = client.post(
        "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1, "prompt_logprobs": 0}
    ).json()
    assert chat["prompt_logprobs"][0] is None and all(len(e) == 1 for e in chat["prompt_logprobs"][1:])
    assert chat["choices"][0].get("prompt_logprobs") is None


def test_include_stop_str_in_output(client):
    base = complete(client, max_tokens=12, logprobs=0)
    tokens = base["choices"][0]["logprobs"]["tokens"]
    stop = tokens[4]  # a whole token in the middle of the text
    text = base["choices"][0]["text"]
    cut = text.index(stop)
    assert complete(client, max_tokens=12, stop=stop)["choices"][0]["text"] == text[:cut]
    kept = complete(client, max_tokens=12, stop=stop, include_stop_str_in_output=True)["choices"][0]
    assert kept["text"] == text[: cut + len(stop)] and kept["stop_reason"] == stop
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "stop": stop, "stream": True}
    with client.stream(
        "POST", "/v1/completions", json={**body, "include_stop_str_in_output": True}
    ) as response:
        streamed = "".join(e["choices"][0]["text"] for e in sse_events(response) if e != "[DONE]")
    assert streamed == kept["text"]


def test_min_tokens_skip_special_tokens_and_end_of_text(eos_server):
    with eos_server.client() as c:

        def complete_rigged(**fields) -> dict:
            body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, **fields}
            response = c.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            return response.json()["choices"][0] | {"usage": response.json()["usage"]}

        assert complete_rigged()["usage"]["completion_tokens"] == 1  # <|endoftext|> at once
        held = complete_rigged(min_tokens=3, logprobs=0)
        # <|endoftext|> is held back for three tokens, then ends the text as usual.
        assert held["usage"]["completion_tokens"] == 4 and held["finish_reason"] == "stop"
        assert "<|endoftext|>" not in held["logprobs"]["tokens"][:3]
        # Special tokens as text: only those that do not end the generation (vLLM cuts the ending one).
        shown = complete_rigged(ignore_eos=True, skip_special_tokens=False, max_tokens=3)
        assert shown["text"] == "<|endoftext|>" * 3
        assert complete_rigged(skip_special_tokens=False)["text"] == ""
        kept = complete_rigged(skip_special_tokens=False, include_stop_str_in_output=True)
        assert kept["text"] == "<|endoftext|>"
        assert complete_rigged(ignore_eos=True, max_tokens=3)["text"] == ""
        # min_tokens also holds back stop strings (vLLM checks none before min_tokens).
        stopped = complete_rigged(ignore_eos=True, skip_special_tokens=False, stop="<|", min_tokens=2)
        assert stopped["text"] == "<|endoftext|>" * 2 and stopped["stop_reason"] == "<|"


def test_odd_unknown_field_names_are_percent_encoded_in_the_header(client):
    """What the fuzzer found: a field name outside visible ASCII broke the header (500)."""
    body = {"prompt": PROMPT, "max_tokens": 1, "Ā\n": 1, **{f"x{i}": i for i in range(25)}}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    header = response.headers["x-ignored-fields"]
    assert header.startswith("%C4%80%0A, x0, x1") and header.endswith("(and 6 more)")
