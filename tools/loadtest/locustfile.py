"""Locust load test of wafer-gpt2's generation routes: /generate, /generate_stream, /v1/completions.

Every simulated user sends a realistic mix: prompts short, medium or long (cut from `corpus.txt` to an
exact token count with the server's tokenizer), `max_new_tokens` from 16 to 128, greedy or sampled,
on the three routes (the OpenAI route half of the time streamed). Prompt plus new tokens always fit the
context the server reports in /info, so every request should succeed: any failure is a real one.

Locust times a streamed response only up to its headers, so each stream is timed here, in the task,
and reported as custom `METRIC` events (locust then keeps their percentiles like any request's):
  time_to_first_token   ms from sending the request to the first event that carries text
  inter_token_latency   ms between consecutive token events (one sample per gap)
  stream_tokens_per_s   a stream's generated tokens / its whole duration (the value is in the
                        response-time columns)
  generated_tokens      one sample per successful request of any route: its generated tokens as the
                        content size, so requests/s x average size = generated tokens/s

    locust -f tools/loadtest/locustfile.py --headless -u 16 -r 16 -t 60s -H http://127.0.0.1:8000

`tools/loadtest/run.py` (`make loadtest`) starts a server, runs this and prints a one-line summary.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

import requests
from locust import HttpUser, between, events, task

from wafer_gpt2.model import tokenizer

CORPUS_FILE = Path(__file__).with_name("corpus.txt")
# (share of requests, fewest tokens, most tokens): chat-like turns, paragraphs, long documents.
PROMPT_MIX = ((0.50, 4, 32), (0.35, 48, 96), (0.15, 128, 192))
# (share of requests, max_new_tokens)
NEW_TOKENS_MIX = ((0.35, 16), (0.30, 32), (0.25, 64), (0.10, 128))
METRIC = "METRIC"
# The server's API key, when it has one (the service's own variable): sent with every request.
AUTH = {"Authorization": f"Bearer {key}"} if (key := os.environ.get("WAFER_GPT2_API_KEY")) else {}


@dataclass(frozen=True)
class Workload:
    """What the server allows (from /info) and the token ids prompts are cut from."""

    context: int
    max_new_tokens: int
    max_input_tokens: int
    corpus_ids: tuple[int, ...]

    @classmethod
    def from_server(cls, host: str) -> Workload:
        info = requests.get(host.rstrip("/") + "/info", headers=AUTH, timeout=30)
        info.raise_for_status()
        limits = info.json()
        ids = tuple(tokenizer.encode(" ".join(CORPUS_FILE.read_text().split())))
        return cls(limits["max_total_tokens"], limits["max_new_tokens"], limits["max_input_tokens"], ids)

    def request(self, rng: random.Random) -> tuple[str, int]:
        """A prompt and a max_new_tokens that fit the context together."""
        max_new = _pick(rng, NEW_TOKENS_MIX)
        max_new = min(max_new, self.max_new_tokens, self.context // 2)
        low, high = _pick(rng, PROMPT_MIX)
        n = min(rng.randint(low, high), self.context - max_new, self.max_input_tokens)
        start = rng.randrange(len(self.corpus_ids) - n)
        prompt = tokenizer.decode(self.corpus_ids[start : start + n])
        # Decoding a slice and encoding it again can merge tokens at the edges: count what the server sees.
        n_prompt = len(tokenizer.encode(prompt))
        return prompt, min(max_new, self.context - n_prompt)


def _pick(rng: random.Random, mix: tuple) -> tuple | int:
    _share, *choice = rng.choices(mix, weights=[m[0] for m in mix])[0]
    return choice[0] if len(choice) == 1 else tuple(choice)


WORKLOAD: Workload | None = None
USER_SEEDS = itertools.count(1)


@events.test_start.add_listener
def read_server_limits(environment, **kwargs) -> None:
    global WORKLOAD
    WORKLOAD = Workload.from_server(environment.host)


def sampling(rng: random.Random) -> dict:
    """Half greedy, half sampled with a seed (the parameters most clients send)."""
    if rng.random() < 0.5:
        return {}
    return {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "seed": rng.randrange(2**32)}


def sse_payloads(response: requests.Response):
    """The `data:` payloads of a Server-Sent Events response, as each event arrives.

    Raw bytes are buffered until an event's blank line: an HTTP chunk may hold part of an event, or
    split a multi-byte character.
    """
    buffer = b""
    for chunk in response.iter_content(chunk_size=None):
        buffer = (buffer + chunk).replace(b"\r\n", b"\n")
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            for line in event.split(b"\n"):
                if line.startswith(b"data:"):
                    yield line[len(b"data:") :].strip().decode("utf-8")


def generated_tokens(response, count) -> int | None:
    """`count(body)` of a successful JSON response; None (and the request marked failed) otherwise."""
    if response.status_code != 200:
        response.failure(f"HTTP {response.status_code}: {response.text[:300]}")
        return None
    try:
        return int(count(response.json()))
    except (ValueError, KeyError, TypeError) as exc:
        response.failure(f"unexpected body ({type(exc).__name__}: {exc}): {response.text[:300]}")
        return None


class StreamTimer:
    """Times one stream's tokens as they arrive."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.first_text: float | None = None
        self.last: float | None = None
        self.gaps: list[float] = []
        self.tokens = 0

    def token(self, text: str) -> None:
        now = time.perf_counter()
        if self.last is not None:
            self.gaps.append(now - self.last)
        self.last = now
        self.tokens += 1
        if self.first_text is None and text:
            self.first_text = now


class LLMUser(HttpUser):
    """One client: a request, a short pause to read it, the next request."""

    wait_time = between(0.1, 0.5)

    def on_start(self) -> None:
        self.rng = random.Random(next(USER_SEEDS))
        self.client.headers.update(AUTH)

    def metric(self, name: str, value: float, size: int = 0) -> None:
        self.environment.events.request.fire(
            request_type=METRIC,
            name=name,
            response_time=value,
            response_length=size,
            exception=None,
            context={},
        )

    def report_stream(self, timer: StreamTimer, generated: int) -> None:
        end = timer.last or time.perf_counter()
        if timer.first_text is not None:
            self.metric("time_to_first_token", (timer.first_text - timer.start) * 1000)
        for gap in timer.gaps:
            self.metric("inter_token_latency", gap * 1000)
        self.metric("stream_tokens_per_s", generated / max(end - timer.start, 1e-9))
        self.metric("generated_tokens", (end - timer.start) * 1000, generated)

    # ----- the routes ------------------------------------------------------------------------------

    @task(3)
    def generate(self) -> None:
        prompt, max_new = WORKLOAD.request(self.rng)
        body = {
            "inputs": prompt,
            "parameters": {"max_new_tokens": max_new, "details": True, **sampling(self.rng)},
        }
        started = time.perf_counter()
        with self.client.post("/generate", json=body, catch_response=True) as response:
            generated = generated_tokens(response, lambda data: data["details"]["generated_tokens"])
        if generated is not None:
            self.metric("generated_tokens", (time.perf_counter() - started) * 1000, generated)

    @task(4)
    def generate_stream(self) -> None:
        prompt, max_new = WORKLOAD.request(self.rng)
        body = {
            "inputs": prompt,
            "parameters": {"max_new_tokens": max_new, "details": True, **sampling(self.rng)},
        }
        timer = StreamTimer()
        with self.client.post("/generate_stream", json=body, stream=True, catch_response=True) as response:
            if response.status_code != 200:
                response.failure(f"HTTP {response.status_code}: {response.text[:300]}")
                return
            final = None
            try:
                for payload in sse_payloads(response):
                    event = json.loads(payload)
                    if "error" in event:
                        response.failure(f"error event: {event['error']}")
                        return
                    timer.token(event["token"]["text"])
                    if event.get("generated_text") is not None:
                        final = event
            except (requests.RequestException, ValueError, KeyError) as exc:
                response.failure(f"broken stream: {type(exc).__name__}: {exc}")
                return
            if final is None:
                response.failure(f"the stream ended after {timer.tokens} tokens without its final event")
                return
        self.report_stream(timer, final["details"]["generated_tokens"])

    @task(3)
    def completions(self) -> None:
        prompt, max_new = WORKLOAD.request(self.rng)
        body = {"prompt": prompt, "max_tokens": max_new, **sampling(self.rng)}
        if "temperature" not in body:
            body["temperature"] = 0.0  # OpenAI's default is 1.0 (sampling); 0 is greedy
        if self.rng.random() < 0.5:
            self.completions_stream(body)
            return
        started = time.perf_counter()
        with self.client.post("/v1/completions", json=body, catch_response=True) as response:
            generated = generated_tokens(response, lambda data: data["usage"]["completion_tokens"])
        if generated is not None:
            self.metric("generated_tokens", (time.perf_counter() - started) * 1000, generated)

    def completions_stream(self, body: dict) -> None:
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        timer = StreamTimer()
        name = "/v1/completions (stream)"
        with self.client.post(
            "/v1/completions", name=name, json=body, stream=True, catch_response=True
        ) as response:
            if response.status_code != 200:
                response.failure(f"HTTP {response.status_code}: {response.text[:300]}")
                return
            usage, done = None, False
            try:
                for payload in sse_payloads(response):
                    if payload == "[DONE]":
                        done = True
                        break
                    chunk = json.loads(payload)
                    if "error" in chunk:
                        response.failure(f"error event: {chunk['error']}")
                        return
                    for choice in chunk["choices"]:
                        timer.token(choice["text"])
                    usage = chunk.get("usage") or usage
            except (requests.RequestException, ValueError, KeyError) as exc:
                response.failure(f"broken stream: {type(exc).__name__}: {exc}")
                return
            if not done or usage is None:
                response.failure(f"the stream ended after {timer.tokens} tokens without usage and [DONE]")
                return
        self.report_stream(timer, usage["completion_tokens"])
