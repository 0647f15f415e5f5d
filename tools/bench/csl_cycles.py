"""The GPT-2 CSL program's cycles per region on the CSL executor, beside the cost model's prediction for
the same plan (docs/kernels.md, "Cycles: executor vs cost model").

Both figures are modeled: the executor's come from its per-event costs (csl_executor/timing.py) running
the real CSL, the cost model's from wafer_gpt2/core/cost.py's formulas. Per region the executor figure is the
longest busy span of any of its PEs for one decode item: from the moment its input is in memory
(residual adds: the GEMV output's arrival) to the moment its output has left (wafer_gpt2/kernels/lib/timing.csl);
the model's is the stage without its input phase, which the executor span leaves out. The last row
is the whole token, like for like: the executor's cycles from the decode step's first H2D command to its
last D2H (memcpy edge in to edge out) against the sum of the model's stages at that position.

The second table follows the token along its path, like for like: per region, the executor's cycles
from the moment the last of its PEs had its input in memory to the same moment of the next region on
the path (the PEs' `started` stamps, read from the executor's memory), against the model's cycles
between the same two moments (the stage without its input phase, any route after it, and the next
stage's input phase). Its rows add up to the path from the first region with counters to io.out.

    python tools/bench/csl_cycles.py [--arch wse2] [--vocab 50257] [--objective compact] [--position 32] [--idle]
                                     [--fc-cols F]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from csl_executor import timing  # noqa: E402
from wafer_gpt2.backends.csl import CslExecutorRuntime, compile_plan  # noqa: E402
from wafer_gpt2.core.cost import attention_cost, head_role_cycles  # noqa: E402
from wafer_gpt2.core.runtime import from_wire  # noqa: E402
from wafer_gpt2.core.steps import StepInputs, StepItem  # noqa: E402
from wafer_gpt2.host.program import CYCLES_SYMBOL, WaferGPT2  # noqa: E402
from wafer_gpt2.model.config import GPT2Config  # noqa: E402
from wafer_gpt2.model.params import GPT2Params  # noqa: E402
from wafer_gpt2.plan import Plan, build_plan, plan_for_knobs  # noqa: E402

INPUT_PHASES = (
    "input",
    "input multicast",
    "task: the input in",
    "the chunk in",
    "request to the lines' first PE",
    "k, q multicast",
    "hand-off",
    "input to the farthest column",
)
# The phases a stage begins with before its last PE has its input in memory (the hand-off ends one).
LEADING_PHASES = tuple(p for p in INPUT_PHASES if p != "hand-off")
STARTED_SYMBOL = "started"  # wafer_gpt2/kernels/lib/timing.csl: the TSC when the PE's last item began


def region_spans(model: WaferGPT2, replica: int = 0) -> dict[str, int]:
    """Per region, the largest `cycles[0]` (the last item's busy span) over its PEs."""
    runtime = model.runtime
    symbol = runtime.get_id(CYCLES_SYMBOL)
    spans = {}
    for region in model.plan.regions:
        if region.replica != replica:
            continue
        words = np.zeros(region.w * region.h * 4, dtype=np.uint32)
        runtime.memcpy_d2h(words, symbol, region.x, region.y, region.w, region.h, 4, streaming=False)
        spans[region.name] = int(from_wire(words, np.uint32).reshape(-1, 4)[:, 0].max())
    return spans


def head_role_spans(model: WaferGPT2, replica: int = 0) -> tuple[int, int]:
    """(a weighted PE, the rounds' PEs) of a head with its rounds apart: the largest last-item span of
    the K-lines' weighted PEs and of the PEs after them (HeadTiling.apart), the latter over the sets
    of the rounds (each takes every sets-th item: `wafer_gpt2.core.cost.head_role_cycles`'s terms)."""
    region = model.plan.region("head", replica)
    words = np.zeros(region.w * region.h * 4, dtype=np.uint32)
    symbol = model.runtime.get_id(CYCLES_SYMBOL)
    model.runtime.memcpy_d2h(words, symbol, region.x, region.y, region.w, region.h, 4, streaming=False)
    spans = from_wire(words, np.uint32).reshape(region.h, region.w, 4)[:, :, 0]  # [y][x]; K along +x
    rows, sets = model.plan.head.gemv.rows, model.plan.head.sets
    return int(spans[:, :rows].max()), -(-int(spans[:, rows:].max()) // sets)


def region_starts(model: WaferGPT2, runtime: CslExecutorRuntime, replica: int = 0) -> dict[str, int]:
    """Per region with counters, the executor's cycle at which the last of its PEs began its last item
    (lib/timing.csl `started` plus the cycle the PE enabled its counter)."""
    starts = {}
    for region in model.plan.regions:
        if region.replica != replica:
            continue
        latest = None
        for y in range(region.y, region.y + region.h):
            for x in range(region.x, region.x + region.w):
                pe = runtime.machine.pes[(x, y)]
                var = next((v for v in pe.program.symbols if v.name == STARTED_SYMBOL), None)
                if var is None or not pe.tsc_on:
                    continue
                stamp = int(pe.mH[var.addr]) | int(pe.mH[var.addr + 1]) << 16
                latest = max(latest or 0, pe.tsc_base + stamp)
        if latest is not None:
            starts[region.name] = latest
    return starts


def path_rows(
    plan, position: int, starts: dict[str, int], edges: tuple[int, int]
) -> list[tuple[str, int, int]]:
    """(region, executor, model) between consecutive regions of the token's path that have counters:
    the moments their last PE had its input in memory (see the module's docstring); the first row from
    the memcpy edge in (`edges`: the executor's first H2D start and last D2H end), the last to the edge
    out."""
    moment, at = {}, 0
    for stage in plan.stage_costs:
        phases = list(_phases(plan, stage, position).items())
        lead = 0
        for name, cycles in phases:
            if name not in LEADING_PHASES:
                break
            lead += cycles
        moment[stage.name] = at + lead
        at += sum(c for _, c in phases)
    on_path = [name for name in moment if name in starts]
    first, last = on_path[0], on_path[-1]
    return [
        ("edge in", starts[first] - edges[0], moment[first]),
        *(
            (a, starts[b] - starts[a], moment[b] - moment[a])
            for a, b in zip(on_path, on_path[1:], strict=False)
        ),
        (last, edges[1] - starts[last], at - moment[last]),
    ]


def _phases(plan, stage, position: int) -> dict[str, int]:
    region = next((r for r in plan.regions if r.name == stage.name), None)
    if region is not None and region.kind == "attention":
        return dict(attention_cost(region.tiling, plan.arch, plan.dtype, position + 1).phases)
    return dict(stage.phases)


def modeled(plan, position: int, whole: bool = False) -> dict[str, int]:
    """Per stage, the model's cycles for a decode item at `position` (attention priced at that context);
    without `whole`, less the input phases the executor's span leaves out."""
    out = {}
    for stage in plan.stage_costs:
        phases = _phases(plan, stage, position)
        out[stage.name] = sum(v for k, v in phases.items() if whole or k not in INPUT_PHASES)
    return out


def edges(runtime: CslExecutorRuntime) -> tuple[int, int]:
    """The executor's cycles at which the step's first H2D command started and its last D2H ended: the
    token's whole path, memcpy edge in to memcpy edge out, as the model's `decode_cycles` counts it."""
    times = runtime.machine.command_times
    starts = [start for kind, start, _ in times if kind == "StreamH2D"]
    ends = [end for kind, _, end in times if kind == "StreamD2H"]
    return min(starts), max(ends)


def add_pacing_argument(p: argparse.ArgumentParser) -> None:
    """--stream-pacing: the executor's rule for a stream into an input queue (csl_executor.timing
    STREAM_PACING, which the hardware data leave open)."""
    p.add_argument(
        "--stream-pacing",
        choices=["queue-depth", "link-rate"],
        default=timing.STREAM_PACING,
        help="how fast the executor streams into an input queue: its depth over the router-to-CE "
        "latency (the executor's default) or a wavelet a cycle (the cost model's)",
    )


def tiny_plan(args: argparse.Namespace) -> tuple[Plan, GPT2Params]:
    """The tiny GPT-2 of docs/kernels.md's tables (2 layers, n_embd 64, 2 heads, 64 positions) on one
    replica, planned as `args` say (arch, dtype, vocab, slots, objective), and its random weights; the
    executor's stream pacing set as `args.stream_pacing` says."""
    timing.STREAM_PACING = args.stream_pacing
    config = GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=args.vocab, n_positions=64, name="tiny")
    plan = build_plan(
        config,
        arch=args.arch,
        dtype=args.dtype,
        slots=args.slots,
        context=64,
        objective=args.objective,
        replicas=1,
    )
    if getattr(args, "fc_cols", None):  # the same size with FC and proj over this many rows
        plan = plan_for_knobs(
            config,
            replace(plan.knobs, fc_cols=args.fc_cols),
            arch=args.arch,
            dtype=args.dtype,
            slots=args.slots,
            context=64,
            objective=args.objective,
        )
    return plan, GPT2Params.random(config, seed=3)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", default="wse2", choices=["wse2", "wse3"])
    p.add_argument("--dtype", default="fp32", choices=["fp16", "fp32"])
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--objective", default="compact")
    p.add_argument("--position", type=int, default=32, help="the decode item's position (its context)")
    p.add_argument(
        "--slots",
        type=int,
        default=2,
        help="KV slots of the plan (4 and more: a throughput plan's head has its rounds apart)",
    )
    p.add_argument(
        "--idle",
        action="store_true",
        help="score the prompt's last item first, so that the decode item runs on an idle wafer (a "
        "chained region's PEs then start it together, not as each finishes the prompt's items)",
    )
    p.add_argument(
        "--fc-cols",
        type=int,
        help="FC's and proj's rows (F) instead of the plan's: one that does not divide 4 n_embd makes "
        "their tiles ragged",
    )
    p.add_argument("--json", help="write the table here")
    add_pacing_argument(p)
    args = p.parse_args()
    plan, params = tiny_plan(args)
    runtime = CslExecutorRuntime(compile_plan(plan))
    model = WaferGPT2(plan, runtime, params)
    try:
        rng = np.random.default_rng(0)
        prompt = [
            StepItem(0, i, int(rng.integers(args.vocab)), want_scores=args.idle and i == args.position - 1)
            for i in range(args.position)
        ]
        if prompt:
            model.step(StepInputs.of_items(prompt))
        runtime.machine.command_times.clear()  # the decode step's commands only
        model.step(StepInputs.of_items([StepItem(0, args.position, 1, want_scores=True)]))
        spans = region_spans(model)
        roles = head_role_spans(model) if plan.head.apart else None
        starts = region_starts(model, runtime)
        edge_in, edge_out = edges(runtime)
        token = edge_out - edge_in
    finally:
        model.close()
    model_cycles = modeled(plan, args.position)
    rows = []
    print(
        f"{plan.config.name}: {args.arch} {args.dtype} {args.objective}, vocab {args.vocab}, decode at position "
        f"{args.position} (modeled cycles, both columns)"
    )
    print(f"{'region':<14}{'executor':>10}{'cost model':>12}{'ratio':>8}")
    for name, span in spans.items():
        if name not in model_cycles:
            continue
        ratio = span / model_cycles[name] if model_cycles[name] else float("inf")
        rows.append(
            {"region": name, "executor": span, "cost_model": model_cycles[name], "ratio": round(ratio, 2)}
        )
        print(f"{name:<14}{span:>10,}{model_cycles[name]:>12,}{ratio:>8.2f}")
    if roles is not None:
        head = next(stage for stage in plan.stage_costs if stage.name == "head")
        for role, span, cost in zip(
            ("head: weighted", "head: rounds"), roles, head_role_cycles(plan.head, head), strict=True
        ):
            rows.append(
                {"region": role, "executor": span, "cost_model": cost, "ratio": round(span / cost, 2)}
            )
            print(f"{role:<14}{span:>10,}{cost:>12,}{span / cost:>8.2f}")
    path = sum(modeled(plan, args.position, whole=True).values())
    rows.append({"region": "token", "executor": token, "cost_model": path, "ratio": round(token / path, 2)})
    print(f"{'token (edge to edge)':<14}{token:>10,}{path:>12,}{token / path:>8.2f}")
    print("\nalong the path: from a region's input in memory to the next one's")
    print(f"{'region':<14}{'executor':>10}{'cost model':>12}{'ratio':>8}")
    path_table = []
    for name, executor, cost in path_rows(plan, args.position, starts, (edge_in, edge_out)):
        ratio = executor / cost if cost else float("inf")
        path_table.append(
            {"region": name, "executor": executor, "cost_model": cost, "ratio": round(ratio, 2)}
        )
        print(f"{name:<14}{executor:>10,}{cost:>12,}{ratio:>8.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"spans": rows, "path": path_table}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
