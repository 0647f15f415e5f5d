"""The modeled stages of one layer and the critical path of one decode token through a replica
(memcpy edge in to memcpy edge out), priced by `wafer_gpt2.core.cost`."""

from __future__ import annotations

from functools import lru_cache

from wafer_gpt2.core.arch import Arch
from wafer_gpt2.core.cost import (
    GELU_CYCLES,
    HOP_CYCLES,
    TASK_ACTIVATION_CYCLES,
    StageCost,
    attention_cost,
    embed_reduction,
    gathered_handoff_cycles,
    gemv_cost,
    head_cost,
    norm_cost,
    reduce_cycles,
    residual_cost,
    stream_cycles,
)
from wafer_gpt2.core.tiling import HeadTiling, NormTiling
from wafer_gpt2.core.wire import HEADER_WORDS, ITEM_WORDS, record_words
from wafer_gpt2.model.config import GPT2Config
from wafer_gpt2.plan.geometry import Geometry, route_words
from wafer_gpt2.plan.tilings import LayerTilings

HANDOFF_CYCLES = HOP_CYCLES  # the next stage's first phase pays its router-to-PE crossing


def layer_stage_costs(lt: LayerTilings, arch: Arch, dtype: str) -> list[StageCost]:
    """The modeled stages of one layer, in pipeline order (the same for every layer)."""
    chunk = lt.ln.chunk
    costs = [
        norm_cost(lt.ln, "ln_1"),
        gemv_cost(lt.qkv, arch, dtype, name="qkv"),
        attention_cost(lt.attn, arch, dtype, name="attn", segment=lt.qkv.segment_tile),
        gemv_cost(lt.attn_proj, arch, dtype, name="attn_proj"),
        residual_cost(chunk, "res_1"),
        norm_cost(lt.ln, "ln_2"),
        gemv_cost(lt.fc, arch, dtype, epilogue_cycles_per_output=GELU_CYCLES, name="fc"),
        gemv_cost(lt.proj, arch, dtype, name="proj"),
        residual_cost(chunk, "res_2"),
    ]
    # Every hand-off between touching regions is one hop (the receiving phase counts its ramp).
    return [c.renamed(f"layer.{c.name}").add("hand-off", HANDOFF_CYCLES) for c in costs]


def _edge_hops(ox: int) -> int:
    """Routers between memcpy's west columns (three, plus the halo) and a port at kernel column ox."""
    return ox + 4


def _request_hops(geo: Geometry) -> int:
    """Routers from io.in to the farthest PE of the embedding lines' first row (the head's bottom row)."""
    rects = geo.strip_rects()
    io_x, io_y, _, _ = rects["io.in"]
    head_x, head_y, head_w, head_h = rects["head"]
    return (io_y - (head_y + head_h - 1)) + (head_x + head_w - 1 - io_x)


def outer_stage_costs(
    config: GPT2Config,
    geo: Geometry,
    lt: LayerTilings,
    head: HeadTiling,
    ln_f: NormTiling,
    arch: Arch,
    dtype: str,
    ox: int,
) -> tuple[list[StageCost], dict[str, StageCost], list[StageCost]]:
    """(stages before layer 0, band turns by layer, stages after the last layer) of the critical path."""
    chunk = lt.ln.chunk
    ends = {n: (a, b) for n, a, b in geo.routes()}

    def route(name: str) -> int:
        src, dst = ends[name]
        if geo.gathered(src, dst):
            return gathered_handoff_cycles(geo.r, chunk, geo.gather_hops(src, dst))
        hops, _ = geo.route_legs(src, dst)
        return stream_cycles(route_words(name, config, geo, head), hops)

    before = [
        StageCost("io.in").add(
            "memcpy edge -> input port", stream_cycles(HEADER_WORDS + ITEM_WORDS, _edge_hops(ox))
        )
    ]
    # Embedding (wafer_gpt2/kernels/pe/head.csl, pe/embed.csl): the request enters at the bottom of the strip
    # and runs up it (geometry.strip_rects), the way the lines run: each K-line's chunks are reduced
    # (comm/reduce.csl, a chain or two levels: `embed_reduction`) from the bottom head row through
    # every head row and then every wpe row: each PE adds its wte chunk (the token's row) or zeros,
    # its wpe chunk (the item's position) or zeros, in its CE, and passes the sum on; the last wpe
    # row sends it to layer 0. The request reaches a row a hop after the row below it, and a line a
    # link (a hop, the ramp into the CE and the add) later, so only the way to the lines' first row
    # (past ln_f, along it to the farthest K-line) is on the path.
    rows_down = geo.embed_rows + geo.head_cols
    kind, group = embed_reduction(arch, rows_down, chunk)
    embed = StageCost("embed")
    embed.add(
        "request to the lines' first row", stream_cycles(2, _request_hops(geo)) + TASK_ACTIVATION_CYCLES
    )
    how = "chained" if kind == "chain" else f"{kind} (runs of {group})"
    embed.add(f"wte chunks reduced to wpe, {how}", reduce_cycles(kind, rows_down, chunk, group))
    embed.add("to layer 0", route("embed.out"))
    before.append(embed)
    turns = {
        name: StageCost(f"band turn after L{name.split('.')[1]}").add("route", route(name))
        for name in ends
        if name.startswith("turn.")
    }
    ln_f_stage, head_stage = _tail_stages(ln_f, head, arch, dtype)
    after = [
        StageCost("to ln_f").add("route", route("final")),
        ln_f_stage.renamed("ln_f"),
        head_stage.renamed("head"),
        StageCost("io.out")
        .add("scores to output port", route("scores"))
        .add("output port -> memcpy edge", stream_cycles(record_words(head.top_k), _edge_hops(ox))),
    ]
    return before, turns, after


@lru_cache(maxsize=1024)  # the same for every candidate with this strip and head: priced once
def _tail_stages(ln_f: NormTiling, head: HeadTiling, arch: Arch, dtype: str) -> tuple[StageCost, StageCost]:
    """The final LayerNorm (with its hand-off) and the LM head (callers copy them: `renamed`)."""
    ln = norm_cost(ln_f, "ln_f").add("hand-off", HANDOFF_CYCLES)
    return ln, head_cost(head, arch, dtype, name="head")


def token_critical_path(n_layer: int, layer_stages: list[StageCost], outer) -> list[StageCost]:
    """Every stage one decode token passes, in order, named like the regions (L3.qkv, head, ...)."""
    before, turns, after = outer
    stages = list(before)
    for layer in range(n_layer):
        for s in layer_stages:
            stages.append(s.renamed(f"L{layer}.{s.name.split('.', 1)[1]}"))
        if f"turn.{layer}" in turns:
            stages.append(turns[f"turn.{layer}"])
    return stages + list(after)
