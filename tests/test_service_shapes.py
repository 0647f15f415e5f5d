"""Response shapes and small routes as TGI, vLLM and SageMaker clients expect them, over real HTTP."""

from __future__ import annotations

import pytest
from service_harness import backend_factory, running_server, sse_events

from wafer_gpt2.model import tokenizer
from wafer_gpt2.settings import ServerSettings

PROMPT = "The wafer holds every layer"


@pytest.fixture(scope="module")
def server(small_params):
    settings = ServerSettings(
        backend="reference", model_id="tiny-gpt2", max_concurrent_requests=4, api_key="key"
    )
    with running_server(settings, backend_factory("reference", small_params, slots=4)) as running:
        yield running


@pytest.fixture
def client(server):
    with server.client(headers={"Authorization": "Bearer key"}) as c:
        yield c
    server.wait_idle()


def test_tgi_root_route_answers_a_one_element_array(client, server):
    from huggingface_hub import InferenceClient

    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 4}}
    expected = client.post("/generate", json=body).json()
    assert client.post("/", json=body).json() == [expected]
    hf = InferenceClient(base_url=server.url, api_key="key")  # it posts to `/`
    assert hf.text_generation(PROMPT, max_new_tokens=4) == expected["generated_text"]


def test_decoder_input_details_cannot_stream(client):
    params = {"max_new_tokens": 2, "details": True, "decoder_input_details": True}
    for route, extra in (("/generate_stream", {}), ("/", {"stream": True})):
        response = client.post(route, json={"inputs": PROMPT, "parameters": params, **extra})
        assert response.status_code == 422, response.text
        assert response.json()["error_type"] == "validation"
        assert (
            "`decoder_input_details` == true is not supported when streaming tokens"
            in response.json()["error"]
        )


def test_models_version_ping(client, server):
    import openai

    card = client.get("/v1/models/tiny-gpt2").json()
    assert card["id"] == "tiny-gpt2" and card["object"] == "model" and card["max_model_len"] == 128
    missing = client.get("/v1/models/gpt-4")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
    oa = openai.OpenAI(base_url=server.url + "/v1", api_key="key", max_retries=0)
    assert oa.models.retrieve("tiny-gpt2").id == "tiny-gpt2"
    assert client.get("/version").json() == {"version": "0.1.0"}
    with server.client() as anonymous:  # health probes carry no key
        assert anonymous.get("/ping").status_code == 200
        assert anonymous.post("/ping").status_code == 200
        assert anonymous.get("/version").status_code == 401


def test_invocations_dispatch_on_the_body(client):
    chat = client.post(
        "/invocations", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    )
    assert chat.status_code == 200 and chat.json()["object"] == "chat.completion"
    completion = client.post("/invocations", json={"prompt": PROMPT, "max_tokens": 2})
    assert completion.status_code == 200 and completion.json()["object"] == "text_completion"
    tgi = client.post("/invocations", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 2}})
    assert tgi.status_code == 200 and "generated_text" in tgi.json()[0]
    with client.stream(
        "POST", "/invocations", json={"prompt": PROMPT, "max_tokens": 2, "stream": True}
    ) as response:
        assert list(sse_events(response))[-1] == "[DONE]"
    # Errors in the schema of the body's protocol.
    bad_openai = client.post("/invocations", json={"prompt": "", "max_tokens": 2})
    assert bad_openai.status_code == 400 and bad_openai.json()["error"]["param"] == "prompt"
    bad_tgi = client.post("/invocations", json={"inputs": ""})
    assert bad_tgi.status_code == 422 and bad_tgi.json()["error"] == "inputs: cannot be empty"
    not_json = client.post("/invocations", content=b"{", headers={"content-type": "application/json"})
    assert not_json.status_code == 422 and "not valid JSON" in not_json.json()["error"]


@pytest.mark.parametrize(
    "method, path, status, schema",
    [
        ("GET", "/v1/nothing", 404, "openai"),
        ("POST", "/nothing", 404, "tgi"),
        ("GET", "/v1/completions", 405, "openai"),
        ("GET", "/generate", 405, "tgi"),
        ("DELETE", "/v1/models", 405, "openai"),
    ],
)
def test_errors_outside_routes_use_the_familys_schema(client, method, path, status, schema):
    response = client.request(method, path)
    assert response.status_code == status, response.text
    body = response.json()
    if schema == "openai":
        assert body["error"]["code"] == status and path in body["error"]["message"]
        assert body["error"]["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    else:
        assert path in body["error"] and body["error_type"] in ("not_found", "method_not_allowed")
    if status == 405:
        assert response.headers["allow"] in ("POST", "GET")


def test_continuous_usage_stats(client, server):
    import openai

    n_prompt = len(tokenizer.encode(PROMPT))
    options = {"include_usage": True, "continuous_usage_stats": True}
    body = {"prompt": PROMPT, "max_tokens": 3, "n": 2, "stream": True, "stream_options": options}
    with client.stream("POST", "/v1/completions", json=body) as response:
        events = [e for e in sse_events(response) if e != "[DONE]"]
    seen = {0: 0, 1: 0}
    for event in events[:-1]:
        (choice,) = event["choices"]
        usage = event["usage"]
        seen[choice["index"]] += 1
        assert usage == {
            "prompt_tokens": n_prompt,
            "completion_tokens": seen[choice["index"]],
            "total_tokens": n_prompt + seen[choice["index"]],
        }
    assert events[-1]["usage"]["completion_tokens"] == 6  # the final usage chunk: both choices
    # Without include_usage the option does nothing (vLLM's rule).
    quiet = {**body, "stream_options": {"continuous_usage_stats": True}}
    with client.stream("POST", "/v1/completions", json=quiet) as response:
        assert all(e["usage"] is None for e in sse_events(response) if e != "[DONE]")

    oa = openai.OpenAI(base_url=server.url + "/v1", api_key="key", max_retries=0)
    chunks = list(
        oa.chat.completions.create(
            model="tiny-gpt2",
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=3,
            stream=True,
            stream_options=options,
        )
    )
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    assert counts[0] == 0 and counts[-1] <= 3 and counts == sorted(counts)  # the role chunk, then 1, 2, ...


def test_stop_list_cap_follows_each_protocol(client):
    stops = ["zq1", "zq2", "zq3", "zq4", "zq5", "zq6"]
    assert (
        client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "stop": stops}).status_code
        == 200
    )
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "stop": stops}
    assert client.post("/v1/chat/completions", json=chat).status_code == 200
    tgi = client.post("/generate", json={"inputs": PROMPT, "parameters": {"stop": stops[:5]}})
    assert tgi.status_code == 422 and "at most 4 stop sequences" in tgi.json()["error"]
