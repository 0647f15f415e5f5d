"""The service on the embedded wafer simulator (`sim` backend), over real HTTP."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
from service_harness import backend_factory, reference_greedy, run_concurrently, running_server, sse_events

from wafer_gpt2.model import tokenizer
from wafer_gpt2.settings import ServerSettings

PROMPT = "Weights stay resident in SRAM"
SLOTS = 4


@pytest.fixture(scope="module")
def server(small_params):
    settings = ServerSettings(backend="sim", model_id="tiny-sim", dtype="fp32", max_concurrent_requests=SLOTS)
    with running_server(settings, backend_factory("sim", small_params, slots=SLOTS)) as running:
        yield running


@pytest.fixture
def client(server):
    with server.client() as c:
        yield c
    server.wait_idle()


def test_info_reports_the_wafer_plan(client):
    assert client.get("/health").status_code == 200
    info = client.get("/info").json()
    assert info["backend"] == "sim" and info["kv_slots"] == SLOTS
    plan = info["plan"]
    assert plan["slots"] == SLOTS and plan["top_k"] == 64 and plan["dtype"] == "fp32"
    assert plan["summary"]["pes_used"] > 0
    assert "modeled" in plan["summary"]  # cost-model figures stay labelled as modeled
    assert client.get("/v1/models").json()["data"][0]["id"] == "tiny-sim"


def test_greedy_generation_matches_the_reference(client, small_params):
    prompt = tokenizer.encode(PROMPT)
    tokens, logprobs, prompt_logprobs = reference_greedy(small_params, prompt, 8)
    body = {
        "inputs": PROMPT,
        "parameters": {"max_new_tokens": 8, "details": True, "decoder_input_details": True},
    }
    details = client.post("/generate", json=body).json()["details"]
    assert [t["id"] for t in details["tokens"]] == tokens
    np.testing.assert_allclose([t["logprob"] for t in details["tokens"]], logprobs, rtol=1e-4)
    np.testing.assert_allclose([t["logprob"] for t in details["prefill"][1:]], prompt_logprobs, rtol=1e-4)


def test_every_generation_route_streaming_and_not(client):
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 5, "seed": 11, "do_sample": True}}
    text = client.post("/generate", json=body).json()["generated_text"]
    with client.stream("POST", "/generate_stream", json=body) as response:
        events = list(sse_events(response))
    assert events[-1]["generated_text"] == text == "".join(e["token"]["text"] for e in events)
    assert client.post("/", json=body).json() == [{"generated_text": text}]  # TGI: a one-element array
    with client.stream("POST", "/", json={**body, "stream": True}) as response:
        assert list(sse_events(response))[-1]["generated_text"] == text

    completion = {"prompt": PROMPT, "max_tokens": 5, "seed": 11}
    whole = client.post("/v1/completions", json=completion).json()
    with client.stream("POST", "/v1/completions", json={**completion, "stream": True}) as response:
        chunks = list(sse_events(response))
    assert chunks[-1] == "[DONE]"
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == whole["choices"][0]["text"]
    assert 'vllm:kv_cache_usage_perc{model_name="tiny-sim"}' in client.get("/metrics").text


def test_seeded_request_is_identical_alone_and_in_a_busy_batch(server, client):
    seeded = {
        "inputs": PROMPT,
        "parameters": {"max_new_tokens": 12, "seed": 5, "temperature": 0.8, "top_k": 20},
    }
    alone = client.post("/generate", json=seeded).json()["generated_text"]

    def other(i):
        body = {
            "inputs": f"Batch neighbour {i}",
            "parameters": {"max_new_tokens": 8 + 4 * i, "do_sample": True},
        }
        return lambda: httpx.post(server.url + "/generate", json=body, timeout=60).status_code

    calls = [other(i) for i in range(4)]
    calls.insert(
        1, lambda: httpx.post(server.url + "/generate", json=seeded, timeout=60).json()["generated_text"]
    )
    results = run_concurrently(calls)
    assert results[1] == alone
    assert results[:1] + results[2:] == [200] * 4


def test_disconnects_free_every_slot(server, client):
    def leave_after(n):
        def call():
            body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 60}}
            with (
                httpx.Client(base_url=server.url, timeout=60) as c,
                c.stream("POST", "/generate_stream", json=body) as r,
            ):
                for i, _ in enumerate(sse_events(r)):
                    if i >= n:
                        return

        return call

    run_concurrently([leave_after(n) for n in (0, 1, 3, 5, 2, 4)])
    server.wait_idle(timeout=10)
    assert client.get("/info").json()["engine"]["kv_usage"]["slots_used"] == 0


def test_well_known_clients(server):
    import openai
    from huggingface_hub import InferenceClient

    hf = InferenceClient(base_url=server.url)
    text = hf.text_generation(PROMPT, max_new_tokens=4)
    assert "".join(hf.text_generation(PROMPT, max_new_tokens=4, stream=True)) == text
    oa = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    assert (
        oa.completions.create(model="tiny-sim", prompt=PROMPT, max_tokens=4, temperature=0).choices[0].text
        == text
    )


def test_fp16_wafer_serves(small_params):
    settings = ServerSettings(backend="sim", dtype="fp16", max_concurrent_requests=2)
    factory = backend_factory("sim", small_params, slots=2, dtype="fp16")
    with running_server(settings, factory) as running, running.client() as c:
        assert c.get("/info").json()["plan"]["dtype"] == "fp16"
        data = c.post(
            "/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 4, "details": True}}
        ).json()
        assert data["details"]["generated_tokens"] == 4
