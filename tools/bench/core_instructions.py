"""The engine core's instructions per generated token, counted by valgrind.

A shared machine's speed swings within a minute by far more than a few percent, so CPU times of
alternated runs cannot resolve such a change in the host's per-token work. Instruction counts can: the
same run gives nearly the same count every time. `EngineCore` is stepped over the null backend (no model;
or `--backend modeled`, the GPT-2 124M plan's stand-in, which also does the host program's side of the
wire, its waits cut to nothing; `--steps-in-flight N` steps its requests in N groups, as the server does
beside a wafer that takes N steps at a time), `--requests` requests of a 10-token prompt and `--new-tokens` tokens each per round, and valgrind's
cachegrind (no cache simulation) counts the instructions of `--rounds` + 1 rounds less those of one
round, so imports and the tokenizer's load cancel out. Counts are fixed by a hash seed, address-space
randomisation off (`setarch -R`) and numpy's thread pools at one thread (their idle threads' instructions
would be counted too).

    python tools/bench/core_instructions.py [--tree PATH ...] [--requests 64] [--new-tokens 32] [--stream]
                                            [--backend null|modeled] [--steps-in-flight N] [--varied] [--pipe]
                                            [--closed-loop N]

`--varied` gives the requests of a round different lengths (the same total), so that they end one after
another, as the server's closed-loop clients' requests do, instead of all at the round's end. `--pipe`
hands the events to the engine process's sink (`wafer_gpt2.engine.process`), which encodes each step's
events for the pipe (the bytes are dropped) and whose receiver makes the text of the requests without
stop sequences, instead of to an event loop's sink in the same process: what the engine process's
thread does. `--closed-loop N` serves a round's requests N at a time, the next joining as one ends, as
the server's closed-loop clients' requests do: a group's decode run ends at each join, and the tokens it
recorded are settled (with `--varied`, as under the server).

`--tree` (repeatable) counts another checkout of the repository too (e.g. a `git worktree` of the
commit before a change), alternately with this one. Needs valgrind and setarch (Debian: valgrind,
util-linux). The figures are this machine's instruction counts, measured, not time.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import pickle
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROMPT = tuple(range(100, 110))
FIXED_ENV = {
    "PYTHONHASHSEED": "0",
    "OPENBLAS_NUM_THREADS": "1",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}


def lengths(requests: int, new_tokens: int, varied: bool) -> list[int]:
    """Each request's new tokens in a round: all `new_tokens`, or (`varied`) spread in pairs above and
    below it by up to half of it, so that requests end one after another as the server's clients' do,
    the round's total unchanged."""
    if not varied:
        return [new_tokens] * requests
    out = []
    for i in range(requests):
        spread = (i // 2) * new_tokens // requests
        out.append(
            new_tokens if i == requests - 1 and requests % 2 else new_tokens + (spread if i % 2 else -spread)
        )
    return out


def workload(
    rounds: int,
    requests: int,
    new_tokens: int,
    stream: bool,
    plan_file: str = "",
    steps_in_flight: int = 1,
    varied: bool = False,
    pipe: bool = False,
    closed_loop: int = 0,
) -> int:
    """Step the engine core over the null backend (or the modeled one, its plan pickled in `plan_file`,
    never waiting: only its instructions count; its steps in flight give the core's groups); the
    tokens it generated."""
    from wafer_gpt2.backends.stand_ins import ModeledWaferBackend, NullBackend
    from wafer_gpt2.core.steps import Backend
    from wafer_gpt2.engine.core import EngineCore, gpt2_tokenizer_hooks
    from wafer_gpt2.engine.request import EventSink, GenerationRequest, RequestStatus, loop_sink

    backend: Backend
    if plan_file:
        plan = pickle.loads(Path(plan_file).read_bytes())
        backend = ModeledWaferBackend(plan, timer_late_s=math.inf, steps_in_flight=steps_in_flight)
    else:
        longest = max(lengths(requests, new_tokens, varied))
        backend = NullBackend(50257, slots=requests, context=len(PROMPT) + longest, top_k=64)
    core = EngineCore(backend, gpt2_tokenizer_hooks(), max_queue=requests, step_token_budget=512)
    loop = asyncio.new_event_loop()  # events go to its queue, as under the server; never run
    sink: EventSink = loop_sink(loop)
    ended = [0]  # with `pipe`: the tokens of the requests that ended (some have no records here)
    if pipe:
        from wafer_gpt2.engine import messages, process, request

        ids_only = getattr(request, "IdsFinishEvent", None)  # none in a tree to compare from before it

        class Forgotten:  # the book of the engine process's requests, for cancellations: none here
            def ended(self, request_ids: list[str]) -> None:
                pass

        def send(message: messages.FromEngine) -> None:
            messages.encode(message)
            for _, event in message.events if isinstance(message, messages.Events) else ():
                if type(event) is ids_only:  # a streamed one's carries the tokens after its token events'
                    ended[0] += getattr(event, "streamed", 0) + len(getattr(event, "ids", ()))
                elif type(event) is not request.TokenEvent:
                    ended[0] += len(getattr(event, "tokens", ()))

        sink = process._PipeSink(send, Forgotten())  # type: ignore[arg-type]
    generated = 0
    try:
        for _ in range(rounds):
            states = [
                core.new_request(GenerationRequest(PROMPT, length), sink, stream=stream)
                for length in lengths(requests, new_tokens, varied)
            ]
            waiting = states[::-1]  # the next to join last
            in_flight = [core.add(waiting.pop()) for _ in range(min(closed_loop, requests) or requests)]
            while core.has_work():
                core.step()
                if waiting:  # (closed loop) as many join as ended
                    for i, state in enumerate(in_flight):
                        if state.status is RequestStatus.FINISHED and waiting:
                            in_flight[i] = core.add(waiting.pop())
            generated += ended[0] if pipe else sum(len(state.tokens) for state in states)
            ended[0] = 0
            loop._ready.clear()  # type: ignore[attr-defined]  # the undelivered event hand-overs
    finally:
        loop.close()
    return generated


def parse_instructions(valgrind_output: str) -> int:
    """The `I refs` total of a cachegrind run."""
    match = re.search(r"I\s+refs:\s+([\d,]+)", valgrind_output)
    if match is None:
        raise RuntimeError(f"no instruction count in valgrind's output:\n{valgrind_output[-2000:]}")
    return int(match[1].replace(",", ""))


def count(tree: Path, rounds: int, args: argparse.Namespace) -> int:
    """Instructions of one process running `rounds` rounds of the workload from `tree`."""
    command = [
        "setarch", "-R", "valgrind", "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null",
        sys.executable, str(Path(__file__).resolve()), "--run", str(rounds),
        "--requests", str(args.requests), "--new-tokens", str(args.new_tokens),
    ]  # fmt: skip
    if args.stream:
        command.append("--stream")
    if args.varied:
        command.append("--varied")
    if args.pipe:
        command.append("--pipe")
    if args.closed_loop:
        command += ["--closed-loop", str(args.closed_loop)]
    if args.plan_file:
        command += ["--plan-file", args.plan_file, "--steps-in-flight", str(args.steps_in_flight)]
    env = {**os.environ, **FIXED_ENV, "PYTHONPATH": str(tree)}
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"valgrind run failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return parse_instructions(done.stderr)


def per_token(tree: Path, args: argparse.Namespace) -> float:
    tokens = args.rounds * args.requests * args.new_tokens
    return (count(tree, args.rounds + 1, args) - count(tree, 1, args)) / tokens


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", action="append", default=[], help="another checkout to count too")
    parser.add_argument("--requests", type=int, default=64, help="requests per round (one step each)")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3, help="rounds counted (beyond the first)")
    parser.add_argument("--repeats", type=int, default=1, help="counts per tree, alternated")
    parser.add_argument("--stream", action="store_true", help="streamed requests (token events)")
    parser.add_argument(
        "--varied",
        action="store_true",
        help="requests of different lengths (the same total), ending one after another as under the server",
    )
    parser.add_argument(
        "--pipe",
        action="store_true",
        help="the engine process's sink: each step's events encoded for the pipe, text made by the receiver",
    )
    parser.add_argument(
        "--closed-loop",
        type=int,
        default=0,
        metavar="N",
        help="N of a round's requests at a time, the next joining as one ends (a run ends at each join)",
    )
    parser.add_argument(
        "--backend",
        choices=("null", "modeled"),
        default="null",
        help="null (no wire) or modeled: the GPT-2 124M plan's stand-in, which does the host program's "
        "side of the wire (each step's message encoded, its records decoded), its waits cut to nothing",
    )
    parser.add_argument(
        "--steps-in-flight",
        type=int,
        default=1,
        help="modeled backend: steps it takes at a time, so the core steps its requests in as many groups",
    )
    parser.add_argument("--plan-file", default="", help=argparse.SUPPRESS)  # the counted process's plan
    parser.add_argument("--run", type=int, default=0, help=argparse.SUPPRESS)  # the counted process
    args = parser.parse_args(argv)
    if min(args.requests, args.new_tokens, args.rounds, args.repeats, args.steps_in_flight) < 1:
        parser.error("--requests, --new-tokens, --rounds, --repeats and --steps-in-flight must be at least 1")
    if args.steps_in_flight > 1 and args.backend != "modeled" and not args.plan_file:
        parser.error("--steps-in-flight needs --backend modeled")
    if args.run:
        sys.path.insert(0, os.environ.get("PYTHONPATH", str(ROOT)).split(os.pathsep)[0])
        workload(
            args.run,
            args.requests,
            args.new_tokens,
            args.stream,
            args.plan_file,
            args.steps_in_flight,
            args.varied,
            args.pipe,
            args.closed_loop,
        )
        return 0
    missing = [tool for tool in ("valgrind", "setarch") if shutil.which(tool) is None]
    if missing:
        print(
            f"core_instructions: {' and '.join(missing)} not found (Debian: valgrind, util-linux)",
            file=sys.stderr,
        )
        return 2
    trees = [ROOT, *(Path(tree).resolve() for tree in args.tree)]
    kind = "streamed" if args.stream else "non-streamed"
    at_a_time = f" ({args.closed_loop} at a time)" if args.closed_loop else ""
    sink = ", events to the engine process's sink" if args.pipe else ""
    groups = f", {args.steps_in_flight} groups" if args.steps_in_flight > 1 else ""
    print(
        f"engine core over the {args.backend} backend{groups}: {args.requests} {kind} requests{at_a_time} x "
        f"{args.new_tokens} new tokens per round{sink}"
    )
    with tempfile.TemporaryDirectory() as scratch:
        if args.backend == "modeled":  # planned once, here: the search would cost minutes under valgrind
            sys.path.insert(0, str(ROOT))  # run as a script: the repository's root is not on the path
            from wafer_gpt2.benchmarks.host import modeled_plan
            from wafer_gpt2.model.config import PRESETS

            args.plan_file = str(Path(scratch) / "plan.pickle")
            plan = modeled_plan(PRESETS["gpt2"], args.requests, len(PROMPT) + args.new_tokens)
            Path(args.plan_file).write_bytes(pickle.dumps(plan))
        for _ in range(args.repeats):
            for tree in trees:
                print(f"  {tree}: {per_token(tree, args):,.0f} instructions per generated token (valgrind)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
