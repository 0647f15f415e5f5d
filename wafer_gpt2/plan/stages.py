"""The modeled stages of one layer and the critical path of one decode token through a replica
(memcpy edge in to memcpy edge out), priced by `wafer_gpt2.core.cost`."""

from __future__ import annotations

from functools import lru_cache

from wafer_gpt2.core.arch import Arch
from wafer_gpt2.core.cost import (
    DSD_OP_START_CYCLES,
    GELU_CYCLES,
    HOP_CYCLES,
    ITEM_HEADER_WORDS,
    MAP_STEP_CYCLES,
    TASK_ACTIVATION_CYCLES,
    StageCost,
    attention_cost,
    embed_reduction,
    gathered_handoff_cycles,
    gemv_cost,
    head_cost,
    norm_cost,
    record_sort_cycles,
    reduce_cycles,
    residual_cost,
    stream_cycles,
    streams_out,
)
from wafer_gpt2.core.tiling import HeadTiling, NormTiling, ceil_div
from wafer_gpt2.core.wire import HEADER_WORDS, ITEM_WORDS, record_words
from wafer_gpt2.model.config import GPT2Config
from wafer_gpt2.plan.geometry import Geometry, route_words
from wafer_gpt2.plan.tilings import LayerTilings

REQUEST_WORDS = 1 + ITEM_WORDS  # wafer_gpt2/kernels/pe/io_in.csl: the item's number, then its fields
HANDOFF_CYCLES = HOP_CYCLES  # the next stage's first phase pays its router-to-PE crossing

# The phase of a hand-off from a res_2 that leads a gather line: its add and send from its frame.
UNSTREAMED_RES_2_PHASE = "res_2's add and send (it leads a gather line)"

# io.out's phase that puts the head's record best first: the top-k's last step, done on io.out.
RECORD_SORT_PHASE = "the record put best first"


def layer_stage_costs(lt: LayerTilings, arch: Arch, dtype: str) -> list[StageCost]:
    """The modeled stages of one layer, in pipeline order (the same for every layer)."""
    chunk = lt.ln.chunk
    costs = [
        norm_cost(lt.ln, "ln_1"),
        gemv_cost(lt.qkv, arch, dtype, name="qkv"),
        attention_cost(lt.attn, arch, dtype, name="attn"),
        gemv_cost(lt.attn_proj, arch, dtype, name="attn_proj"),
        residual_cost(chunk, "res_1", streams_out(lt.attn_proj), lane_in=True),
        norm_cost(lt.ln, "ln_2"),
        gemv_cost(lt.fc, arch, dtype, epilogue_cycles_per_output=GELU_CYCLES, name="fc"),
        gemv_cost(lt.proj, arch, dtype, name="proj"),
        # res_2 hands off in lanes inside a band (a gathered hand-off adds its own difference:
        # `outer_stage_costs`)
        residual_cost(chunk, "res_2", streams_out(lt.proj), streams_through=True),
    ]
    # Every hand-off between touching regions is one hop (the receiving phase counts its ramp).
    return [c.renamed(f"layer.{c.name}").add("hand-off", HANDOFF_CYCLES) for c in costs]


@lru_cache(maxsize=256)  # a handful of chunk sizes and proj tilings per search
def _unstreamed_res_2(chunk: int, streamed_in: bool) -> int:
    """What a res_2 that hands off by a gather line (residual.csl sends from its frame) takes beyond
    the streamed res_2 of `layer_stage_costs`."""
    framed = residual_cost(chunk, streamed_in=streamed_in, lane_in=True).cycles
    return framed - residual_cost(chunk, streamed_in=streamed_in, streams_through=True).cycles


def _edge_hops(ox: int) -> int:
    """Routers between memcpy's west columns (three, plus the halo) and a port at kernel column ox."""
    return ox + 4


def _request_hops(geo: Geometry) -> int:
    """Routers from io.in to the PE where the embedding's lines start last: with a copy of wte, the
    far corner of its last row; else the far end of the head's bottom row (the lines run up the strip
    from there, the request with them)."""
    io_x, io_y, _, _ = geo.strip_rects()["io.in"]
    if geo.embed_copy:
        x, y, w, h = geo.embed_rect()
        return max(abs(x - io_x), abs(x + w - 1 - io_x)) + abs(y + h - 1 - io_y)
    x, y, w, h = geo.strip_rects()["head"]
    return abs(io_y - (y + h - 1)) + abs(x + w - 1 - io_x)


def outer_stage_costs(
    config: GPT2Config,
    geo: Geometry,
    lt: LayerTilings,
    head: HeadTiling,
    ln_f: NormTiling,
    arch: Arch,
    dtype: str,
    ox: int,
) -> tuple[tuple[StageCost, ...], dict[str, StageCost], tuple[StageCost, ...]]:
    """(stages before layer 0, band turns by layer, stages after the last layer) of the critical path.
    Shared by every candidate of the search with the same geometry, head and final LayerNorm: read
    them, never change them (`token_critical_path` copies them)."""
    unstreamed = _unstreamed_res_2(lt.ln.chunk, streams_out(lt.proj))
    return _outer_stages(config, geo, unstreamed, head, ln_f, arch, dtype, ox)


# The search prices thousands of candidates whose geometry, head and final LayerNorm are the same
# (knobs that change none of them): their outer stages are priced once.
@lru_cache(maxsize=8192)
def _outer_stages(
    config: GPT2Config,
    geo: Geometry,
    unstreamed_res_2: int,
    head: HeadTiling,
    ln_f: NormTiling,
    arch: Arch,
    dtype: str,
    ox: int,
) -> tuple[tuple[StageCost, ...], dict[str, StageCost], tuple[StageCost, ...]]:
    ends = {n: (a, b) for n, a, b in geo.outer_routes()}

    def route(name: str) -> int:
        return route_cycles(config, geo, head, name, *ends[name])

    before = [
        StageCost("io.in").add(
            "memcpy edge -> input port",
            stream_cycles(HEADER_WORDS + ITEM_WORDS, _edge_hops(ox + geo.strip_rects()["io.in"][0])),
        )
    ]
    # Embedding (wafer_gpt2/kernels/pe/embed.csl, and pe/head.csl where there is no copy of wte): each
    # chunk's line (comm/reduce.csl, a chain or two levels: `embed_reduction`) runs from its first PE to
    # the embedding's row 0, which hands off to layer 0; every PE adds its wte chunk where it holds the
    # token and its wpe chunk where it holds the position, else zeros, in its CE, and passes the sum on.
    # With a copy the line is a column of the embedding from its far row (each PE's rows added by one
    # @map); without, it runs through every head column of a K-line first, from the bottom. The request
    # reaches a member a hop before the member after it in the line, so only its way to the first
    # member is on the path.
    rows = geo.embed_rows if geo.embed_copy else geo.embed_rows + geo.head_cols
    embed_chunk = ceil_div(config.n_embd, geo.embed_rect()[2])
    kind, group = embed_reduction(arch, rows, embed_chunk, head=not geo.embed_copy)
    embed = StageCost("embed")
    embed.add(
        "request to the lines' first PE",
        stream_cycles(REQUEST_WORDS, _request_hops(geo)) + TASK_ACTIVATION_CYCLES,
    )
    if geo.embed_copy:
        embed.add("the first PE's rows added (one @map)", DSD_OP_START_CYCLES + MAP_STEP_CYCLES * embed_chunk)
    how = "chained" if kind == "chain" else f"{kind} (runs of {group})"
    through = "the embedding's rows" if geo.embed_copy else "the head's columns and the wpe rows"
    embed.add(
        f"wte and wpe chunks reduced through {through}, {how}", reduce_cycles(kind, rows, embed_chunk, group)
    )
    # embed.csl on row 0: the request's header copied into x's frame (while the line's sum is in the
    # fabric, where the line is longer than one PE), a task when the sum is in, the header and the sum
    # sent in one operation
    copy = DSD_OP_START_CYCLES + ITEM_HEADER_WORDS
    embed.add("task: the sum in", TASK_ACTIVATION_CYCLES + (copy if rows == 1 else 0))
    embed.add("the output's header (its send's start)", DSD_OP_START_CYCLES + ITEM_HEADER_WORDS)
    embed.add("to layer 0", route("embed.out"))
    before.append(embed)

    def from_res_2(stage: StageCost, name: str) -> StageCost:
        return from_res_2_stage(stage, config, geo, head, unstreamed_res_2, name, *ends[name])

    # Turns a band pair apart are the same turn moved down the pair's height (even bands run east,
    # odd ones west, each leaves its last layer for the next band's first): one of each is priced.
    turns: dict[str, StageCost] = {}
    priced: list[StageCost] = []  # the first turn of each parity
    for i, name in enumerate(n for n in ends if n.startswith("turn.")):
        label = f"band turn after L{name.split('.')[1]}"
        if i < 2:
            priced.append(from_res_2(StageCost(label), name))
        turns[name] = priced[i % 2] if i < 2 else priced[i % 2].renamed(label)
    ln_f_stage, head_stage = tail_stages(ln_f, head, arch, dtype)
    after = [
        from_res_2(StageCost("to ln_f"), "final"),
        ln_f_stage.renamed("ln_f"),
        head_stage.renamed("head"),
        StageCost("io.out")
        .add("scores to output port", route("scores"))
        .add(RECORD_SORT_PHASE, record_sort_cycles(head))
        .add(
            "output port -> memcpy edge",
            stream_cycles(record_words(head.top_k), _edge_hops(ox + geo.strip_rects()["io.out"][0])),
        ),
    ]
    return tuple(before), turns, tuple(after)


def route_cycles(config: GPT2Config, geo: Geometry, head: HeadTiling, name: str, src: str, dst: str) -> int:
    """Cycles of the hand-off `name` from region `src` to `dst`: gather lines (`Geometry.handoff_lines`)
    and their multicasts, side by side, or a bundle of lanes."""
    if geo.gathered(src, dst):
        # the residual adds send from their input's frame; the embedding sends its row apart
        sources = geo.rect(src)[2]
        lines = geo.handoff_lines(name, src, dst, config.n_embd)
        return gathered_handoff_cycles(
            sources // lines,
            ceil_div(config.n_embd, sources),
            geo.gather_hops(src, dst, lines),
            framed=src != "embed",
        )
    hops, _ = geo.route_legs(src, dst)
    return stream_cycles(route_words(name, config, geo, head), hops)


def from_res_2_stage(
    stage: StageCost,
    config: GPT2Config,
    geo: Geometry,
    head: HeadTiling,
    unstreamed_res_2: int,
    name: str,
    src: str,
    dst: str,
) -> StageCost:
    """`stage` with the hand-off `name` from a res_2: a res_2 that leads a gather line does not
    stream through (residual.csl sends from its frame), so its add and send, which the layer's res_2
    stage leaves out, go here."""
    if geo.gathered(src, dst):
        stage.add(UNSTREAMED_RES_2_PHASE, unstreamed_res_2)
    return stage.add("route", route_cycles(config, geo, head, name, src, dst))


@lru_cache(maxsize=1024)  # the same for every candidate with this strip and head: priced once
def tail_stages(ln_f: NormTiling, head: HeadTiling, arch: Arch, dtype: str) -> tuple[StageCost, StageCost]:
    """The final LayerNorm (with its hand-off) and the LM head: shared, read only (callers copy them:
    `renamed`)."""
    ln = norm_cost(ln_f, "ln_f").add("hand-off", HANDOFF_CYCLES)
    return ln, head_cost(head, arch, dtype, name="head")


def token_critical_path(n_layer: int, layer_stages: list[StageCost], outer) -> list[StageCost]:
    """Every stage one decode token passes, in order, named like the regions (L3.qkv, head, ...): copies,
    the plan's own (the search's stages are shared)."""
    before, turns, after = outer
    stages = [s.renamed(s.name) for s in before]
    for layer in range(n_layer):
        for s in layer_stages:
            stages.append(s.renamed(f"L{layer}.{s.name.split('.', 1)[1]}"))
        if f"turn.{layer}" in turns:
            stages.append(turns[f"turn.{layer}"].renamed(turns[f"turn.{layer}"].name))
    return stages + [s.renamed(s.name) for s in after]
