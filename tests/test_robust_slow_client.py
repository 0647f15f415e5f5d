"""Slow clients: a reader that does not consume its stream, and a sender that never finishes its body.

What it guarantees: a client that stops reading its stream holds only its own request. The engine
generates its tokens at full speed without waiting for it (the slot is freed when its generation ends,
not when the client reads), other requests run as fast as they do beside a client that reads, and when
the slow reader finally reads, its stream is complete. A client that sends headers and part of a body,
then nothing, holds no slot and delays nobody.

The slow readers ask for big streams (a TGI stream with 64 alternatives per token, ~450 KB; an OpenAI
stream of 8 choices with 5 logprobs per token, ~420 KB). So that they push back on the server itself,
and do not just fill kernel buffers (Linux lets a send buffer grow to 4 MB, more than a whole stream),
the server's connections get an 8 KB send buffer and the readers a 4 KB receive buffer: all but a few
tens of KB must wait inside the server, whose writes to those connections stall.
"""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
from service_harness import backend_factory, run_concurrently, running_server, wait_until

from wafer_gpt2.settings import ServerSettings

SLOTS = 13
PROMPT = "A reader who never reads"
BIG_STREAM = {  # 8 sequences: 8 of the slots
    "prompt": PROMPT,
    "max_tokens": 100,
    "n": 8,
    "logprobs": 5,
    "stream": True,
    "ignore_eos": True,
}
TOP_N = 64  # the server allows all the wafer's candidates per token: ~4.5 KB per event
BIG_TGI_STREAM = {
    "inputs": PROMPT,
    "parameters": {"max_new_tokens": 100, "top_n_tokens": TOP_N, "details": True},
}
SERVER_SEND_BUFFER = 8192
READER_RECEIVE_BUFFER = 4096
NORMAL_TOKENS = 20


@pytest.fixture(scope="module")
def server(small_params):
    settings = ServerSettings(
        backend="sim", model_id="slow", dtype="fp32", max_concurrent_requests=SLOTS, max_top_n_tokens=TOP_N
    )
    with running_server(settings, backend_factory("sim", small_params, slots=SLOTS)) as running:
        # Accepted connections inherit the listening socket's buffer size (and skip its autotuning).
        listener = running.server.servers[0].sockets[0]
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SERVER_SEND_BUFFER)
        yield running


def raw_request(url: str, path: str, body: bytes, declared_length: int | None = None) -> socket.socket:
    """A connection that sends a POST (or part of one) and reads nothing until told to."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, READER_RECEIVE_BUFFER)
    sock.connect((host, int(port)))
    length = len(body) if declared_length is None else declared_length
    head = f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
    sock.sendall(head.encode() + body)
    return sock


def read_to_the_end(sock: socket.socket) -> bytes:
    sock.settimeout(20)
    data = b""
    while not data.endswith(b"0\r\n\r\n"):  # the last chunk of a chunked response
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    sock.close()
    return data


def normal_requests(url: str) -> list[float]:
    """Four requests on the three routes at once; each must succeed. Their latencies, in seconds."""

    def timed(route: str, body: dict):
        def call() -> float:
            started = time.monotonic()
            with httpx.Client(base_url=url, timeout=30) as client:
                response = client.post(route, json=body)
                assert response.status_code == 200, response.text
                # No error object, in the body or in any event (the generated text itself may say "error").
                if body.get("stream") or route.endswith("_stream"):
                    payloads = [line[len("data:") :].strip() for line in response.text.splitlines()]
                    events = [json.loads(p) for p in payloads if p.startswith("{")]
                else:
                    events = [response.json()]
                assert events and not any("error" in event for event in events), response.text
            return time.monotonic() - started

        return call

    tgi = {"inputs": PROMPT, "parameters": {"max_new_tokens": NORMAL_TOKENS}}
    openai = {"prompt": PROMPT, "max_tokens": NORMAL_TOKENS}
    calls = [
        timed("/generate", tgi),
        timed("/generate_stream", tgi),
        timed("/v1/completions", openai),
        timed("/v1/completions", {**openai, "stream": True}),
    ]
    return run_concurrently(calls)


def test_readers_that_do_not_read_stall_nobody(server):
    engine = server.engine
    big_streams = (("/v1/completions", BIG_STREAM), ("/generate_stream", BIG_TGI_STREAM))
    big_sequences = BIG_STREAM["n"] + 1

    # Control: the same big streams with clients that read them, beside the normal requests.
    with httpx.Client(base_url=server.url, timeout=30) as client:
        with (
            client.stream("POST", big_streams[0][0], json=big_streams[0][1]) as first,
            client.stream("POST", big_streams[1][0], json=big_streams[1][1]) as second,
        ):
            assert first.status_code == second.status_code == 200
            wait_until(lambda: engine.queue_sizes()[1] >= big_sequences, timeout=10)
            beside_readers = normal_requests(server.url)
            first.read()
            second.read()
    server.wait_idle()

    # Now readers that do not read, and a sender that stops half-way through its body.
    slow = [raw_request(server.url, path, json.dumps(body).encode()) for path, body in big_streams]
    stalled_body = raw_request(server.url, "/generate", b'{"inputs": "never fini', declared_length=500)
    try:
        wait_until(lambda: engine.queue_sizes()[1] >= big_sequences, timeout=10)
        beside_slow_readers = normal_requests(server.url)
        # The engine finished the slow readers' generations, and freed their slots, without them reading.
        wait_until(lambda: engine.queue_sizes() == (0, 0) and engine.kv_usage().slots_used == 0, timeout=20)
    finally:
        stalled_body.close()
    openai_data, tgi_data = (read_to_the_end(sock) for sock in slow)

    assert max(beside_slow_readers) <= 2 * max(beside_readers) + 1.0, (beside_slow_readers, beside_readers)
    # Linux doubles a buffer size set by setsockopt: the kernel held at most a few tens of KB of these.
    kernel_buffers = 2 * (SERVER_SEND_BUFFER + READER_RECEIVE_BUFFER)
    assert len(openai_data) > 10 * kernel_buffers and len(tgi_data) > 10 * kernel_buffers

    # Nothing was lost while they waited: the whole streams, every sequence to its end.
    assert openai_data.startswith(b"HTTP/1.1 200") and tgi_data.startswith(b"HTTP/1.1 200")
    events = sse_payloads(openai_data)
    assert events[-1] == b"[DONE]"
    finished = [c for e in events[:-1] for c in json.loads(e)["choices"] if c["finish_reason"] == "length"]
    assert sorted(c["index"] for c in finished) == list(range(BIG_STREAM["n"]))
    events = [json.loads(e) for e in sse_payloads(tgi_data)]
    assert len(events) == 100 and events[-1]["details"]["finish_reason"] == "length"
    server.wait_idle()


def sse_payloads(data: bytes) -> list[bytes]:
    return [line[len(b"data:") :].strip() for line in data.split(b"\n") if line.startswith(b"data:")]
