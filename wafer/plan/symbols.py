"""The arrays (symbols) a PE of each region kind declares for its tiling, and the bytes they take:
what the per-PE memory limit is checked against and what the simulator allocates."""

from __future__ import annotations

from wafer.plan.model import Symbol
from wafer.tiling import AttentionTiling, GemvTiling, HeadTiling, NormTiling
from wafer.wire import HEADER_WORDS, ITEM_WORDS, record_words

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
