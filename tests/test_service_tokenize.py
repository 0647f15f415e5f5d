"""The tokenizer routes over real HTTP (vLLM's /tokenize, /detokenize, /tokenizer_info and TGI's
/tokenize), and `<|endoftext|>` in text prompts, which every route reads as the special token."""

from __future__ import annotations

import pytest
from service_harness import backend_factory, running_server

from wafer_gpt2.model import tokenizer
from wafer_gpt2.service.chat_template import DEFAULT_CHAT_TEMPLATE
from wafer_gpt2.settings import ServerSettings

TEXT = "Héllo 🙂 world<|endoftext|>again"
IDS = tokenizer.encode(TEXT, allow_special=True)


@pytest.fixture(scope="module")
def server(small_params):
    settings = ServerSettings(backend="reference", model_id="tiny-gpt2", max_concurrent_requests=2)
    with running_server(settings, backend_factory("reference", small_params, slots=2)) as running:
        yield running


@pytest.fixture
def client(server):
    with server.client() as c:
        yield c
    server.wait_idle()


def test_end_of_text_in_a_prompt_is_the_special_token(client):
    assert tokenizer.EOT_ID in IDS and IDS.count(tokenizer.EOT_ID) == 1
    data = client.post("/tokenize", json={"prompt": TEXT}).json()
    assert data == {"count": len(IDS), "max_model_len": 128, "tokens": IDS, "token_strs": None}
    tgi = client.post(
        "/generate",
        json={
            "inputs": TEXT,
            "parameters": {"max_new_tokens": 1, "details": True, "decoder_input_details": True},
        },
    ).json()
    assert [t["id"] for t in tgi["details"]["prefill"]] == IDS
    openai = client.post("/v1/completions", json={"prompt": TEXT, "max_tokens": 1, "echo": True}).json()
    assert openai["usage"]["prompt_tokens"] == len(IDS)
    assert openai["choices"][0]["text"].startswith(TEXT)


def test_vllm_tokenize_and_detokenize(client):
    data = client.post(
        "/tokenize", json={"model": "tiny-gpt2", "prompt": TEXT, "return_token_strs": True}
    ).json()
    assert data["tokens"] == IDS and data["token_strs"] == [tokenizer.decode([t]) for t in IDS]
    messages = [{"role": "user", "content": "Hi"}]
    chat = client.post("/tokenize", json={"messages": messages}).json()
    assert chat["tokens"] == tokenizer.encode_prompt(DEFAULT_CHAT_TEMPLATE.render(messages))
    assert client.post("/detokenize", json={"tokens": IDS}).json() == {"prompt": TEXT}
    info = client.get("/tokenizer_info").json()
    assert info["eos_token"] == "<|endoftext|>" and info["model_max_length"] == 128
    assert info["chat_template"] == DEFAULT_CHAT_TEMPLATE.source


def test_tgi_tokenize(client):
    tokens = client.post("/tokenize", json={"inputs": TEXT, "parameters": {"truncate": 5}}).json()
    assert [t["id"] for t in tokens] == IDS
    raw = TEXT.encode()
    assert b"".join(raw[t["start"] : t["stop"]] for t in tokens) == raw
    assert tokens[-1]["stop"] == len(raw) and tokens[0]["text"] == tokenizer.decode(IDS[:1])


@pytest.mark.parametrize(
    "route, body, status, check",
    [
        ("/tokenize", {"prompt": 5}, 400, lambda e: e["error"]["param"] == "prompt"),
        (
            "/tokenize",
            {"messages": [{"content": "x"}]},
            400,
            lambda e: e["error"]["param"] == "messages.0.role",
        ),
        ("/tokenize", {"prompt": "x", "model": "gpt-4"}, 404, lambda e: e["error"]["param"] == "model"),
        (
            "/tokenize",
            {"inputs": 5},
            422,
            lambda e: e["error"].startswith("inputs:") and e["error_type"] == "validation",
        ),
        ("/detokenize", {"tokens": [50257]}, 400, lambda e: "outside 0..50256" in e["error"]["message"]),
        ("/detokenize", {"tokens": "x"}, 400, lambda e: e["error"]["param"] == "tokens"),
    ],
)
def test_tokenizer_route_errors_in_the_protocols_schema(client, route, body, status, check):
    response = client.post(route, json=body)
    assert response.status_code == status, response.text
    assert check(response.json()), response.json()


def test_tokenize_takes_texts_as_long_as_a_prompt_and_no_longer(client):
    cap = 127 * tokenizer.longest_token_chars()  # the small model's prompt cap: 127 tokens of 128 positions
    user = {"role": "user", "content": ""}
    chat_overhead = len(DEFAULT_CHAT_TEMPLATE.render([user]))
    bodies = [
        ("prompt", 400, lambda n: {"prompt": "a" * n}),
        ("messages", 400, lambda n: {"messages": [{**user, "content": "a" * (n - chat_overhead)}]}),
        ("inputs", 422, lambda n: {"inputs": "a" * n}),
    ]
    for field, status, body in bodies:
        assert client.post("/tokenize", json=body(cap)).status_code == 200, field
        refused = client.post("/tokenize", json=body(cap + 1))
        assert refused.status_code == status, refused.text
        error = refused.json()["error"]
        message = error if status == 422 else error["message"]
        assert f"`{field}` must have at most {cap} characters" in message, message
        assert f"given {cap + 1}" in message, message
        if status == 400:
            assert error["param"] == field, error


def test_lm_eval_remote_tokenizer(server):
    from lm_eval.utils import RemoteTokenizer, check_remote_tokenizer_support

    assert check_remote_tokenizer_support(server.url + "/v1/completions")
    remote = RemoteTokenizer(server.url + "/v1/completions")
    assert remote.eos_token_id == tokenizer.EOT_ID
    assert remote.encode(TEXT) == IDS and remote.decode(IDS) == TEXT
