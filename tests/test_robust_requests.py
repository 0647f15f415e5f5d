"""One request must never take the others down: hostile or careless requests against a real server.

What it guarantees (simulator backend, a small model, uvicorn on 127.0.0.1):
- sampling parameters beyond what the sampler's arithmetic carries (a temperature or repetition penalty
  of 1e-320, with and without top_p) are refused with a 4xx naming the field, while a stream beside them
  runs to its end, the worker never reloads and /health stays 200;
- a failure while one request's token is chosen or detokenized ends that request alone (a 500 or an
  error event, whose message carries no internal exception text), never the others and never a reload;
- prompts of 990 KB are refused by their length in characters before they are tokenized, and prompts
  that are tokenized are tokenized off the event loop: /health answers within 0.5 s all through a
  flood of them (tokenizing one on the loop would stall it for longer than that);
- a model whose vocabulary is padded beyond the tokenizer's (50304 rows, 50257 tokens) never emits an id
  the tokenizer does not know, and a prompt of such ids is refused naming the field;
- bodies Python's json cannot take (arrays nested 100,000 deep, an integer of 4,400 digits) get a 4xx
  naming the limit on every route that reads a body, and the connection stays open for the next request.
"""

from __future__ import annotations

import http.client
import json
import re
import sys
import threading
import time

import httpx
import pytest
from service_harness import backend_factory, run_concurrently, running_server, sse_events

from wafer_gpt2.engine.detokenizer import IncrementalDetokenizer
from wafer_gpt2.model import tokenizer
from wafer_gpt2.model.config import GPT2Config
from wafer_gpt2.model.params import GPT2Params
from wafer_gpt2.settings import ServerSettings

SLOTS = 4
PROMPT = "One request must not take the others down"
LONG = 40


@pytest.fixture(scope="module")
def server(small_params):
    settings = ServerSettings(
        backend="sim", model_id="robust", dtype="fp32", max_concurrent_requests=SLOTS, max_queue=8
    )
    with running_server(settings, backend_factory("sim", small_params, slots=SLOTS)) as running:
        yield running


def restarts(client: httpx.Client) -> float:
    return float(re.search(r"^wafer_engine_restarts_total (\S+)$", client.get("/metrics").text, re.M)[1])


class Stream(threading.Thread):
    """A long OpenAI stream in a thread: its events, and whether it ended with [DONE] and no error."""

    def __init__(self, url: str, max_tokens: int = LONG, **extra):
        super().__init__(daemon=True)
        self.url, self.body = url, {"prompt": PROMPT, "max_tokens": max_tokens, "stream": True, **extra}
        self.events: list = []
        self.started = threading.Event()

    def run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=60) as client:
            with client.stream("POST", "/v1/completions", json={"ignore_eos": True, **self.body}) as response:
                for event in sse_events(response):
                    self.events.append(event)
                    self.started.set()
        self.started.set()

    def finished_cleanly(self) -> bool:
        errors = [e for e in self.events if isinstance(e, dict) and "error" in e]
        return not errors and self.events[-1] == "[DONE]"


@pytest.mark.parametrize(
    ("route", "body", "status", "field"),
    [
        ("/generate", {"parameters": {"temperature": 1e-320, "top_p": 0.5}}, 422, "temperature"),
        ("/generate", {"parameters": {"temperature": 1e-320}}, 422, "temperature"),
        (
            "/generate",
            {"parameters": {"repetition_penalty": 1e-320, "top_p": 0.9}},
            422,
            "repetition_penalty",
        ),
        ("/v1/completions", {"temperature": 1e-320, "top_p": 0.5}, 400, "temperature"),
        ("/v1/completions", {"repetition_penalty": 1e-320, "top_p": 0.9}, 400, "repetition_penalty"),
    ],
)
def test_sampling_parameters_beyond_the_math_are_refused_and_nobody_else_notices(
    server, route, body, status, field
):
    with server.client() as client:
        before = restarts(client)
        beside = Stream(server.url)
        beside.start()
        assert beside.started.wait(30)
        key = "inputs" if route == "/generate" else "prompt"
        extra = {"max_new_tokens": 8} if route == "/generate" else {"max_tokens": 8}
        if route == "/generate":
            request = {key: PROMPT, "parameters": {**body["parameters"], **extra}}
        else:
            request = {key: PROMPT, **body, **extra}
        for _ in range(3):
            response = client.post(route, json=request)
            assert response.status_code == status, response.text
            assert field in response.text, response.text
            assert client.get("/health").status_code == 200
        beside.join(60)
        assert beside.finished_cleanly(), beside.events[-3:]
        assert restarts(client) == before
    server.wait_idle()


MARKER = "<<detokenizer fault>>"


def test_a_failure_in_one_requests_detokenizer_fails_that_request_alone(server, monkeypatch):
    real_add = IncrementalDetokenizer.add

    def add(self: IncrementalDetokenizer, token: int, **kwargs):
        if MARKER in self._stops:
            raise KeyError("internal detail 0xdeadbeef")
        return real_add(self, token, **kwargs)

    monkeypatch.setattr(IncrementalDetokenizer, "add", add)
    with server.client() as client:
        before = restarts(client)
        beside = Stream(server.url)
        beside.start()
        assert beside.started.wait(30)
        failed = client.post(
            "/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 8, "stop": [MARKER]}}
        )
        assert failed.status_code == 500, failed.text
        assert failed.json()["error_type"] == "incomplete_generation"
        assert "0xdeadbeef" not in failed.text and "KeyError" not in failed.text
        failed_stream = Stream(server.url, max_tokens=8, stop=[MARKER])
        failed_stream.run()
        error = failed_stream.events[-2]["error"]
        assert error["code"] == 500 and "0xdeadbeef" not in error["message"], failed_stream.events
        assert client.get("/health").status_code == 200
        beside.join(60)
        assert beside.finished_cleanly(), beside.events[-3:]
        assert restarts(client) == before
        again = client.post("/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 4}})
        assert again.status_code == 200, again.text
    server.wait_idle()


def test_a_vocabulary_padded_beyond_the_tokenizer_never_emits_unknown_ids():
    config = GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=50304, n_positions=64, name="padded")
    params = GPT2Params.random(config, seed=7)
    # Random weights, the padded rows (50257..50303) made louder: unguarded, they come first.
    params.wte[50257:] *= 3.0
    settings = ServerSettings(backend="sim", model_id="padded", dtype="fp32", max_concurrent_requests=2)
    with (
        running_server(settings, backend_factory("sim", params, slots=2, top_k=16)) as running,
        running.client() as client,
    ):
        for body in (
            {"prompt": PROMPT, "max_tokens": 24, "ignore_eos": True, "logprobs": 3},
            {"prompt": PROMPT, "max_tokens": 24, "ignore_eos": True, "temperature": 1.5, "seed": 1},
        ):
            response = client.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            tokens = response.json()["choices"][0]["logprobs"]["tokens"] if "logprobs" in body else []
            assert all(not t.startswith("<|unknown") for t in tokens)
        details = client.post(
            "/generate",
            json={"inputs": PROMPT, "parameters": {"max_new_tokens": 24, "details": True, "top_n_tokens": 3}},
        )
        assert details.status_code == 200, details.text
        ids = [t["id"] for t in details.json()["details"]["tokens"]]
        ids += [t["id"] for top in details.json()["details"]["top_tokens"] for t in top]
        assert max(ids) < 50257, ids
        refused = client.post("/v1/completions", json={"prompt": [50300, 11], "max_tokens": 2})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt", refused.text
        assert "50300" in refused.text
        assert running.engine.restarts == 0


def test_429_and_503_say_when_to_retry(small_params):
    # One slot, no queue: a second request while one runs is refused with 429.
    settings = ServerSettings(backend="sim", dtype="fp32", max_concurrent_requests=1, max_queue=0)
    with running_server(settings, backend_factory("sim", small_params, slots=1)) as server:
        beside = Stream(server.url, max_tokens=60)
        beside.start()
        assert beside.started.wait(30)
        with server.client() as client:
            for route, body in (
                ("/generate", {"inputs": PROMPT, "parameters": {"max_new_tokens": 2}}),
                ("/v1/completions", {"prompt": PROMPT, "max_tokens": 2}),
            ):
                refused = client.post(route, json=body)
                assert refused.status_code == 429, refused.text
                assert int(refused.headers["retry-after"]) >= 1, refused.headers
            beside.join(60)
            server.engine.begin_drain()  # shutting down: 503 with a hint to retry (elsewhere) later
            draining = client.post("/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 2}})
            assert draining.status_code == 503 and int(draining.headers["retry-after"]) >= 1, draining.headers
            health = client.get("/health")
            assert health.status_code == 503 and int(health.headers["retry-after"]) >= 1, health.headers


class HealthLatency(threading.Thread):
    """Polls /health every 20 ms and keeps the slowest answer's time."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.slowest, self.stop = url, 0.0, threading.Event()

    def run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=30) as client:
            while not self.stop.is_set():
                started = time.monotonic()
                assert client.get("/health").status_code == 200
                self.slowest = max(self.slowest, time.monotonic() - started)
                time.sleep(0.02)


def flood_of_huge_prompts(url: str, route: str) -> list[httpx.Response]:
    prompt = "a" * 990_000  # one pre-token: the slowest text per character for BPE
    body = {"inputs": prompt} if route == "/generate" else {"prompt": [prompt], "max_tokens": 2}
    calls = [lambda: httpx.post(url + route, json=body, timeout=60) for _ in range(10)]
    return run_concurrently(calls)


@pytest.mark.parametrize("route", ["/generate", "/v1/completions"])
def test_huge_prompts_are_bounded_by_characters_before_tokenizing(server, route):
    watch = HealthLatency(server.url)
    watch.start()
    try:
        answers = flood_of_huge_prompts(server.url, route)
    finally:
        watch.stop.set()
        watch.join(10)
    limit = 127 * tokenizer.longest_token_chars()  # the small model: 128 positions
    for answer in answers:
        assert answer.status_code in (400, 422), answer.text
        assert f"at most {limit} characters" in answer.text and "990000" in answer.text, answer.text
    assert watch.slowest < 0.5, f"/health took {watch.slowest:.2f} s during the flood"


def test_tokenizing_runs_off_the_event_loop(small_params):
    # The character bound raised out of the way: ten 990 KB prompts are tokenized, and /health answers.
    settings = ServerSettings(
        backend="sim", dtype="fp32", max_concurrent_requests=2, max_input_chars=2_000_000
    )
    with running_server(settings, backend_factory("sim", small_params, slots=2)) as running:
        watch = HealthLatency(running.url)
        watch.start()
        try:
            answers = flood_of_huge_prompts(running.url, "/generate")
        finally:
            watch.stop.set()
            watch.join(10)
    for answer in answers:
        assert answer.status_code == 422 and "must have at most 127 tokens" in answer.text, answer.text
    assert watch.slowest < 0.5, f"/health took {watch.slowest:.2f} s while prompts were tokenized"


def test_echoed_lone_surrogates_come_back_escaped_not_as_500(server):
    with server.client() as client:
        inputs = "Lone \ud800 surrogate"
        body = {"inputs": inputs, "parameters": {"max_new_tokens": 3, "return_full_text": True}}
        response = client.post(
            "/generate", content=json.dumps(body), headers={"content-type": "application/json"}
        )
        assert response.status_code == 200, response.text
        assert response.json()["generated_text"].startswith(inputs)
        body = {"model": "gpt\udc00", "prompt": PROMPT, "max_tokens": 2}
        response = client.post(
            "/v1/completions", content=json.dumps(body), headers={"content-type": "application/json"}
        )
        assert response.status_code == 404, response.text
        assert (
            response.json()["error"]["param"] == "model"
            and "gpt\udc00" in response.json()["error"]["message"]
        )
        body = {"prompt": PROMPT, "max_tokens": 4, "stop": ["\ud83d"], "echo": True}
        response = client.post(
            "/v1/completions", content=json.dumps(body), headers={"content-type": "application/json"}
        )
        assert response.status_code == 200, response.text


# Every route that reads a body, and the status its family answers a bad body with.
BODY_ROUTES = [
    ("/generate", 422),
    ("/generate_stream", 422),
    ("/", 422),
    ("/tokenize", 422),
    ("/invocations", 422),
    ("/v1/completions", 400),
    ("/v1/chat/completions", 400),
    ("/detokenize", 400),
]
HOSTILE_BODIES = [
    (b"[" * 100_000 + b"]" * 100_000, "nests arrays and objects too deeply"),
    (
        b'{"inputs": "hi", "prompt": "hi", "messages": [{"role": "user", "content": "hi"}], "tokens": [1], '
        b'"seed": ' + b"7" * 4400 + b"}",
        f"integer of more than {sys.get_int_max_str_digits()} digits",
    ),
]


@pytest.mark.parametrize(("route", "status"), BODY_ROUTES)
def test_bodies_json_cannot_take_get_a_4xx_and_the_connection_stays_open(server, route, status):
    host, port = server.url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        for body, reason in HOSTILE_BODIES:
            connection.request("POST", route, body=body, headers={"Content-Type": "application/json"})
            response = connection.getresponse()
            text = response.read().decode()
            assert response.status == status, text
            error = json.loads(text)["error"]
            assert reason in (error if status == 422 else error["message"]), text
            assert response.getheader("connection") != "close"
            sock = connection.sock
            # The next request goes out on the same connection and is answered there.
            connection.request("GET", "/health")
            health = connection.getresponse()
            health.read()
            assert health.status == 200 and connection.sock is sock and sock is not None
    finally:
        connection.close()


def test_an_unexpected_error_answers_without_its_internal_text(server, monkeypatch, caplog):
    from wafer_gpt2.service.routes import tgi_routes

    def broken(*args, **kwargs):
        raise RuntimeError("secret internal state 0xfeedface")

    monkeypatch.setattr(tgi_routes, "tgi_response", broken)
    with server.client() as client:
        response = client.post("/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 2}})
    assert response.status_code == 500, response.text
    assert "0xfeedface" not in response.text and "RuntimeError" not in response.text, response.text
    reference = re.search(r"reference (\w+)", response.json()["error"])[1]
    logged = [r for r in caplog.records if reference in r.getMessage()]
    assert logged and logged[0].exc_info is not None  # the details are in the log, under that reference


def failures(client: httpx.Client, reason: str) -> float:
    found = re.search(rf'^tgi_request_failure\{{err="{reason}"\}} (\S+)$', client.get("/metrics").text, re.M)
    return float(found[1]) if found else 0.0


def test_a_key_outside_latin1_works_and_refusals_are_counted(small_params):
    key = "clé-🔑-ключ"
    settings = ServerSettings(
        backend="sim", dtype="fp32", max_concurrent_requests=1, api_key=key, max_body_bytes=1000
    )
    with (
        running_server(settings, backend_factory("sim", small_params, slots=1)) as running,
        running.client() as client,
    ):
        body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 2}}
        good = client.post("/generate", json=body, headers={"Authorization": f"Bearer {key}".encode()})
        assert good.status_code == 200, good.text
        auth_before, size_before = failures(client, "authentication"), failures(client, "validation")
        wrong = client.post("/generate", json=body, headers={"Authorization": "Bearer clé".encode()})
        assert wrong.status_code == 401
        too_big = client.post(
            "/generate", json={"inputs": "x" * 2000}, headers={"Authorization": f"Bearer {key}".encode()}
        )
        assert too_big.status_code == 413
        for refused in (wrong, too_big):  # the guards' refusals carry the request id like any answer
            assert refused.headers.get("x-request-id"), refused.headers
        assert failures(client, "authentication") == auth_before + 1
        assert failures(client, "validation") == size_before + 1
