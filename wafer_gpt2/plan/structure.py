"""What a plan is: its regions, routes, per-PE arrays and knobs, the figures it models, its JSON and
summary. Every other module of `wafer_gpt2.plan` builds or checks these."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from wafer_gpt2.core.arch import Arch
from wafer_gpt2.core.code_bytes import program_of
from wafer_gpt2.core.cost import CLOCK_HZ, SDK_CLOCK_HZ, StageCost, stream_cycles
from wafer_gpt2.core.tiling import AttentionTiling, GemvTiling, HeadTiling, NormTiling
from wafer_gpt2.core.wire import record_words
from wafer_gpt2.errors import WaferGPT2Error
from wafer_gpt2.model.config import GPT2Config

PLAN_VERSION = 1
DTYPES = ("fp16", "fp32")
# latency: fastest decode token; throughput: most tokens/s with replicas; compact: the smallest
# footprint that fits (for running the CSL itself on the backend, where every PE costs time).
OBJECTIVES = ("latency", "throughput", "compact")
SYMBOL_BYTES = {"f16": 2, "u16": 2, "f32": 4, "i32": 4, "u32": 4}
# Wafer kinds of region, in the order the map's legend lists them.
KINDS = ("io", "embed", "embed_head", "layernorm", "gemv", "attention", "residual")


class PlanError(WaferGPT2Error, ValueError):
    """A request no plan can meet; the message names the limit and by how much it is exceeded."""


@dataclass(frozen=True)
class Symbol:
    """One array a PE program declares (and the simulator allocates)."""

    dtype: Literal["f16", "u16", "f32", "i32", "u32"]
    elems: int

    @property
    def nbytes(self) -> int:
        return SYMBOL_BYTES[self.dtype] * self.elems


@dataclass
class Region:
    name: str  # e.g. "L3.qkv", "head", "io.in"
    kind: str  # one of KINDS
    layer: int | None
    replica: int
    x: int
    y: int
    w: int
    h: int
    symbols: dict[str, Symbol] = field(default_factory=dict)  # per-PE arrays (max over its PEs)
    tiling: object | None = None  # the wafer_gpt2.core.tiling object this region executes
    colors: int = 0  # routable colors one PE of the region needs (own routes + routes passing over it)
    # Which way the tiling's indices grow on the fabric, e.g. {"k": "+x", "n": "+y"} ("-x": westward).
    axes: dict[str, str] = field(default_factory=dict)

    @property
    def max_pe_bytes(self) -> int:
        return sum(s.nbytes for s in self.symbols.values())

    @property
    def pes(self) -> int:
        return self.w * self.h

    def overlaps(self, other: Region) -> bool:
        return (
            self.x < other.x + other.w
            and other.x < self.x + self.w
            and self.y < other.y + other.h
            and other.y < self.y + self.h
        )

    def touches(self, x: int, y: int, w: int, h: int) -> bool:
        return self.x < x + w and x < self.x + self.w and self.y < y + h and y < self.y + self.h


@dataclass
class LayerPlan:
    index: int
    ln_1: NormTiling
    qkv: GemvTiling
    attn: AttentionTiling
    attn_proj: GemvTiling
    ln_2: NormTiling
    fc: GemvTiling
    proj: GemvTiling


@dataclass(frozen=True)
class Route:
    """A hand-off between two regions that are not simply side by side: a bundle of parallel lanes
    (one color) that runs along x at the source's rows, then along y at the destination's columns.
    `legs` are the (x, y, w, h) rectangles it covers; every router in them holds its color."""

    name: str
    src: str
    dst: str
    words: int  # words per lane
    hops: int
    legs: tuple[tuple[int, int, int, int], ...]
    replica: int = 0
    lines: int = 1  # gather lines of a gathered hand-off, a multicast color each (`gather_lines`)

    @property
    def cycles(self) -> int:
        return stream_cycles(self.words, self.hops)


@dataclass(frozen=True)
class Knobs:
    """The sizes the planner explores (one candidate plan)."""

    stream_pes: int  # R: PEs holding the residual stream (LayerNorm strips, GEMV K or N side)
    fold: int  # rows per attention head group
    attn_chain: int  # PEs along positions per head group (fold rows of attn_chain / fold)
    fc_cols: int  # F: FC output columns = PROJ reduction rows
    head_cols: int  # LM head output columns (vocab split), laid out along y
    even_bands: bool = False  # add a band when that makes the count even: the last layer then ends
    # next to the head strip instead of across the wafer
    bands: int = 0  # at least this many bands of layers (0: as few as the kernel's width allows): more,
    # shorter bands make a squarer replica, of which more can fit the kernel
    strip_pes: int = 0  # PEs across the west strip (the LM head's K-lines, ln_f, an embedding there);
    # 0: as many as the stream's. A wider strip shortens the head's tile FMACs, which cap a small replica
    head_workers: int = 0  # the head's workers on PEs of their own, without weights, at the east end of
    # each K-line before its root (HeadTiling.apart): the K-line takes the next item during the rounds;
    # 0: its last weighted PEs are its workers and root
    head_sets: int = 1  # sets of such workers and root, one after the other, taking the items in turn
    interlock: bool = False  # odd bands upside down, a stream's width east, their FC and proj in the rows
    # under the even bands' attention (Geometry.interlocked): a pair of bands is FC's height shorter

    @property
    def strip(self) -> int:
        """PEs across the west strip."""
        return self.strip_pes or self.stream_pes

    @property
    def head_rows(self) -> int:
        """PEs of each head K-line that hold weights (ln_f and an embedding in the strip span them):
        the strip less the rounds' PEs where they are apart."""
        return self.strip - (self.head_sets * (self.head_workers + 1) if self.head_workers else 0)


@dataclass
class Plan:
    config: GPT2Config
    arch: Arch
    dtype: str
    slots: int  # KV slots per replica
    context: int
    objective: str
    replicas: int
    layers: list[LayerPlan]
    ln_f: NormTiling
    head: HeadTiling
    regions: list[Region]
    knobs: Knobs
    routes: list[Route] = field(default_factory=list)
    stage_costs: list[StageCost] = field(default_factory=list)  # critical path of one token, in order
    layer_stage_costs: list[StageCost] = field(default_factory=list)  # one layer's stages
    top_k: int = 64
    footprint: tuple[int, int] = (0, 0)  # (w, h) of one replica
    colors_used: int = 0
    candidates_explored: int = 0

    # --- queries --------------------------------------------------------------------------------
    def regions_of(self, layer: int | None = None, kind: str | None = None, replica: int = 0) -> list[Region]:
        return [
            r
            for r in self.regions
            if r.replica == replica
            and (layer is None or r.layer == layer)
            and (kind is None or r.kind == kind)
        ]

    def region(self, name: str, replica: int = 0) -> Region:
        for r in self.regions:
            if r.name == name and r.replica == replica:
                return r
        raise KeyError(f"no region {name!r} in replica {replica}")

    @property
    def records_held(self) -> int:
        """Records each replica's io.out holds (its ring, wafer_gpt2/kernels/pe/io_out.csl): the scored
        items a host whose memcpy runs one command at a time may send a replica before it reads them."""
        return self.region("io.out").symbols["record"].elems // record_words(self.top_k)

    def io_ports(self, replica: int = 0) -> tuple[Region, Region]:
        """(input port, output port) of one pipeline replica: where memcpy streams go in and out."""
        return self.region("io.in", replica), self.region("io.out", replica)

    @property
    def io(self) -> list[tuple[Region, Region]]:
        return [self.io_ports(r) for r in range(self.replicas)]

    # --- modeled figures ------------------------------------------------------------------------
    @property
    def decode_cycles(self) -> int:
        """Modeled cycles of one decode token on the critical path (full context), memcpy edge in to
        memcpy edge out."""
        return sum(s.cycles for s in self.stage_costs)

    @property
    def occupancy_cycles(self) -> int:
        """Modeled initiation interval of one replica: the largest stage occupancy (`StageCost.busy`:
        a blocking stage's whole span, a pipelined one's busiest PE per item); one replica accepts a
        new item this often."""
        return max(s.busy for s in self.stage_costs)

    @property
    def bottleneck_cycles(self) -> int:
        """The initiation interval under its older name (`occupancy_cycles`)."""
        return self.occupancy_cycles

    @property
    def imbalance(self) -> float:
        """max / mean of the modeled stage times of one layer (the pipeline stages that repeat)."""
        times = [s.cycles for s in self.layer_stage_costs]
        return max(times) / (sum(times) / len(times))

    def modeled(self, clock_hz: float = CLOCK_HZ) -> dict[str, float]:
        return modeled_figures(self.decode_cycles, self.occupancy_cycles, self.slots, self.replicas, clock_hz)

    @property
    def pes_used(self) -> int:
        return sum(r.pes for r in self.regions)

    @property
    def sram_bytes_used(self) -> int:
        """Planned bytes (max per PE times PEs, region by region; the reserve is not included)."""
        return sum(r.max_pe_bytes * r.pes for r in self.regions)

    @property
    def max_pe_bytes(self) -> int:
        return max(r.max_pe_bytes for r in self.regions)

    @property
    def fullest_region(self) -> Region:
        """The region whose PEs come closest to their limit: data against what their program's code
        and the stack leave of 48 KB."""
        return max(
            self.regions, key=lambda r: r.max_pe_bytes / self.arch.data_bytes(program_of(r.kind, r.name))
        )

    def to_json(self) -> dict:
        c = self.config
        return {
            "version": PLAN_VERSION,
            "model": {
                "name": c.name,
                "n_layer": c.n_layer,
                "n_head": c.n_head,
                "n_embd": c.n_embd,
                "vocab_size": c.vocab_size,
                "n_positions": c.n_positions,
            },
            "arch": self.arch.name,
            "dtype": self.dtype,
            "objective": self.objective,
            "slots": self.slots,
            "context": self.context,
            "top_k": self.top_k,
            "fabric": {"width": self.arch.fabric_w, "height": self.arch.fabric_h},
            "kernel": {"width": self.arch.kernel_w, "height": self.arch.kernel_h},
            "limits": {
                "pe_sram_bytes": self.arch.pe_sram_bytes,
                "code_bytes": dict(self.arch.code_bytes),
                "stack_bytes": self.arch.stack_bytes,
                "data_bytes_per_pe": self.arch.data_bytes_per_pe,
                "usable_colors": self.arch.usable_colors,
            },
            "knobs": {
                "stream_pes": self.knobs.stream_pes,
                "attention_fold": self.knobs.fold,
                "attention_chain": self.knobs.attn_chain,
                "fc_cols": self.knobs.fc_cols,
                "head_cols": self.knobs.head_cols,
                "strip_pes": self.knobs.strip,
                "head_workers_apart": self.knobs.head_workers,
                "head_sets_apart": self.knobs.head_sets,
                "interlocked_bands": self.knobs.interlock,
            },
            "regions": [
                {
                    "name": r.name,
                    "kind": r.kind,
                    "layer": r.layer,
                    "replica": r.replica,
                    "x": r.x,
                    "y": r.y,
                    "w": r.w,
                    "h": r.h,
                    "max_pe_bytes": r.max_pe_bytes,
                    "colors": r.colors,
                    "axes": r.axes,
                    "tiling": _tiling_json(r.tiling),
                    "symbols": {k: {"dtype": s.dtype, "elems": s.elems} for k, s in r.symbols.items()},
                }
                for r in self.regions
            ],
            "routes": [
                {
                    "name": rt.name,
                    "src": rt.src,
                    "dst": rt.dst,
                    "words": rt.words,
                    "hops": rt.hops,
                    "replica": rt.replica,
                    "lines": rt.lines,
                    "legs": [list(leg) for leg in rt.legs],
                }
                for rt in self.routes
            ],
            "summary": {
                "pes_used": self.pes_used,
                "pes_available": self.arch.kernel_pes,
                "sram_bytes_used": self.sram_bytes_used,
                "max_pe_bytes": self.max_pe_bytes,
                "colors_used": self.colors_used,
                "replicas": self.replicas,
                "footprint": {"width": self.footprint[0], "height": self.footprint[1]},
                "imbalance": round(self.imbalance, 3),
                "modeled": {
                    **self.modeled(CLOCK_HZ),
                    "decode_cycles": self.decode_cycles,
                    "at_0_85_ghz": self.modeled(SDK_CLOCK_HZ),
                    "context_positions": self.context,
                    "note": "modeled by wafer_gpt2.core.cost, not measured; decode at full context, batch 1 per slot",
                    "occupancy_cycles": self.occupancy_cycles,
                    "critical_path": [
                        {
                            "stage": s.name,
                            "cycles": s.cycles,
                            "first_word": s.first_word_cycles,
                            "occupancy": s.busy,
                        }
                        for s in self.stage_costs
                    ],
                },
            },
        }

    def summary_text(self) -> str:
        c, a = self.config, self.arch
        m, slow = self.modeled(CLOCK_HZ), self.modeled(SDK_CLOCK_HZ)
        k = self.knobs
        fullest = self.fullest_region
        lines = [
            f"plan v{PLAN_VERSION}: {c.name} ({c.n_layer} layers, {c.n_head} heads, C={c.n_embd}) on {a.name} "
            f"({a.kernel_w}x{a.kernel_h} kernel of a {a.fabric_w}x{a.fabric_h} fabric), {self.dtype}, "
            f"objective {self.objective}",
            f"  KV capacity: {self.slots} slots x {self.context} tokens per replica; replicas: {self.replicas} "
            f"(replica footprint {self.footprint[0]}x{self.footprint[1]}"
            f"{', its bands interlocked' if k.interlock else ''})",
            f"  sizes: residual stream on {k.stream_pes} PEs, attention {self.layers[0].attn.head_groups} head groups "
            f"x fold {k.fold} x chain {k.attn_chain}, FC {k.fc_cols} output columns, LM head {k.head_cols} vocab "
            f"columns{f' x {k.strip} PEs' if k.strip != k.stream_pes else ''}"
            f"{_rounds_apart(k)} "
            f"({self.candidates_explored} candidates explored)",
            f"  PEs used: {self.pes_used:,} of {a.kernel_pes:,} ({100 * self.pes_used / a.kernel_pes:.1f}%); "
            f"SRAM planned {self.sram_bytes_used / 2**20:,.1f} MiB; fullest PE {fullest.max_pe_bytes:,} B "
            f"({fullest.name}) of the {a.budget_words(program_of(fullest.kind, fullest.name))}",
            f"  colors: {self.colors_used} of the {a.usable_colors} usable on the busiest PE (routes of its region "
            f"plus routes passing over it)",
            "  one layer (modeled cycles per token): "
            + ", ".join(f"{s.name.split('.', 1)[-1]} {s.cycles}" for s in self.layer_stage_costs)
            + f"; imbalance max/mean {self.imbalance:.2f}",
            f"  modeled decode latency: {m['decode_latency_us']:.2f} us/token at 1.1 GHz "
            f"({slow['decode_latency_us']:.2f} us at 0.85 GHz), {self.decode_cycles:,} cycles at full context",
            f"  modeled tokens/s: single stream {m['tokens_per_s_single_stream']:,.0f}; total "
            f"{m['tokens_per_s_total']:,.0f} with {self.replicas} replica(s) x {self.slots} slots "
            f"(at 0.85 GHz: {slow['tokens_per_s_single_stream']:,.0f} / {slow['tokens_per_s_total']:,.0f})",
        ]
        return "\n".join(lines)


def _rounds_apart(k: Knobs) -> str:
    """The plan's summary of the head's rounds apart ('' where they run on its weighted PEs)."""
    if not k.head_workers:
        return ""
    sets = f" in each of {k.head_sets} sets taking items in turn" if k.head_sets > 1 else ""
    return f" (its rounds on {k.head_workers + 1} PEs apart{sets})"


def _tiling_json(tiling: object | None) -> dict | None:
    if tiling is None:
        return None
    if isinstance(tiling, HeadTiling):
        return {
            "type": "HeadTiling",
            "vocab": tiling.vocab,
            "dim": tiling.dim,
            "top_k": tiling.top_k,
            "workers": tiling.workers,
            "tree": tiling.tree,
            "tree_group": tiling.tree_group,
            "apart": tiling.apart,
            "sets": tiling.sets,
            "gemv": _tiling_json(tiling.gemv),
        }
    data = {"type": type(tiling).__name__}
    data.update({k: v for k, v in vars(tiling).items()})
    return data


def modeled_figures(
    decode_cycles: int, occupancy_cycles: int, slots: int, replicas: int, clock_hz: float = CLOCK_HZ
) -> dict[str, float]:
    """Latency and throughput of a pipeline (`Plan.modeled`; the report's operating points use it too).
    `occupancy_cycles` is the replica's initiation interval (`Plan.occupancy_cycles`)."""
    latency_s = decode_cycles / clock_hz
    single = 1.0 / latency_s
    # Decode: a slot's next token needs its previous one, so one replica has at most `slots`
    # items in flight; it also cannot accept items faster than its busiest stage takes them
    # (a blocking stage's whole span: StageCost.busy).
    per_replica = min(slots / latency_s, clock_hz / occupancy_cycles)
    return {
        "clock_ghz": clock_hz / 1e9,
        "decode_latency_us": round(latency_s * 1e6, 3),
        "tokens_per_s_single_stream": round(single, 1),
        "tokens_per_s_per_replica": round(per_replica, 1),
        "tokens_per_s_total": round(per_replica * replicas, 1),
        "bottleneck_stage_us": round(occupancy_cycles / clock_hz * 1e6, 3),
    }
