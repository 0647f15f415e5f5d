"""The search: every candidate size, priced by the cycle model (`price_candidates`); the best that
places and passes every check (`build_plan`); the most KV slots a plan fits (`largest_slots`)."""

from __future__ import annotations

import copy
import heapq
from collections.abc import Iterator
from dataclasses import dataclass, replace
from functools import cached_property, lru_cache

from wafer_gpt2.core.arch import Arch, resolve_arch
from wafer_gpt2.core.cost import CLOCK_HZ, StageCost, head_cost
from wafer_gpt2.core.tiling import AttentionTiling, HeadTiling, NormTiling, ceil_div
from wafer_gpt2.model.config import GPT2Config
from wafer_gpt2.plan.checks import (
    assign_colors,
    check_colors,
    check_geometry,
    check_input_queues,
    check_memory,
    check_request,
    check_total_capacity,
    memory_over,
    strip_over,
)
from wafer_gpt2.plan.geometry import Dirs, Geometry, layer_bands, replica_geometry
from wafer_gpt2.plan.placement import place_replica
from wafer_gpt2.plan.stages import layer_stage_costs, outer_stage_costs, tail_stages, token_critical_path
from wafer_gpt2.plan.structure import Knobs, LayerPlan, Plan, PlanError, Region, Route
from wafer_gpt2.plan.symbols import attention_symbols, pe_bytes
from wafer_gpt2.plan.tilings import LayerTilings, head_tiling, layer_tilings, strip_norm


def _positions_per_pe_max(config: GPT2Config, arch: Arch, dtype: str, slots: int, context: int) -> int:
    """How many positions (of every slot, one head) an attention PE can hold (at most
    MAX_POSITIONS_PER_PE); raises when not even one."""
    probe = [
        AttentionTiling(config.n_head, config.head_dim, slots, context, config.n_head, ceil_div(context, p))
        for p in (1, 2)
    ]
    one, two = (pe_bytes(attention_symbols(t, dtype)) for t in probe)
    per_position = two - one
    fixed = one - per_position
    usable = arch.data_bytes("attention")
    most = (usable - fixed) // per_position
    if most < 1:
        per_slot = per_position // slots
        fit = (usable - fixed) // per_slot
        raise PlanError(
            f"{config.name} with {slots} slots does not fit {arch.name}: per-PE memory: an attention PE holds K and V "
            f"of every slot for its positions, and one position of one head for {slots} slots takes {one:,} B with "
            f"its buffers, {one - usable:,} B over the {arch.budget_words('attention')}; at most {fit} slots fit "
            f"per replica"
        )
    return min(most, MAX_POSITIONS_PER_PE)


# wafer_gpt2/kernels/pe/attention.csl stores a position's k as a column of K^T, its values ppp apart:
# a mem1d DSD's stride is an i8.
MAX_POSITIONS_PER_PE = 127


# `build_plan`'s defaults, which `largest_slots`' probes ask for too.
DEFAULT_OBJECTIVE = "latency"
DEFAULT_REPLICAS = 1
DEFAULT_TOP_K = 64  # candidates the head returns per token

STREAM_WIDTHS = (8, 12, 16, 20, 24, 28, 32, 40, 48, 56, 64, 80, 96, 128)
# Widths a throughput plan's west strip may take into the columns its replicas leave, besides the
# stream's: the head's K-lines need not divide n_embd (their tiles are zero-padded). Each width is a
# head of its own to price (cached per strip), so they are offered only to the shapes that the first
# pass ranks best (`WIDER_STRIP_STARTS`).
STRIP_WIDTHS = tuple(sorted({*range(8, 17), *STREAM_WIDTHS, 18, 22, 26, 30, 36, 44, 52, 60}))
WIDER_STRIP_STARTS = 20
# Logits per head column (the head has vocab / tile columns, one strip row each): between 128 and 256
# the steps let the strip grow to the height the layers' bands give a replica, whose tile FMACs are
# what limits a throughput plan's head.
HEAD_TILES = (16, 32, 64, 96, 128, 160, 192, 208, 224, 256)
# `compact` also tries the narrowest strips and the widest vocabulary tiles: fewest PEs, not speed.
# A strip is at least 2 PEs wide: a head K-line's root hands its logits to PEs before it (HeadTiling).
COMPACT_STREAM_WIDTHS = (2, 4)
COMPACT_HEAD_TILES = (512, 1024)


def _candidate_knobs(
    config: GPT2Config, arch: Arch, dtype: str, slots: int, context: int, compact: bool = False
) -> list[Knobs]:
    """The sizes to explore: stream width, attention fold and chain, FC width, LM head width."""
    c, dim = config.n_embd, config.head_dim
    ppp_max = _positions_per_pe_max(config, arch, dtype, slots, context)
    out = []
    widths = STREAM_WIDTHS + (COMPACT_STREAM_WIDTHS if compact else ())
    head_tiles = HEAD_TILES + (COMPACT_HEAD_TILES if compact else ())
    stream_options = sorted({r for r in widths if r <= c})
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
                    for head_tile in head_tiles:
                        hc = ceil_div(config.vocab_size, head_tile)
                        for even in (False, True):
                            out.append(Knobs(r, fold, chain, f, hc, even))
    return out


@dataclass(frozen=True)
class PricedCandidate:
    """One candidate that meets the per-PE memory and kernel-area limits, priced by the cycle model
    (placement and the color check come later: `build_plan` does them for the best ones only).

    Its layers, final LayerNorm and head are priced at once; the stages outside them (the routes of
    the embedding, the band turns, the way to ln_f and out) when first read. `decode_floor` and
    `bottleneck_floor` are what those routes can only add to, so the planner ranks by the floors and
    prices the routes of the few candidates that could come first (`_ranked`)."""

    index: int  # order of exploration: breaks ties between equal scores
    config: GPT2Config
    arch: Arch
    dtype: str
    knobs: Knobs
    tilings: LayerTilings
    head: HeadTiling
    ln_f: NormTiling  # the final LayerNorm, across the west strip
    geometry: Geometry
    replicas_fit: int  # how many replicas of this footprint the kernel holds
    layer_stages: list[StageCost]  # one layer's stages
    decode_floor: int  # the layers, ln_f and the head: `decode_cycles` without the outer routes
    bottleneck_floor: int  # the busiest of those stages

    @property
    def footprint_pes(self) -> int:
        return self.geometry.width * self.geometry.height

    @property
    def layer_pes(self) -> int:
        return self.geometry.layer_pes

    @cached_property
    def outer(self) -> tuple[tuple[StageCost, ...], dict[str, StageCost], tuple[StageCost, ...]]:
        """See `outer_stage_costs` (shared with other candidates: read, never changed)."""
        return outer_stage_costs(
            self.config, self.geometry, self.tilings, self.head, self.ln_f, self.arch, self.dtype, 0
        )

    @cached_property
    def _figures(self) -> tuple[int, int]:
        before, turns, after = self.outer
        outer_stages = (*before, *turns.values(), *after)
        layer_cycles, layer_busy = _layer_figures(self.tilings, self.arch, self.dtype)
        # the critical path is the layer's stages n_layer times plus the outer stages (`token_critical_path`)
        latency = self.config.n_layer * layer_cycles + sum(s.cycles for s in outer_stages)
        # the initiation interval: the busiest stage (a blocking stage's whole span, StageCost.busy)
        return latency, max(layer_busy, max(s.busy for s in outer_stages))

    @property
    def decode_cycles(self) -> int:
        """Modeled critical path of one token at full context."""
        return self._figures[0]

    @property
    def bottleneck_cycles(self) -> int:
        """Modeled initiation interval: the largest stage occupancy (StageCost.busy)."""
        return self._figures[1]

    def critical_path(self) -> list[StageCost]:
        return token_critical_path(self.geometry.n_layer, self.layer_stages, self.outer)


@dataclass
class CandidateSearch:
    explored: int  # candidate sizes tried
    priced: list[PricedCandidate]  # those within the memory and kernel-area limits, in explored order
    # (how far over, why) of the closest candidate left out: of those that fit the per-PE memory, where
    # any does (another size's memory miss does not name what stops the ones that fit it)
    nearest_miss: tuple[float, str] | None


def price_candidates(
    config: GPT2Config,
    arch: str | Arch = "wse2",
    dtype: str = "fp16",
    slots: int = 16,
    context: int | None = None,
    top_k: int = DEFAULT_TOP_K,
    compact: bool = False,
    pack: bool = False,
) -> CandidateSearch:
    """Every candidate size of the planner's search, checked against the per-PE memory and the kernel
    area and priced by the cycle model (one replica at the kernel's corner); `build_plan` picks from these.
    `pack` (the throughput objective): each size also with the band count that fits the most replicas
    in the kernel, where that is more bands than fewest (`Knobs.bands`), then FC and the west strip
    grown into the rows and columns those replicas leave. The last search is kept: a report plans one,
    two, four and as many replicas as fit from the same one (callers read it, never change it)."""
    arch = resolve_arch(arch)
    context = check_request(config, dtype, slots, context, top_k)
    request = (config, arch, dtype, slots, context, top_k, compact, pack)
    try:
        hash(request)
    except TypeError:  # a config that cannot be a key: searched every time
        return _search(*request)
    return _kept_search(*request)


@lru_cache(maxsize=1)  # the last search: a report asks it for each replica count in turn
def _kept_search(*request) -> CandidateSearch:
    return _search(*request)


def _search(
    config: GPT2Config,
    arch: Arch,
    dtype: str,
    slots: int,
    context: int,
    top_k: int,
    compact: bool,
    pack: bool,
) -> CandidateSearch:
    priced: list[PricedCandidate] = []
    starts: list[tuple[Knobs, Geometry]] = []  # pack: the shape each priced one grew from
    closest: tuple[float, str] | None = None
    area: tuple[float, str] | None = None  # the closest of those that fit the memory
    knobs_list = _candidate_knobs(config, arch, dtype, slots, context, compact)
    for knobs in knobs_list:
        lt, head = _tilings(config, knobs, slots, context, arch, dtype, top_k)
        over = memory_over(lt, head, dtype, arch)
        if over is not None:
            closest = _closer(closest, over)
            continue
        dirs = Dirs.of(lt, head)
        geo = replica_geometry(config, knobs, arch, dtype, dirs)
        if not isinstance(geo, Geometry):
            area = _closer(area, (geo[0], f"kernel area: {geo[1]}"))
            continue
        shapes = [(knobs, geo)]
        if pack:
            # interlocked bands instead where they fit as many replicas (more where bands are many; the
            # plain shape is not priced beside them, which would cost the search a tenth more for no
            # plan the search has found better)
            shapes = _interlocked(config, knobs, geo, arch, dtype, dirs) or shapes
            shapes += _packed(config, *shapes[-1], arch, dtype, dirs)
            # the shape that fits the most replicas (the last) also with FC into the rows they leave
            # (whole tiles, and ragged ones where shorter: each is priced), each of those (or that
            # shape, where none fits) also with the west strip as wide as the columns they leave, and
            # that one also with the head's rounds on PEs of their own, in one set and in two (two take
            # items more often, one leaves more weighted PEs for a faster token: each is priced)
            packed = shapes[-1]
            filled = [
                shape
                for fc_knobs in _fc_filled(config, *packed, arch)
                for shape in _as_many_replicas(
                    config, fc_knobs, packed[1], slots, context, arch, dtype, top_k
                )
            ]
            origins = [packed] * len(shapes) + filled  # the shape each grew from (a filled one: itself)
            shapes += filled
            for start in filled or [packed]:
                grown = _widened_and_apart(config, start, slots, context, arch, dtype, top_k)
                shapes += grown
                origins += [start] * len(grown)
            starts += origins
        for k, g in shapes:
            tilings, strip_head = _tilings(config, k, slots, context, arch, dtype, top_k)
            priced.append(_priced(len(priced), config, k, tilings, strip_head, g, arch, dtype))
    if pack:
        priced += _wider_strips(config, priced, starts, slots, context, arch, dtype, top_k)
    return CandidateSearch(len(knobs_list), priced, area or closest)


def _wider_strips(
    config: GPT2Config,
    priced: list[PricedCandidate],
    starts: list[tuple[Knobs, Geometry]],
    slots: int,
    context: int,
    arch: Arch,
    dtype: str,
    top_k: int,
) -> list[PricedCandidate]:
    """The second pass of a throughput search: the shapes that the best-ranked candidates (by their
    floors, as many replicas as fit) grew from, each with its west strip at the widest of
    `STRIP_WIDTHS` that fits where that is wider than the stream's widths allowed, then with the
    head's rounds apart (`_apart_shapes`), priced."""
    ranked = sorted(
        range(len(priced)),
        key=lambda i: _score(
            "throughput", slots, priced[i].replicas_fit, priced[i].footprint_pes,
            priced[i].decode_floor, priced[i].bottleneck_floor,
        ) + (priced[i].index,),
    )  # fmt: skip
    tried: list[tuple[Knobs, Geometry]] = []
    out: list[PricedCandidate] = []
    for i in ranked:
        start = starts[i]
        if start in tried:
            continue
        if len(tried) == WIDER_STRIP_STARTS:
            break
        tried.append(start)
        knobs, geo = start
        widest = _widest_strip(config, geo, arch)
        stream = max((w for w in STREAM_WIDTHS if geo.s < w <= widest), default=0)
        strip = max((w for w in STRIP_WIDTHS if max(geo.s, stream) < w <= widest), default=0)
        if strip:
            widened = _as_many_replicas(
                config, replace(knobs, strip_pes=strip), geo, slots, context, arch, dtype, top_k
            )
            shapes = list(widened)
            for base in widened:
                shapes += _apart_shapes(config, base, slots, context, arch, dtype, top_k)
            for k, g in shapes:
                tilings, strip_head = _tilings(config, k, slots, context, arch, dtype, top_k)
                out.append(_priced(len(priced) + len(out), config, k, tilings, strip_head, g, arch, dtype))
    return out


def _replicas_fit(geo: Geometry, arch: Arch) -> int:
    return (arch.kernel_w // geo.width) * (arch.kernel_h // geo.height)


def _widened_and_apart(
    config: GPT2Config,
    start: tuple[Knobs, Geometry],
    slots: int,
    context: int,
    arch: Arch,
    dtype: str,
    top_k: int,
) -> list[tuple[Knobs, Geometry]]:
    """The shapes grown from `start` that fit as many replicas: its west strip widened
    (`_strip_widened`), then that shape (or `start`) with the head's rounds apart in each of HEAD_SETS."""
    shapes = [start]
    widened = _strip_widened(config, *start, arch)
    if widened is not None:
        shapes += _as_many_replicas(config, widened, start[1], slots, context, arch, dtype, top_k)
    return shapes[1:] + _apart_shapes(config, shapes[-1], slots, context, arch, dtype, top_k)


def _apart_shapes(
    config: GPT2Config,
    base: tuple[Knobs, Geometry],
    slots: int,
    context: int,
    arch: Arch,
    dtype: str,
    top_k: int,
) -> list[tuple[Knobs, Geometry]]:
    """`base` with the head's rounds apart in each of HEAD_SETS (`_head_apart`'s counts of workers),
    those that fit as many replicas."""
    return [
        shape
        for sets in HEAD_SETS
        for grown in _head_apart(config, *base, arch, dtype, top_k, sets)
        for shape in _as_many_replicas(config, grown, base[1], slots, context, arch, dtype, top_k)
    ]


def _packed(
    config: GPT2Config, knobs: Knobs, geo: Geometry, arch: Arch, dtype: str, dirs: Dirs
) -> list[tuple[Knobs, Geometry]]:
    """The same size with the band count above its own that fits the most replicas in the kernel (the
    fewest such bands), where one fits more than its own: [] otherwise."""
    best, most = None, _replicas_fit(geo, arch)
    tried = {geo.bands}
    for bands in range(geo.bands + 1, config.n_layer + 1):
        count = layer_bands(config, knobs, arch, bands)
        if not isinstance(count, int) or count in tried:  # the geometry of a count before
            continue
        tried.add(count)
        shape = replica_geometry(config, replace(knobs, bands=bands), arch, dtype, dirs)
        if isinstance(shape, Geometry) and _replicas_fit(shape, arch) > most:
            best, most = shape, _replicas_fit(shape, arch)
    return [] if best is None else [(replace(knobs, bands=best.bands), best)]


def _interlocked(
    config: GPT2Config, knobs: Knobs, geo: Geometry, arch: Arch, dtype: str, dirs: Dirs
) -> list[tuple[Knobs, Geometry]]:
    """The same size with its bands interlocked (`Knobs.interlock`), where its attention is wide
    enough and that fits as many replicas in the kernel; [] otherwise."""
    knobs = replace(knobs, interlock=True)
    shape = replica_geometry(config, knobs, arch, dtype, dirs)
    if isinstance(shape, Geometry) and _replicas_fit(shape, arch) >= _replicas_fit(geo, arch):
        return [(knobs, shape)]
    return []


def _fc_filled(config: GPT2Config, knobs: Knobs, geo: Geometry, arch: Arch) -> list[Knobs]:
    """The same knobs with FC and proj taller, into the rows the kernel leaves each replica of its
    column of replicas (the head strip, or the kernel's height over the replicas it stacks, is often
    taller than the bands): FC's and proj's tile FMACs, which a small replica's latency is mostly made
    of, shrink with every row they take. The tallest count whose tiles are whole (4 n_embd a multiple
    of it), and the tallest count at all where its tiles are shorter still: a count that does not
    divide 4 n_embd leaves the last row's tile ragged (zero-padded, `GemvTiling`), which fc's epilogue
    shares multicast (pe/gemv.csl's slices); proj's K-lines over such a count can reduce slower, so
    both are priced. Each is the fewest rows with its tile (the least padding); none taller than the
    knobs' own: []."""
    hidden = 4 * config.n_embd  # fc's outputs
    tallest = arch.kernel_h // (arch.kernel_h // geo.height)  # as many replicas stacked
    # FC's rows are in every band's height, or in every pair's and an odd band's where they interlock
    stacked = geo.bands // 2 + geo.bands % 2 if geo.interlocked else geo.bands
    rows = min((tallest - (geo.bands_h - stacked * geo.f)) // stacked, hidden)
    tile = ceil_div(hidden, knobs.fc_cols)
    options = []
    whole = next((f for f in range(rows, knobs.fc_cols, -1) if hidden % f == 0), None)
    if whole is not None:
        options.append(whole)
        tile = hidden // whole
    if ceil_div(hidden, rows) < tile:
        options.append(ceil_div(hidden, ceil_div(hidden, rows)))
    return [replace(knobs, fc_cols=f) for f in options]


def _strip_widened(config: GPT2Config, knobs: Knobs, geo: Geometry, arch: Arch) -> Knobs | None:
    """The same knobs with the west strip wider, into the columns the kernel leaves each replica of
    its row of replicas: the head's K-lines longer and its tiles shorter, whose FMACs are half of the
    stage that caps a small replica's tokens/s. The widest of the stream's widths (`STREAM_WIDTHS`)
    that fits; None where none is wider."""
    widest = _widest_strip(config, geo, arch)
    strip = max((w for w in STREAM_WIDTHS if geo.s < w <= widest), default=None)
    return None if strip is None else replace(knobs, strip_pes=strip)


def _widest_strip(config: GPT2Config, geo: Geometry, arch: Arch) -> int:
    """The widest west strip a shape can take with as many replicas side by side, their layers (and an
    interlock's shift) as wide as before; no wider than n_embd (a K-line's row a channel at least)."""
    return min(arch.kernel_w // (arch.kernel_w // geo.width) - (geo.width - geo.s), config.n_embd)


def _head_apart(
    config: GPT2Config,
    knobs: Knobs,
    geo: Geometry,
    arch: Arch,
    dtype: str,
    top_k: int,
    sets: int,
) -> list[Knobs]:
    """The same knobs with the head's workers and root on PEs of their own after its K-lines, in the
    same strip (HeadTiling.apart), in `sets` sets taking the items in turn: the K-lines take the next
    item while the rounds run, so the stage that caps a small replica takes an item about as often as
    its rounds allow. One per count of workers `_apart_workers` offers; [] where none makes the head
    faster per item."""
    counts = _apart_workers(config, knobs.strip, knobs.head_cols, top_k, arch, dtype, sets)
    return [replace(knobs, head_workers=w, head_sets=sets) for w in counts]


# Sets of the rounds apart the search offers: a second set halves the rounds' share of the interval;
# a third has not paid in the model (the weighted PEs' FMACs or the token's latency cap first).
HEAD_SETS = (1, 2)


@lru_cache(maxsize=256)  # many candidates share a strip and a head
def _apart_workers(config, strip_pes, head_cols, top_k, arch, dtype, sets) -> tuple[int, ...]:
    """The counts of workers of each of `sets` sets of the rounds apart worth pricing for this strip
    and head, of those whose weighted PEs (and ln_f across them) still fit a PE and whose head is
    faster per item than with its rounds on its weighted PEs: the fastest per item (then per token),
    and the fastest per token. More workers shorten the rounds but take weighted rows (longer tiles):
    a replica capped by its head wants the first, one capped by its token's latency the second.
    () where none is faster per item."""
    head = _head_tiling(config, strip_pes, head_cols, top_k, arch, dtype)
    tile_n = head.gemv.tile_n
    priced = []
    for w in range(1, min(tile_n, strip_pes - 2, 64) + 1):
        rows = strip_pes - sets * (w + 1)
        if tile_n % w or rows < 1:
            continue
        # priced with the head's tree as it is (the plan's head then takes its own)
        apart = replace(head, gemv=replace(head.gemv, rows=rows), workers=w, apart=True, sets=sets)
        if strip_over(apart, dtype, arch):
            continue
        cost = head_cost(apart, arch, dtype)
        priced.append((cost.busy, cost.cycles, w))
    together = head_cost(head, arch, dtype).busy
    faster = [p for p in priced if p[0] < together]
    if not faster:
        return ()
    per_item = min(faster)[2]
    per_token = min(faster, key=lambda p: (p[1], p[0]))[2]
    return (per_item,) if per_token == per_item else (per_item, per_token)


def _as_many_replicas(
    config: GPT2Config,
    knobs: Knobs,
    geo: Geometry,
    slots: int,
    context: int,
    arch: Arch,
    dtype: str,
    top_k: int,
) -> list[tuple[Knobs, Geometry]]:
    """[(knobs, their geometry)] where their tilings fit the per-PE memory and as many replicas fit
    the kernel as of `geo`; [] otherwise."""
    lt, head = _tilings(config, knobs, slots, context, arch, dtype, top_k)
    if memory_over(lt, head, dtype, arch) is not None:
        return []
    shape = replica_geometry(config, knobs, arch, dtype, Dirs.of(lt, head))
    if isinstance(shape, Geometry) and _replicas_fit(shape, arch) >= _replicas_fit(geo, arch):
        return [(knobs, shape)]
    return []


def _priced(
    index: int,
    config: GPT2Config,
    knobs: Knobs,
    lt: LayerTilings,
    head: HeadTiling,
    geo: Geometry,
    arch: Arch,
    dtype: str,
) -> PricedCandidate:
    ln_f = strip_norm(config.n_embd, knobs.head_rows, normalise=True)
    layer_cycles, layer_busy = _layer_figures(lt, arch, dtype)
    ln_f_stage, head_stage = tail_stages(ln_f, head, arch, dtype)
    return PricedCandidate(
        index,
        config,
        arch,
        dtype,
        knobs,
        lt,
        head,
        ln_f,
        geo,
        _replicas_fit(geo, arch),
        _cached_layer_stages(lt, arch, dtype),
        config.n_layer * layer_cycles + ln_f_stage.cycles + head_stage.cycles,
        max(layer_busy, ln_f_stage.busy, head_stage.busy),
    )


def build_plan(
    config: GPT2Config,
    arch: str | Arch = "wse2",
    dtype: str = "fp16",
    slots: int = 16,
    context: int | None = None,
    objective: str = DEFAULT_OBJECTIVE,
    replicas: int | str = DEFAULT_REPLICAS,
    top_k: int = DEFAULT_TOP_K,
) -> Plan:
    """The best feasible plan for the request, or PlanError naming the limit it hits.

    The search is deterministic and costs seconds, and a process often asks for the same plan again
    (a server and its reloads, the simulator and the backend of one test): the plan is kept, and every
    caller gets its own copy to change."""
    request = (config, resolve_arch(arch), dtype, slots, context, objective, replicas, top_k)
    try:
        hash(request)
    except TypeError:  # an argument no plan can take: the search's checks name it
        return _search_plan(*request)
    plan = _kept_plan(*request)
    return copy.deepcopy(plan, {id(plan.config): plan.config, id(plan.arch): plan.arch})


def plan_for_knobs(
    config: GPT2Config,
    knobs: Knobs,
    arch: str | Arch = "wse2",
    dtype: str = "fp16",
    slots: int = 16,
    context: int | None = None,
    objective: str = DEFAULT_OBJECTIVE,
    replicas: int = DEFAULT_REPLICAS,
    top_k: int = DEFAULT_TOP_K,
) -> Plan:
    """The plan of one candidate size, `knobs`, placed and checked as `build_plan` places its pick
    (what-ifs, and tests of a size the search would not pick); PlanError naming the limit it misses."""
    arch = resolve_arch(arch)
    context = check_request(config, dtype, slots, context, top_k, objective)
    lt, head = _tilings(config, knobs, slots, context, arch, dtype, top_k)
    over = memory_over(lt, head, dtype, arch)
    if over is not None:
        raise PlanError(f"{knobs}: {over[1]}")
    geo = replica_geometry(config, knobs, arch, dtype, Dirs.of(lt, head))
    if not isinstance(geo, Geometry):
        raise PlanError(f"{knobs}: kernel area: {geo[1]}")
    cand = _priced(0, config, knobs, lt, head, geo, arch, dtype)
    if cand.replicas_fit < replicas:
        raise PlanError(f"{knobs}: kernel area: at most {cand.replicas_fit} replicas fit, {replicas} asked")
    plan = _assemble(config, arch, dtype, slots, context, objective, replicas, top_k, cand)
    if isinstance(plan, str):
        raise PlanError(f"{knobs}: {plan}")
    plan.candidates_explored = 1
    return plan


@lru_cache(maxsize=32, typed=True)  # typed: slots=True is refused, not taken for slots=1
def _kept_plan(*request) -> Plan:
    return _search_plan(*request)


def forget_kept_plans() -> None:
    """Drop the plans `build_plan` keeps and the searches `price_candidates` keeps: the next request
    searches again (for timing the search)."""
    _kept_plan.cache_clear()
    _kept_search.cache_clear()


def _search_plan(
    config: GPT2Config,
    arch: Arch,
    dtype: str,
    slots: int,
    context: int | None,
    objective: str,
    replicas: int | str,
    top_k: int,
) -> Plan:
    context = check_request(config, dtype, slots, context, top_k, objective)
    if replicas != "auto" and (isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1):
        raise PlanError(f"replicas must be a positive integer or 'auto', got {replicas!r}")
    check_total_capacity(config, arch, dtype, slots, context, 1 if isinstance(replicas, str) else replicas)

    search = price_candidates(
        config,
        arch,
        dtype,
        slots,
        context,
        top_k,
        compact=objective == "compact",
        pack=objective == "throughput",
    )
    closest = search.nearest_miss
    most_replicas: tuple[int, str] | None = None  # the most replicas any candidate fits, when short
    taking = []
    for cand in search.priced:
        fit = cand.replicas_fit
        wanted = fit if isinstance(replicas, str) else replicas  # a str is "auto" (checked above)
        if fit < wanted:
            if most_replicas is None or fit > most_replicas[0]:
                g = cand.geometry
                most_replicas = (
                    fit,
                    f"kernel area: {wanted} replicas do not fit; at most {fit} replicas of "
                    f"{g.width}x{g.height} PEs do, {wanted - fit} short",
                )
            continue
        taking.append((wanted, cand))
    for wanted, cand in _ranked(taking, objective, slots):
        plan = _assemble(config, arch, dtype, slots, context, objective, wanted, top_k, cand)
        if isinstance(plan, str):
            closest = _closer(closest, (1.0, plan))
            continue
        plan.candidates_explored = search.explored
        return plan
    if most_replicas is not None:  # one replica fits: the replica count is the limit
        closest = (0.0, most_replicas[1])
    raise PlanError(_infeasible_message(config, arch, slots, context, closest))


def _score(objective: str, slots: int, wanted: int, footprint: int, decode: int, bottleneck: int) -> tuple:
    """A candidate's rank (lower first) from its figures; never lower for larger `decode` or
    `bottleneck`, so a candidate's floors score no higher than its price."""
    if objective == "compact":
        return (footprint * (1 + 1e-12 * decode),)
    if objective == "latency":
        # Among near-equal candidates prefer the smaller footprint (frees room, keeps the map readable).
        return (decode * (1 + 1e-9 * footprint),)
    # Tokens/s capped by one stage's occupancy ties across many sizes: then the faster token, then the
    # smaller footprint.
    per_replica = min(slots * CLOCK_HZ / decode, CLOCK_HZ / bottleneck)
    return (-per_replica * wanted, decode, footprint)


def _ranked(
    taking: list[tuple[int, PricedCandidate]], objective: str, slots: int
) -> Iterator[tuple[int, PricedCandidate]]:
    """(replicas, candidate) in the order of their scores, ties by exploration order. Each enters
    scored on its floors and is priced in full when it reaches the front: a candidate whose floors
    score worse than the next one's price could not come before it, so most are never priced."""
    heap = [
        (
            _score(objective, slots, w, c.footprint_pes, c.decode_floor, c.bottleneck_floor),
            c.index,
            False,
            w,
            c,
        )
        for w, c in taking
    ]
    heapq.heapify(heap)
    while heap:
        _, index, priced, wanted, cand = heapq.heappop(heap)
        if priced:
            yield wanted, cand
            continue
        score = _score(
            objective, slots, wanted, cand.footprint_pes, cand.decode_cycles, cand.bottleneck_cycles
        )
        heapq.heappush(heap, (score, index, True, wanted, cand))


def _tilings(
    config: GPT2Config, knobs: Knobs, slots: int, context: int, arch: Arch, dtype: str, top_k: int
) -> tuple[LayerTilings, HeadTiling]:
    """A candidate size's layer tilings and head tiling (each cached by the knobs it depends on)."""
    lt = _layer_tilings(
        config, knobs.stream_pes, knobs.fold, knobs.attn_chain, knobs.fc_cols, slots, context, arch, dtype
    )
    head = _head_tiling(
        config, knobs.strip, knobs.head_cols, top_k, arch, dtype, knobs.head_workers, knobs.head_sets
    )
    return lt, head


@lru_cache(maxsize=4096)  # keyed by the knobs a layer's tilings depend on: many candidates share them
def _layer_tilings(
    config, stream_pes, fold, attn_chain, fc_cols, slots, context, arch, dtype
) -> LayerTilings:
    return layer_tilings(config, Knobs(stream_pes, fold, attn_chain, fc_cols, 1), slots, context, arch, dtype)


@lru_cache(maxsize=1024)
def _head_tiling(config, strip_pes, head_cols, top_k, arch, dtype, head_workers=0, head_sets=1) -> HeadTiling:
    knobs = Knobs(strip_pes, 1, 1, 1, head_cols, head_workers=head_workers, head_sets=head_sets)
    return head_tiling(config, knobs, top_k, arch, dtype)


@lru_cache(maxsize=4096)
def _cached_layer_stages(lt: LayerTilings, arch: Arch, dtype: str) -> list[StageCost]:
    return layer_stage_costs(lt, arch, dtype)


@lru_cache(maxsize=4096)
def _layer_figures(lt: LayerTilings, arch: Arch, dtype: str) -> tuple[int, int]:
    """(cycles, busiest stage's occupancy) of one layer's stages."""
    stages = _cached_layer_stages(lt, arch, dtype)
    return sum(s.cycles for s in stages), max(s.busy for s in stages)


def _closer(closest, miss):
    return miss if closest is None or miss[0] < closest[0] else closest


def _infeasible_message(config, arch, slots, context, closest) -> str:
    why = closest[1] if closest else "no candidate sizes (head_dim has no usable fold)"
    return (
        f"{config.name} with {slots} slots x {context} tokens does not fit {arch.name}; the nearest "
        f"candidate fails on {why}"
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
        placed, placed_routes = place_replica(
            config, geo, lt, head, cand.ln_f, dtype, rep, col * geo.width, row * geo.height
        )
        regions.extend(placed)
        routes.extend(placed_routes)
    check_geometry(regions, arch)
    assign_colors(regions, routes)
    problem = check_colors(regions, arch) or check_memory(regions, arch) or check_input_queues(regions, arch)
    if problem is not None:
        return problem
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
        ln_f=cand.ln_f,
        head=head,
        regions=regions,
        knobs=cand.knobs,
        routes=routes,
        stage_costs=cand.critical_path(),
        layer_stage_costs=[s.renamed(s.name) for s in cand.layer_stages],
        top_k=top_k,
        footprint=(geo.width, geo.height),
        colors_used=max(region.colors for region in regions),
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
        # build_plan's request, without its copy: the probe's plan is only looked at
        _kept_plan(config, arch, dtype, slots, context, DEFAULT_OBJECTIVE, DEFAULT_REPLICAS, DEFAULT_TOP_K)
        return True
    except PlanError:
        return False
