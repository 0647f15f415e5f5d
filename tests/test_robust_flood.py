"""Flood: many times more concurrent clients than the server has KV slots.

What it guarantees: a request beyond what the server can hold (running batch + bounded queue) is refused
with 429 at once, before any accepted request could have finished; every accepted request completes with
its full answer; nothing gets a 5xx; and /health keeps answering promptly all through the flood.
"""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import pytest
from service_harness import SlowBackend, backend_factory, running_server

from wafer_gpt2.settings import ServerSettings

SLOTS, QUEUE = 4, 4
CLIENTS = 96  # 24 x the slots, 12 x what the server holds
NEW_TOKENS = 40
STEP_DELAY_S = 0.06  # every step takes at least this: an accepted request runs >= 2.4 s
HEALTH_LIMIT_S = 1.0
PROMPT = "The flood came over the river banks"
ROUTES = ("/generate", "/generate_stream", "/v1/completions")


@pytest.fixture(scope="module")
def server(small_params):
    settings = ServerSettings(
        backend="sim", model_id="flood", dtype="fp32", max_concurrent_requests=SLOTS, max_queue=QUEUE
    )

    def factory():
        return SlowBackend(backend_factory("sim", small_params, slots=SLOTS)(), STEP_DELAY_S)

    with running_server(settings, factory) as running:
        yield running


def request_for(route: str) -> dict:
    if route == "/v1/completions":
        return {"prompt": PROMPT, "max_tokens": NEW_TOKENS, "ignore_eos": True, "stream": True}
    return {"inputs": PROMPT, "parameters": {"max_new_tokens": NEW_TOKENS, "details": True}}


async def one_client(client: httpx.AsyncClient, route: str) -> dict:
    """Status, seconds to the answer (to its end, for a stream) and the tokens received."""
    started = time.perf_counter()
    async with client.stream("POST", route, json=request_for(route)) as response:
        body = await response.aread()
    result = {"route": route, "status": response.status_code, "seconds": time.perf_counter() - started}
    text = body.decode()
    if response.status_code != 200:
        result["error"] = json.loads(text)
    elif route == "/generate":
        result["tokens"] = json.loads(text)["details"]["generated_tokens"]
    else:
        events = [line[len("data:") :].strip() for line in text.splitlines() if line.startswith("data:")]
        result["errors"] = [e for e in events if '"error"' in e]
        result["tokens"] = sum(1 for e in events if e != "[DONE]" and '"error"' not in e)
        result["finished"] = (
            events[-1] == "[DONE]" if route == "/v1/completions" else '"details":{' in events[-1]
        )
    return result


async def poll_health(client: httpx.AsyncClient, flood: asyncio.Future) -> list[tuple[int, float]]:
    answers = []
    while not flood.done():
        started = time.perf_counter()
        response = await client.get("/health")
        answers.append((response.status_code, time.perf_counter() - started))
        await asyncio.sleep(0.05)
    return answers


async def flood(url: str) -> tuple[list[dict], list[tuple[int, float]]]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
        clients = asyncio.gather(*(one_client(client, ROUTES[i % len(ROUTES)]) for i in range(CLIENTS)))
        health = asyncio.create_task(poll_health(client, clients))
        return await clients, await health


@pytest.mark.slow  # among the slowest tests (make test-fast leaves it out)
def test_a_flood_gets_429_at_once_and_every_accepted_request_completes(server):
    results, health = asyncio.run(flood(server.url))

    statuses = sorted({r["status"] for r in results})
    assert statuses == [200, 429], f"statuses {statuses}: only 200 and 429 are acceptable, never a 5xx"
    accepted = [r for r in results if r["status"] == 200]
    refused = [r for r in results if r["status"] == 429]
    # Nothing finished while the flood arrived, so at most the running batch and the queue got in.
    assert QUEUE <= len(accepted) <= SLOTS + QUEUE, f"{len(accepted)} accepted"

    # "At once": every refusal came back before any accepted request could have finished.
    slowest_refusal = max(r["seconds"] for r in refused)
    fastest_success = min(r["seconds"] for r in accepted)
    assert slowest_refusal < NEW_TOKENS * STEP_DELAY_S <= fastest_success, (slowest_refusal, fastest_success)
    for r in refused:
        message = r["error"]["error"]["message"] if r["route"] == "/v1/completions" else r["error"]["error"]
        assert f"queue limit {QUEUE}" in message, r

    for r in accepted:  # complete answers, no error inside a stream
        assert r["tokens"] == NEW_TOKENS, r
        assert not r.get("errors") and r.get("finished", True), r

    # The server stayed responsive: /health answered 200 promptly, all through the flood.
    assert len(health) >= 10, f"only {len(health)} health checks during the flood"
    assert all(status == 200 for status, _ in health), health
    assert max(seconds for _, seconds in health) < HEALTH_LIMIT_S, health

    server.wait_idle(timeout=10)
    with server.client() as c:
        metrics = c.get("/metrics").text
        refused_count = re.search(r'tgi_request_failure\{err="overloaded"\} (\S+)', metrics)
        assert refused_count and float(refused_count[1]) == len(refused)
        after = c.post("/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 2}})
        assert after.status_code == 200  # the flood left nothing behind
