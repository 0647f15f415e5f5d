"""The load test, short: `tools/loadtest/run.py` (what `make loadtest` runs) for 20 s with 16 users.

What it guarantees: the driver starts a real `wafer-gpt2 serve` on the simulator (a small model, so it
keeps up on a shared 2-core machine), locust's users send the realistic mix of the locustfile to
/generate, /generate_stream and /v1/completions (streamed and not), and not one request fails; the
streams' custom metrics (time to first token, inter-token latency, tokens/s) are measured and
reported; the CSV and HTML reports and the one-line summary are written; and the server is stopped.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DURATION = "20s"
USERS = 16


@pytest.mark.slow  # among the slowest tests (make test-fast leaves it out)
def test_locust_run_against_the_simulator_has_no_failed_request(small_params, write_checkpoint, tmp_path):
    checkpoint = write_checkpoint(small_params, "safetensors")
    out = tmp_path / "loadtest"
    command = [
        sys.executable,
        str(REPO / "tools" / "loadtest" / "run.py"),
        "--duration",
        DURATION,
        "--users",
        str(USERS),
    ]
    command += ["--weights", str(checkpoint), "--out", str(out), "--", "--dtype", "fp32"]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, (
        f"exit status {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    )

    summary = json.loads((out / "summary.json").read_text())
    assert summary["failures"] == 0 and summary["locust_exit_status"] == 0
    assert summary["requests"] >= 2 * USERS, summary  # every user got through several requests
    by_route = summary["by_route"]
    for route in ("/generate", "/generate_stream", "/v1/completions", "/v1/completions (stream)"):
        assert by_route[f"POST {route}"]["requests"] > 0, by_route
    # The streams were timed in the task: first token, the gaps between tokens, tokens/s.
    assert summary["ttft_ms"]["count"] > 0 and 0 < summary["ttft_ms"]["p50"] <= summary["ttft_ms"]["p99"]
    assert 0 < summary["itl_ms"]["p50"] <= summary["itl_ms"]["p99"]
    assert summary["tokens_per_s"] > 0 and summary["generated_tokens"] > 0

    line = result.stdout.strip().splitlines()[-1]
    assert line == (out / "summary.txt").read_text().strip()
    assert "requests/s" in line and "tokens/s" in line and "0 failed of" in line
    assert (out / "report.html").stat().st_size > 0 and (out / "locust_stats.csv").stat().st_size > 0

    port = int(summary["url"].rsplit(":", 1)[1])  # the driver stopped the server it started
    with socket.socket() as sock:
        assert sock.connect_ex(("127.0.0.1", port)) != 0
