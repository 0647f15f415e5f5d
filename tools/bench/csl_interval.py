"""A plan's initiation interval on the CSL executor, beside the cost model's (docs/kernels.md, "The
head's interval"): how often one replica takes an item when items come back to back.

Both figures are modeled: the executor's from its per-event costs running the real CSL, the cost
model's from `Plan.occupancy_cycles` (the busiest stage's occupancy). The executor's is the difference
between a step of 2n scored items and one of n, each sent in one message, over n: the pipeline's fill
and drain cancel. The host program splits a message at the records io.out holds (`Plan.records_held`,
a replica's slots) and reads them before it sends on, which would time the token's latency once per
part, so the measurement sends each step whole (its runtime's `serial_memcpy` off): the tiny model's
pipeline holds the records of both steps (a message stalls only past about 15 on these plans).

    python tools/bench/csl_interval.py [--arch wse2] [--vocab 512] [--objective throughput] [--slots 4] [--items 4]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.bench.csl_cycles import add_pacing_argument, tiny_plan  # noqa: E402
from wafer_gpt2.backends.csl import CslExecutorRuntime, compile_plan  # noqa: E402
from wafer_gpt2.core.steps import StepInputs, StepItem  # noqa: E402
from wafer_gpt2.host.program import WaferGPT2  # noqa: E402
from wafer_gpt2.model.params import GPT2Params  # noqa: E402


def step_cycles(plan, params: GPT2Params, items: int) -> int:
    """The executor's cycles from a step's first H2D start to its last D2H end, for `items` scored
    prompt items of one slot sent in one message."""
    runtime = CslExecutorRuntime(compile_plan(plan))
    runtime.serial_memcpy = False  # each step in one message (module docstring)
    model = WaferGPT2(plan, runtime, params)
    try:
        vocab = plan.config.vocab_size
        runtime.machine.command_times.clear()
        model.step(
            StepInputs.of_items([StepItem(0, i, (7 * i + 1) % vocab, want_scores=True) for i in range(items)])
        )
        times = runtime.machine.command_times
        return max(end for kind, _, end in times if kind == "StreamD2H") - min(
            start for kind, start, _ in times if kind == "StreamH2D"
        )
    finally:
        model.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", default="wse2", choices=["wse2", "wse3"])
    p.add_argument("--dtype", default="fp32", choices=["fp16", "fp32"])
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--objective", default="throughput")
    p.add_argument(
        "--slots",
        type=int,
        default=4,
        help="KV slots (at 4 and more the tiny throughput plan's head runs its rounds apart)",
    )
    p.add_argument("--items", type=int, default=4, help="n: steps of n and 2n scored items")
    add_pacing_argument(p)
    args = p.parse_args()
    plan, params = tiny_plan(args)
    config = plan.config
    one, two = (step_cycles(plan, params, n) for n in (args.items, 2 * args.items))
    interval = (two - one) / args.items
    slowest = max(plan.stage_costs, key=lambda stage: stage.busy)
    sets = f" in each of {plan.head.sets} sets" if plan.head.sets > 1 else ""
    apart = f", its rounds apart ({plan.head.workers} workers{sets})" if plan.head.apart else ""
    print(
        f"{config.name}: {args.arch} {args.dtype} {args.objective}, {args.slots} slots, vocab {args.vocab}; "
        f"the head {plan.head.line} x {plan.head.gemv.cols} PEs{apart} (modeled cycles, both)"
    )
    print(f"steps of {args.items} and {2 * args.items} scored items: {one:,} and {two:,} cycles")
    print(
        f"interval: executor {interval:,.0f}, cost model {plan.occupancy_cycles:,} ({slowest.name}), "
        f"executor / model {interval / plan.occupancy_cycles:.2f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
