"""Where the HTTP process's event-loop thread spends its time under `wafer-gpt2 bench host`.

py-spy samples every thread of a process and counts a thread that waits for the GIL or for a core as
busy at the line it stopped on; cProfile, enabled on the loop's own thread, times every call the loop
makes, so a call that lets go of the GIL (a socket write, tiktoken's encode, a pipe write) shows what
getting the GIL back cost it. The server runs as `bench host` runs it (the engine in a process of its
own, `--stand-in` null or modeled), the load generator in a process of its own; the profile covers
`--seconds` in the middle of the load's window. Measured, on this machine; cProfile's own overhead
inflates the Python-heavy calls, so compare profiles with each other, not with tokens/s.

    python tools/bench/http_loop_profile.py [--route generate] [--streams 64] [--stand-in null] [--seconds 3]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from wafer_gpt2.benchmarks import host as bench_host  # noqa: E402
from wafer_gpt2.benchmarks.bench_server import HelperProcess  # noqa: E402
from wafer_gpt2.benchmarks.load_client import client_process  # noqa: E402

NEW_TOKENS = 32
WARMUP_S = 1.0


def profile(route: str, streams: int, stand_in_kind: str, seconds: float) -> tuple[pstats.Stats, float]:
    """The loop thread's profile over `seconds`, and the tokens/s the clients received meanwhile."""
    backend, _ = bench_host.build_stand_in(stand_in_kind, streams, 64 + NEW_TOKENS, 1)
    clients = HelperProcess(client_process, "load generator")
    clients.start()
    try:
        clients.answer(120, "start")
        with bench_host.bench_server(backend, streams, True) as server:
            job = bench_host.load_job(
                route, server.port, streams, NEW_TOKENS, seconds + 2 * WARMUP_S, WARMUP_S
            )
            clients.connection.send(job)
            (loop,) = {listener._loop for listener in server.server.servers}
            profiler = cProfile.Profile()
            time.sleep(2 * WARMUP_S)
            done = threading.Event()
            loop.call_soon_threadsafe(profiler.enable)  # on the loop's thread: cProfile is per thread
            time.sleep(seconds)
            loop.call_soon_threadsafe(lambda: (profiler.disable(), done.set()))
            done.wait(10)
            result = clients.answer(seconds + 60, "finish")
        backend.close()
    finally:
        clients.stop()
    return pstats.Stats(profiler), result.tokens_per_s


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--route", default="generate", choices=list(bench_host.ROUTE_TABLE))
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--stand-in", default="null", choices=["null", "modeled"])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--top", type=int, default=30, help="rows of each table")
    args = parser.parse_args()
    stats, tokens_per_s = profile(args.route, args.streams, args.stand_in, args.seconds)
    print(
        f"{args.route}, {args.streams} streams, {args.stand_in} backend: {tokens_per_s:,.0f} tokens/s "
        f"received while profiled (measured; cProfile slows the loop)"
    )
    stats.sort_stats("tottime").print_stats(args.top)
    stats.sort_stats("cumtime").print_stats(args.top)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
