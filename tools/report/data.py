"""The numbers of the performance report, gathered from the planner and its cycle model.

Everything here is *modeled* (`wafer_gpt2.plan` + `wafer_gpt2.core.cost`); the measured figures come from
`tools.report.measured`. This module only asks the planner and regroups its answers: where the
cycles of a token go, what the planner's other candidates would cost, how throughput grows with the
streams in flight and the replicas, and how full the PEs are.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from dataclasses import dataclass, field

from tools.report.measured import Measured
from tools.report.peers import GPUS, PUBLISHED, BandwidthFloor, PublishedFigure, bandwidth_floor
from wafer_gpt2 import plan as planner
from wafer_gpt2.core.abi import WEIGHT_SYMBOLS
from wafer_gpt2.core.cost import CLOCK_HZ
from wafer_gpt2.model.config import PRESETS, GPT2Config, resolve_config
from wafer_gpt2.plan import Plan, build_plan, price_candidates
from wafer_gpt2.plan.stages import RECORD_SORT_PHASE
from wafer_gpt2.plan.structure import modeled_figures

SIZES = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")
# What a phase of a stage spends its cycles on, by the words `wafer_gpt2.core.cost` names its phases with.
PHASE_CLASSES = ("data movement", "compute", "reduction / merge")
_REDUCTION_WORDS = ("reduction", "reduce", "merge")
_MOVEMENT_WORDS = ("multicast", "hand-off", "broadcast", "route", "input", "memcpy", "gather", " to ")


def phase_class(phase: str) -> str:
    if any(word in phase for word in _REDUCTION_WORDS):
        return "reduction / merge"
    if any(word in phase for word in _MOVEMENT_WORDS) or phase.startswith("to "):
        return "data movement"
    return "compute"


@dataclass(frozen=True)
class ReportSettings:
    model: str = "gpt2"  # the model the detailed figures are about (a preset or a config path)
    arch: str = "wse2"
    dtype: str = "fp16"
    slots: int = 16
    top_k: int = 64
    sizes: tuple[str, ...] = SIZES  # the presets compared side by side
    replica_counts: tuple[int | str, ...] = (1, 2, 4, "auto")  # "auto": as many as fit
    # KV slots per replica compared for the whole wafer's throughput (as many replicas as fit)
    slot_counts: tuple[int, ...] = (16, 32, 64)


@functools.lru_cache(maxsize=64)
def cached_plan(
    config: GPT2Config,
    arch: str,
    dtype: str,
    slots: int,
    objective: str = "latency",
    replicas: int | str = 1,
    top_k: int = 64,
) -> Plan:
    """`build_plan` once per distinct request: several figures read the same plan."""
    return build_plan(
        config, arch=arch, dtype=dtype, slots=slots, objective=objective, replicas=replicas, top_k=top_k
    )


@dataclass(frozen=True)
class OperatingPoint:
    """A pipeline with `slots` streams in flight per replica. `modeled` is `Plan.modeled`'s formula
    (`wafer_gpt2.plan.structure.modeled_figures`), so the throughput (streams / latency, capped by the slowest
    stage) lives in one place."""

    decode_cycles: int
    bottleneck_cycles: int
    slots: int
    replicas: int = 1

    def modeled(self, clock_hz: float = CLOCK_HZ) -> dict[str, float]:
        return modeled_figures(
            self.decode_cycles, self.bottleneck_cycles, self.slots, self.replicas, clock_hz
        )

    @classmethod
    def of(cls, plan: Plan, streams: int) -> OperatingPoint:
        return cls(plan.decode_cycles, plan.bottleneck_cycles, streams, plan.replicas)


# ----------------------------------------------------------------------------------------------------
# Where the time of a token goes


def time_by_part(plan: Plan) -> dict[str, int]:
    """Critical-path cycles of one token grouped into the parts of the model: each layer operation
    summed over all layers, and the stages outside the layers (I/O, embedding, routes, head)."""
    n_layer = plan.config.n_layer
    parts: dict[str, int] = defaultdict(int)
    for stage in plan.stage_costs:
        name, cycles = stage.name, stage.cycles
        if name.startswith("L") and "." in name and name.split(".", 1)[0][1:].isdigit():
            parts[f"{name.split('.', 1)[1]} (x{n_layer})"] += cycles
        elif name.startswith("band turn") or name == "to ln_f":
            parts["routes between bands"] += cycles
        elif name in ("io.in", "io.out"):
            # io.out also puts the head's record best first: the top-k's part
            sort = stage.phases.get(RECORD_SORT_PHASE, 0)
            parts["memcpy I/O"] += cycles - sort
            parts["LM head + top-k"] += sort
        elif name == "head":
            parts["LM head + top-k"] += cycles
        else:
            parts[name] += cycles
    return dict(parts)


def time_by_layer(plan: Plan) -> list[tuple[str, dict[str, int]]]:
    """(label, {operation: cycles}) in pipeline order: embed, L0 .. L{n-1} (with the band turn that
    follows a layer, if any), ln_f + head. The sums add up to `plan.decode_cycles`."""
    rows: list[tuple[str, dict[str, int]]] = [("in + embed", {})]
    for stage in plan.stage_costs:
        name = stage.name
        prefix, _, op = name.partition(".")
        if prefix.startswith("L") and prefix[1:].isdigit() and op:
            if rows[-1][0] != prefix:
                rows.append((prefix, {}))
            rows[-1][1][op] = stage.cycles
        elif name.startswith("band turn"):
            rows[-1][1]["route"] = stage.cycles
        elif name in ("io.in", "embed"):
            rows[0][1][name] = stage.cycles
        else:
            if rows[-1][0] != "head + out":
                rows.append(("head + out", {}))
            rows[-1][1][name] = stage.cycles
    return rows


def path_by_class(plan: Plan) -> dict[str, int]:
    """The whole critical path of one token: {phase class: cycles}, every stage's phases classed as
    `phase_class` classes them. What is not "compute" is the path's floor under this program's
    dataflow: its cycles stay when every compute phase is made free."""
    classes = dict.fromkeys(PHASE_CLASSES, 0)
    for stage in plan.stage_costs:
        for phase, cycles in stage.phases.items():
            classes[phase_class(phase)] += cycles
    return classes


def layer_phases(plan: Plan) -> dict[str, dict[str, int]]:
    """One layer: {operation: {phase class: cycles}} from the stage costs the planner priced."""
    out: dict[str, dict[str, int]] = {}
    for stage in plan.layer_stage_costs:
        op = stage.name.split(".", 1)[1]
        classes = dict.fromkeys(PHASE_CLASSES, 0)
        for phase, cycles in stage.phases.items():
            classes[phase_class(phase)] += cycles
        out[op] = classes
    return out


# ----------------------------------------------------------------------------------------------------
# The trade-off the planner navigates


@dataclass(frozen=True)
class Candidate:
    """One feasible candidate of the planner's search (before its color check), with its cost."""

    knobs: planner.Knobs
    pes_per_layer: int
    footprint_pes: int  # width x height of the replica's rectangle
    point: OperatingPoint

    @property
    def latency_us(self) -> float:
        return self.point.modeled()["decode_latency_us"]

    @property
    def tokens_per_s(self) -> float:
        return self.point.modeled()["tokens_per_s_per_replica"]


def explore_candidates(config: GPT2Config, arch: str, dtype: str, slots: int, top_k: int) -> list[Candidate]:
    """Every candidate size the planner prices for one replica (`wafer_gpt2.plan.price_candidates`), not only
    the one `build_plan` keeps."""
    search = price_candidates(config, arch, dtype, slots, config.n_positions, top_k)
    return [
        Candidate(
            c.knobs, c.layer_pes, c.footprint_pes, OperatingPoint(c.decode_cycles, c.bottleneck_cycles, slots)
        )
        for c in search.priced
    ]


def pes_per_layer(plan: Plan) -> int:
    return sum(r.pes for r in plan.regions_of(layer=0))


def pareto_front(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The (x, y) points no other point beats on both (smaller x and smaller y are better)."""
    front, best_y = [], float("inf")
    for x, y in sorted(points):
        if y < best_y:
            front.append((x, y))
            best_y = y
    return front


# ----------------------------------------------------------------------------------------------------
# SRAM


SYMBOL_CLASSES = ("weights", "KV cache", "working buffers")
_WEIGHT_SYMBOLS = {s for names in WEIGHT_SYMBOLS.values() for s in names}  # what the checkpoint fills


def symbol_class(name: str) -> str:
    if name in _WEIGHT_SYMBOLS:
        return "weights"
    if "cache" in name:
        return "KV cache"
    return "working buffers"


def sram_per_pe(plan: Plan) -> list[tuple[str, dict[str, int]]]:
    """(region, {symbol class: bytes on its fullest PE}) for the regions outside the layers and those
    of layer 0 (every layer is laid out alike), largest first."""
    regions = [r for r in plan.regions_of() if r.layer in (None, 0) and r.kind != "io"]
    regions.sort(key=lambda r: r.max_pe_bytes, reverse=True)
    out = []
    for r in regions:
        classes = dict.fromkeys(SYMBOL_CLASSES, 0)
        for name, symbol in r.symbols.items():
            classes[symbol_class(name)] += symbol.nbytes
        out.append((r.name, classes))
    return out


def sram_by_part(plan: Plan) -> dict[str, dict[str, int]]:
    """Planned bytes of all replicas by part (each layer operation summed over the layers) and by
    symbol class, largest part first. The sums add up to `plan.sram_bytes_used`."""
    parts: dict[str, dict[str, int]] = defaultdict(lambda: dict.fromkeys(SYMBOL_CLASSES, 0))
    for r in plan.regions:
        name = r.name.split(".", 1)[1] if r.layer is not None else r.name
        for symbol_name, symbol in r.symbols.items():
            parts[name][symbol_class(symbol_name)] += symbol.nbytes * r.pes
    return dict(sorted(parts.items(), key=lambda kv: -sum(kv[1].values())))


# ----------------------------------------------------------------------------------------------------
# Everything the report shows


@dataclass
class ReplicaCurve:
    label: str  # e.g. "4 replicas"
    plan: Plan
    streams: list[int]
    tokens_per_s: list[float]  # total over the replicas, at `streams` in flight per replica


@dataclass
class ReportData:
    settings: ReportSettings
    config: GPT2Config
    plan: Plan  # the focus model's default (latency) plan
    sizes: dict[str, Plan]
    candidates: list[Candidate]
    replica_curves: list[ReplicaCurve]
    slot_plans: dict[int, Plan]  # slots per replica -> the throughput plan with as many replicas as fit
    floors: list[BandwidthFloor]
    published: tuple[PublishedFigure, ...] = PUBLISHED
    measured: Measured | None = None  # when --measure ran
    size_notes: list[str] = field(default_factory=list)  # sizes no plan could meet, and why
    replica_notes: list[str] = field(default_factory=list)  # replica counts no plan could meet, and why


def replica_curves(config: GPT2Config, settings: ReportSettings, notes: list[str]) -> list[ReplicaCurve]:
    curves: list[ReplicaCurve] = []
    for count in settings.replica_counts:
        try:
            plan = cached_plan(
                config, settings.arch, settings.dtype, settings.slots, "throughput", count, settings.top_k
            )
        except planner.PlanError as exc:
            notes.append(f"replicas={count}: no plan ({exc})")
            continue
        if any(c.plan.replicas == plan.replicas for c in curves):
            continue  # "auto" may land on a count already shown
        streams = list(range(1, plan.slots + 1))
        totals = [OperatingPoint.of(plan, n).modeled()["tokens_per_s_total"] for n in streams]
        label = f"{plan.replicas} replica" + ("s" if plan.replicas > 1 else "")
        if count == "auto":
            label += " (as many as fit)"
        curves.append(ReplicaCurve(label, plan, streams, totals))
    return curves


def slot_plans(config: GPT2Config, settings: ReportSettings, notes: list[str]) -> dict[int, Plan]:
    """For each count of KV slots per replica, the throughput plan with as many replicas as fit."""
    plans: dict[int, Plan] = {}
    for slots in settings.slot_counts:
        try:
            plans[slots] = cached_plan(
                config, settings.arch, settings.dtype, slots, "throughput", "auto", settings.top_k
            )
        except planner.PlanError as exc:
            notes.append(f"{slots} slots per replica: no plan ({exc})")
    return plans


def collect(settings: ReportSettings | None = None, progress=None) -> ReportData:
    """Build every plan the report needs (a few seconds each) and regroup their figures."""
    settings = settings or ReportSettings()
    say = progress or (lambda message: None)
    config = resolve_config(settings.model)
    say(f"planning {config.name} ({settings.arch}, {settings.dtype}, {settings.slots} slots)")
    plan = cached_plan(config, settings.arch, settings.dtype, settings.slots, top_k=settings.top_k)
    # before another size is planned: the search of this plan is the one `price_candidates` keeps
    say(f"pricing every candidate size of {config.name}")
    candidates = explore_candidates(config, settings.arch, settings.dtype, settings.slots, settings.top_k)
    sizes: dict[str, Plan] = {}
    size_notes: list[str] = []
    replica_notes: list[str] = []
    for name in settings.sizes:
        say(f"planning {name}")
        try:
            sizes[name] = cached_plan(
                PRESETS[name], settings.arch, settings.dtype, settings.slots, top_k=settings.top_k
            )
        except planner.PlanError as exc:
            size_notes.append(f"{name}: no plan ({exc})")
    say("planning replicas")
    curves = replica_curves(config, settings, replica_notes)
    say("planning slots per replica")
    by_slots = slot_plans(config, settings, replica_notes)
    floors = [bandwidth_floor(PRESETS[name], gpu) for name in sizes for gpu in GPUS]
    return ReportData(
        settings,
        config,
        plan,
        sizes,
        candidates,
        curves,
        by_slots,
        floors,
        size_notes=size_notes,
        replica_notes=replica_notes,
    )
