"""The arrays (symbols) a PE of each region kind declares for its tiling, and the bytes they take:
what the per-PE memory limit is checked against and what the simulator allocates."""

from __future__ import annotations

from typing import Literal

from wafer_gpt2.core.abi import CYCLES_SYMBOL
from wafer_gpt2.core.cost import HEAD_CHUNK, NORM_STAT_WORDS, TOPK_BINS
from wafer_gpt2.core.tiling import AttentionTiling, GemvTiling, HeadTiling, NormTiling
from wafer_gpt2.core.wire import ITEM_WORDS, record_words
from wafer_gpt2.plan.structure import Symbol


def with_cycles(symbols: dict[str, Symbol]) -> dict[str, Symbol]:
    """A PE program's arrays plus the u32[4] counter every PE keeps for the host to read back: modeled
    busy cycles of the last step and since reset (lo, hi words each). It counts against the PE's memory
    like any other array."""
    return {**symbols, CYCLES_SYMBOL: Symbol("u32", 4)}


def pe_bytes(symbols: dict[str, Symbol]) -> int:
    """Bytes a PE program with these arrays needs, its cycle counter included."""
    return sum(s.nbytes for s in with_cycles(symbols).values())


def weight_symbol_dtype(dtype: str) -> Literal["f16", "f32"]:
    return "f16" if dtype == "fp16" else "f32"


# Every PE program also keeps a few words for stream headers, sinks and link buffers of its comm
# modules (wafer_gpt2/kernels/comm): counted as one small array.
COMM = Symbol("u32", 16)
# wafer_gpt2/kernels/comm/reduce.csl's FIFO (PASS_WORDS) on a two-level reduction's run ends, where both levels
# stream at once; a three-level reduction's second-level ends hold a second one.
REDUCE_PASS = Symbol("f32", 16)
# wafer_gpt2/kernels/comm/gather.csl's relay FIFO (RELAY_WORDS) on a PE of a gather line led from its
# output end that relays the slices behind it: every program that hands its output off by a gather
# line may hold one.
GATHER_RELAY = Symbol("f32", 64)


def reduction_symbols(reduction: str) -> dict[str, Symbol]:
    """The FIFOs a PE of a two- or three-level reduction may hold (the run ends that stream into the
    ends' chain; the second-level ends that stream into the third level's)."""
    if reduction == "three_level":
        return {"reduce_pass": REDUCE_PASS, "reduce_pass_top": REDUCE_PASS}
    return {"reduce_pass": REDUCE_PASS} if reduction == "two_level" else {}


def gemv_symbols(t: GemvTiling, dtype: str, multicast: int = 0) -> dict[str, Symbol]:
    """wafer_gpt2/kernels/pe/gemv.csl's arrays; `multicast`: the words of a multicast that several
    K-lines share, which a PE reads whole (0: a lane of its chunk)."""
    wd = weight_symbol_dtype(dtype)
    return {
        "w": Symbol(wd, t.tile_k * t.tile_n),  # weight tile, row-major [tile_k, tile_n]
        # bias slice (used on the PEs that end the reduction); with the LayerNorm folded in, fp32
        # bias + beta @ W and the column sums of diag(gain) @ W
        **(
            {"norm_b": Symbol("f32", t.tile_n), "norm_g": Symbol("f32", t.tile_n)}
            if t.norm_fold
            else {"b": Symbol(wd, t.tile_n)}
        ),
        "x": Symbol("f32", max(t.tile_k, multicast)),  # the input as it arrives
        "acc": Symbol("f32", t.tile_n + (NORM_STAT_WORDS if t.norm_fold else 0)),  # fp32 partial sums
        "comm": COMM,
        "relay": GATHER_RELAY,  # a root's place in a gather line of roots
        **reduction_symbols(t.reduction),
        # comm/spread.csl: a PE sharing the epilogue writes its slice into a vector zero elsewhere
        **(
            {"epi": Symbol("f32", t.tile_n - t.tile_n // t.epilogue_pes)}
            if t.epilogue_multicast and t.epilogue_pes > 1
            else {}
        ),
    }


def norm_symbols(t: NormTiling) -> dict[str, Symbol]:
    """wafer_gpt2/kernels/pe/layernorm.csl's arrays (a layer's strip, whose LayerNorm is folded into the
    GEMV after it, keeps x and the statistics it makes for that GEMV)."""
    if not t.normalise:  # ln_1 also forwards x to the residual add by a gather line
        return {
            "x": Symbol("f32", t.chunk),
            "sums": Symbol("f32", 2),
            "comm": COMM,
            "relay": GATHER_RELAY,
            **reduction_symbols(t.reduction),
        }
    return {
        "gain": Symbol("f32", t.chunk),
        "bias": Symbol("f32", t.chunk),
        "x": Symbol("f32", t.chunk),
        "y": Symbol("f32", t.chunk),
        "sums": Symbol("f32", 2),  # sum of x, sum of x^2: the statistics all-reduced together
        "comm": COMM,
        "relay": GATHER_RELAY,  # ln_f hands off to the head by a gather line where lanes would cross
        **reduction_symbols(t.reduction),
    }


def residual_symbols(chunk: int) -> dict[str, Symbol]:
    """wafer_gpt2/kernels/pe/residual.csl's arrays."""
    return {"resid": Symbol("f32", chunk), "x": Symbol("f32", chunk), "comm": COMM, "relay": GATHER_RELAY}


def attention_symbols(t: AttentionTiling, dtype: str) -> dict[str, Symbol]:
    """wafer_gpt2/kernels/pe/attention.csl's arrays."""
    wd = weight_symbol_dtype(dtype)
    cache = t.slots * t.positions_per_pe * t.heads_per_pe * t.head_dim
    hd = t.heads_per_pe * t.head_dim
    return {
        "k_cache": Symbol(wd, cache),  # [slot][head in PE][head_dim][position in PE]
        "v_cache": Symbol(wd, cache),  # [slot][head in PE][position in PE][head_dim]
        "qkv": Symbol("f32", 3 * hd),  # the group's [k | q | v] as it arrives (the scores read q there)
        "scores": Symbol("f32", t.heads_per_pe * t.positions_per_pe),  # every head's scores, then weights
        "rec": Symbol("f32", t.heads_per_pe + hd),  # [sum per head | exp-weighted V]
        "stats": Symbol("f32", 4 * t.heads_per_pe),  # own max, the max round's, M, the factors
        **reduction_symbols(t.reduction),  # the merge's FIFOs
        "comm": COMM,
    }


def head_symbols(t: HeadTiling, dtype: str) -> dict[str, Symbol]:
    """wafer_gpt2/kernels/pe/head.csl's arrays (and lib/topk.csl's, comm/tree.csl's), the largest of its roles: a
    worker's slice and entries, a root's round vectors, the centre's k best and its output record."""
    g = t.gemv
    record = 2 * t.top_k + 3  # item, ids, logits, log-sum-exp, target
    return {
        "w": Symbol(weight_symbol_dtype(dtype), g.tile_k * g.tile_n),  # wte^T tile; no bias (tied)
        "x": Symbol("f32", g.tile_k),
        "acc": Symbol("f32", g.tile_n),  # the column's logits (a worker: then its slice)
        "rounds": Symbol("f32", 3 + TOPK_BINS + 2 + 3),  # round A's and B's vectors, the centre's answer
        "entries": Symbol("u32", 2 * t.slice + 4),  # a worker's (id, logit) pairs of round C; counts
        "topk_best": Symbol("u32", 2 * t.top_k),  # the centre's k best (lib/topk.csl)
        "topk_bins": Symbol("u16", TOPK_BINS),  # and its bins' next places
        # the centre's entries as they are read, and the right half's first, read early
        "chunk": Symbol("u32", 2 * 2 * HEAD_CHUNK),
        "wire": Symbol("u32", record),  # the centre's output record
        "row": Symbol("f32", g.tile_k),  # the token's wte chunk on its way to the embed region
        "comm": COMM,
        "emb_pass": REDUCE_PASS,  # the embedding's line may be two-level (wafer_gpt2.core.cost.embed_reduction)
    }


def embed_symbols(tokens_per_pe: int, positions_per_pe: int, tile_k: int, dtype: str) -> dict[str, Symbol]:
    """wafer_gpt2/kernels/pe/embed.csl's arrays."""
    wtype = weight_symbol_dtype(dtype)
    # [token][dim chunk], where the embedding holds a copy of wte (else the head's columns serve it)
    table = {"wte": Symbol(wtype, tokens_per_pe * tile_k)} if tokens_per_pe else {}
    return {
        **table,
        "wpe": Symbol(wtype, positions_per_pe * tile_k),  # [position][dim chunk]
        "none": Symbol(wtype, tile_k),  # the zeros a PE adds for a row it does not hold
        "x": Symbol("f32", tile_k),  # this PE's rows of the item's token and position, plus the line's sum
        "comm": COMM,
        "emb_pass": REDUCE_PASS,  # the embedding's line may be two-level (wafer_gpt2.core.cost.embed_reduction)
        # in the strip (no copy of wte) it hands off to layer 0 by a gather line; a copy, by lanes
        **({} if tokens_per_pe else {"relay": GATHER_RELAY}),
    }


# io.out's ring of records holds a replica's slots' (a decode step's), as many as fit this many bytes.
RECORD_RING_BYTES = 32 * 1024


def records_held(top_k: int, slots: int) -> int:
    """Records io.out's ring holds: a replica's slots, as many of them as fit `RECORD_RING_BYTES`
    (at least one)."""
    return max(1, min(slots, RECORD_RING_BYTES // (4 * record_words(top_k))))


def io_symbols(top_k: int, inbound: bool, slots: int = 1) -> dict[str, Symbol]:
    """wafer_gpt2/kernels/pe/io_in.csl (the count, an item, a request) and io_out.csl (its ring of
    `records_held` records, each sorted before it passes it on)."""
    if inbound:
        return {"items": Symbol("u32", 1 + ITEM_WORDS + ITEM_WORDS + 1)}  # count, item, request
    return {"record": Symbol("u32", records_held(top_k, slots) * record_words(top_k)), "comm": COMM}
