"""Connection limits against the real `wafer-gpt2 serve` process on loopback (reference backend, demo model).

What it guarantees, with --header-timeout 1 --body-timeout 1 --keep-alive-timeout 1 --max-connections 16:
a connection that sends nothing is closed; one that trickles its headers or stops halfway through its
body gets 408 and is closed; headers beyond 64 KB get 431; a kept-alive connection left idle is closed;
at the cap a new connection evicts the oldest idle one (a flood of silent sockets cannot lock clients
out), and when every connection carries a request the new one gets 503 with Retry-After at once; a client that half-closes after its request still gets its answer;
and a flood of identical log lines (a hundred malformed requests, refused connections) is cut to a few
lines plus a count of what was suppressed.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from service_harness import free_port

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 1.0
MAX_CONNECTIONS = 16


@pytest.fixture(scope="module")
def server():
    port = free_port()
    command = [sys.executable, "-m", "service.cli", "serve", "--backend", "reference", "--port", str(port)]
    command += ["--header-timeout", "1", "--body-timeout", "1", "--keep-alive-timeout", "1"]
    command += ["--max-connections", str(MAX_CONNECTIONS), "--log-level", "info"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    process = subprocess.Popen(command, cwd=REPO, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        assert process.poll() is None, process.stderr.read().decode()
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "the server never became healthy"
        time.sleep(0.1)
    yield port, process
    if process.poll() is None:
        process.terminate()
        process.wait(30)


def connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S + 4)
    return sock


def read_all(sock: socket.socket) -> bytes:
    """Everything until the server closes (socket timeout: the test fails rather than hangs)."""
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def test_info_does_not_show_where_the_weights_lie(server):
    port, _ = server
    info = httpx.get(f"http://127.0.0.1:{port}/info", timeout=5).json()
    weights = info["model_config_summary"]["weights"]
    assert weights == "demo-gpt2" and "/" not in weights, weights


def test_a_silent_connection_is_closed(server):
    port, _ = server
    with connect(port) as sock:
        started = time.monotonic()
        assert read_all(sock) == b""
        assert time.monotonic() - started < TIMEOUT_S + 2


def test_trickled_headers_get_408(server):
    port, _ = server
    with connect(port) as sock:
        started = time.monotonic()
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        answer = b""
        for _ in range(40):  # one byte every 0.1 s: never the end of the headers
            try:
                sock.sendall(b"a")
            except OSError:
                break
            time.sleep(0.1)
            sock.settimeout(0.01)
            try:
                answer += sock.recv(65536)
            except TimeoutError:
                pass
            sock.settimeout(TIMEOUT_S + 4)
            if answer:
                break
        assert answer.startswith(b"HTTP/1.1 408"), answer
        assert time.monotonic() - started < TIMEOUT_S + 2


def test_a_half_sent_body_gets_408(server):
    port, _ = server
    with connect(port) as sock:
        started = time.monotonic()
        sock.sendall(
            b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"inputs": "half a bo'
        )
        answer = read_all(sock)
        assert answer.startswith(b"HTTP/1.1 408"), answer
        assert time.monotonic() - started < TIMEOUT_S + 2


def test_the_next_request_on_a_kept_alive_connection_has_its_own_deadline(server):
    """The second request's half-sent body gets 408 a body timeout after it was sent: not at the first
    request's deadline, which passes meanwhile (the connection's timer, set for it, must wait on)."""
    port, _ = server
    with connect(port) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        time.sleep(TIMEOUT_S / 2)
        sent = time.monotonic()
        sock.sendall(
            b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"inputs": "half a bo'
        )
        answer = read_all(sock)
        took = time.monotonic() - sent
        assert answer.startswith(b"HTTP/1.1 408"), answer
        assert TIMEOUT_S - 0.1 < took < TIMEOUT_S + 1, took


def test_oversized_headers_get_431(server):
    port, _ = server
    with connect(port) as sock:
        try:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 200_000 + b"\r\n\r\n")
        except OSError:
            pass  # the server may close before it has read it all
        assert read_all(sock).startswith(b"HTTP/1.1 431")


def test_an_idle_kept_alive_connection_is_closed(server):
    port, _ = server
    with connect(port) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        started = time.monotonic()
        answer = read_all(sock)
        assert answer.startswith(b"HTTP/1.1 200"), answer
        assert time.monotonic() - started < TIMEOUT_S + 2


def test_idle_connections_beyond_the_cap_make_room_and_busy_ones_get_503(server):
    port, _ = server
    url = f"http://127.0.0.1:{port}"
    # A flood of silent sockets: at the cap each new one evicts the oldest silent one, so clients
    # still get in (the old behaviour: the server unreachable while the idle sockets lived).
    idle = [connect(port) for _ in range(MAX_CONNECTIONS + 8)]
    try:
        for _ in range(3):
            assert httpx.get(url + "/health", timeout=5).status_code == 200
        closed = 0
        for sock in idle:
            sock.settimeout(0.2)
            try:
                closed += sock.recv(65536) == b""
            except TimeoutError:
                pass
        assert closed >= 8, closed  # the oldest were closed to make room
    finally:
        for sock in idle:
            sock.close()
    time.sleep(0.2)
    # Every connection carries a request (a body still arriving): the next connection gets 503 at once.
    busy = [connect(port) for _ in range(MAX_CONNECTIONS)]
    try:
        for sock in busy:
            sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        time.sleep(0.2)
        with connect(port) as extra:
            answer = read_all(extra)
        assert answer.startswith(b"HTTP/1.1 503") and b"retry-after: 1" in answer, answer
    finally:
        for sock in busy:
            sock.close()
    time.sleep(TIMEOUT_S)
    assert httpx.get(url + "/health", timeout=5).status_code == 200


def test_a_client_that_half_closes_after_its_request_gets_its_answer(server):
    port, _ = server
    body = b'{"inputs": "Half closed", "parameters": {"max_new_tokens": 4}}'
    with connect(port) as sock:
        sock.sendall(
            b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        sock.shutdown(socket.SHUT_WR)
        answer = read_all(sock)
        assert answer.startswith(b"HTTP/1.1 200") and b"generated_text" in answer, answer


def test_repeated_log_lines_are_rate_limited(server):
    port, process = server
    for _ in range(100):
        with connect(port) as sock:
            sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")
            read_all(sock)
    assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
    process.terminate()
    _, stderr = process.communicate(timeout=30)
    lines = stderr.decode().splitlines()
    invalid = [line for line in lines if "Invalid HTTP request received" in line]
    assert 1 <= len(invalid) <= 6, invalid


def test_the_repeat_filter_counts_what_it_suppressed():
    import logging

    from service.log_limits import RepeatFilter

    now = [0.0]
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logger = logging.getLogger("test.repeat")
    logger.propagate = False
    handler = Keep()
    handler.addFilter(RepeatFilter(burst=3, window_s=10.0, clock=lambda: now[0]))
    logger.addHandler(handler)
    try:
        for i in range(50):
            logger.warning("accept failed on fd %d", i)
        logger.warning("something else")
        now[0] = 11.0
        logger.warning("accept failed on fd %d", 99)
    finally:
        logger.removeHandler(handler)
    assert records[:3] == ["accept failed on fd 0", "accept failed on fd 1", "accept failed on fd 2"]
    assert records[3] == "something else"
    assert records[4] == "accept failed on fd 99 [47 more like this suppressed in the last 10 s]"
    assert len(records) == 5
