"""The cost model's open constants, fitted on published hardware measurements (`wafer-gpt2 cost calibrate`).

The data: WaferLLM's MeshGEMV (He et al., "WaferLLM: Large Language Model Inference at Wafer Scale",
OSDI 2025; code github.com/MeshInfra/WaferLLM, MeshGEMV/WSE-3) run on a CS-3 by one of its authors,
whose per-run logs are public in the fork github.com/FxPiGaAo/WaferLLM (MeshGEMV/WSE-3/wse_result.json
at commit 5c67053; every log says "Running on simulator: False"). Each figure is the mean over the PEs
of the cycles per iteration of a loop of 100 GEMVs (TSC counters, after 10 warm-up iterations).

The algorithm as published, priced with this model's constants (`meshgemv_cycles`): on a P x P grid,
every PE multiplies its Mt x Nt fp16 tile (`@map` of `@fmach`), then the Nt partial sums are
all-reduced along the column in two phases, chains inside G groups of g = P / G PEs toward each group's
middle, then chains over the group roots toward root_2nd = (G / 2) g + g / 2, then broadcast back along
the column. The loop's period is the cycle a PE at the column's end closes: its partial travels
g / 2 + (G / 2) g hops to root_2nd and the broadcast root_2nd hops back, P + g hops in all; it stops at
g / 2 + G / 2 PEs on the way (each a router-to-PE crossing, an add and a crossing back out); and about
ten synchronous DSD operations are started one after another on that path (the zeroing, the @map, a
send, two adds at each root, the broadcast send and receive), with the loop's scalar control.

The fit: `ROUTER_TO_PE_CYCLES` keeps its public value; the per-hop latency, the start of a DSD
operation and the overhead of a @map step are fitted on the runs with P <= 80 (the group sweep, tiles of
1 x 1 and 8 x 8), and every other run is the check.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from wafer_gpt2.core.arch import ARCHS
from wafer_gpt2.core.cost import (
    DSD_OP_START_CYCLES,
    FP32_OPS_PER_CYCLE,
    HOP_CYCLES,
    MAP_STEP_CYCLES,
    ROUTER_TO_PE_CYCLES,
)
from wafer_gpt2.core.tiling import ceil_div

SOURCE = "FxPiGaAo/WaferLLM@5c67053 MeshGEMV/WSE-3/wse_result.json (CS-3; WaferLLM, OSDI 2025)"
# Synchronous DSD operations started one after another on the loop's critical cycle (see above).
MESHGEMV_SERIAL_OPS = 10
WSE3_FP16_SIMD = ARCHS["wse3"].macs_per_cycle("fp16")  # the runs are fp16 on a CS-3


@dataclass(frozen=True)
class Run:
    """One published run: a P x P grid, an [1, M] x [M, N] GEMV in fp16, G groups; mean cycles."""

    p: int
    m: int
    n: int
    groups: int
    cycles: float

    @property
    def tile(self) -> tuple[int, int]:
        return self.m // self.p, self.n // self.p


# Mean cycles per iteration, as published (output_P{P}_M{M}_N{N}_G{G}.txt "Mean cycle count").
MESHGEMV_WSE3 = (
    Run(16, 16, 16, 2, 246.95),
    Run(16, 16, 16, 4, 237.96),
    Run(16, 16, 16, 8, 240.96),
    Run(16, 128, 128, 2, 274.96),
    Run(16, 128, 128, 4, 267.95),
    Run(16, 128, 128, 8, 268.95),
    Run(80, 80, 80, 2, 596.96),
    Run(80, 80, 80, 4, 468.95),
    Run(80, 80, 80, 8, 416.96),
    Run(80, 640, 640, 8, 447.95),
    Run(144, 144, 144, 8, 601.95),
    Run(144, 1152, 1152, 8, 631.95),
    Run(208, 208, 208, 8, 784.96),
    Run(208, 1664, 1664, 8, 815.95),
    Run(272, 272, 272, 8, 970.95),
    Run(272, 2176, 2176, 8, 998.96),
    Run(336, 336, 336, 8, 1188.10),
    Run(336, 2688, 2688, 8, 1219.09),
    Run(400, 400, 400, 8, 1372.08),
    Run(400, 3200, 3200, 8, 1403.07),
    Run(464, 464, 464, 8, 1556.07),
    Run(464, 3712, 3712, 8, 1587.10),
    Run(528, 528, 528, 8, 1742.05),
    Run(528, 4224, 4224, 8, 1770.11),
    Run(592, 592, 592, 8, 1924.07),
    Run(592, 4736, 4736, 8, 1955.04),
    Run(656, 656, 656, 8, 2143.22),
    Run(656, 5248, 5248, 8, 2174.21),
    Run(720, 720, 720, 8, 2327.22),
    Run(720, 5760, 5760, 8, 2358.03),
    Run(720, 5760, 720, 8, 2350.22),
    Run(720, 720, 5760, 8, 2339.21),
)


def is_fit_run(run: Run) -> bool:
    """The runs the constants are fitted on: the group sweep at P = 16 and 80."""
    return run.p <= 80


def meshgemv_terms(run: Run) -> tuple[float, float, float, float]:
    """(hops, DSD operations started, @map steps, everything priced by public constants) on the
    loop's cycle."""
    g = run.p // run.groups
    mt, nt = run.tile
    hops = run.p + g
    stops = g // 2 + run.groups // 2
    # per stop: into the PE, the add of the first element, back out; the vector streams behind it
    public = stops * (ROUTER_TO_PE_CYCLES + FP32_OPS_PER_CYCLE + 1) + nt
    public += mt * ceil_div(nt, WSE3_FP16_SIMD)  # the @map's fp16 FMACs, SIMD 8 on WSE-3
    return hops, MESHGEMV_SERIAL_OPS, mt, public


def meshgemv_cycles(
    run: Run,
    hop: float = HOP_CYCLES,
    op_start: float = DSD_OP_START_CYCLES,
    map_step: float = MAP_STEP_CYCLES,
) -> float:
    hops, ops, steps, public = meshgemv_terms(run)
    return hops * hop + ops * op_start + steps * map_step + public


def fit(runs: tuple[Run, ...] = MESHGEMV_WSE3) -> tuple[float, float, float]:
    """(per-hop cycles, cycles to start a DSD operation, cycles of a @map step beyond its compute),
    least squares on the fit runs."""
    train = [r for r in runs if is_fit_run(r)]
    terms = [meshgemv_terms(r) for r in train]
    a = np.array([t[:3] for t in terms], dtype=float)
    y = np.array([r.cycles - t[3] for r, t in zip(train, terms, strict=True)])
    (hop, op_start, map_step), *_ = np.linalg.lstsq(a, y, rcond=None)
    return float(hop), float(op_start), float(map_step)


@dataclass(frozen=True)
class Check:
    run: Run
    modeled: float
    fitted_on: bool

    @property
    def ratio(self) -> float:
        return self.modeled / self.run.cycles


def checks(runs: tuple[Run, ...] = MESHGEMV_WSE3) -> list[Check]:
    """Every run beside the model's figure with the constants in wafer_gpt2.core.cost."""
    return [Check(r, meshgemv_cycles(r), is_fit_run(r)) for r in runs]


def report() -> str:
    hop, op_start, map_step = fit()
    lines = [
        f"MeshGEMV on a CS-3 (WSE-3), fp16, mean cycles per iteration: {SOURCE}",
        f"fit on the {sum(is_fit_run(r) for r in MESHGEMV_WSE3)} runs with P <= 80: "
        f"{hop:.2f} cycles per hop, {op_start:.1f} per DSD operation started, {map_step:.1f} per @map step "
        f"beyond its compute (wafer_gpt2.core.cost uses {HOP_CYCLES}, {DSD_OP_START_CYCLES} and {MAP_STEP_CYCLES})",
        "",
        "| P | M x N | tile | groups | measured | modeled | modeled / measured | |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in checks():
        r = c.run
        mt, nt = r.tile
        lines.append(
            f"| {r.p} | {r.m} x {r.n} | {mt} x {nt} | {r.groups} | {r.cycles:,.1f} | {c.modeled:,.0f} | "
            f"{c.ratio:.3f} | {'fit' if c.fitted_on else 'check'} |"
        )
    return "\n".join(lines)
