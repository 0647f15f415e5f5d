"""`wafer-gpt2 bench host`: how many tokens per second the host stack (HTTP, engine, sampler,
detokenizer) delivers, over backends that stand in for the wafer (`wafer_gpt2/backends/stand_ins.py`):

- `null`: fixed scores at once, no model: the host's own ceiling;
- `modeled`: the same after the cost model's step time for a GPT-2 124M plan (modeled, no wafer), with
  the host program's wire work around it (each step's message encoded, its records decoded): how busy
  the host keeps a wafer as fast as the model says one is (utilisation = modeled busy time / wall).

For each backend and number of streams S, the real server (`wafer_gpt2.service.api.create_app` under uvicorn on
127.0.0.1, in this process) serves S KV slots, and a load generator in a process of its own
(`wafer_gpt2/benchmarks/load_client.py`) keeps S connections busy with the same greedy request (a short
prompt, N new tokens, end-of-text never first) over each route for a timed window. The figures: tokens/s
as the clients receive them, the server's CPU time per token (this process, whose main thread only
waits, and the engine process's: by default the engine runs in one, as under `serve`), the client's
CPU share, and the client's own ceiling: the same client against a trivial endpoint
that replays a recorded response of the same route at once, run in the same session.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from wafer_gpt2.backends.stand_ins import ModeledWaferBackend, NullBackend, modeled_step_seconds
from wafer_gpt2.benchmarks.bench_server import BenchFailed, BenchServer, HelperProcess
from wafer_gpt2.benchmarks.load_client import (
    LoadJob,
    LoadResult,
    client_process,
    record_response,
    replay_server,
)
from wafer_gpt2.core.steps import Backend
from wafer_gpt2.errors import UserError
from wafer_gpt2.settings import SERVE_ENGINE_PROCESS

STAND_INS = ("null", "modeled")
ROUTES = ("tgi-stream", "openai-stream", "generate", "openai")
PROMPT = "The wafer-scale engine streams one token per stream per step, and the host"
# The host's goals: tokens/s streamed and not at 64 streams over the null backend; the modeled wafer's
# busy share at 16 streams.
GOAL_STREAM_TPS, GOAL_PLAIN_TPS, GOAL_UTILISATION = 40_000.0, 80_000.0, 0.80


@dataclass(frozen=True)
class Route:
    name: str
    path: str
    stream: bool
    events_not_tokens: int  # events per stream that carry no token (OpenAI's [DONE])

    def body(self, new_tokens: int) -> dict:
        if self.path.startswith("/v1/"):
            return {
                "prompt": PROMPT,
                "max_tokens": new_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stream": self.stream,
            }
        return {"inputs": PROMPT, "parameters": {"max_new_tokens": new_tokens}}

    def request(self, new_tokens: int) -> bytes:
        body = json.dumps(self.body(new_tokens)).encode()
        head = (
            f"POST {self.path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        )
        return head.encode() + body


ROUTE_TABLE = {
    "tgi-stream": Route("tgi-stream", "/generate_stream", True, 0),
    "openai-stream": Route("openai-stream", "/v1/completions", True, 1),
    "generate": Route("generate", "/generate", False, 0),
    "openai": Route("openai", "/v1/completions", False, 0),
}


@dataclass
class Cell:
    """One (backend, streams, route): the repetitions' results."""

    backend: str
    streams: int
    route: str
    runs: list[LoadResult] = field(default_factory=list)
    server_cpu_s: list[float] = field(default_factory=list)  # both processes
    engine_cpu_s: list[float] = field(default_factory=list)  # the engine process's share of it
    modeled_busy_s: list[float] = field(default_factory=list)
    overshoot_s: list[float] = field(default_factory=list)
    idle_s: list[float] = field(default_factory=list)  # the engine waited with no request to step
    steps: list[int] = field(default_factory=list)
    ceiling: LoadResult | None = None

    def median(self, values: list[float]) -> float:
        return statistics.median(values) if values else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.median([r.tokens_per_s for r in self.runs])

    @property
    def server_us_per_token(self) -> float:
        return self.median(
            [1e6 * cpu / max(r.tokens, 1) for cpu, r in zip(self.server_cpu_s, self.runs, strict=True)]
        )

    @property
    def engine_us_per_token(self) -> float | None:
        """The engine process's CPU per token (None: the engine ran on a thread of the HTTP process)."""
        if not self.engine_cpu_s:
            return None
        return self.median(
            [1e6 * cpu / max(r.tokens, 1) for cpu, r in zip(self.engine_cpu_s, self.runs, strict=True)]
        )

    @property
    def client_cpu_share(self) -> float:
        return self.median([r.cpu_s / r.window_s for r in self.runs])

    @property
    def utilisation(self) -> float | None:
        if not self.modeled_busy_s:
            return None
        return self.median([b / r.window_s for b, r in zip(self.modeled_busy_s, self.runs, strict=True)])

    def share(self, values: list[float]) -> float:
        """A time per window (median over the windows), as a share of the window."""
        return self.median([v / r.window_s for v, r in zip(values, self.runs, strict=True)])

    @property
    def tokens_per_step(self) -> float:
        return self.median([r.tokens / max(s, 1) for s, r in zip(self.steps, self.runs, strict=True)])

    @property
    def errors(self) -> int:
        return sum(r.errors for r in self.runs)


# ----------------------------------------------------------------------------------------------------


def build_stand_in(kind: str, streams: int, context: int, steps_in_flight: int = 1) -> tuple[Backend, str]:
    """The backend for `kind` with `streams` slots, and how it is described in the output;
    `steps_in_flight`: how many steps the modeled wafer takes at a time (`PipelinedBackend`)."""
    from wafer_gpt2.backends import stand_ins
    from wafer_gpt2.model.config import PRESETS

    config = PRESETS["gpt2"]
    if kind == "null":
        return stand_ins.NullBackend(config.vocab_size, slots=streams, context=context), "null (no model)"
    plan = modeled_plan(config, streams, context)
    backend = stand_ins.ModeledWaferBackend(plan, steps_in_flight=steps_in_flight)
    figures = plan.modeled()
    return backend, (
        f"modeled wafer: GPT-2 124M plan, {plan.replicas} replica(s) x {plan.slots} slots x {plan.context} "
        f"positions, {figures['decode_latency_us']:.1f} us critical path, slowest stage "
        f"{figures['bottleneck_stage_us']:.1f} us (modeled, cost model; no wafer); "
        f"{steps_in_flight} step(s) in flight"
    )


def modeled_plan(config, streams: int, context: int):
    """The GPT-2 124M plan serving `streams` slots: the default full-context one at 16 slots; for more
    slots, the longest context (at least `context`) and fewest replicas that fit the per-PE memory."""
    from wafer_gpt2.plan import PlanError, build_plan

    last: Exception | None = None
    for replicas in (1, 2, 4, 8):
        if streams % replicas:
            continue
        per = streams // replicas
        longest = 1024
        while longest > context and per * longest > 16 * 1024:  # the KV of 16 slots x 1024 fits
            longest //= 2
        try:
            return build_plan(config, slots=per, context=max(longest, context), replicas=replicas)
        except PlanError as error:
            last = error
    raise BenchFailed(f"no GPT-2 124M plan serves {streams} slots: {last}")


def twin_factory(backend: Backend) -> Callable[[], Backend]:
    """A picklable factory of a stand-in like `backend`, for the engine process (the modeled one
    takes its plan along: the planner's search is not run twice)."""
    if isinstance(backend, ModeledWaferBackend):
        return functools.partial(
            ModeledWaferBackend, backend.plan, backend.clock_hz, steps_in_flight=backend.steps_in_flight
        )
    return functools.partial(
        NullBackend,
        backend.vocab_size,
        slots=backend.num_slots,
        context=backend.context_length,
        top_k=backend.top_k,
    )


def bench_server(backend: Backend, streams: int, engine_process: bool) -> BenchServer:
    """The service for `streams` streams, admitting all of them at once; `engine_process`: its engine
    in a process of its own, which builds a backend like `backend` (`wafer_gpt2/engine/process.py`)."""
    from wafer_gpt2.settings import ServerSettings

    settings = ServerSettings(
        port=0,
        model_id="gpt2",
        backend="bench-host",
        max_concurrent_requests=streams,
        max_queue=4 * streams,
        max_connections=max(1024, 4 * streams),
        engine_process=engine_process,
        freeze_heap=True,  # as `serve` does
    )
    factory = twin_factory(backend) if engine_process else None
    return BenchServer(backend, settings, "gpt2", ready_timeout_s=120, backend_factory=factory)


def _cpu(server: BenchServer) -> tuple[float, float | None]:
    """CPU seconds of the server: this process and the engine's, and the engine's alone when it runs in
    a process of its own (None: on a thread of this one)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    total = usage.ru_utime + usage.ru_stime
    pid = getattr(server.engine, "pid", None)
    if pid is None:
        return total, None
    # utime and stime, fields 14 and 15 of /proc/PID/stat, in clock ticks
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    engine = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total + engine, engine


def measure(
    backends: list[str],
    streams: list[int],
    routes: list[str],
    new_tokens: int = 32,
    seconds: float = 3.0,
    warmup_s: float = 1.0,
    reps: int = 1,
    log=print,
    engine_process: bool = False,
    steps_in_flight: int = 1,
) -> tuple[list[Cell], dict[str, str]]:
    """Every (backend, streams, route) `reps` times, routes rotating; then each route's ceiling."""
    cells: list[Cell] = []
    labels: dict[str, str] = {}
    recorded: dict[str, bytes] = {}
    context = 64 + new_tokens  # the prompt is about 16 tokens
    clients = HelperProcess(client_process, "load generator")
    clients.start()
    try:
        clients.answer(120, "start")
        for kind in backends:
            for count in streams:
                backend, labels[f"{kind} {count}"] = build_stand_in(kind, count, context, steps_in_flight)
                if isinstance(backend, ModeledWaferBackend):
                    step_s = modeled_step_seconds(backend.plan, list(range(count)))
                    labels[f"{kind} {count}"] += (
                        f"; a full decode step is modeled at {1e6 * step_s:.0f} us; time.sleep wakes "
                        f"{1e6 * backend.timer_late_s:.0f} us late here (median, server idle), which the "
                        "stand-in subtracts from its sleeps"
                    )
                log(f"bench host: {labels[f'{kind} {count}']}; {count} streams")
                row = {route: Cell(kind, count, route) for route in routes}
                with bench_server(backend, count, engine_process) as server:
                    for route in routes:  # warm-up, and the response the replay server will send
                        recorded[route] = record_response(
                            "127.0.0.1", server.port, ROUTE_TABLE[route].request(new_tokens)
                        )
                    for rep in range(reps):
                        order = routes[rep % len(routes) :] + routes[: rep % len(routes)]
                        for route in order:
                            _run_cell(row[route], clients, server, backend, new_tokens, seconds, warmup_s)
                            log(_cell_line(row[route]))
                backend.close()
                cells.extend(row.values())
        # The client's ceiling: the same jobs against a server that replays the recorded response at once.
        ceilings: dict[tuple[str, int], LoadResult] = {}
        for route in routes:
            replay = HelperProcess(replay_server, "replay server")
            replay.start()
            try:
                replay.connection.send(recorded[route])
                port = replay.answer(60, "start")
                for count in streams:
                    job = load_job(route, port, count, new_tokens, seconds, warmup_s)
                    clients.connection.send(job)
                    ceilings[route, count] = clients.answer(seconds + warmup_s + 60, "finish")
                    log(
                        f"  ceiling {route:<14} {count:>4} conns: {ceilings[route, count].tokens_per_s:>10,.0f} "
                        f"tokens/s (the client against a replay of a recorded response)"
                    )
            finally:
                replay.stop()
        for cell in cells:
            cell.ceiling = ceilings.get((cell.route, cell.streams))
    finally:
        clients.stop()
    return cells, labels


def load_job(
    route: str, port: int, streams: int, new_tokens: int, seconds: float, warmup_s: float
) -> LoadJob:
    """The load generator's job: `streams` connections sending `route`'s request to the server at `port`."""
    spec = ROUTE_TABLE[route]
    return LoadJob(
        host="127.0.0.1",
        port=port,
        request=spec.request(new_tokens),
        connections=streams,
        seconds=seconds,
        warmup_s=warmup_s,
        stream=spec.stream,
        tokens_per_response=new_tokens,
        events_not_tokens=spec.events_not_tokens,
    )


def _run_cell(
    cell: Cell,
    clients: HelperProcess,
    server: BenchServer,
    backend: Backend,
    new_tokens: int,
    seconds: float,
    warmup_s: float,
) -> None:
    job = load_job(cell.route, server.port, cell.streams, new_tokens, seconds, warmup_s)
    clients.connection.send(job)
    # The server's CPU and the wafer's modeled busy time over the client's window (from its start time).
    time.sleep(warmup_s)
    engine = server.engine

    def counters() -> tuple[tuple[float, float | None], float, float, int, float, float]:
        return (
            _cpu(server),
            _busy(server, backend),
            _overshoot(server, backend),
            engine.steps,
            engine.idle_seconds,
            _backend_counter(server, backend, "stand_in_cpu_s"),
        )

    cpu0, busy0, over0, steps0, idle0, own0 = counters()
    time.sleep(seconds)
    cpu1, busy1, over1, steps1, idle1, own1 = counters()
    result: LoadResult = clients.answer(seconds + warmup_s + 60, "finish")
    if result.errors:
        raise BenchFailed(f"{cell.route}: {result.errors} failed responses; the first: {result.first_error}")
    cell.runs.append(result)
    # The stand-in's own work (the records a modeled wafer sends, built on the engine's side) is no
    # host's: out of both figures.
    stand_in = own1 - own0
    cell.server_cpu_s.append(cpu1[0] - cpu0[0] - stand_in)
    if cpu1[1] is not None and cpu0[1] is not None:
        cell.engine_cpu_s.append(cpu1[1] - cpu0[1] - stand_in)
    cell.steps.append(steps1 - steps0)
    cell.idle_s.append(idle1 - idle0)
    if hasattr(backend, "modeled_busy_s"):
        cell.modeled_busy_s.append(busy1 - busy0)
        cell.overshoot_s.append(over1 - over0)
    # Let the last responses of the window drain before the next cell starts.
    deadline = time.monotonic() + 30
    while server.engine.queue_sizes() != (0, 0) and time.monotonic() < deadline:
        time.sleep(0.02)


def _busy(server: BenchServer, backend: Backend) -> float:
    return _backend_counter(server, backend, "modeled_busy_s")


def _overshoot(server: BenchServer, backend: Backend) -> float:
    return _backend_counter(server, backend, "overshoot_s")


def _backend_counter(server: BenchServer, backend: Backend, name: str) -> float:
    """A stand-in's counter: from the engine process's last report when the engine runs there."""
    counters = getattr(server.engine, "backend_counters", None)
    if counters is not None:
        return float(counters.get(name, 0.0))
    return float(getattr(backend, name, 0.0))


def _cell_line(cell: Cell) -> str:
    utilisation = cell.utilisation
    extra = "" if utilisation is None else f", wafer {100 * utilisation:.0f}% busy (modeled)"
    return (
        f"  {cell.backend:<8}{cell.streams:>4} streams {cell.route:<14}{cell.runs[-1].tokens_per_s:>10,.0f} tokens/s, "
        f"server {1e6 * cell.server_cpu_s[-1] / max(cell.runs[-1].tokens, 1):.1f} us CPU/token"
        + (
            f" (engine process {1e6 * cell.engine_cpu_s[-1] / max(cell.runs[-1].tokens, 1):.1f}), "
            if cell.engine_cpu_s
            else ", "
        )
        + f"client {100 * cell.runs[-1].cpu_s / cell.runs[-1].window_s:.0f}% of a core{extra}"
    )


def print_result(
    cells: list[Cell], labels: dict[str, str], new_tokens: int, seconds: float, reps: int
) -> None:
    print(
        f"{'backend':<9}{'streams':>8} {'route':<15}{'tokens/s':>10}{'ceiling':>10}{'us CPU/tok':>11}{'engine':>7}"
        f"{'client %':>9}{'tok/step':>9}{'wafer busy':>11}{'late':>6}{'no work':>8}{'host':>6}"
    )
    for cell in cells:
        utilisation = cell.utilisation
        busy = late = idle = host = ""
        if utilisation is not None:
            # Where the wafer's idle time went: the stand-in's sleep waking late, the engine waiting with
            # no request to step, and the rest: the host's work between steps.
            busy, late, idle = (
                f"{100 * utilisation:.1f}%",
                f"{100 * cell.share(cell.overshoot_s):.1f}",
                f"{100 * cell.share(cell.idle_s):.1f}",
            )
            rest = 1 - utilisation - cell.share(cell.overshoot_s) - cell.share(cell.idle_s)
            host = f"{100 * rest:.1f}"
        ceiling = f"{cell.ceiling.tokens_per_s:,.0f}" if cell.ceiling else "-"
        engine = "-" if cell.engine_us_per_token is None else f"{cell.engine_us_per_token:.1f}"
        print(
            f"{cell.backend:<9}{cell.streams:>8} {cell.route:<15}{cell.tokens_per_s:>10,.0f}{ceiling:>10}"
            f"{cell.server_us_per_token:>11.1f}{engine:>7}{100 * cell.client_cpu_share:>9.0f}{cell.tokens_per_step:>9.1f}{busy:>11}{late:>6}{idle:>8}{host:>6}"
        )
    print(
        f"tokens/s: received by the clients (a process of their own), median of {reps} window(s) of {seconds:g} s; "
        f"{new_tokens} new tokens per request, greedy; ceiling: the same client against a replay of a recorded "
        "response (its own limit); us CPU/tok: the server's CPU time per token (the HTTP and the engine process; "
        "the modeled stand-in's own work, the records a wafer sends, left out), "
        "engine: the engine process's alone; client %: the client "
        "process's CPU, of one core; wafer busy: modeled busy time / wall time (modeled backend only), and the rest "
        "in % of wall time: late (steps returned after their modeled end: GIL hand-over, timer jitter), no work (the engine waited "
        "with no request: the clients' turnaround), host (the host's work between steps)"
    )
    for kind, label in labels.items():
        print(f"{kind}: {label}")
    print(summary_line(cells))


def summary_line(cells: list[Cell]) -> str:
    parts = []
    for cell in cells:
        if cell.backend == "null" and cell.streams == 64:
            goal = GOAL_STREAM_TPS if ROUTE_TABLE[cell.route].stream else GOAL_PLAIN_TPS
            verdict = "met" if cell.tokens_per_s >= goal else "missed"
            parts.append(f"null 64 {cell.route} {cell.tokens_per_s:,.0f} tok/s (goal {goal:,.0f}: {verdict})")
        if cell.backend == "modeled" and cell.streams == 16 and cell.utilisation is not None:
            verdict = "met" if cell.utilisation >= GOAL_UTILISATION else "missed"
            parts.append(
                f"modeled 16 {cell.route} wafer {100 * cell.utilisation:.0f}% busy (modeled; goal 80%: {verdict})"
            )
    return "bench host summary: " + ("; ".join(parts) if parts else "no goal cell measured")


def _int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part]
    except ValueError:
        raise UserError(f"{flag} must be comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise UserError(f"{flag} must be positive integers, got {text!r}")
    return values


def _names(text: str, flag: str, allowed: tuple[str, ...]) -> list[str]:
    names = [part for part in text.split(",") if part]
    unknown = [name for name in names if name not in allowed]
    if not names or unknown:
        raise UserError(f"{flag}: expected some of {', '.join(allowed)}, got {text!r}")
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Every flag `bench host` reads (`wafer_gpt2/cli/bench_command.py` gives them to its parser)."""
    parser.add_argument(
        "--stand-in",
        default="null,modeled",
        help="stand-in backends, comma-separated: null (no model, no time), modeled (the cost "
        "model's step time for a GPT-2 124M plan; modeled) (null,modeled)",
    )
    parser.add_argument(
        "--routes", default=",".join(ROUTES), help=f"routes, comma-separated ({','.join(ROUTES)})"
    )
    parser.add_argument(
        "--host-streams",
        default="16,64,256",
        metavar="S,..",
        help="concurrent streams, comma-separated (16,64,256)",
    )
    parser.add_argument(
        "--new-tokens", type=int, default=32, metavar="N", help="tokens generated per request, greedy (32)"
    )
    parser.add_argument("--reps", type=int, default=3, help="windows per cell; medians are reported (3)")
    parser.add_argument("--seconds", type=float, default=3.0, help="measured window per cell (3)")
    parser.add_argument("--warmup", type=float, default=1.0, help="unmeasured start of each window (1)")
    parser.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        default=SERVE_ENGINE_PROCESS,
        help="the server's engine in a process of its own, as `serve` runs it "
        "(--no-engine-process: on a thread of the HTTP process)",
    )
    parser.add_argument(
        "--steps-in-flight",
        type=int,
        default=1,
        metavar="N",
        help="steps the modeled wafer takes at a time; above 1 the engine submits the next step "
        "from what became ready while another computes (1: one step at a time, as the host program "
        "drives the wafer today; docs/performance.md has both)",
    )


def run(args: argparse.Namespace) -> int:
    backends = _names(args.stand_in, "--stand-in", STAND_INS)
    routes = _names(args.routes, "--routes", ROUTES)
    streams = _int_list(args.host_streams, "--host-streams")
    if args.new_tokens < 1 or args.reps < 1 or args.steps_in_flight < 1:
        raise UserError("--new-tokens, --reps and --steps-in-flight must be at least 1")
    if not 0 < args.seconds <= 600 or not 0 <= args.warmup <= 60:
        raise UserError("--seconds must be in (0, 600] and --warmup in [0, 60]")
    cells, labels = measure(
        backends,
        streams,
        routes,
        new_tokens=args.new_tokens,
        seconds=args.seconds,
        warmup_s=args.warmup,
        reps=args.reps,
        log=lambda message: print(message, file=sys.stderr, flush=True),
        engine_process=args.engine_process,
        steps_in_flight=args.steps_in_flight,
    )
    print_result(cells, labels, args.new_tokens, args.seconds, args.reps)
    return 0
