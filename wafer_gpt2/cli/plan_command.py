"""`wafer-gpt2 plan`: place a GPT-2 model on the wafer and report what it uses and what it costs.

Prints a text summary (every time figure is modeled by `wafer_gpt2.core.cost`, not measured); `--json` writes
the plan (regions, tilings, routes, summary) and `--png` a map of the wafer.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from wafer_gpt2.core.arch import ARCHS
from wafer_gpt2.errors import UserError
from wafer_gpt2.model.config import PRESETS, resolve_config
from wafer_gpt2.plan import DTYPES, OBJECTIVES, build_plan, largest_slots


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="place a model on the wafer (regions, tilings, modeled cost)",
        description="Plan the layer-pipelined, weight-stationary placement of a GPT-2 model on a wafer.",
    )
    parser.add_argument(
        "--model", default="gpt2", help=f"{', '.join(PRESETS)}, or a config.json / HF directory"
    )
    parser.add_argument("--arch", choices=tuple(ARCHS), default="wse2", help="target wafer (wse2)")
    parser.add_argument("--dtype", choices=DTYPES, default="fp16", help="weight precision (fp16)")
    parser.add_argument("--slots", type=int, default=16, metavar="N", help="KV cache slots per replica (16)")
    parser.add_argument(
        "--context", type=int, metavar="N", help="tokens per slot (default: the model's n_positions)"
    )
    parser.add_argument(
        "--objective", choices=OBJECTIVES, default="latency", help="what to optimise (latency)"
    )
    parser.add_argument(
        "--replicas", default="1", metavar="N|auto", help="pipelines side by side (1; auto: as many as fit)"
    )
    parser.add_argument(
        "--top-k", type=int, default=64, metavar="K", help="candidates the head returns per token (64)"
    )
    parser.add_argument("--json", metavar="FILE", help="write the plan as JSON")
    parser.add_argument("--png", metavar="FILE", help="write a map of the wafer as PNG")
    parser.add_argument(
        "--max-slots",
        action="store_true",
        help="also report the largest slot count that fits at this context",
    )
    parser.set_defaults(func=run)


def parse_replicas(text: str) -> int | str:
    if text == "auto":
        return "auto"
    try:
        value = int(text)
    except ValueError:
        raise UserError(f"--replicas must be a positive integer or 'auto', got {text!r}") from None
    if value < 1:
        raise UserError(f"--replicas must be a positive integer or 'auto', got {text!r}")
    return value


def run(args: argparse.Namespace) -> int:
    config = resolve_config(args.model)
    replicas = parse_replicas(args.replicas)
    plan = build_plan(
        config, args.arch, args.dtype, args.slots, args.context, args.objective, replicas, args.top_k
    )
    print(plan.summary_text())
    if args.max_slots:
        most = largest_slots(config, args.arch, args.dtype, plan.context)
        print(f"  largest KV capacity that fits: {most} slots x {plan.context} tokens")
    if args.json:
        _write(args.json, lambda p: p.write_text(json.dumps(plan.to_json(), indent=1) + "\n"))
        print(f"  wrote {args.json}")
    if args.png:
        from wafer_gpt2.plan.drawing import draw_wafer_map

        _write(args.png, lambda p: draw_wafer_map(plan, p))
        print(f"  wrote {args.png}")
    sys.stdout.flush()
    return 0


def _write(name: str, write) -> None:
    path = Path(name)
    if not path.parent.is_dir():
        raise UserError(f"cannot write {name}: directory {path.parent} does not exist")
    try:
        write(path)
    except OSError as exc:
        raise UserError(f"cannot write {name}: {exc.strerror or exc}") from None
