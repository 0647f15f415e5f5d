"""The wafer plan: which rectangle of PEs holds what, how each operation is tiled, and what it costs.

GPT-2 decode is layer-pipelined and weight-stationary: every transformer layer gets its own
rectangle, split into one sub-region per operation; a token's activation flows from region to region
over the fabric. `build_plan` explores the free sizes (how many PEs carry the residual stream, how
the attention chain is folded, how wide FC/PROJ and the LM head are), keeps the candidates that meet
every limit (48 KB per PE minus a reserve, routable colors, the kernel rectangle, no overlaps, a route
for every hand-off) and picks the best by the objective, using the cycle model of `wafer_gpt2.core.cost`.

The modules, in reading order:

- model.py: what a plan is (Plan, Region, Route, Symbol, Knobs, PlanError), its JSON and summary.
- tilings.py: the tiling each operation gets from one candidate's knobs.
- symbols.py: the arrays a PE of each region kind keeps, and their bytes.
- geometry.py: where one replica's regions and routes go, as arithmetic (the layer layout is drawn there).
- placement.py: the Region and Route objects of one replica at its corner of the kernel.
- checks.py: the request's arguments and every limit (memory, kernel area, overlaps, colors).
- stages.py: the modeled stages of one layer and the critical path of one token.
- search.py: the candidates and their prices, `build_plan`, `plan_for_knobs` and `largest_slots`.
"""

from wafer_gpt2.core.abi import LAYER_OPS
from wafer_gpt2.plan.geometry import exit_dirs
from wafer_gpt2.plan.search import build_plan, largest_slots, plan_for_knobs, price_candidates
from wafer_gpt2.plan.structure import (
    DTYPES,
    KINDS,
    OBJECTIVES,
    Knobs,
    LayerPlan,
    Plan,
    PlanError,
    Region,
    Route,
    Symbol,
)

__all__ = [
    "DTYPES",
    "KINDS",
    "LAYER_OPS",
    "OBJECTIVES",
    "Knobs",
    "LayerPlan",
    "Plan",
    "PlanError",
    "Region",
    "Route",
    "Symbol",
    "build_plan",
    "exit_dirs",
    "largest_slots",
    "plan_for_knobs",
    "price_candidates",
]
