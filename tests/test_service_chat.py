"""`/v1/chat/completions` over real HTTP: the default transcript template and one given with
`--chat-template`, plain and streaming, through the openai and huggingface_hub clients."""

from __future__ import annotations

import dataclasses

import pytest
from service_harness import backend_factory, running_server, sse_events

from wafer_gpt2.model import tokenizer
from wafer_gpt2.service.chat_template import DEFAULT_CHAT_TEMPLATE, ChatTemplateError, load_chat_template
from wafer_gpt2.settings import ServerSettings

MESSAGES = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "What holds every layer?"},
]
TRANSCRIPT = "System: You answer briefly.\nUser: What holds every layer?\nAssistant:"
# A template in the style of a model's own (HF's `chat_template`), with <|endoftext|> between turns.
CUSTOM_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools here') }}{% endif %}"
    "<{{ m['role'] }}>{{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.fixture(scope="module")
def settings() -> ServerSettings:
    return ServerSettings(backend="reference", model_id="tiny-gpt2", max_concurrent_requests=4, max_queue=8)


@pytest.fixture(scope="module")
def server(small_params, settings):
    with running_server(settings, backend_factory("reference", small_params, slots=4)) as running:
        yield running


@pytest.fixture
def client(server):
    with server.client() as c:
        yield c
    server.wait_idle()


def completion_of(client, prompt: str, **fields) -> dict:
    body = {"prompt": prompt, "temperature": 0, "max_tokens": 8, "stop": ["\nUser:"], **fields}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_default_template_is_a_transcript_the_model_continues(client):
    assert DEFAULT_CHAT_TEMPLATE.render(MESSAGES) == TRANSCRIPT
    body = {"model": "tiny-gpt2", "messages": MESSAGES, "max_tokens": 8, "temperature": 0}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    data = response.json()
    assert data["object"] == "chat.completion" and data["id"].startswith("chatcmpl-")
    (choice,) = data["choices"]
    # The same as completing the transcript (the default template adds the stop "\nUser:").
    expected = completion_of(client, TRANSCRIPT)
    assert choice["message"] == {"role": "assistant", "content": expected["choices"][0]["text"]}
    assert choice["finish_reason"] == expected["choices"][0]["finish_reason"]
    assert data["usage"] == expected["usage"]
    assert data["usage"]["prompt_tokens"] == len(tokenizer.encode(TRANSCRIPT))


def test_openai_client_chat_plain_and_streaming(server, client):
    import openai

    oa = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    chat = oa.chat.completions.create(
        model="tiny-gpt2", messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2
    )
    text = chat.choices[0].message.content
    assert chat.choices[0].message.role == "assistant"
    assert chat.usage.completion_tokens == len(chat.choices[0].logprobs.content) <= 6
    first = chat.choices[0].logprobs.content[0]
    assert len(first.top_logprobs) == 2 and first.top_logprobs[0].token == first.token  # greedy
    assert bytes(first.bytes).decode("utf-8", "replace") == first.token

    chunks = list(
        oa.chat.completions.create(
            model="tiny-gpt2",
            messages=MESSAGES,
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == chat.usage.total_tokens

    with pytest.raises(openai.BadRequestError, match="only text parts"):
        oa.chat.completions.create(
            model="tiny-gpt2",
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
        )

    # Over the context: vLLM's words (litellm's context-window fallback keys on them), naming the field.
    n_prompt = len(tokenizer.encode(TRANSCRIPT))
    with pytest.raises(openai.BadRequestError) as refused:
        oa.chat.completions.create(model="tiny-gpt2", messages=MESSAGES, max_completion_tokens=120)
    assert refused.value.body["message"] == (
        "'max_tokens' or 'max_completion_tokens' is too large: 120. This model's maximum context length is "
        f"128 tokens and your request has {n_prompt} input tokens (120 > 128 - {n_prompt})."
    )
    assert refused.value.param == "max_completion_tokens"
    with pytest.raises(openai.BadRequestError) as refused:
        oa.chat.completions.create(model="tiny-gpt2", messages=[{"role": "user", "content": "hi " * 130}])
    assert refused.value.param == "messages" and refused.value.body["message"].startswith(
        "This model's maximum context length is 128 tokens. However, your request has "
    )
    assert refused.value.body["message"].endswith(
        " input tokens. Please reduce the length of the input messages."
    )


def test_huggingface_chat_completion(server, client):
    from huggingface_hub import InferenceClient

    hf = InferenceClient(base_url=server.url)
    output = hf.chat_completion(MESSAGES, max_tokens=6, temperature=0.0, seed=1)
    expected = client.post(
        "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 6, "temperature": 0}
    ).json()
    assert output.choices[0].message.content == expected["choices"][0]["message"]["content"]
    streamed = "".join(
        chunk.choices[0].delta.content or ""
        for chunk in hf.chat_completion(MESSAGES, max_tokens=6, temperature=0.0, stream=True)
        if chunk.choices
    )
    assert streamed == output.choices[0].message.content


def test_stream_with_n_choices_and_text_parts(client):
    body = {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}],
            }
        ],
        "max_tokens": 4,
        "n": 2,
        "seed": 5,
        "temperature": 1.0,
        "stream": True,
    }
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        events = list(sse_events(response))
    assert events[-1] == "[DONE]"
    texts = {0: "", 1: ""}
    for event in events[:-1]:
        assert event["object"] == "chat.completion.chunk"
        (choice,) = event["choices"]
        texts[choice["index"]] += choice["delta"]["content"] or ""
    whole = client.post("/v1/chat/completions", json={**body, "stream": False}).json()
    assert [c["message"]["content"] for c in whole["choices"]] == [texts[0], texts[1]]
    assert whole["usage"]["prompt_tokens"] == len(tokenizer.encode("User: Hello\nthere\nAssistant:"))


def test_unknown_keys_in_messages_are_named_like_unknown_fields(client):
    messages = [
        {"role": "system", "content": "You answer briefly.", "foo": 1},
        {"role": "user", "content": "What holds every layer?", "name": "ada", "x-trace": {"id": 7}},
    ]
    body = {"messages": messages, "max_tokens": 2, "temperature": 0, "priority": 1}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.headers["x-ignored-fields"] == "priority, messages.0.foo, messages.1.x-trace"
    # Known message fields are not named; the prompt is the one the messages make without the unknown keys.
    assert response.json()["usage"]["prompt_tokens"] == len(tokenizer.encode(TRANSCRIPT))
    tokenized = client.post("/tokenize", json={"messages": messages})
    assert tokenized.headers["x-ignored-fields"] == "messages.0.foo, messages.1.x-trace"
    plain = client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2})
    assert "x-ignored-fields" not in plain.headers


def test_the_template_sees_the_known_message_fields_only():
    from wafer_gpt2.service.chat_template import ChatTemplate
    from wafer_gpt2.service.openai_chat import render_chat
    from wafer_gpt2.service.schemas import ChatCompletionRequest

    shown = ChatTemplate("{% for m in messages %}{{ m | tojson }}\n{% endfor %}")
    body = ChatCompletionRequest.model_validate(
        {
            "messages": [
                {"role": "user", "content": "Hi", "name": "ada", "foo": 1},
                {"role": "assistant", "content": None, "tool_calls": [], "bar": 2},
                {"role": "tool", "content": "42", "tool_call_id": "call-1"},
            ],
            "add_generation_prompt": False,
        }
    )
    assert render_chat(body, shown).splitlines() == [
        '{"role": "user", "content": "Hi", "name": "ada"}',
        '{"role": "assistant", "content": "", "tool_calls": []}',
        '{"role": "tool", "content": "42", "tool_call_id": "call-1"}',
    ]


@pytest.mark.parametrize(
    "body, param, message",
    [
        ({"messages": []}, "messages", "must hold at least one message"),
        ({"messages": [{"content": "hi"}]}, "messages.0.role", "Field required"),
        ({"messages": MESSAGES, "max_tokens": 0}, "max_tokens", "must be at least 1"),
        ({"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs", "needs `logprobs: true`"),
        ({"messages": MESSAGES, "tools": [{"type": "function"}]}, "tools", "tool calling is not supported"),
        ({"messages": MESSAGES, "chat_template": "{{ x }}"}, "chat_template", "--chat-template"),
        ({"messages": MESSAGES, "response_format": {"type": "json_object"}}, "response_format", "only"),
        ({"messages": MESSAGES, "model": "gpt-4"}, "model", "does not exist"),
    ],
)
def test_chat_errors_name_the_field(client, body, param, message):
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code in (400, 404), response.text
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"], error


def test_custom_template_from_the_command_line(small_params, settings, tmp_path):
    path = tmp_path / "template.jinja"
    path.write_text(CUSTOM_TEMPLATE)
    template = load_chat_template(str(path))
    rendered = template.render(MESSAGES)
    assert (
        rendered
        == "<system>You answer briefly.<|endoftext|><user>What holds every layer?<|endoftext|><assistant>"
    )
    with pytest.raises(ChatTemplateError, match="line 1"):
        load_chat_template("{% for %}")
    with pytest.raises(ChatTemplateError, match="no such file"):
        load_chat_template(str(tmp_path / "missing.jinja"))

    custom = dataclasses.replace(settings, chat_template=template.source)
    with (
        running_server(custom, backend_factory("reference", small_params, slots=1)) as running,
        running.client() as c,
    ):
        body = {"messages": MESSAGES, "max_tokens": 5, "temperature": 0}
        data = c.post("/v1/chat/completions", json=body).json()
        # eos_token in the template is the <|endoftext|> token (one id), as vLLM tokenizes it.
        ids = tokenizer.encode(rendered, allow_special=True)
        assert ids.count(tokenizer.EOT_ID) == 2
        assert data["usage"]["prompt_tokens"] == len(ids)
        expected = c.post("/v1/completions", json={"prompt": ids, "max_tokens": 5, "temperature": 0}).json()
        assert data["choices"][0]["message"]["content"] == expected["choices"][0]["text"]
        refused = c.post("/v1/chat/completions", json={"messages": [{"role": "tool", "content": "x"}]})
        assert refused.status_code == 400 and "no tools here" in refused.json()["error"]["message"]
        continued = c.post(
            "/v1/chat/completions",
            json={
                "messages": [*MESSAGES, {"role": "assistant", "content": "The wafer"}],
                "continue_final_message": True,
                "add_generation_prompt": False,
                "max_tokens": 3,
                "temperature": 0,
            },
        ).json()
        prefix = rendered.removesuffix("<assistant>") + "<assistant>The wafer"
        assert continued["usage"]["prompt_tokens"] == len(tokenizer.encode(prefix, allow_special=True))


def test_serve_refuses_a_bad_template_before_listening(tmp_path, capsys):
    from wafer_gpt2.cli.main import main

    path = tmp_path / "broken.jinja"
    path.write_text("{% if %}")
    assert main(["serve", "--backend", "reference", "--chat-template", str(path), "--port", "0"]) == 2
    assert "--chat-template" in capsys.readouterr().err
