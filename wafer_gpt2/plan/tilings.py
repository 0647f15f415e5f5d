"""The tilings (`wafer_gpt2.core.tiling`) one candidate's knobs give every operation of a layer and the LM head,
each with the reduction the cycle model finds fastest."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from wafer_gpt2.core.arch import Arch
from wafer_gpt2.core.cost import GELU_CYCLES, best_attention, best_gemv_reduction, best_head, stats_reduction
from wafer_gpt2.core.tiling import QKV_ORDER, AttentionTiling, GemvTiling, HeadTiling, NormTiling
from wafer_gpt2.model.config import GPT2Config
from wafer_gpt2.plan.structure import Knobs


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
    # ln_1 and ln_2 make the statistics; qkv and fc normalise (the LayerNorm folded in, wafer_gpt2/core/tiling.py)
    ln = strip_norm(c, r, normalise=False)
    best = best_gemv_reduction
    # a head group's columns (fold of them) hold its [k | q | v] contiguous: attention reads q in place
    qkv = GemvTiling(
        c,
        3 * c,
        r,
        t_rows,
        "k_along_x",
        n_split=3,
        norm_fold=True,
        split_cols=knobs.fold,
        segment_order=QKV_ORDER,
    )
    qkv = best(qkv, arch, dtype)
    attn = AttentionTiling(heads, config.head_dim, slots, context, heads, knobs.attn_chain, knobs.fold)
    attn = best_attention(attn, arch, dtype)
    o = best(GemvTiling(c, c, t_rows, r, "k_along_y"), arch, dtype)
    fc = best(GemvTiling(c, 4 * c, r, knobs.fc_cols, "k_along_x", norm_fold=True), arch, dtype, GELU_CYCLES)
    proj = best(GemvTiling(4 * c, c, knobs.fc_cols, r, "k_along_y"), arch, dtype)
    return LayerTilings(ln, qkv, attn, o, fc, proj)


@lru_cache(maxsize=256)
def strip_norm(dim: int, pes: int, normalise: bool) -> NormTiling:
    """A LayerNorm over `pes` PEs of a strip, its statistics all-reduced the way the model prices
    fastest. The final LayerNorm (`normalise`: the LM head has none folded in) spans the west strip;
    a layer's two only make the statistics of the LayerNorm folded into the GEMV after them."""
    kind, group = stats_reduction(pes)
    return NormTiling(dim, pes, reduction=kind, axis="x", group=group, normalise=normalise)


def head_tiling(config: GPT2Config, knobs: Knobs, top_k: int, arch: Arch, dtype: str) -> HeadTiling:
    gemv = GemvTiling(config.n_embd, config.vocab_size, knobs.head_rows, knobs.head_cols, "k_along_x")
    if knobs.head_workers:
        head = HeadTiling(
            config.vocab_size,
            config.n_embd,
            gemv,
            top_k,
            knobs.head_workers,
            apart=True,
            sets=knobs.head_sets,
        )
    else:
        head = HeadTiling(config.vocab_size, config.n_embd, gemv, top_k)
    return best_head(head, arch, dtype)
