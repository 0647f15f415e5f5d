"""Scoring a prompt without generating (`echo` + `logprobs` + `max_tokens: 0`, as vLLM serves it):
the prompt's logprobs come from the prefill alone, and the request leaves the batch right after it."""

from __future__ import annotations

import numpy as np
import pytest
from service_harness import backend_factory, reference_greedy, running_server, sse_events

from wafer_gpt2.model import tokenizer
from wafer_gpt2.settings import ServerSettings

PROMPT = "The wafer holds every layer"


@pytest.fixture(scope="module")
def server(small_params):
    settings = ServerSettings(backend="reference", model_id="tiny-gpt2", max_concurrent_requests=2)
    with running_server(settings, backend_factory("reference", small_params, slots=2)) as running:
        yield running


def test_echo_with_max_tokens_zero_scores_the_prompt_in_one_prefill(server, small_params):
    ids = tokenizer.encode(PROMPT)
    _, _, expected = reference_greedy(small_params, ids, 1)
    body = {"prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 1, "temperature": 0}
    with server.client() as client:
        steps = server.engine.steps
        data = client.post("/v1/completions", json=body).json()
        assert server.engine.steps - steps == 1  # the prefill, and no decode step
        server.wait_idle()
        (choice,) = data["choices"]
        assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
        assert data["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)}
        lp = choice["logprobs"]
        assert lp["tokens"] == [tokenizer.decode([t]) for t in ids]
        assert lp["token_logprobs"][0] is None
        np.testing.assert_allclose(lp["token_logprobs"][1:], expected, rtol=1e-5)
        assert all(len(top) >= 1 for top in lp["top_logprobs"][1:])

        # Several prompts at once (how evaluation harnesses batch), and streamed: one chunk each.
        batch = client.post("/v1/completions", json={**body, "prompt": [PROMPT, "Hello world"]}).json()
        assert [c["text"] for c in batch["choices"]] == [PROMPT, "Hello world"]
        batched = batch["choices"][0]["logprobs"]
        assert batched["tokens"] == lp["tokens"] and batched["text_offset"] == lp["text_offset"]
        np.testing.assert_allclose(batched["token_logprobs"][1:], expected, rtol=1e-5)
        with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
            events = list(sse_events(response))
        assert events[-1] == "[DONE]" and len(events) == 2
        assert events[0]["choices"][0]["text"] == PROMPT
        assert events[0]["choices"][0]["logprobs"]["tokens"] == lp["tokens"]

        refused = client.post("/v1/completions", json={**body, "echo": False})
        assert refused.status_code == 400
        assert refused.json()["error"]["param"] == "max_tokens"
        assert "0 is allowed with `echo`" in refused.json()["error"]["message"]
    server.wait_idle()


def test_openai_client_scores_with_echo(server):
    import openai

    oa = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    scored = oa.completions.create(model="tiny-gpt2", prompt=PROMPT, max_tokens=0, echo=True, logprobs=0)
    assert scored.choices[0].text == PROMPT
    assert len(scored.choices[0].logprobs.token_logprobs) == len(tokenizer.encode(PROMPT))
    assert scored.usage.completion_tokens == 0
