"""`make loadtest`: start wafer-gpt2 on the simulator, run locust headless against it, summarize.

    python tools/loadtest/run.py [--duration 60s] [--users 16] [--weights PATH] [--out out/loadtest] [-- SERVE FLAGS]

The server is a real `wafer-gpt2 serve` subprocess on a free port of 127.0.0.1 (default: the embedded
demo model on the `sim` backend); once /health answers 200, locust runs `tools/loadtest/locustfile.py` for the
given duration. Everything goes to the output folder: locust's CSV files (`locust_stats.csv`, ...), its
HTML report (`report.html`), the server's log (`server.log`) and `summary.json`. The last line printed is
the summary: requests/s, generated tokens/s, time to first token p50/p99, failures.

Exit status: 0 when every request succeeded, 1 when any failed, 2 when the server did not come up. The
server (and locust) are stopped whatever happens.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
LOCUSTFILE = Path(__file__).with_name("locustfile.py")
METRIC = "METRIC"  # the request type of the locustfile's custom events
STARTUP_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 30.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def duration_seconds(text: str) -> float:
    """Locust's `-t` syntax: 20s, 2m, 1h30m, or plain seconds."""
    total, number = 0.0, ""
    for char in text.strip():
        if char.isdigit() or char == ".":
            number += char
        elif char in "hms" and number:
            total += float(number) * {"h": 3600, "m": 60, "s": 1}[char]
            number = ""
        else:
            raise argparse.ArgumentTypeError(f"duration {text!r}: expected e.g. 20s, 2m or 1h30m")
    total += float(number) if number else 0.0
    if total <= 0:
        raise argparse.ArgumentTypeError(f"duration {text!r} must be positive")
    return total


def start_server(args: argparse.Namespace, port: int, log_file) -> subprocess.Popen:
    command = [
        sys.executable,
        "-m",
        "wafer_gpt2.cli.main",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    command += [
        "--backend",
        args.backend,
        "--max-concurrent",
        str(args.max_concurrent),
        "--log-level",
        "warning",
    ]
    if args.weights:
        command += ["--weights", str(args.weights)]
    command += args.serve_flags
    # As in the tests: on a small shared machine OpenBLAS's thread hand-off costs more than it gains
    # (the simulator's pool is the parallelism; BLAS threads inside it oversubscribe the cores). The
    # caller's setting wins.
    env = {"OPENBLAS_NUM_THREADS": "1", **os.environ}
    print("server:", " ".join(command[1:]), flush=True)
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=log_file, stderr=subprocess.STDOUT)


def wait_healthy(server: subprocess.Popen, url: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            return False
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return True
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    return False


def stop(process: subprocess.Popen | None) -> None:
    """SIGTERM (the server drains its requests), then SIGKILL if it does not exit in time."""
    if process is None or process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def run_locust(args: argparse.Namespace, url: str, out: Path) -> int:
    command = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless"]
    command += ["-u", str(args.users), "-r", str(args.spawn_rate or args.users), "-t", args.duration]
    command += ["-H", url, "--csv", str(out / "locust"), "--html", str(out / "report.html")]
    command += ["--only-summary", "--loglevel", "WARNING"]
    print("locust:", " ".join(command[1:]), flush=True)
    locust = subprocess.Popen(command, cwd=REPO)
    try:
        return locust.wait(timeout=duration_seconds(args.duration) + STOP_TIMEOUT_S + 60)
    except subprocess.TimeoutExpired:
        stop(locust)
        return 1
    finally:
        stop(locust)


def summarize(stats_csv: Path) -> dict:
    """The figures of one run from locust's `_stats.csv` (the METRIC rows are the locustfile's own)."""
    with stats_csv.open(newline="") as f:
        rows = [row for row in csv.DictReader(f) if row["Name"] != "Aggregated"]
    requests = [row for row in rows if row["Type"] != METRIC]
    metrics = {row["Name"]: row for row in rows if row["Type"] == METRIC}

    def number(row: dict | None, column: str) -> float | None:
        if row is None or row.get(column) in (None, "", "N/A"):
            return None
        return float(row[column])

    tokens = metrics.get("generated_tokens")
    ttft, itl = metrics.get("time_to_first_token"), metrics.get("inter_token_latency")
    tokens_per_s = None
    if tokens is not None:
        tokens_per_s = number(tokens, "Requests/s") * number(tokens, "Average Content Size")
    return {
        "requests": int(sum(number(row, "Request Count") for row in requests)),
        "failures": int(sum(number(row, "Failure Count") for row in requests)),
        "requests_per_s": sum(number(row, "Requests/s") for row in requests),
        "tokens_per_s": tokens_per_s,
        "generated_tokens": int(number(tokens, "Request Count") * number(tokens, "Average Content Size"))
        if tokens
        else 0,
        "ttft_ms": {
            "p50": number(ttft, "50%"),
            "p99": number(ttft, "99%"),
            "count": number(ttft, "Request Count"),
        },
        "itl_ms": {"p50": number(itl, "50%"), "p99": number(itl, "99%")},
        "by_route": {
            f"{row['Type']} {row['Name']}": {
                "requests": int(number(row, "Request Count")),
                "failures": int(number(row, "Failure Count")),
                "p50_ms": number(row, "50%"),
                "p99_ms": number(row, "99%"),
            }
            for row in requests
        },
    }


def summary_line(summary: dict, args: argparse.Namespace) -> str:
    def ms(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.0f} ms"

    tokens = "n/a" if summary["tokens_per_s"] is None else f"{summary['tokens_per_s']:.0f}"
    return (
        f"loadtest ({args.users} users, {args.duration}, backend {args.backend}): "
        f"{summary['requests_per_s']:.2f} requests/s, {tokens} tokens/s, "
        f"time to first token p50 {ms(summary['ttft_ms']['p50'])} p99 {ms(summary['ttft_ms']['p99'])}, "
        f"inter-token p50 {ms(summary['itl_ms']['p50'])} p99 {ms(summary['itl_ms']['p99'])}, "
        f"{summary['failures']} failed of {summary['requests']} requests"
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", default="60s", help="how long locust runs (locust's -t: 20s, 2m)")
    parser.add_argument("--users", type=int, default=16, help="concurrent simulated users (16)")
    parser.add_argument("--spawn-rate", type=float, help="users started per second (default: all at once)")
    parser.add_argument("--backend", default="sim", help="the server's backend (sim)")
    parser.add_argument("--weights", type=Path, help="checkpoint to serve (default: the embedded demo model)")
    parser.add_argument("--max-concurrent", type=int, default=16, help="the server's KV slots (16)")
    parser.add_argument("--out", type=Path, default=REPO / "out" / "loadtest", help="output folder")
    parser.add_argument("serve_flags", nargs="*", help="more `wafer-gpt2 serve` flags (after --)")
    args = parser.parse_args(argv)
    duration_seconds(args.duration)  # refuse a bad duration before starting anything
    if args.users < 1:
        parser.error(f"--users must be at least 1, got {args.users}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("locust_*.csv"):
        old.unlink()  # a failed run must not be summarized from the last one's files
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = None
    with (out / "server.log").open("w") as log_file:
        try:
            server = start_server(args, port, log_file)
            if not wait_healthy(server, url, STARTUP_TIMEOUT_S):
                stop(server)
                log = (out / "server.log").read_text().strip().splitlines()
                print(f"loadtest: the server did not become healthy: {log[-1] if log else 'no output'}")
                return 2
            locust_status = run_locust(args, url, out)
        finally:
            stop(server)
    stats = out / "locust_stats.csv"
    if not stats.exists():
        print(f"loadtest: locust wrote no statistics (exit status {locust_status})")
        return 1
    summary = summarize(stats)
    summary.update(locust_exit_status=locust_status, users=args.users, duration=args.duration, url=url)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    line = summary_line(summary, args)
    (out / "summary.txt").write_text(line + "\n")
    print(f"report: {out / 'report.html'}")
    print(line)
    return 0 if locust_status == 0 and summary["failures"] == 0 and summary["requests"] > 0 else 1


if __name__ == "__main__":
    os.chdir(REPO)
    sys.exit(main())
