"""The Region and Route objects of one replica, placed at its corner of the kernel: the geometry's
rectangles filled with each region's tiling, per-PE arrays and axes."""

from __future__ import annotations

from typing import Any

from wafer_gpt2.core.tiling import HeadTiling, NormTiling, ceil_div
from wafer_gpt2.model.config import GPT2Config
from wafer_gpt2.plan.geometry import Geometry, exit_dirs, route_words
from wafer_gpt2.plan.structure import Region, Route, Symbol
from wafer_gpt2.plan.symbols import (
    attention_symbols,
    embed_symbols,
    gemv_symbols,
    head_symbols,
    io_symbols,
    norm_symbols,
    residual_symbols,
    with_cycles,
)
from wafer_gpt2.plan.tilings import LayerTilings

# The array each reader of a gathered hand-off takes the whole multicast into (the PE programs read a
# multicast's payload in one operation: wafer_gpt2/kernels/pe/gemv.csl, layernorm.csl, residual.csl).
_MULTICAST_READS = {"ln_1": "x", "qkv": "x", "res_1": "resid", "res_2": "resid", "ln_f": "x"}


def place_replica(
    config: GPT2Config,
    geo: Geometry,
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
    strip_content = {
        "io.in": ("io", io_symbols(head.top_k, True), None, {}),
        # column 0 at the bottom, next to ln_f: ln_f's output runs up the head (geometry.strip_rects)
        "head": (
            "embed_head",
            head_symbols(head, dtype),
            head,
            {"k": geo.dirs.head_k, "n": exit_dirs("chain", "north")},
        ),
        "ln_f": ("layernorm", norm_symbols(ln_f), ln_f, {"i": geo.dirs.head_k}),
        "io.out": ("io", io_symbols(head.top_k, False, lt.attn.slots), None, {}),
    }
    for name, (kind, symbols, tiling, axes) in strip_content.items():
        x, y, w, h = strip[name]
        regions.append(
            Region(name, kind, None, replica, ox + x, oy + y, w, h, with_cycles(symbols), tiling, 0, axes)
        )
    # the embedding: its row 0 (which sends) its top row
    x, y, w, h = geo.embed_rect()
    symbols = embed_symbols(geo.tokens_per_pe, geo.positions_per_pe, ceil_div(config.n_embd, w), dtype)
    axes = {"k": geo.embed_k_axis, "row": "+y"}
    embed = Region("embed", "embed", None, replica, ox + x, oy + y, w, h, with_cycles(symbols), None, 0, axes)
    regions.insert(1, embed)  # in the order a token meets them: io.in, the embedding, ...
    content: dict[str, tuple[dict[str, Symbol], Any]] = {
        "qkv": (gemv_symbols(lt.qkv, dtype), lt.qkv),
        "attn": (attention_symbols(lt.attn, dtype), lt.attn),
        # a head group's output is multicast over the attn_proj rows that take it
        "attn_proj": (
            gemv_symbols(lt.attn_proj, dtype, lt.attn.heads_per_pe * lt.attn.head_dim),
            lt.attn_proj,
        ),
        # ln_1's and ln_2's LayerNorms are folded into qkv and fc (check_layer_norms_folded): the stream
        # crosses the strips' routers into the GEMVs, and their PEs make the statistics from it
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
    _widen_multicast_readers(regions, geo, config.n_embd)
    routes = []
    for name, src, dst in geo.routes():
        hops, legs = geo.route_legs(src, dst)
        legs = tuple((x + ox, y + oy, w, h) for x, y, w, h in legs)
        words, lines = route_words(name, config, geo, head), geo.handoff_lines(name, src, dst, config.n_embd)
        routes.append(Route(name, src.split(".root")[0], dst, words, hops, legs, replica, lines))
    return regions, routes


def _widen_multicast_readers(regions: list[Region], geo: Geometry, n_embd: int) -> None:
    """Size the input array of every region fed by gather lines and their multicasts (not lanes) to
    a line's payload, its sources' chunks of the stream (`Geometry.multicast_readers`: a layer's ln_1
    and the qkv behind it, a residual strip's skip input, ln_f; `Geometry.handoff_lines`)."""
    by_name = {r.name: r for r in regions}
    for name, src, dst in geo.routes():
        if not geo.gathered(src, dst):
            continue
        sources = geo.rect(src)[2]
        # each gather line's stream carries its own sources' chunks
        payload = sources // geo.handoff_lines(name, src, dst, n_embd) * ceil_div(n_embd, sources)
        for name in geo.multicast_readers(dst):
            region = by_name[name]
            symbol = _MULTICAST_READS[name.rsplit(".", 1)[-1]]
            held = region.symbols[symbol]
            region.symbols = {**region.symbols, symbol: Symbol(held.dtype, max(held.elems, payload))}
