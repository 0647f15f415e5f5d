"""`python -m tools.bench service`: what the service itself costs on top of the wafer steps.

One run, one backend (the embedded simulator), the same S requests (random prompts of P tokens,
greedy, N new tokens each, EOS ignored so every stream generates N) three ways:

1. direct: a plain loop calls `backend.step` (all prompts in one step, then one decode step per token);
2. engine: the service's engine (scheduler, sampler, detokenizer, worker thread) in this process, with
   the requests submitted directly, no HTTP;
3. HTTP: a real uvicorn server on 127.0.0.1 and S concurrent streaming clients (`/v1/completions`,
   `stream: true`).

Every backend step of every mode is timed where it runs, so all modes are measured the same way.
The service's overhead is how much longer a full decode step (one item per stream, no prompt tokens)
takes, start to start, under HTTP than driven directly: scheduling, sampling, detokenizing and the
HTTP work (request parsing, SSE framing, JSON encoding on the server), as a share of the step time
(medians over every such step of every run). Modes alternate and rotate order.

What is isolated, and why: the server, its engine and the direct/engine drivers share this process;
the S clients run in a separate process, started (and warmed up with one request) before any timed
window, at a lower CPU priority (`os.nice(+19)`). On a real deployment the clients parse their
streams on other machines; on a small shared machine their parsing would otherwise take cores (and,
in this process, the GIL) from the backend's step and be counted as the service's cost. At nice 19
the clients still read every event, but mostly while the server waits between steps. Tokens/s end
to end are printed too; they include the prompts, which under the service arrive a few milliseconds
apart and are spread over more steps, and the clients' reading of the last events.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from wafer_gpt2.benchmarks.bench_server import BenchFailed, BenchServer, HelperProcess
from wafer_gpt2.core.steps import Backend, StepScores
from wafer_gpt2.engine.core import bare_greedy
from wafer_gpt2.errors import UserError

GOAL_OVERHEAD_PCT = 10.0  # of step time, at 16 concurrent streams
MODES = ("direct", "engine", "http")
MIN_NEW_TOKENS = 3  # a prefill step and at least two decode steps: one start-to-start period
CLIENT_NICENESS = 19  # the client process yields the CPU to the server (clients run elsewhere in production)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags only `bench service` reads (the bench parser shares --model, --new-tokens, ...)."""
    parser.add_argument(
        "--streams",
        type=int,
        default=16,
        metavar="S",
        help="service: concurrent streaming clients = KV slots (16)",
    )
    parser.add_argument(
        "--weights",
        metavar="PATH|demo",
        help="service: a checkpoint to serve instead of random weights of --model "
        "('demo': the embedded demo model)",
    )


class TimedBackend:
    """The backend every mode drives, recording when each step starts and ends; `close` is deferred to
    the benchmark's end because the engine closes its backend when it stops."""

    def __init__(self, inner: Backend):
        self.inner = inner
        self.num_slots = inner.num_slots
        self.context_length = inner.context_length
        self.vocab_size = inner.vocab_size
        self.top_k = inner.top_k
        self.steps: list[tuple[float, float, int]] = []  # (start, end, items) of every step so far

    def step(self, inputs) -> StepScores:
        start = time.perf_counter()
        out = self.inner.step(inputs)
        self.steps.append((start, time.perf_counter(), len(inputs)))
        return out

    def free_slot(self, slot: int) -> None:
        self.inner.free_slot(slot)

    def reset(self) -> None:
        self.inner.reset()

    def describe(self) -> dict:
        return self.inner.describe()

    def close(self) -> None:
        pass  # the benchmark closes `inner` once every mode is done


@dataclass
class ModeRun:
    wall_s: float
    tokens: int
    steps: list[tuple[float, float, int]]  # (start, end, items) of each backend step of this run

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s

    @property
    def step_times(self) -> list[float]:
        return [end - start for start, end, _ in self.steps]

    def full_decode_steps(self, streams: int) -> list[int]:
        """Indices of the steps that carry exactly one decode item per stream and no prompt tokens: the
        same work in every mode (requests that arrive a little apart add steps that mix prefill chunks
        and decodes; those are left out of the step comparison)."""
        return [i for i, (_, _, items) in enumerate(self.steps) if i > 0 and items == streams]

    def decode_periods(self, streams: int) -> list[float]:
        """Start-to-start times from each full decode step to the next step: the step's work plus
        whatever the driver does before the next one begins (sampling, detokenizing, HTTP, waiting)."""
        starts = [start for start, _, _ in self.steps]
        return [starts[i + 1] - starts[i] for i in self.full_decode_steps(streams) if i + 1 < len(starts)]

    @property
    def gap_s(self) -> float:
        """Wall time outside backend steps, per step: what the driver adds between steps."""
        return max(0.0, self.wall_s - sum(self.step_times)) / max(len(self.steps), 1)


@dataclass
class ServiceBenchResult:
    model: str
    streams: int
    prompt_tokens: int
    new_tokens: int
    runs: dict[str, list[ModeRun]] = field(default_factory=lambda: {mode: [] for mode in MODES})
    same_tokens: bool | None = None  # direct and engine produced the same greedy ids
    client_niceness: int = CLIENT_NICENESS  # the client process's nice increment (0: not lowered)

    def tokens_per_s(self, mode: str) -> float:
        return statistics.median(run.tokens_per_s for run in self.runs[mode])

    def step_ms(self, mode: str) -> float:
        """Median time inside one full decode step (the backend's work), over every run of the mode."""
        times = [run.step_times[i] for run in self.runs[mode] for i in run.full_decode_steps(self.streams)]
        return 1e3 * statistics.median(times)

    def period_ms(self, mode: str) -> float:
        """Median start-to-start time of full decode steps: the step time the streams see."""
        return 1e3 * statistics.median(p for run in self.runs[mode] for p in run.decode_periods(self.streams))

    def first_step_ms(self, mode: str) -> float:
        """The first step: every prompt directly; under the service, the prompts that had arrived."""
        return 1e3 * statistics.median(run.step_times[0] for run in self.runs[mode])

    def gap_ms(self, mode: str) -> float:
        return 1e3 * statistics.median(run.gap_s for run in self.runs[mode])

    def steps(self, mode: str) -> float:
        return statistics.median(len(run.steps) for run in self.runs[mode])

    def overhead_pct(self, mode: str = "http") -> float:
        """How much longer a decode step takes, start to start, under `mode` than driven directly: the
        service's own cost (scheduling, sampling, detokenizing, HTTP) as a share of the step time.
        Medians over every decode step of every run, so one slow step on a busy machine does not decide."""
        return 100.0 * (self.period_ms(mode) / self.period_ms("direct") - 1.0)

    def summary_line(self) -> str:
        overhead = self.overhead_pct("http")
        verdict = "met" if overhead < GOAL_OVERHEAD_PCT else "MISSED"
        return (
            f"bench service summary: {self.model}, {self.streams} streams x {self.new_tokens} tokens: decode step "
            f"{self.period_ms('direct'):.1f} ms direct, {self.period_ms('engine'):.1f} ms engine, "
            f"{self.period_ms('http'):.1f} ms HTTP; tokens/s direct {self.tokens_per_s('direct'):.1f}, HTTP "
            f"{self.tokens_per_s('http'):.1f}; service overhead {overhead:+.1f}% of step time "
            f"(goal < {GOAL_OVERHEAD_PCT:g}% at 16 streams: {verdict}); time outside the backend "
            f"{self.gap_ms('http'):.1f} ms per step ({100 * self.gap_ms('http') / self.period_ms('direct'):.1f}%); "
            f"{self.clients_note()}"
        )

    def clients_note(self) -> str:
        return f"clients in a separate process at nice +{self.client_niceness} (their parsing is not the service's)"


# ----------------------------------------------------------------------------------------------------
# The three ways to run the same requests


def run_direct(
    backend: TimedBackend, prompts: list[list[int]], new_tokens: int
) -> tuple[ModeRun, list[list[int]]]:
    """All prompts in one step, then one step per new token, greedy (the top-1 id the wafer returns)."""
    backend.reset()
    first = len(backend.steps)
    start = time.perf_counter()
    generated = bare_greedy(backend, prompts, new_tokens)
    wall = time.perf_counter() - start
    return ModeRun(wall, len(prompts) * new_tokens, backend.steps[first:]), generated


async def _engine_requests(engine, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    from wafer_gpt2.engine.request import ErrorEvent, FinishEvent, GenerationRequest

    sequences = [engine.submit(GenerationRequest(tuple(p), new_tokens, ignore_eos=True)) for p in prompts]
    out = []
    for sequence in sequences:
        while True:
            event = await sequence.events.get()
            if isinstance(event, ErrorEvent):
                raise BenchFailed(f"the engine failed a request: {event.error}")
            if isinstance(event, FinishEvent):
                out.append([token.id for token in event.tokens])
                break
    return out


def run_engine(engine, backend: TimedBackend, prompts, new_tokens) -> tuple[ModeRun, list[list[int]]]:
    first = len(backend.steps)
    start = time.perf_counter()
    ids = asyncio.run(_engine_requests(engine, prompts, new_tokens))
    wall = time.perf_counter() - start
    return ModeRun(wall, sum(len(i) for i in ids), backend.steps[first:]), ids


async def _http_streams(client, prompts: list[list[int]], new_tokens: int) -> int:
    async def one(prompt: list[int]) -> int:
        body = {
            "prompt": prompt,
            "max_tokens": new_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        generated = None
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                raise BenchFailed(
                    f"the server answered {response.status_code}: {(await response.aread())[:300]!r}"
                )
            async for line in response.aiter_lines():
                if line.startswith("data:") and line[5:].strip() != "[DONE]":
                    chunk = json.loads(line[5:])
                    if "error" in chunk:
                        raise BenchFailed(f"stream error: {chunk['error']}")
                    if chunk.get("usage"):
                        generated = chunk["usage"]["completion_tokens"]
        if generated is None:
            raise BenchFailed("the stream ended without a usage chunk")
        return generated

    counts = await asyncio.gather(*(one(p) for p in prompts))
    return sum(counts)


def _client_process(connection, niceness: int) -> None:
    """The client process: lower its priority, then run each job (url, prompts, new tokens) it is sent
    and answer ("ok", tokens) or ("error", message); None ends it.

    One event loop and one connection pool per server live as long as the process: the warm-up opens a
    connection per stream, so a timed job only writes its requests. Opening them in the timed window
    (a TCP handshake each, at the client's low priority) spread the requests over several steps on a
    loaded machine."""
    if niceness and hasattr(os, "nice"):
        os.nice(niceness)
    import httpx

    loop = asyncio.new_event_loop()
    pools: dict[str, httpx.AsyncClient] = {}
    connection.send(("ready", None))
    try:
        while (job := connection.recv()) is not None:
            url, prompts, new_tokens = job
            try:
                if url not in pools:
                    limits = httpx.Limits(max_connections=len(prompts) + 1, max_keepalive_connections=None)
                    pools[url] = httpx.AsyncClient(base_url=url, timeout=600.0, limits=limits)
                tokens = loop.run_until_complete(_http_streams(pools[url], prompts, new_tokens))
                connection.send(("ok", tokens))
            except Exception as error:  # reported to the benchmark, which raises it there
                connection.send(("error", f"{type(error).__name__}: {error}"))
    finally:
        for pool in pools.values():
            loop.run_until_complete(pool.aclose())
        loop.close()


class _Clients(HelperProcess):
    """The streaming clients in a separate process, kept for the whole benchmark so starting it is
    never inside a timed window."""

    def __init__(self, niceness: int = CLIENT_NICENESS):
        super().__init__(_client_process, "client process", (niceness,))

    def __enter__(self) -> _Clients:
        self.start()
        self.answer(120, "start")
        return self

    def streams(self, url: str, prompts: list[list[int]], new_tokens: int) -> int:
        """Run the streams in the client process; the tokens they received."""
        self.connection.send((url, prompts, new_tokens))
        return self.answer(600, "finish its streams")

    def __exit__(self, *exc) -> None:
        self.stop()


def run_http(clients: _Clients, url: str, backend: TimedBackend, prompts, new_tokens) -> ModeRun:
    first = len(backend.steps)
    start = time.perf_counter()
    tokens = clients.streams(url, prompts, new_tokens)
    wall = time.perf_counter() - start
    return ModeRun(wall, tokens, backend.steps[first:])


HTTP_ATTEMPTS = 3  # tries at a streaming run whose requests all arrived before the first one finished


def _http_with_full_steps(
    clients: _Clients, url: str, backend: TimedBackend, prompts, new_tokens, log
) -> ModeRun:
    """An HTTP run with at least one full decode step to compare. Requests that arrive more than a few
    steps apart (the clients run at low priority; a busy machine may hold them back) leave none: such
    a run is measured again, and the benchmark stops with what happened if every attempt misses."""
    for attempt in range(1, HTTP_ATTEMPTS + 1):
        run = run_http(clients, url, backend, prompts, new_tokens)
        if run.decode_periods(len(prompts)):
            return run
        log(f"  the HTTP run {attempt} had no step with all {len(prompts)} streams' decodes; measured again")
    raise BenchFailed(
        f"in {HTTP_ATTEMPTS} HTTP runs the {len(prompts)} requests never shared a decode step (the last arrived "
        f"after the first had finished its {new_tokens} tokens): raise --new-tokens or run on a quieter machine"
    )


def _server(backend: TimedBackend, streams: int, prompt_tokens: int, model_id: str) -> BenchServer:
    """The service for `streams` streams, every prompt in the first step (as in the direct run)."""
    from wafer_gpt2.settings import ServerSettings

    settings = ServerSettings(
        port=0,
        model_id=model_id,
        max_concurrent_requests=streams,
        max_queue=4 * streams,
        step_token_budget=max(ServerSettings.step_token_budget, streams * prompt_tokens),
    )
    return BenchServer(backend, settings, model_id, ready_timeout_s=600)


# ----------------------------------------------------------------------------------------------------


def measure(
    params,
    model_name: str,
    streams: int = 16,
    prompt_tokens: int = 8,
    new_tokens: int = 16,
    reps: int = 3,
    dtype: str = "fp16",
    seed: int = 0,
    log=print,
) -> ServiceBenchResult:
    """Run the three modes `reps` times each, alternating; every figure is measured here."""
    from wafer_gpt2.backends.registry import BackendOptions, build_sim_backend

    config = params.config
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, config.vocab_size - 1, prompt_tokens).tolist() for _ in range(streams)]
    options = BackendOptions(slots=streams, context=prompt_tokens + new_tokens, dtype=dtype)
    log(
        f"bench service: {model_name}, {streams} streams, prompt {prompt_tokens} tokens, {new_tokens} new tokens "
        f"each (greedy, EOS ignored), simulator {dtype}, median of {reps}; planning and uploading ..."
    )
    backend = TimedBackend(build_sim_backend(params, options))
    result = ServiceBenchResult(model_name, streams, prompt_tokens, new_tokens)
    try:
        with _server(backend, streams, prompt_tokens, model_name) as server, _Clients() as clients:
            # Warm-up: the first requests through every layer (and the client process's connections,
            # one per stream), and the batch shape once directly.
            run_http(clients, server.url, backend, prompts, 2)
            run_direct(backend, prompts, 2)
            ids: dict[str, list[list[int]]] = {}
            for rep in range(reps):
                # Rotate the order so no mode always runs first (caches, the neighbours' load).
                for mode in MODES[rep % 3 :] + MODES[: rep % 3]:
                    if mode == "direct":
                        run, ids["direct"] = run_direct(backend, prompts, new_tokens)
                    elif mode == "engine":
                        run, ids["engine"] = run_engine(server.engine, backend, prompts, new_tokens)
                    else:
                        run = _http_with_full_steps(clients, server.url, backend, prompts, new_tokens, log)
                    result.runs[mode].append(run)
                same = ids["direct"] == ids["engine"]
                result.same_tokens = same if result.same_tokens in (None, True) else False
                log(
                    f"  rep {rep + 1}: "
                    + ", ".join(f"{mode} {result.runs[mode][-1].tokens_per_s:.1f}" for mode in MODES)
                    + " tokens/s (measured)"
                )
    finally:
        backend.inner.close()
    return result


def print_result(result: ServiceBenchResult) -> None:
    print(
        f"{'mode':<26}{'tokens/s':>10}{'steps':>7}{'1st step ms':>12}{'in step ms':>12}{'step ms':>9}"
        f"{'gap ms':>8}{'overhead':>10}"
    )
    labels = {
        "direct": "direct (backend steps)",
        "engine": "engine, no HTTP",
        "http": "HTTP service, streaming",
    }
    for mode in MODES:
        overhead = "" if mode == "direct" else f"{result.overhead_pct(mode):+.1f}%"
        print(
            f"{labels[mode]:<26}{result.tokens_per_s(mode):>10.1f}{result.steps(mode):>7.0f}"
            f"{result.first_step_ms(mode):>12.1f}{result.step_ms(mode):>12.1f}{result.period_ms(mode):>9.1f}"
            f"{result.gap_ms(mode):>8.2f}{overhead:>10}  (measured)"
        )
    print(
        "step ms: full decode steps (one item per stream) start to start, median; in step ms: inside "
        "backend.step; gap ms: wall time outside steps, per step; overhead: step ms against direct; "
        f"HTTP {result.clients_note()}"
    )
    if result.same_tokens is not None:
        print(
            f"greedy tokens of direct steps and engine: {'identical' if result.same_tokens else 'DIFFERENT'}"
        )
    print(result.summary_line())


def run(args: argparse.Namespace) -> int:
    from wafer_gpt2.model.checkpoint import load_checkpoint, resolve_weights
    from wafer_gpt2.model.config import resolve_config
    from wafer_gpt2.model.params import GPT2Params

    for flag, value, minimum in (
        ("--streams", args.streams, 1),
        ("--prompt-tokens", args.prompt_tokens, 1),
        ("--new-tokens", args.new_tokens, MIN_NEW_TOKENS),
        ("--reps", args.reps, 1),
    ):
        if value < minimum:
            raise UserError(f"{flag} must be at least {minimum} for bench service, got {value}")
    if args.weights is None:
        params, name = (
            GPT2Params.random(resolve_config(args.model), seed=args.seed),
            f"{args.model} (random weights)",
        )
    else:
        path = resolve_weights(None if args.weights == "demo" else args.weights)
        params, name = load_checkpoint(path), str(args.weights)
    if args.prompt_tokens + args.new_tokens > params.config.n_positions:
        raise UserError(
            f"prompt + new tokens ({args.prompt_tokens + args.new_tokens}) exceed the context "
            f"{params.config.n_positions}"
        )
    result = measure(
        params,
        name,
        args.streams,
        args.prompt_tokens,
        args.new_tokens,
        args.reps,
        args.dtype,
        args.seed,
        log=lambda message: print(message, file=sys.stderr, flush=True),
    )
    print_result(result)
    return 0
