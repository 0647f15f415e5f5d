"""The wafer plan: which rectangle of PEs holds what, how each operation is tiled, and what it costs.

GPT-2 decode is layer-pipelined and weight-stationary: every transformer layer gets its own
rectangle, split into one sub-region per operation; a token's activation flows from region to region
over the fabric. `build_plan` explores the free sizes (how many PEs carry the residual stream, how
the attention chain is folded, how wide FC/PROJ and the LM head are), keeps the candidates that meet
every limit (48 KB per PE minus a reserve, routable colors, the kernel rectangle, no overlaps, a route
for every hand-off) and picks the best by the objective, using the cycle model of `wafer.cost`.

Layout of one layer (flow east; odd bands are mirrored and flow west), R = PEs of the residual
stream, T = head_groups * fold, Lc = attention columns, F = FC output columns:

    x:   0 ...... R ....... R+Lc ..... 2R+Lc ...... 3R+Lc
    0    [ qkv   ][ attn    ][ attn_proj ]             QKV: K along x (R), reduce east, out rows
         [ R x T ][ Lc x T  ][  R x T    ]             ATTN: head group g = rows g*fold..; LSE merge
    T    [ ln_1  ]           [ res_1     ]             O:   K along y (T), reduce south, out columns
    T+1                      [ ln_2      ][ res_2    ]  FC:  K along x (R), reduce east, GELU, out rows
    T+2                      [ fc  R x F ][ proj R x F]  PROJ: K along y (F), reduce north, out columns

The next layer starts at x = 2R + Lc: its ln_1 sits right above this layer's res_2, its qkv above this
layer's proj. Every GEMV hands its output to the next one along the axis that one multicasts on, so
orientations alternate (k_along_x, k_along_y, ...) and nothing is transposed. West of the layers a
strip of R columns holds the I/O ports, the position embedding, the LM head (wte once, tied; its rows
also serve the token embedding), the final LayerNorm and the top-k.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Literal

from wafer.arch import Arch, resolve_arch
from wafer.cost import (
    CLOCK_HZ,
    GELU_CYCLES,
    HOP_CYCLES,
    SDK_CLOCK_HZ,
    TASK_ACTIVATION_CYCLES,
    StageCost,
    allreduce_cycles,
    attention_cost,
    best_attention,
    best_gemv_reduction,
    best_head,
    gemv_cost,
    head_cost,
    norm_cost,
    residual_cost,
    stream_cycles,
)
from wafer.tiling import AttentionTiling, GemvTiling, HeadTiling, NormTiling, ceil_div
from wafer.wire import HEADER_WORDS, ITEM_WORDS, record_words
from weights.config import GPT2Config

PLAN_VERSION = 1
DTYPES = ("fp16", "fp32")
OBJECTIVES = ("latency", "throughput")
SYMBOL_BYTES = {"f16": 2, "f32": 4, "i32": 4, "u32": 4}
# The operations of one layer, in the order a token meets them (region L3.qkv is layer 3's qkv).
LAYER_OPS = ("ln_1", "qkv", "attn", "attn_proj", "res_1", "ln_2", "fc", "proj", "res_2")
# Wafer kinds of region, in the order the map's legend lists them.
KINDS = ("io", "embed", "embed_head", "layernorm", "gemv", "attention", "residual")


class PlanError(ValueError):
    """A request no plan can meet; the message names the limit and by how much it is exceeded."""


@dataclass(frozen=True)
class Symbol:
    """One array a PE program declares (and the simulator allocates)."""

    dtype: Literal["f16", "f32", "i32", "u32"]
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
    tiling: object | None = None  # the wafer.tiling object this region executes
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
    def bottleneck_cycles(self) -> int:
        """Modeled occupancy of the slowest stage: one replica accepts a new item this often."""
        return max(s.cycles for s in self.stage_costs)

    @property
    def imbalance(self) -> float:
        """max / mean of the modeled stage times of one layer (the pipeline stages that repeat)."""
        times = [s.cycles for s in self.layer_stage_costs]
        return max(times) / (sum(times) / len(times))

    def modeled(self, clock_hz: float = CLOCK_HZ) -> dict:
        latency_s = self.decode_cycles / clock_hz
        single = 1.0 / latency_s
        # Decode: a slot's next token needs its previous one, so one replica has at most `slots`
        # items in flight; it also cannot accept items faster than its slowest stage.
        per_replica = min(self.slots / latency_s, clock_hz / self.bottleneck_cycles)
        return {
            "clock_ghz": clock_hz / 1e9,
            "decode_latency_us": round(latency_s * 1e6, 3),
            "tokens_per_s_single_stream": round(single, 1),
            "tokens_per_s_per_replica": round(per_replica, 1),
            "tokens_per_s_total": round(per_replica * self.replicas, 1),
            "bottleneck_stage_us": round(self.bottleneck_cycles / clock_hz * 1e6, 3),
        }

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
                "sram_reserve_bytes": self.arch.sram_reserve_bytes,
                "data_bytes_per_pe": self.arch.data_bytes_per_pe,
                "usable_colors": self.arch.usable_colors,
            },
            "knobs": {
                "stream_pes": self.knobs.stream_pes,
                "attention_fold": self.knobs.fold,
                "attention_chain": self.knobs.attn_chain,
                "fc_cols": self.knobs.fc_cols,
                "head_cols": self.knobs.head_cols,
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
                    "note": "modeled by wafer.cost, not measured; decode at full context, batch 1 per slot",
                    "critical_path": [{"stage": s.name, "cycles": s.cycles} for s in self.stage_costs],
                },
            },
        }

    def summary_text(self) -> str:
        c, a = self.config, self.arch
        m, slow = self.modeled(CLOCK_HZ), self.modeled(SDK_CLOCK_HZ)
        k = self.knobs
        lines = [
            f"plan v{PLAN_VERSION}: {c.name} ({c.n_layer} layers, {c.n_head} heads, C={c.n_embd}) on {a.name} "
            f"({a.kernel_w}x{a.kernel_h} kernel of a {a.fabric_w}x{a.fabric_h} fabric), {self.dtype}, "
            f"objective {self.objective}",
            f"  KV capacity: {self.slots} slots x {self.context} tokens per replica; replicas: {self.replicas} "
            f"(replica footprint {self.footprint[0]}x{self.footprint[1]})",
            f"  sizes: residual stream on {k.stream_pes} PEs, attention {self.layers[0].attn.head_groups} head groups "
            f"x fold {k.fold} x chain {k.attn_chain}, FC {k.fc_cols} output columns, LM head {k.head_cols} vocab "
            f"columns ({self.candidates_explored} candidates explored)",
            f"  PEs used: {self.pes_used:,} of {a.kernel_pes:,} ({100 * self.pes_used / a.kernel_pes:.1f}%); "
            f"SRAM planned {self.sram_bytes_used / 2**20:,.1f} MiB; max per PE {self.max_pe_bytes:,} B of "
            f"{a.data_bytes_per_pe:,} B usable (48 KB - {a.sram_reserve_bytes // 1024} KB reserve)",
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


def _tiling_json(tiling: object | None) -> dict | None:
    if tiling is None:
        return None
    if isinstance(tiling, HeadTiling):
        return {
            "type": "HeadTiling",
            "vocab": tiling.vocab,
            "dim": tiling.dim,
            "top_k": tiling.top_k,
            "merge": tiling.merge,
            "gemv": _tiling_json(tiling.gemv),
        }
    data = {"type": type(tiling).__name__}
    data.update({k: v for k, v in vars(tiling).items()})
    return data


# ----------------------------------------------------------------------------------------------------
# Tilings and per-PE memory of one candidate


CYCLES_SYMBOL = "cycles"


def with_cycles(symbols: dict[str, Symbol]) -> dict[str, Symbol]:
    """A PE program's arrays plus the u32[4] counter every PE keeps for the host to read back: modeled
    busy cycles of the last step and since reset (lo, hi words each). It counts against the PE's memory
    like any other array."""
    return {**symbols, CYCLES_SYMBOL: Symbol("u32", 4)}


def pe_bytes(symbols: dict[str, Symbol]) -> int:
    """Bytes a PE program with these arrays needs, its cycle counter included."""
    return sum(s.nbytes for s in with_cycles(symbols).values())


def weight_symbol_dtype(dtype: str) -> str:
    return "f16" if dtype == "fp16" else "f32"


def gemv_symbols(t: GemvTiling, dtype: str) -> dict[str, Symbol]:
    wd = weight_symbol_dtype(dtype)
    return {
        "w": Symbol(wd, t.tile_k * t.tile_n),  # weight tile, row-major [tile_k, tile_n]
        "b": Symbol(wd, t.tile_n),  # bias slice (used on the PEs that end the reduction)
        "x": Symbol(wd, 2 * t.tile_k),  # input chunk, double-buffered (item t+1 arrives during t)
        "acc": Symbol("f32", 2 * t.tile_n),  # fp32 partial sums, double-buffered
    }


def norm_symbols(t: NormTiling) -> dict[str, Symbol]:
    return {
        "gain": Symbol("f32", t.chunk),
        "bias": Symbol("f32", t.chunk),
        "x": Symbol("f32", 2 * t.chunk),  # the arriving chunk, double-buffered
        "y": Symbol("f32", t.chunk),
        "stats": Symbol("f32", 4),  # pass 1: partial sum, mean; pass 2: partial sum of (x - mean)^2, rstd
    }


def residual_symbols(chunk: int) -> dict[str, Symbol]:
    return {"resid": Symbol("f32", 2 * chunk), "x": Symbol("f32", chunk)}


def attention_symbols(t: AttentionTiling, dtype: str) -> dict[str, Symbol]:
    wd = weight_symbol_dtype(dtype)
    cache = t.slots * t.positions_per_pe * t.heads_per_pe * t.head_dim
    hd = t.heads_per_pe * t.head_dim
    return {
        "k_cache": Symbol(wd, cache),  # [slot][position in PE][head in PE][head_dim]
        "v_cache": Symbol(wd, cache),
        "q": Symbol(wd, hd),
        "kv_in": Symbol("f32", 2 * hd),  # the new token's k and v on their way to the owning PE
        "scores": Symbol("f32", t.heads_per_pe * t.positions_per_pe),
        "acc": Symbol("f32", hd),  # exp-weighted V
        "stats": Symbol("f32", 2 * t.heads_per_pe),  # running max and sum per head
        "merge_in": Symbol("f32", t.heads_per_pe * (t.head_dim + 2)),  # a partner's partial
    }


def head_symbols(t: HeadTiling, dtype: str) -> dict[str, Symbol]:
    symbols = gemv_symbols(t.gemv, dtype)
    del symbols["b"]  # the tied LM head has no bias
    k = t.top_k
    symbols.update(
        {
            "topk_ids": Symbol("i32", k),
            "topk_logits": Symbol("f32", k),
            "merge_ids": Symbol("i32", k),  # a partner column's list during the merge
            "merge_logits": Symbol("f32", k),
            "lse": Symbol("f32", 4),  # local max, local sum of exp, partner's pair
            "target": Symbol("f32", 2),
        }
    )
    return symbols


def embed_symbols(positions_per_pe: int, tile_k: int, dtype: str) -> dict[str, Symbol]:
    return {
        "wpe": Symbol(weight_symbol_dtype(dtype), positions_per_pe * tile_k),  # [position][dim chunk]
        "x": Symbol("f32", 2 * tile_k),  # the token's wte chunk arriving from the head
    }


def io_symbols(top_k: int, inbound: bool) -> dict[str, Symbol]:
    if inbound:
        return {"items": Symbol("u32", 2 * (HEADER_WORDS + ITEM_WORDS))}
    return {"records": Symbol("u32", 2 * record_words(top_k))}


@dataclass(frozen=True)
class LayerTilings:
    ln: NormTiling
    qkv: GemvTiling
    attn: AttentionTiling
    attn_proj: GemvTiling
    fc: GemvTiling
    proj: GemvTiling


def layer_tilings(
    config: GPT2Config, knobs: Knobs, slots: int, context: int, arch: Arch, dtype: str
) -> LayerTilings:
    c, r, heads = config.n_embd, knobs.stream_pes, config.n_head
    t_rows = heads * knobs.fold
    ln = NormTiling(c, r, reduction=_scalar_reduction(r), axis="x")
    best = best_gemv_reduction
    qkv = best(GemvTiling(c, 3 * c, r, t_rows, "k_along_x", n_split=3), arch, dtype)
    attn = AttentionTiling(heads, config.head_dim, slots, context, heads, knobs.attn_chain, knobs.fold)
    attn = best_attention(attn, arch, dtype)
    o = best(GemvTiling(c, c, t_rows, r, "k_along_y"), arch, dtype)
    fc = best(GemvTiling(c, 4 * c, r, knobs.fc_cols, "k_along_x"), arch, dtype, GELU_CYCLES)
    proj = best(GemvTiling(4 * c, c, knobs.fc_cols, r, "k_along_y"), arch, dtype)
    return LayerTilings(ln, qkv, attn, o, fc, proj)


def _scalar_reduction(pes: int) -> str:
    return "tree" if allreduce_cycles("tree", pes, 1) < allreduce_cycles("chain", pes, 1) else "chain"


def head_tiling(config: GPT2Config, knobs: Knobs, top_k: int, arch: Arch, dtype: str) -> HeadTiling:
    gemv = GemvTiling(config.n_embd, config.vocab_size, knobs.stream_pes, knobs.head_cols, "k_along_x")
    return best_head(HeadTiling(config.vocab_size, config.n_embd, gemv, top_k), arch, dtype)


def reduction_colors(kind: str, n: int) -> int:
    """Colors a reduction over n PEs needs: a chain alternates two (a PE never receives and sends on
    the same color); a tree gives each round its own, so rounds in flight never share a link color."""
    if n <= 1:
        return 0
    return 2 if kind == "chain" else math.ceil(math.log2(n))


# ----------------------------------------------------------------------------------------------------
# Geometry of one replica


def _mirror(axis: str) -> str:
    return {"+x": "-x", "-x": "+x"}.get(axis, axis)


def exit_dirs(reduction: str, toward: str) -> str:
    """Which way a GEMV's reduction index must grow so the reduction ends at the `toward` edge:
    a chain ends at index rows - 1, a tree at index 0."""
    grow = {"east": "+x", "west": "-x", "south": "+y", "north": "-y"}[toward]
    return grow if reduction == "chain" else {"+x": "-x", "-x": "+x", "+y": "-y", "-y": "+y"}[grow]


@dataclass(frozen=True)
class _Dirs:
    """How the indices of the stream and of each tiling run in a layer flowing east (see docs/plan.md):
    every producer's output order equals its consumer's input order, so hand-offs need no reordering."""

    stream_1: str  # ln_1 chunks = qkv K (exit east) = the previous layer's proj N / res_2
    rows: str  # qkv N = attention head groups = attn_proj K (exit south)
    stream_2: str  # attn_proj N = res_1 = ln_2 = fc K (exit east)
    hidden: str  # fc N = proj K (exit north)
    head_k: str  # the head's K (exit east, to the merge column); the strip is never mirrored

    @staticmethod
    def of(lt: LayerTilings, head: HeadTiling) -> _Dirs:
        return _Dirs(
            exit_dirs(lt.qkv.reduction, "east"),
            exit_dirs(lt.attn_proj.reduction, "south"),
            exit_dirs(lt.fc.reduction, "east"),
            exit_dirs(lt.proj.reduction, "north"),
            exit_dirs(head.gemv.reduction, "east"),
        )


# Sub-regions of one layer in its own coordinates (flow east): name -> (kind, x, y, w, h, axes), with
# R = stream PEs, T = attention rows, Lc = attention columns, F = FC columns; `out` is the order of
# proj's output (the next ln_1's order, or the order a band turn or the head strip needs).
def _layer_rects(r: int, t: int, lc: int, f: int, d: _Dirs, out: str) -> dict[str, tuple]:
    return {
        "qkv": ("gemv", 0, 0, r, t, {"k": d.stream_1, "n": d.rows}),
        # chain index p = 0 sits next to attn_proj, where the merge ends
        "attn": ("attention", r, 0, lc, t, {"position": "-x", "head_group": d.rows}),
        "attn_proj": ("gemv", r + lc, 0, r, t, {"k": d.rows, "n": d.stream_2}),
        "ln_1": ("layernorm", 0, t, r, 1, {"i": d.stream_1}),
        "res_1": ("residual", r + lc, t, r, 1, {"i": d.stream_2}),
        "ln_2": ("layernorm", r + lc, t + 1, r, 1, {"i": d.stream_2}),
        "fc": ("gemv", r + lc, t + 2, r, f, {"k": d.stream_2, "n": d.hidden}),
        "proj": ("gemv", 2 * r + lc, t + 2, r, f, {"k": d.hidden, "n": out}),
        "res_2": ("residual", 2 * r + lc, t + 1, r, 1, {"i": out}),
    }


@dataclass(frozen=True)
class _Geometry:
    """Where everything of one replica goes, as arithmetic (no Region objects): cheap enough to
    evaluate for every candidate. Coordinates are relative to the replica's top-left corner."""

    r: int  # stream PEs (width of the head strip and of every strip)
    t_rows: int
    lc: int
    f: int
    n_layer: int
    per_band: int
    bands: int
    embed_rows: int
    positions_per_pe: int
    head_cols: int
    dirs: _Dirs

    @property
    def pitch(self) -> int:
        return 2 * self.r + self.lc

    @property
    def band_h(self) -> int:
        return self.t_rows + 2 + self.f

    @property
    def band_w(self) -> int:
        return self.per_band * self.pitch + self.r

    @property
    def width(self) -> int:
        return self.r + self.band_w

    @property
    def layer_pes(self) -> int:
        return sum(self.layer_rect(0, op)[3] * self.layer_rect(0, op)[4] for op in LAYER_OPS)

    @property
    def strip_h(self) -> int:
        return 3 + self.embed_rows + self.head_cols

    @property
    def height(self) -> int:
        return max(self.strip_h, self.bands * self.band_h)

    def strip_rects(self) -> dict[str, tuple[int, int, int, int]]:
        e, v, r = self.embed_rows, self.head_cols, self.r
        return {
            "io.in": (0, 0, 1, 1),
            "embed": (0, 1, r, e),
            "head": (0, 1 + e, r, v),
            "ln_f": (0, 1 + e + v, r, 1),
            "io.out": (0, 2 + e + v, 1, 1),
        }

    def layer_rect(self, layer: int, name: str) -> tuple[str, int, int, int, int, dict[str, str]]:
        band, j = divmod(layer, self.per_band)
        mirrored = band % 2 == 1  # odd bands flow west: mirrored inside the band
        out = self.dirs.stream_1
        if layer == self.n_layer - 1:  # ln_f and the head take the stream in the strip's order
            out = _mirror(self.dirs.head_k) if mirrored else self.dirs.head_k
        elif (layer + 1) % self.per_band == 0:  # the next band is mirrored: hand it the mirrored order
            out = _mirror(self.dirs.stream_1)
        kind, x, y, w, h, axes = _layer_rects(self.r, self.t_rows, self.lc, self.f, self.dirs, out)[name]
        lx = j * self.pitch + x
        if mirrored:  # indices that grew east grow west
            lx = self.band_w - lx - w
            axes = {k: _mirror(v) for k, v in axes.items()}
        return kind, self.r + lx, band * self.band_h + y, w, h, axes

    def rect(self, name: str) -> tuple[int, int, int, int]:
        if name.startswith("L"):
            layer, op = name[1:].split(".", 1)
            return self.layer_rect(int(layer), op)[1:5]
        return self.strip_rects()[name]

    def routes(self) -> list[tuple[str, str, str]]:
        """(route name, src, dst) of the hand-offs that are not between touching regions."""
        out = [("embed.out", "embed", "L0.ln_1")]
        for layer in range(self.n_layer):
            out.append((f"L{layer}.resid_1", f"L{layer}.ln_1", f"L{layer}.res_1"))
            out.append((f"L{layer}.resid_2", f"L{layer}.res_1", f"L{layer}.res_2"))
            if layer + 1 < self.n_layer and (layer + 1) % self.per_band == 0:
                out.append((f"turn.{layer}", f"L{layer}.res_2", f"L{layer + 1}.ln_1"))
        out.append(("final", f"L{self.n_layer - 1}.res_2", "ln_f"))
        out.append(("scores", "head.root", "io.out"))
        return out

    def route_legs(self, src: str, dst: str) -> tuple[int, tuple[tuple[int, int, int, int], ...]]:
        """(hops, legs) of a bundle of lanes from src to dst: along x at src's rows, then along y at
        dst's columns. "head.root" is the PE where the top-k merge ends (the head's south-east PE)."""
        if src == "head.root":
            hx, hy, hw, hh = self.rect("head")
            sx, sy, sw, sh = hx + hw - 1, hy + hh - 1, 1, 1
        else:
            sx, sy, sw, sh = self.rect(src)
        dx, dy, dw, dh = self.rect(dst)
        x0, x1 = min(sx, dx), max(sx + sw, dx + dw)
        y0, y1 = min(sy, dy), max(sy + sh, dy + dh)
        hops = abs(dx - sx) + abs(dy - sy) + 1
        return hops, ((x0, sy, x1 - x0, sh), (dx, y0, dw, y1 - y0))


def _geometry(
    config: GPT2Config, knobs: Knobs, arch: Arch, dtype: str, dirs: _Dirs
) -> _Geometry | tuple[float, str]:
    """The replica's geometry, or (how far over, which limit of the kernel area it exceeds)."""
    r = knobs.stream_pes
    t_rows = config.n_head * knobs.fold
    lc = ceil_div(knobs.attn_chain, knobs.fold)
    tile_k = ceil_div(config.n_embd, r)
    # wpe: each PE of the embed strip holds a block of positions of its dim chunk (+ its fixed buffers).
    fixed = pe_bytes(embed_symbols(0, tile_k, dtype))
    per_position = tile_k * SYMBOL_BYTES[weight_symbol_dtype(dtype)]
    positions_per_pe = max(1, (arch.data_bytes_per_pe - fixed) // per_position)
    embed_rows = ceil_div(config.n_positions, positions_per_pe)
    positions_per_pe = ceil_div(config.n_positions, embed_rows)  # spread evenly over the rows
    pitch = 2 * r + lc
    per_band = (arch.kernel_w - 2 * r) // pitch
    if per_band < 1:
        need = pitch + 2 * r
        return need / arch.kernel_w, (
            f"one layer and the head strip are {need} PEs wide, "
            f"{need - arch.kernel_w} over the kernel width {arch.kernel_w}"
        )
    bands = ceil_div(config.n_layer, per_band)
    if knobs.even_bands and bands % 2 and bands < config.n_layer:
        bands += 1
    per_band = ceil_div(config.n_layer, bands)  # spread the layers evenly over the bands
    bands = ceil_div(config.n_layer, per_band)
    g = _Geometry(
        r,
        t_rows,
        lc,
        knobs.fc_cols,
        config.n_layer,
        per_band,
        bands,
        embed_rows,
        positions_per_pe,
        knobs.head_cols,
        dirs,
    )
    if g.strip_h > arch.kernel_h:
        return g.strip_h / arch.kernel_h, (
            f"the head strip is {g.strip_h} rows, {g.strip_h - arch.kernel_h} "
            f"over the kernel height {arch.kernel_h}"
        )
    if g.bands * g.band_h > arch.kernel_h:
        need = g.bands * g.band_h
        return need / arch.kernel_h, (
            f"{g.bands} bands of layers x {g.band_h} rows = {need} rows, "
            f"{need - arch.kernel_h} over the kernel height {arch.kernel_h}"
        )
    return g


def _place_replica(
    config: GPT2Config,
    geo: _Geometry,
    lt: LayerTilings,
    head: HeadTiling,
    ln_f: NormTiling,
    dtype: str,
    replica: int,
    ox: int,
    oy: int,
) -> tuple[list[Region], list[Route]]:
    """Regions and routes of one replica with its top-left corner at (ox, oy)."""
    regions: list[Region] = []
    strip = geo.strip_rects()
    tile_k = ceil_div(config.n_embd, geo.r)
    strip_content = {
        "io.in": ("io", io_symbols(head.top_k, True), None, {}),
        "embed": (
            "embed",
            embed_symbols(geo.positions_per_pe, tile_k, dtype),
            None,
            {"k": geo.dirs.head_k, "position": "+y"},
        ),
        # the merge of the columns ends at the bottom (next to io.out): column 0 there for a tree
        "head": (
            "embed_head",
            head_symbols(head, dtype),
            head,
            {"k": geo.dirs.head_k, "n": exit_dirs(head.merge, "south")},
        ),
        "ln_f": ("layernorm", norm_symbols(ln_f), ln_f, {"i": geo.dirs.head_k}),
        "io.out": ("io", io_symbols(head.top_k, False), None, {}),
    }
    for name, (kind, symbols, tiling, axes) in strip_content.items():
        x, y, w, h = strip[name]
        regions.append(
            Region(name, kind, None, replica, ox + x, oy + y, w, h, with_cycles(symbols), tiling, 0, axes)
        )
    content = {
        "qkv": (gemv_symbols(lt.qkv, dtype), lt.qkv),
        "attn": (attention_symbols(lt.attn, dtype), lt.attn),
        "attn_proj": (gemv_symbols(lt.attn_proj, dtype), lt.attn_proj),
        "ln_1": (norm_symbols(lt.ln), lt.ln),
        "res_1": (residual_symbols(lt.ln.chunk), None),
        "ln_2": (norm_symbols(lt.ln), lt.ln),
        "fc": (gemv_symbols(lt.fc, dtype), lt.fc),
        "proj": (gemv_symbols(lt.proj, dtype), lt.proj),
        "res_2": (residual_symbols(lt.ln.chunk), None),
    }
    for layer in range(config.n_layer):
        for op, (symbols, tiling) in content.items():
            kind, x, y, w, h, axes = geo.layer_rect(layer, op)
            symbols = with_cycles(symbols)
            regions.append(
                Region(f"L{layer}.{op}", kind, layer, replica, ox + x, oy + y, w, h, symbols, tiling, 0, axes)
            )
    routes = []
    for name, src, dst in geo.routes():
        hops, legs = geo.route_legs(src, dst)
        legs = tuple((x + ox, y + oy, w, h) for x, y, w, h in legs)
        routes.append(
            Route(
                name, src.split(".root")[0], dst, _route_words(name, config, geo, head), hops, legs, replica
            )
        )
    return regions, routes


def _route_words(name: str, config: GPT2Config, geo: _Geometry, head: HeadTiling) -> int:
    if name == "scores":
        return record_words(head.top_k)
    if name.endswith(("resid_1", "resid_2")):
        return (
            config.n_embd
        )  # the residual bus carries the whole vector past the strip (off the critical path)
    if name == "embed.out" and geo.dirs.head_k != geo.dirs.stream_1:
        return config.n_embd  # wte's chunk order differs from layer 0's: one serial lane, picked by count
    return ceil_div(config.n_embd, geo.r)  # one stream chunk per lane


# ----------------------------------------------------------------------------------------------------
# Checks


def _check_memory(regions: list[Region], arch: Arch) -> str | None:
    worst = max(regions, key=lambda r: r.max_pe_bytes)
    if worst.max_pe_bytes > arch.data_bytes_per_pe:
        return (
            f"per-PE memory: region {worst.name} needs {worst.max_pe_bytes:,} B on one PE, "
            f"{worst.max_pe_bytes - arch.data_bytes_per_pe:,} B over the {arch.data_bytes_per_pe:,} B usable "
            f"(48 KB minus the {arch.sram_reserve_bytes // 1024} KB reserve)"
        )
    return None


def _assign_colors(regions: list[Region], routes: list[Route]) -> None:
    for reg in regions:
        t = reg.tiling
        if isinstance(t, HeadTiling):
            own = (
                2
                + reduction_colors(t.gemv.reduction, t.gemv.rows)
                + reduction_colors(t.merge, t.gemv.cols)
                + 2
            )
        elif isinstance(t, GemvTiling):
            own = 2 + reduction_colors(t.reduction, t.rows)  # in/multicast + reduction + out
        elif isinstance(t, AttentionTiling):
            own = 1 + t.fold + reduction_colors(t.reduction, t.chain) + 1  # in, gather rows, merge, out
        elif isinstance(t, NormTiling):
            own = (
                1 + reduction_colors(t.reduction, t.pes) + 1 + 1 + 1
            )  # in, reduce, broadcast, out, resid tap
        elif reg.kind == "residual":
            own = 3  # gemv result in, residual bus in, out
        elif reg.kind == "embed":
            own = 3  # token in, wte chunk in, out
        else:
            own = 2
        reg.colors = own
    for rt in routes:
        for reg in regions:
            if reg.replica == rt.replica and reg.name not in (rt.src, rt.dst):
                if any(reg.touches(*leg) for leg in rt.legs):
                    reg.colors += 1


def _check_geometry(regions: list[Region], arch: Arch) -> None:
    """Every region inside the kernel rectangle, none overlapping (raises: a planner bug, not user input)."""
    for reg in regions:
        if reg.x < 0 or reg.y < 0 or reg.x + reg.w > arch.kernel_w or reg.y + reg.h > arch.kernel_h:
            raise PlanError(
                f"region {reg.name} at ({reg.x},{reg.y}) {reg.w}x{reg.h} leaves the "
                f"{arch.kernel_w}x{arch.kernel_h} kernel area"
            )
    ordered = sorted(regions, key=lambda r: r.x)
    for i, a in enumerate(ordered):
        for b in ordered[i + 1 :]:
            if b.x >= a.x + a.w:
                break
            if a.overlaps(b):
                raise PlanError(
                    f"regions {a.name} (replica {a.replica}) and {b.name} (replica {b.replica}) overlap"
                )


# ----------------------------------------------------------------------------------------------------
# Critical path


def _layer_stages(lt: LayerTilings, arch: Arch, dtype: str) -> list[StageCost]:
    """The modeled stages of one layer, in pipeline order (the same for every layer)."""
    chunk = lt.ln.chunk
    costs = [
        norm_cost(lt.ln, "ln_1"),
        gemv_cost(lt.qkv, arch, dtype, name="qkv"),
        attention_cost(lt.attn, arch, dtype, name="attn"),
        gemv_cost(lt.attn_proj, arch, dtype, name="attn_proj"),
        residual_cost(chunk, "res_1"),
        norm_cost(lt.ln, "ln_2"),
        gemv_cost(lt.fc, arch, dtype, epilogue_cycles_per_output=GELU_CYCLES, name="fc"),
        gemv_cost(lt.proj, arch, dtype, name="proj"),
        residual_cost(chunk, "res_2"),
    ]
    # Every hand-off between touching regions is one hop (the receiving phase counts its ramp).
    return [StageCost(f"layer.{c.name}", dict(c.phases)).add("hand-off", HANDOFF_CYCLES) for c in costs]


HANDOFF_CYCLES = HOP_CYCLES  # the next stage's first phase pays its router-to-PE crossing


def _edge_hops(ox: int) -> int:
    """Routers between memcpy's west columns (three, plus the halo) and a port at kernel column ox."""
    return ox + 4


def _outer_stages(
    config: GPT2Config,
    geo: _Geometry,
    lt: LayerTilings,
    head: HeadTiling,
    ln_f: NormTiling,
    arch: Arch,
    dtype: str,
    ox: int,
) -> tuple[list[StageCost], dict[str, StageCost], list[StageCost]]:
    """(stages before layer 0, band turns by layer, stages after the last layer) of the critical path."""
    chunk = lt.ln.chunk

    def route(name: str) -> int:
        src, dst = {n: (a, b) for n, a, b in geo.routes()}[name]
        hops, _ = geo.route_legs(src, dst)
        return stream_cycles(_route_words(name, config, geo, head), hops)

    before = [
        StageCost("io.in").add(
            "memcpy edge -> input port", stream_cycles(HEADER_WORDS + ITEM_WORDS, _edge_hops(ox))
        )
    ]
    # Embedding: the token id runs down the head strip to its vocab row and along it (R PEs); each PE
    # of that row streams its wte chunk up to the position-embedding strip, which adds wpe and sends
    # the sum to layer 0. Worst case: the last vocab row.
    rows_down = geo.embed_rows + geo.head_cols
    embed = StageCost("embed")
    embed.add("token id to vocab row", stream_cycles(2, rows_down + geo.r - 1) + TASK_ACTIVATION_CYCLES)
    embed.add("wte chunk up to wpe", stream_cycles(chunk, rows_down) + TASK_ACTIVATION_CYCLES)
    embed.add("add wpe", chunk)
    embed.add("to layer 0", route("embed.out"))
    before.append(embed)
    turns = {
        name: StageCost(f"band turn after L{name.split('.')[1]}").add("route", route(name))
        for name, _, _ in geo.routes()
        if name.startswith("turn.")
    }
    after = [
        StageCost("to ln_f").add("route", route("final")),
        norm_cost(ln_f, "ln_f").add("hand-off", HANDOFF_CYCLES),
        head_cost(head, arch, dtype, name="head"),
        StageCost("io.out")
        .add("scores to output port", route("scores"))
        .add("output port -> memcpy edge", stream_cycles(record_words(head.top_k), _edge_hops(ox))),
    ]
    return before, turns, after


def _critical_path(n_layer: int, layer_stages: list[StageCost], outer) -> list[StageCost]:
    """Every stage one decode token passes, in order, named like the regions (L3.qkv, head, ...)."""
    before, turns, after = outer
    stages = list(before)
    for layer in range(n_layer):
        for s in layer_stages:
            stages.append(StageCost(f"L{layer}.{s.name.split('.', 1)[1]}", dict(s.phases)))
        if f"turn.{layer}" in turns:
            stages.append(turns[f"turn.{layer}"])
    return stages + list(after)


# ----------------------------------------------------------------------------------------------------
# The search


def _positions_per_pe_max(config: GPT2Config, arch: Arch, dtype: str, slots: int, context: int) -> int:
    """How many positions (of every slot, one head) an attention PE can hold; raises when not even one."""
    probe = [
        AttentionTiling(config.n_head, config.head_dim, slots, context, config.n_head, ceil_div(context, p))
        for p in (1, 2)
    ]
    one, two = (pe_bytes(attention_symbols(t, dtype)) for t in probe)
    per_position = two - one
    fixed = one - per_position
    most = (arch.data_bytes_per_pe - fixed) // per_position
    if most < 1:
        per_slot = per_position // slots
        fit = (arch.data_bytes_per_pe - fixed) // per_slot
        raise PlanError(
            f"{config.name} with {slots} slots does not fit {arch.name}: per-PE memory: an attention PE holds K and V "
            f"of every slot for its positions, and one position of one head for {slots} slots takes {one:,} B with "
            f"its buffers, {one - arch.data_bytes_per_pe:,} B over the {arch.data_bytes_per_pe:,} B usable "
            f"(48 KB minus the {arch.sram_reserve_bytes // 1024} KB reserve); at most {fit} slots fit per replica"
        )
    return most


def _candidate_knobs(config: GPT2Config, arch: Arch, dtype: str, slots: int, context: int) -> list[Knobs]:
    """The sizes to explore: stream width, attention fold and chain, FC width, LM head width."""
    c, dim = config.n_embd, config.head_dim
    ppp_max = _positions_per_pe_max(config, arch, dtype, slots, context)
    out = []
    stream_options = sorted({r for r in (8, 12, 16, 20, 24, 28, 32, 40, 48, 56, 64, 80, 96, 128) if r <= c})
    folds = [f for f in (1, 2, 4, 8, 16, 32) if dim % f == 0]
    for r in stream_options:
        for fold in folds:
            # The shortest chain that holds the context; twice as long halves each PE's work but adds a
            # merge round.
            chain_min = ceil_div(ceil_div(context, ppp_max), fold) * fold
            for chain in (chain_min, 2 * chain_min):
                if chain > max(context, fold):
                    continue
                for tile_fc in (4, 8, 16, 32, 64, 128):
                    f = ceil_div(4 * c, tile_fc)
                    if not 2 <= f <= arch.kernel_h // 2:
                        continue
                    for head_tile in (16, 32, 64, 128, 256):
                        hc = ceil_div(config.vocab_size, head_tile)
                        for even in (False, True):
                            out.append(Knobs(r, fold, chain, f, hc, even))
    return out


@dataclass(frozen=True)
class PricedCandidate:
    """One candidate that meets the per-PE memory and kernel-area limits, priced by the cycle model
    (placement and the color check come later: `build_plan` does them for the best ones only)."""

    index: int  # order of exploration: breaks ties between equal scores
    knobs: Knobs
    tilings: LayerTilings
    head: HeadTiling
    geometry: _Geometry
    replicas_fit: int  # how many replicas of this footprint the kernel holds
    layer_stages: list[StageCost]  # one layer's stages
    outer: tuple[list[StageCost], dict[str, StageCost], list[StageCost]]  # see `_outer_stages`
    decode_cycles: int  # modeled critical path of one token at full context
    bottleneck_cycles: int  # modeled slowest stage

    @property
    def footprint_pes(self) -> int:
        return self.geometry.width * self.geometry.height

    @property
    def layer_pes(self) -> int:
        return self.geometry.layer_pes

    def critical_path(self) -> list[StageCost]:
        return _critical_path(self.geometry.n_layer, self.layer_stages, self.outer)


@dataclass
class CandidateSearch:
    explored: int  # candidate sizes tried
    priced: list[PricedCandidate]  # those within the memory and kernel-area limits, in explored order
    nearest_miss: tuple[float, str] | None  # (how far over, why) of the closest candidate left out


def price_candidates(
    config: GPT2Config,
    arch: str | Arch = "wse2",
    dtype: str = "fp16",
    slots: int = 16,
    context: int | None = None,
    top_k: int = 64,
) -> CandidateSearch:
    """Every candidate size of the planner's search, checked against the per-PE memory and the kernel
    area and priced by the cycle model (one replica at the kernel's corner); `build_plan` picks from these."""
    arch = resolve_arch(arch)
    context = _check_request(config, dtype, slots, context, top_k)
    priced = []
    closest: tuple[float, str] | None = None
    knobs_list = _candidate_knobs(config, arch, dtype, slots, context)
    for index, knobs in enumerate(knobs_list):
        lt = _layer_tilings(config, knobs, slots, context, arch, dtype)
        head = _head_tiling(config, knobs.stream_pes, knobs.head_cols, top_k, arch, dtype)
        over = _memory_over(lt, head, dtype, arch)
        if over is not None:
            closest = _closer(closest, over)
            continue
        geo = _geometry(config, knobs, arch, dtype, _Dirs.of(lt, head))
        if not isinstance(geo, _Geometry):
            closest = _closer(closest, (geo[0], f"kernel area: {geo[1]}"))
            continue
        fit = (arch.kernel_w // geo.width) * (arch.kernel_h // geo.height)
        layer_stages = _cached_layer_stages(lt, arch, dtype)
        outer = _outer_stages(config, geo, lt, head, lt.ln, arch, dtype, 0)
        # The critical path is layer_stages n_layer times plus the outer stages (see `_critical_path`).
        outer_cycles = [s.cycles for s in outer[0] + list(outer[1].values()) + outer[2]]
        layer_cycles = [s.cycles for s in layer_stages]
        latency = config.n_layer * sum(layer_cycles) + sum(outer_cycles)
        bottleneck = max(max(layer_cycles), max(outer_cycles))
        priced.append(
            PricedCandidate(index, knobs, lt, head, geo, fit, layer_stages, outer, latency, bottleneck)
        )
    return CandidateSearch(len(knobs_list), priced, closest)


def build_plan(
    config: GPT2Config,
    arch: str | Arch = "wse2",
    dtype: str = "fp16",
    slots: int = 16,
    context: int | None = None,
    objective: str = "latency",
    replicas: int | str = 1,
    top_k: int = 64,
) -> Plan:
    """The best feasible plan for the request, or PlanError naming the limit it hits."""
    arch = resolve_arch(arch)
    context = _check_request(config, dtype, slots, context, top_k, objective)
    if replicas != "auto" and (isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1):
        raise PlanError(f"replicas must be a positive integer or 'auto', got {replicas!r}")
    _check_total_capacity(config, arch, dtype, slots, context, 1 if replicas == "auto" else replicas)

    search = price_candidates(config, arch, dtype, slots, context, top_k)
    closest = search.nearest_miss
    most_replicas: tuple[int, str] | None = None  # the most replicas any candidate fits, when short
    ranked = []
    for cand in search.priced:
        fit = cand.replicas_fit
        wanted = fit if replicas == "auto" else replicas
        if fit < wanted:
            if most_replicas is None or fit > most_replicas[0]:
                g = cand.geometry
                most_replicas = (
                    fit,
                    f"kernel area: {wanted} replicas do not fit; at most {fit} replicas of "
                    f"{g.width}x{g.height} PEs do, {wanted - fit} short",
                )
            continue
        per_replica = min(slots * CLOCK_HZ / cand.decode_cycles, CLOCK_HZ / cand.bottleneck_cycles)
        score = cand.decode_cycles if objective == "latency" else -per_replica * wanted
        # Among near-equal candidates prefer the smaller footprint (frees room, keeps the map readable).
        ranked.append((score * (1 + 1e-9 * cand.footprint_pes), cand.index, wanted, cand))
    ranked.sort(key=lambda item: (item[0], item[1]))
    for _, _, wanted, cand in ranked:
        plan = _assemble(config, arch, dtype, slots, context, objective, wanted, top_k, cand)
        if isinstance(plan, str):
            closest = _closer(closest, (1.0, plan))
            continue
        plan.candidates_explored = search.explored
        return plan
    if most_replicas is not None:  # one replica fits: the replica count is the limit
        closest = (0.0, most_replicas[1])
    raise PlanError(_infeasible_message(config, arch, slots, context, closest))


def _check_request(
    config: GPT2Config, dtype: str, slots: int, context: int | None, top_k: int, objective: str = "latency"
) -> int:
    """The request's context (the model's n_positions when None); PlanError naming a bad argument."""
    if dtype not in DTYPES:
        raise PlanError(f"dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    if objective not in OBJECTIVES:
        raise PlanError(f"objective {objective!r}: expected one of {', '.join(OBJECTIVES)}")
    context = config.n_positions if context is None else context
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
        raise PlanError(f"slots must be a positive integer, got {slots!r}")
    if isinstance(context, bool) or not isinstance(context, int) or not 1 <= context <= config.n_positions:
        raise PlanError(f"context must be 1..{config.n_positions} (the model's n_positions), got {context!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= config.vocab_size:
        raise PlanError(f"top_k must be 1..{config.vocab_size}, got {top_k!r}")
    return context


@lru_cache(maxsize=4096)
def _layer_tilings(config, knobs, slots, context, arch, dtype) -> LayerTilings:
    return layer_tilings(config, knobs, slots, context, arch, dtype)


@lru_cache(maxsize=1024)
def _head_tiling(config, stream_pes, head_cols, top_k, arch, dtype) -> HeadTiling:
    return head_tiling(config, Knobs(stream_pes, 1, 1, 1, head_cols), top_k, arch, dtype)


@lru_cache(maxsize=4096)
def _cached_layer_stages(lt: LayerTilings, arch: Arch, dtype: str) -> list[StageCost]:
    return _layer_stages(lt, arch, dtype)


def _closer(closest, miss):
    return miss if closest is None or miss[0] < closest[0] else closest


def _infeasible_message(config, arch, slots, context, closest) -> str:
    why = closest[1] if closest else "no candidate sizes (head_dim has no usable fold)"
    return (
        f"{config.name} with {slots} slots x {context} tokens does not fit {arch.name}; the nearest "
        f"candidate fails on {why}"
    )


def _memory_over(lt: LayerTilings, head: HeadTiling, dtype: str, arch: Arch) -> tuple[float, str] | None:
    """(ratio, message) when some region's per-PE data exceeds the usable bytes."""
    budget = arch.data_bytes_per_pe
    checks = {
        "qkv": gemv_symbols(lt.qkv, dtype),
        "attn": attention_symbols(lt.attn, dtype),
        "attn_proj": gemv_symbols(lt.attn_proj, dtype),
        "fc": gemv_symbols(lt.fc, dtype),
        "proj": gemv_symbols(lt.proj, dtype),
        "head": head_symbols(head, dtype),
        "ln": norm_symbols(lt.ln),
    }
    worst_name, worst = max(((n, pe_bytes(v)) for n, v in checks.items()), key=lambda p: p[1])
    if worst > budget:
        return (
            worst / budget,
            f"per-PE memory: the {worst_name} region needs {worst:,} B on one PE, "
            f"{worst - budget:,} B over the {budget:,} B usable (48 KB minus the "
            f"{arch.sram_reserve_bytes // 1024} KB reserve)",
        )
    return None


def _check_total_capacity(
    config: GPT2Config, arch: Arch, dtype: str, slots: int, context: int, replicas: int
):
    """A quick bound before the search: weights + KV cache of every replica against all usable SRAM."""
    wb = 2 if dtype == "fp16" else 4
    weights = config.n_params * wb
    kv = 2 * config.n_layer * config.n_embd * slots * context * wb
    need = replicas * (weights + kv)
    have = arch.kernel_pes * arch.data_bytes_per_pe
    if need > have:
        raise PlanError(
            f"{config.name} with {slots} slots x {context} tokens x {replicas} replica(s) does not fit {arch.name}: "
            f"weights {weights / 2**30:.2f} GiB + KV cache {kv / 2**30:.2f} GiB per replica = {need / 2**30:.2f} GiB "
            f"> {have / 2**30:.2f} GiB of usable PE memory ({arch.kernel_pes:,} PEs x {arch.data_bytes_per_pe:,} B), "
            f"over by {(need - have) / 2**30:.2f} GiB"
        )


def _assemble(
    config: GPT2Config,
    arch: Arch,
    dtype: str,
    slots: int,
    context: int,
    objective: str,
    replicas: int,
    top_k: int,
    cand: PricedCandidate,
) -> Plan | str:
    """Place every replica, check the geometry and the colors; a string says which check failed."""
    lt, head, geo = cand.tilings, cand.head, cand.geometry
    per_row = arch.kernel_w // geo.width
    regions: list[Region] = []
    routes: list[Route] = []
    for rep in range(replicas):
        row, col = divmod(rep, per_row)
        placed, placed_routes = _place_replica(
            config, geo, lt, head, lt.ln, dtype, rep, col * geo.width, row * geo.height
        )
        regions.extend(placed)
        routes.extend(placed_routes)
    _check_geometry(regions, arch)
    _assign_colors(regions, routes)
    worst = max(regions, key=lambda r: r.colors)
    if worst.colors > arch.usable_colors:
        return (
            f"colors: region {worst.name} needs {worst.colors} colors on one PE, "
            f"{worst.colors - arch.usable_colors} over the {arch.usable_colors} usable "
            f"({arch.routable_colors} routable minus memcpy's {len(arch.memcpy_reserved_colors)})"
        )
    memory = _check_memory(regions, arch)
    if memory is not None:
        return memory
    layers = [
        LayerPlan(i, lt.ln, lt.qkv, lt.attn, lt.attn_proj, lt.ln, lt.fc, lt.proj)
        for i in range(config.n_layer)
    ]
    return Plan(
        config=config,
        arch=arch,
        dtype=dtype,
        slots=slots,
        context=context,
        objective=objective,
        replicas=replicas,
        layers=layers,
        ln_f=lt.ln,
        head=head,
        regions=regions,
        knobs=cand.knobs,
        routes=routes,
        stage_costs=cand.critical_path(),
        layer_stage_costs=[StageCost(s.name, dict(s.phases)) for s in cand.layer_stages],
        top_k=top_k,
        footprint=(geo.width, geo.height),
        colors_used=worst.colors,
    )


def largest_slots(
    config: GPT2Config,
    arch: str | Arch = "wse2",
    dtype: str = "fp16",
    context: int | None = None,
    limit: int = 4096,
) -> int:
    """The largest KV slot count (at `context` tokens, one replica) a plan fits; 0 if not even one."""
    arch = resolve_arch(arch)
    context = config.n_positions if context is None else context
    lo, hi = 0, limit + 1  # lo fits (0 trivially), hi does not
    if _fits(config, arch, dtype, limit, context):
        return limit
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _fits(config, arch, dtype, mid, context):
            lo = mid
        else:
            hi = mid
    return lo


def _fits(config, arch, dtype, slots, context) -> bool:
    try:
        build_plan(config, arch, dtype, slots, context)
        return True
    except PlanError:
        return False
