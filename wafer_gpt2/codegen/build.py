"""A plan -> the CSL program: which PE program every PE runs, with which params, and every flow.

One replica, in the order a token meets it (wafer_gpt2/sim/wafer_program.py walks the same way):

    io.in --request--> embed               each chunk a line to the embedding's top row, adding the
                                           token's wte chunk and the position's wpe chunk: a column
                                           of its copy of wte, or (no copy) every head column of the
                                           K-line, then the embedding's rows (wpe)
    embed --> L0.qkv (and L0.ln_1) --per head group--> L0.attn --> L0.attn_proj --> L0.res_1
              L0.ln_1 --x (residual)------------------------------------------------> L0.res_1
    L0.res_1 --> L0.fc --> L0.proj --> L0.res_2;  L0.res_1 --x--> L0.res_2
    L(n-1).res_2 --> ln_f --> head K-lines; their roots --> their workers --rounds--> the roots' tree
    --> the centre --answers--> every worker;  the centre --> io.out

qkv and fc have their LayerNorms folded in (wafer_gpt2/core/tiling.py GemvTiling.norm_fold): the stream
enters their K-lines through the routers of the ln_1 and ln_2 strips, whose PEs take their chunks from
it to make the LayerNorm's statistics (all-reduced over the strip, then sent along the GEMV's roots'
column by the strip's PE in it); ln_1's also forward x to res_1. Only ln_f normalises (a plan whose
layers normalise in their strips is refused, `check_layer_norms_folded`: the simulator and the host
fold them too).

Every hand-off between two regions is `connect`ed: as lanes (source PE i feeds destination line i,
when the slices match and the lanes' routes do not cross), else as a gather line over the sources
whose stream is multicast to every destination PE, each keeping its window. Inside a region, partial
sums travel along chains (comm/chain.csl). Flows are colored afterwards (routes.assign_colors) and
each region's task IDs are picked clear of the colors that reach its PEs (WSE-2 shares one ID space).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import compress
from typing import TYPE_CHECKING, Any

from wafer_gpt2.codegen.frames import Frame, frame_of
from wafer_gpt2.codegen.routes import Flow, Pos, assign_colors, make_flow, make_path_flow, staircase_corners
from wafer_gpt2.core.arch import ARCHS
from wafer_gpt2.core.cost import HEAD_CHUNK, TOPK_BINS, embed_reduction
from wafer_gpt2.core.tiling import (
    GATHER_LINES,
    QKV_ORDER,
    ceil_div,
    gather_lines,
    reduction_end_runs,
    reduction_runs,
    three_level_fits,
)
from wafer_gpt2.core.wire import D2H_COLOR, H2D_COLOR, record_words
from wafer_gpt2.errors import ProgramError
from wafer_gpt2.plan.checks import check_layer_norms_folded

if TYPE_CHECKING:
    from wafer_gpt2.plan.structure import Plan

# comm/chain.csl and comm/gather.csl roles
FIRST, MIDDLE, LAST, ALONE, NONE = 0, 1, 2, 3, 4
# comm/gather.csl's roles in a line led from its output end
LEAD, TRAIL, TAIL = 5, 6, 7
# comm/allreduce.csl join roles
JOIN_NONE, JOIN_SEND, JOIN_ROOT = 0, 1, 2

# Routable colors (0-23 less the three memcpy keeps, 21-23) less the two memcpy streaming colors;
# the same on both architectures.
MEMCPY_COLORS = (H2D_COLOR, D2H_COLOR)
PALETTE = [
    c
    for c in range(ARCHS["wse2"].routable_colors)
    if c not in ARCHS["wse2"].memcpy_reserved_colors and c not in MEMCPY_COLORS
]
# Local task IDs a PE program may bind, highest first (wafer_gpt2/core/arch.py: WSE-2 0-30, shared with the
# colors; WSE-3 8-30; memcpy's 21-23 and 27-31 left out on both).
TASK_POOL = {name: arch.kernel_task_ids for name, arch in ARCHS.items()}

PE_FILES = {
    "io.in": "pe/io_in.csl",
    "io.out": "pe/io_out.csl",
    "embed": "pe/embed.csl",
    "embed_head": "pe/head.csl",
    "layernorm": "pe/layernorm.csl",
    "residual": "pe/residual.csl",
    "gemv": "pe/gemv.csl",
    "attention": "pe/attention.csl",
    "idle": "pe/idle.csl",
}
TASKS = {
    "pe/io_in.csl": 4,
    "pe/io_out.csl": 3,
    "pe/embed.csl": 6,
    "pe/head.csl": 10,
    "pe/layernorm.csl": 10,
    "pe/residual.csl": 10,
    "pe/gemv.csl": 8,
    "pe/attention.csl": 8,
    "pe/idle.csl": 0,
}


@dataclass(frozen=True)
class Raw:
    """A param written as this CSL expression (e.g. a layout param's color)."""

    csl: str


H2D = Raw("@get_color(MEMCPYH2D_DATA_1_ID)")
D2H = Raw("@get_color(MEMCPYD2H_DATA_1_ID)")


@dataclass
class Tile:
    """One PE's program: its file and params. A param that is a Flow means that flow's color; the
    `tasks` param is filled in once the colors are known (per region, or per PE where the region's
    colors together leave too few: `_assign_tasks`)."""

    file: str
    region: str
    params: dict[str, Any] = field(default_factory=dict)


@dataclass
class Program:
    plan: Plan
    width: int
    height: int
    tiles: dict[Pos, Tile]
    flows: list[Flow]
    frames: dict[str, Frame]

    def color_configs(self) -> dict[Pos, list[tuple[int, str, frozenset[str]]]]:
        out: dict[Pos, list[tuple[int, str, frozenset[str]]]] = {}
        for flow in self.flows:
            for pos, (rx, tx) in flow.routes.items():
                out.setdefault(pos, []).append((flow.color, rx, tx))
        return out


@dataclass
class _Connection:
    """Params for both ends of a hand-off."""

    out: dict[Pos, dict[str, Any]]
    into: dict[Pos, dict[str, Any]]


def _disjoint(flows: list[Flow]) -> bool:
    """Whether no two of `flows` share a router (lanes that can share one color)."""
    seen: set[Pos] = set()
    for flow in flows:
        if seen & flow.routes.keys():
            return False
        seen |= flow.routes.keys()
    return True


class _Builder:
    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.flows: list[Flow] = []
        self.params: dict[Pos, dict[str, Any]] = {}
        self.frames: dict[str, Frame] = {}
        self.fp16 = plan.dtype == "fp16"

    # -- flows ---------------------------------------------------------------------------------------
    def flow(self, name: str, src: Pos, dsts: list[Pos]) -> Flow:
        f = make_flow(name, src, dsts)
        self.flows.append(f)
        return f

    def chain(self, name: str, members: list[Pos], prefix: str) -> None:
        """A chain along `members` in order (comm/chain.csl): role, rx and tx params per member."""
        links = [self.flow(f"{name}.{i}", members[i], [members[i + 1]]) for i in range(len(members) - 1)]
        role_key, rx_key, tx_key = f"{prefix}_role", f"{prefix}_rx", f"{prefix}_tx"
        for i, pos in enumerate(members):
            if len(members) == 1:
                role = ALONE
            else:
                role = FIRST if i == 0 else LAST if i == len(members) - 1 else MIDDLE
            p = self.params.get(pos)
            if p is None:
                p = self.params[pos] = {}
            p[role_key] = role
            p[rx_key] = links[i - 1] if i > 0 else None
            p[tx_key] = links[i] if i < len(links) else None

    def reduction(
        self, name: str, members: list[Pos], prefix: str, kind: str, group: int, end_group: int = 0
    ) -> Pos:
        """A reduction along `members` in the tiling's order (comm/reduce.csl): the runs chain
        ({prefix}_role/_rx/_tx), then the runs' last PEs ({prefix}_end_role/_end_rx/_end_tx; ROLE_NONE
        elsewhere, and everywhere for a single run); three_level: those in runs of `end_group`, whose
        last PEs then chain ({prefix}_top_role/_rx/_tx, which the caller sets to ROLE_NONE first: only
        the programs that take a third level declare them). Returns the PE that ends with the result."""
        runs = reduction_runs(len(members), kind, group)
        for pos in members:
            self.params.setdefault(pos, {}).update(
                {f"{prefix}_end_role": NONE, f"{prefix}_end_rx": None, f"{prefix}_end_tx": None}
            )
        for j, run in enumerate(runs):
            self.chain(f"{name}.run{j}", [members[i] for i in run], prefix)
        if len(runs) == 1:
            return members[-1]
        ends = [members[run[-1]] for run in runs]
        end_runs = reduction_end_runs(len(runs), kind, end_group)
        if len(end_runs) == 1:
            self.chain(f"{name}.ends", ends, f"{prefix}_end")
            return ends[-1]
        if not three_level_fits(len(members), group, end_group):
            raise ProgramError(
                f"{name}: a three-level reduction of {len(members)} PEs in runs of {group}, their ends in "
                f"runs of {end_group}, is not one comm/reduce.csl implements"
            )
        for s, end_run in enumerate(end_runs):
            self.chain(f"{name}.ends{s}", [ends[j] for j in end_run], f"{prefix}_end")
        tops = [ends[end_run[-1]] for end_run in end_runs]
        self.chain(f"{name}.top", tops, f"{prefix}_top")
        return tops[-1]

    def connect(
        self,
        name: str,
        sources: list[Pos],
        chunk: int,
        lines: list[list[Pos]],
        line_chunk: int,
        out: str,
        into: str,
        most_gathers: int = 1,
    ) -> None:
        """Hand off a vector held in `chunk`-sized slices by `sources` (in order) to `lines`, line d
        wanting [d*line_chunk, +line_chunk). Source params: {out}_role/_rx/_tx/_line; destination
        params: {into}_color/_payload/_per_stream (and the per-row window is computed on the PE).
        Where it is gathered, it takes up to `most_gathers` gather lines side by side
        (`gather_lines`: the hand-offs on a token's way outside the layers, as the plan prices them)."""
        if len(sources) == len(lines) and chunk == line_chunk:
            pairs = enumerate(zip(sources, lines, strict=True))
            lanes = [make_flow(f"{name}.lane{i}", src, line) for i, (src, line) in pairs]
            if not _disjoint(lanes) and all(len(line) == 1 for line in lines):
                # lanes that turn, each at a row of its own (`staircase_corners`), where the
                # straight ones would share routers
                corners = staircase_corners(sources, [line[0] for line in lines])
                if corners is not None:
                    lanes = [make_path_flow(f"{name}.lane{i}", path) for i, path in enumerate(corners)]
            if _disjoint(lanes):
                self.flows.extend(lanes)
                for src, lane, line in zip(sources, lanes, lines, strict=True):
                    self._out(src, out, ALONE, None, lane, 1)
                    for pos in line:
                        self._into(pos, into, lane, chunk, 1)
                return
        # Gather lines led from their output end (comm/gather.csl): a line's first source sends the
        # header and its slice and starts the multicast, every other source sends its slice at once and
        # then relays what comes from behind it, so the stream [header | the line's slices, in order]
        # runs at the fabric's pace instead of a task and an operation's start per source in series.
        # Split into n lines, line g takes the g-th run of sources and feeds the g-th run of lines.
        n = gather_lines(len(sources), chunk, len(lines), line_chunk, most_gathers)
        per, readers = len(sources) // n, len(lines) // n
        for g in range(n):
            group = sources[g * per : (g + 1) * per]
            tag = name if n == 1 else f"{name}.line{g}"
            everyone = [pos for line in lines[g * readers : (g + 1) * readers] for pos in line]
            links = [self.flow(f"{tag}.gather{i}", group[i + 1], [group[i]]) for i in range(per - 1)]
            multicast = self.flow(f"{tag}.multicast", group[0], everyone)
            last = per - 1
            for i, src in enumerate(group):
                role = ALONE if last == 0 else LEAD if i == 0 else TAIL if i == last else TRAIL
                tx = links[i - 1] if i > 0 else multicast
                self._out(src, out, role, links[i] if i < last else None, tx, per, near_led=True)
            for pos in everyone:
                self._into(pos, into, multicast, per * chunk, readers)

    def _out(
        self, pos: Pos, prefix: str, role: int, rx: Flow | None, tx: Flow, line: int, near_led: bool = False
    ) -> None:
        """Gather params of an output: role, links, the line's length and `_rev`, which turns the PE's
        place into the count of words it relays (a near-led line relays those of the PEs behind it in
        the stream, a far-led one those ahead)."""
        p = self.params.setdefault(pos, {})
        if f"{prefix}_role" in p:
            raise ProgramError(f"PE {pos}: output {prefix!r} is connected twice")
        p.update({f"{prefix}_role": role, f"{prefix}_rx": rx, f"{prefix}_tx": tx, f"{prefix}_line": line})
        p[f"{prefix}_rev"] = near_led

    def _into(self, pos: Pos, prefix: str, flow: Flow, payload: int, per_stream: int) -> None:
        p = self.params.setdefault(pos, {})
        if f"{prefix}_color" in p:
            raise ProgramError(f"PE {pos}: input {prefix!r} is connected twice")
        p.update({f"{prefix}_color": flow, f"{prefix}_payload": payload, f"{prefix}_per_stream": per_stream})

    # -- regions ---------------------------------------------------------------------------------------
    def frame(self, region: Any) -> Frame:
        f = frame_of(region)
        self.frames[region.name if region.replica == 0 else f"{region.name}@{region.replica}"] = f
        return f

    def replica(self, replica: int) -> None:
        plan, cfg = self.plan, self.plan.config

        def region(name: str) -> Any:
            return plan.region(name, replica)

        io_in, io_out, embed, head, ln_f = (region(n) for n in ("io.in", "io.out", "embed", "head", "ln_f"))
        head_t = head.tiling.gemv
        hf, ef = self.frame(head), self.frame(embed)
        copy = "wte" in embed.symbols  # the embedding's own copy of wte, else the head's columns serve it
        embed_tile_k = ceil_div(cfg.n_embd, ef.a_len)
        if not copy and ef.a_len != head_t.rows:  # the head's K-lines run on into the embedding's lines
            raise ProgramError(
                f"embed has {ef.a_len} K chunks, the head {head_t.rows} K-lines: they must match"
            )
        if not copy and embed_tile_k != head_t.tile_k:
            raise ProgramError(f"embed chunks of {embed_tile_k} values, head K-lines of {head_t.tile_k}")
        head_pes = [hf.pe(r, c) for r in range(head_t.rows) for c in range(head_t.cols)]
        embed_pes = [ef.pe(i, j) for i in range(ef.a_len) for j in range(ef.b_len)]

        # io.in -> every PE of the embedding's lines: the request stream.
        members = embed_pes if copy else embed_pes + head_pes
        request = self.flow(f"r{replica}.request", (io_in.x, io_in.y), members)
        self.params.setdefault((io_in.x, io_in.y), {})["req_color"] = request
        for pos in members:
            self.params.setdefault(pos, {})["req_color"] = request
        for pos in head_pes:
            self.params.setdefault(pos, {})["embeds"] = not copy

        # The embedding's lines, one per chunk, each ending on the embedding's row 0 (its top row), which
        # hands off to layer 0, reduced as a chain or in two levels (wafer_gpt2.core.cost.embed_reduction):
        # with the copy, column i of the embedding from its far row; without, every head column of
        # K-line i from the one farthest from the embedding, then embed column i from the head side.
        rows = list(reversed(range(ef.b_len)))
        cols = list(range(head_t.cols))
        if _distance(hf.pe(0, 0), ef.pe(0, 0)) < _distance(hf.pe(0, head_t.cols - 1), ef.pe(0, 0)):
            cols.reverse()
        through_head = 0 if copy else head_t.cols
        kind, group = embed_reduction(plan.arch, through_head + ef.b_len, embed_tile_k, head=not copy)
        for i in range(ef.a_len):
            line = [ef.pe(i, j) for j in rows]
            if not copy:
                line = [hf.pe(i, c) for c in cols] + line
            self.reduction(f"r{replica}.emb{i}", line, "emb", kind, group)
        last_embed_row = [ef.pe(i, 0) for i in range(ef.a_len)]
        for i in range(ef.a_len):
            for j in range(1, ef.b_len):
                self._out(ef.pe(i, j), "out", NONE, None, None, 1)  # type: ignore[arg-type]

        stream = last_embed_row
        stream_chunk = embed_tile_k
        for layer in range(cfg.n_layer):
            stream, stream_chunk = self.layer(replica, layer, stream, stream_chunk)

        # ln_f -> head K-lines; the K-lines' roots -> their workers; the rounds over the tree of the
        # roots to the centre, its answers to every worker, the output record -> io.out.
        ln_lines = self.layernorm(ln_f, stream, stream_chunk, f"r{replica}.final", "next")
        k_lines = [[hf.pe(r, c) for c in range(head_t.cols)] for r in range(head_t.rows)]
        self.connect(f"r{replica}.ln_f.y", ln_lines, ln_f.tiling.chunk, k_lines, head_t.tile_k, "y", "in")
        # the records from each set's centre, read in the sets' turn
        centres = self.head_rounds(head, hf, replica)
        io_params = self.params.setdefault((io_out.x, io_out.y), {})
        for s, (centre, key) in enumerate(zip(centres, ("in_color", "in_second"), strict=False)):
            to_io = self.flow(f"r{replica}.scores{'' if s == 0 else s}", centre, [(io_out.x, io_out.y)])
            self.params[centre]["out_color"] = to_io
            io_params[key] = to_io
        io_params["alternates"] = len(centres) > 1

    def head_rounds(self, head: Any, f: Frame, replica: int) -> list[Pos]:
        """The LM head's threshold selection (pe/head.csl, comm/tree.csl): every K-line reduced in a
        chain to its root, which sends its logits to the `workers` PEs before it (comm/scatter.csl:
        a line from the root back to the farthest); the two halves of the roots' column on either
        side of the centre each a reduction line towards it (`HeadTiling.tree_halves`), whose ends
        join the centre; one broadcast from the centre to every worker. Apart in `sets`, each set
        has its workers, roots, tree and centre, and the K chain's last weighted PE multicasts each
        item's header and sum to every PE of its set (a later set's over the routers of the sets
        before it), whose workers keep their slices of it. Returns the centres, one per set."""
        t = head.tiling
        g = t.gemv
        most = t.workers if t.apart else g.rows - 1
        if g.reduction != "chain" or not 1 <= t.workers <= most or g.tile_n % t.workers:
            raise ProgramError(
                f"{head.name}: threshold selection needs a chain reduction along its K-lines and 1 .. {most} "
                f"workers dividing tile_n (rows {g.rows}, tile_n {g.tile_n}, workers {t.workers}, {g.reduction})"
            )
        if t.sets > 2:
            raise ProgramError(f"{head.name}: pe/head.csl runs the rounds apart in one set or two ({t.sets})")
        tag = f"{head.name}@{replica}"
        if not t.apart:
            for c in range(g.cols):
                members = [f.pe(r, c) for r in range(g.rows)]
                self.reduction(f"{tag}.red{c}", members, "red", "chain", 0)
            return [self.head_set(t, f, tag, g.rows - 1 - t.workers)]
        # apart: the rounds' PEs (no weights, no lane) after the weighted ones, each set after the last.
        # The last weighted PE's K chain add streams [header | sum] onto a multicast to every PE of a
        # set (the later sets' over the routers of those before); each set's rounds chain along it.
        for c in range(g.cols):
            last = f.pe(g.rows - 1, c)
            self.reduction(f"{tag}.red{c}", [f.pe(r, c) for r in range(g.rows)], "red", "chain", 0)
            self.params[last].update(header_out=True, red_role=FIRST if g.rows == 1 else MIDDLE)
            for s in range(t.sets):
                members = [f.pe(r, c) for r in range(t.set_start(s), t.set_start(s + 1))]
                sums = self.flow(f"{tag}.sums{c}" + (f".set{s}" if s else ""), last, members)
                self.params[last]["second_tx" if s else "red_tx"] = sums
                for pos in members:
                    self.params.setdefault(pos, {}).update(weighted=False, embeds=False, sums_rx=sums)
            self.params[last]["alternates"] = t.sets > 1
        return [self.head_set(t, f, f"{tag}.set{s}" if s else tag, t.set_start(s)) for s in range(t.sets)]

    def head_set(self, t: Any, f: Frame, tag: str, start: int) -> Pos:
        """One set of the head's workers and roots, its workers along each K-line from index `start`
        and its root after them: the slices (the root's scatter back along them, or apart the sum read
        whole), the rounds' chain to the root apart, the tree of the roots, the broadcast. Returns its
        centre."""
        cols = t.gemv.cols
        root = start + t.workers
        for c in range(cols):
            members = [f.pe(r, c) for r in range(start, root + 1)]
            if t.apart:
                self.reduction(f"{tag}.rounds{c}", members, "red", "chain", 0)
                for slot, pos in enumerate(members):
                    self.params[pos]["worker_slot"] = slot
            else:
                self.scatter_line(f"{tag}.slices{c}", members, "worker_slot")
        roots = [f.pe(root, c) for c in range(cols)]
        centre = roots[t.centre]
        left, right = t.tree_halves()
        for pos in roots:
            self.params[pos].update(join_role=JOIN_NONE, tree_side=0)
        ends = []
        for side, half in ((0, left), (1, right)):
            if not half:
                ends.append(None)
                continue
            members = [roots[c] for c in half]
            for pos in members:
                self.params[pos]["tree_side"] = side
            end = self.reduction(f"{tag}.tree{side}", members, "tree", t.tree, t.tree_group)
            join = self.flow(f"{tag}.join{side}", end, [centre])
            self.params[end].update(join_role=JOIN_SEND, join_tx=join)
            ends.append(join)
        self.params[centre].update(
            join_role=JOIN_ROOT, join_left=ends[0], join_right=ends[1],
            has_left=ends[0] is not None, has_right=ends[1] is not None,
        )  # fmt: skip
        workers = [f.pe(r, c) for c in range(cols) for r in range(start, root)]
        bcast = self.flow(f"{tag}.answers", centre, workers)
        for pos in workers + [centre]:
            self.params[pos]["bcast_color"] = bcast
        return centre

    def layernorm(self, region: Any, sources: list[Pos], chunk: int, name: str, source_out: str) -> list[Pos]:
        """Connect `sources` (their output `source_out`) into a LayerNorm strip and lay out its
        all-reduce; returns the strip's PEs."""
        t = region.tiling
        f = self.frame(region)
        pes = [f.pe(i) for i in range(t.pes)]
        self.connect(name, sources, chunk, [[pos] for pos in pes], t.chunk, source_out, "in", GATHER_LINES)
        self.allreduce(region, pes)
        return pes

    def allreduce(self, region: Any, pes: list[Pos]) -> None:
        """comm/allreduce.csl over a LayerNorm strip's PEs: both halves reduce towards the root (the
        halves share no router, so the colors of one are free for the other), root + 1 joins its
        half's sums into the root's, and the root broadcasts the result."""
        t = region.tiling
        tag = f"{region.name}@{region.replica}"
        left, right = ([pes[i] for i in half] for half in t.halves())
        root = self.reduction(f"{tag}.red", left, "red", t.reduction, t.group)
        join = bcast = None
        if right:
            joining = self.reduction(f"{tag}.red_right", right, "red", t.reduction, t.group)
            join = self.flow(f"{tag}.join", joining, [root])
            bcast = self.flow(f"{tag}.bcast", root, [pos for pos in pes if pos != root])
        for pos in pes:
            role = JOIN_NONE
            if join is not None:
                role = JOIN_ROOT if pos == root else JOIN_SEND if pos == join.source else JOIN_NONE
            self.params[pos].update(
                red_join_role=role, red_join=join if role != JOIN_NONE else None, red_bcast=bcast
            )

    def folded_stats(self, region: Any, pes: list[Pos], roots: list[Pos]) -> None:
        """A layer's LayerNorm strip makes the statistics of the LayerNorm folded into the GEMV after
        it (pe/layernorm.csl `folded_stats`): its all-reduce, and one multicast from its last PE, which
        feeds the K-lines' last index, along the GEMV's roots (pe/gemv.csl `stats_in`)."""
        self.allreduce(region, pes)
        flow = self.flow(f"{region.name}@{region.replica}.stats", pes[-1], roots)
        self.params[pes[-1]].update(sends_stats=True, stats_color=flow)
        for pos in roots:
            self.params[pos]["stats_color"] = flow

    def gemv_lines(self, region: Any) -> tuple[Frame, list[list[Pos]], list[Pos]]:
        t = region.tiling
        f = self.frame(region)
        lines = [[f.pe(r, c) for c in range(t.cols)] for r in range(t.rows)]
        for c in range(t.cols):
            members = [f.pe(r, c) for r in range(t.rows)]
            for pos in members:
                self.params.setdefault(pos, {}).update(
                    chain_top_role=NONE, chain_top_rx=None, chain_top_tx=None
                )
            name = f"{region.name}@{region.replica}.red{c}"
            self.reduction(name, members, "chain", t.reduction, t.group, t.end_group)
        return f, lines, [f.pe(t.rows - 1, c) for c in range(t.cols)]

    def layer(self, replica: int, layer: int, stream: list[Pos], chunk: int) -> tuple[list[Pos], int]:
        plan = self.plan

        def region(op: str) -> Any:
            return plan.region(f"L{layer}.{op}", replica)

        ln_1, qkv, attn, attn_proj, res_1, ln_2, fc, proj, res_2 = (
            region(op) for op in ("ln_1", "qkv", "attn", "attn_proj", "res_1", "ln_2", "fc", "proj", "res_2")
        )
        tag = f"r{replica}.L{layer}"
        source = "out" if layer == 0 else "next"  # the producer's output that feeds the layer (embed: "out")
        _, qkv_lines, qkv_roots = self.gemv_lines(qkv)
        # qkv has the LayerNorm folded in: the stream goes straight into its K-lines, through ln_1's
        # routers, and ln_1's PEs take their chunks from it for the statistics and to forward x to res_1
        ln1_pes = self.strip(ln_1)
        lines = [[pos, *line] for pos, line in zip(ln1_pes, qkv_lines, strict=True)]
        self.connect(f"{tag}.into_qkv", stream, chunk, lines, qkv.tiling.tile_k, source, "in", GATHER_LINES)
        self.folded_stats(ln_1, ln1_pes, qkv_roots)
        res1_pes = self.strip(res_1)
        self.connect(f"{tag}.ln_1.x", ln1_pes, ln_1.tiling.chunk, [[p] for p in res1_pes], self.chunk(res_1),
                     "resid", "resid")  # fmt: skip

        self.attention(attn, qkv, qkv_roots, attn_proj, tag)
        _, ap_lines, ap_roots = self.gemv_lines(attn_proj)
        self.connect(f"{tag}.attn_proj.out", ap_roots, attn_proj.tiling.tile_n, [[p] for p in res1_pes],
                     self.chunk(res_1), "out", "in")  # fmt: skip

        res2_pes = self.strip(res_2)
        self.connect(f"{tag}.res_1.x", res1_pes, self.chunk(res_1), [[p] for p in res2_pes], self.chunk(res_2),
                     "fwd", "resid")  # fmt: skip
        fc_frame, fc_lines, fc_roots = self.gemv_lines(fc)
        # fc has the LayerNorm folded in: res_1 feeds it through ln_2's routers, whose PEs take their
        # chunks for the statistics
        ln2_pes = self.strip(ln_2)
        lines = [[pos, *line] for pos, line in zip(ln2_pes, fc_lines, strict=True)]
        self.connect(f"{tag}.into_fc", res1_pes, self.chunk(res_1), lines, fc.tiling.tile_k, "next", "in")
        self.folded_stats(ln_2, ln2_pes, fc_roots)
        _, proj_lines, proj_roots = self.gemv_lines(proj)
        self.connect(f"{tag}.fc.out", fc_roots, fc.tiling.tile_n, proj_lines, proj.tiling.tile_k, "out", "in")
        self.share_epilogue(fc, fc_frame)
        self.connect(f"{tag}.proj.out", proj_roots, proj.tiling.tile_n, [[p] for p in res2_pes],
                     self.chunk(res_2), "out", "in")  # fmt: skip
        return res2_pes, self.chunk(res_2)

    def share_epilogue(self, region: Any, f: Frame) -> None:
        """The last `epilogue_pes` PEs of every K-line share the GEMV's epilogue (pe/gemv.csl): the
        root sends the others their slices back along the line (comm/scatter.csl: a chain of links
        from the root to the farthest), and a gather line from the farthest through the root carries
        [header | slices] into the lane `connect` gave the root. `epilogue_multicast`: comm/spread.csl,
        one multicast from the root to the others and a chain from the farthest to the root (`spread`)."""
        t = region.tiling
        pes = t.epilogue_pes
        if pes <= 1:
            return
        if pes > min(t.tile_n, t.rows) or (not t.epilogue_multicast and t.tile_n % pes):
            how = "multicast" if t.epilogue_multicast else "relayed (equal slices)"
            raise ProgramError(
                f"{region.name}: {pes} PEs cannot share its epilogue {how}: its K-lines have {t.rows} PEs "
                f"and its columns {t.tile_n} outputs"
            )
        name = f"{region.name}@{region.replica}"
        for c in range(t.cols):
            members = [f.pe(r, c) for r in range(t.rows - pes, t.rows)]  # the farthest first, the root last
            root = self.params[members[-1]]
            if root.get("out_role") != ALONE:
                raise ProgramError(
                    f"{region.name}: {pes} PEs share its epilogue, which needs one lane per output column "
                    f"into the next region, but its output column {c} feeds a gather line"
                )
            if t.epilogue_multicast:
                self.spread(f"{name}.spread{c}", members)  # the root keeps its lane
                continue
            lane = root.pop("out_tx")
            del root["out_role"]
            self.scatter_line(f"{name}.scatter{c}", members, "epi_slot")
            gather = [
                self.flow(f"{name}.epilogue{c}.{i}", members[i], [members[i + 1]]) for i in range(pes - 1)
            ]
            for i, pos in enumerate(members):
                tx = gather[i] if i < pes - 1 else lane
                self._out(pos, "out", FIRST if i == 0 else MIDDLE, gather[i - 1] if i > 0 else None, tx, pes)

    def spread(self, name: str, members: list[Pos]) -> None:
        """comm/spread.csl over `members` (the farthest first, the root last): the root's multicast to
        the others, and a chain of links from the farthest to the root for the sum; spread_role/_bcast/
        _rx/_tx and epi_slot (the index in `members`) per member."""
        bcast = self.flow(f"{name}.bcast", members[-1], members[:-1])
        links = [self.flow(f"{name}.sum{i}", members[i], [members[i + 1]]) for i in range(len(members) - 1)]
        for i, pos in enumerate(members):
            self.params[pos].update(
                spread_role=FIRST if i == 0 else LAST if i == len(members) - 1 else MIDDLE,
                spread_bcast=bcast,
                spread_rx=links[i - 1] if i > 0 else None,
                spread_tx=links[i] if i < len(links) else None,
                epi_slot=i,
            )

    def scatter_line(self, name: str, members: list[Pos], slot: str) -> None:
        """A scatter line (comm/scatter.csl) from the last of `members` (the root) back to the first:
        scatter_role/_rx/_tx per member, and `slot` = its index in `members` (its slice)."""
        back = members[::-1]
        links = [self.flow(f"{name}.{i}", back[i], [back[i + 1]]) for i in range(len(back) - 1)]
        for i, pos in enumerate(back):
            self.params[pos].update(
                {
                    "scatter_role": FIRST if i == 0 else LAST if i == len(back) - 1 else MIDDLE,
                    "scatter_rx": links[i - 1] if i > 0 else None,
                    "scatter_tx": links[i] if i < len(links) else None,
                    slot: len(back) - 1 - i,
                }
            )

    def strip(self, region: Any) -> list[Pos]:
        f = self.frame(region)
        return [f.pe(i) for i in range(f.a_len)]

    def chunk(self, region: Any) -> int:
        return ceil_div(self.plan.config.n_embd, self.frame(region).a_len)

    def attention(self, attn: Any, qkv: Any, qkv_roots: list[Pos], attn_proj: Any, tag: str) -> None:
        t, q = attn.tiling, qkv.tiling
        f = self.frame(attn)
        width = t.heads_per_pe * t.head_dim
        if (
            q.n_split != 3
            or q.segment_order != QKV_ORDER
            or q.split_cols * q.segment_tile != width
            or q.cols != t.head_groups * q.split_cols
        ):
            raise ProgramError(
                f"{attn.name}: a head group's [k | q | v] ({width} values each) must be a run of whole qkv "
                f"columns (columns of {q.segment_tile} values of each, runs of {q.split_cols} columns)"
            )
        cols_per_group = q.split_cols
        ap = attn_proj.tiling
        if width % ap.tile_k or ap.rows != t.head_groups * (width // ap.tile_k):
            raise ProgramError(
                f"{attn_proj.name}: its K-lines of {ap.tile_k} must split head groups of {width}"
            )
        rows_per_group = width // ap.tile_k
        ap_frame = frame_of(attn_proj)
        for g in range(t.head_groups):
            snake = []
            for p in range(t.chain):
                along, row = t.snake(p)
                snake.append(f.pe(along, g * t.fold + row))
            self.connect(f"{tag}.qkv.g{g}", qkv_roots[g * cols_per_group : (g + 1) * cols_per_group], q.tile_n,
                         [snake], 3 * width, "out", "in")  # fmt: skip
            root = self.reduction(f"{tag}.attn.g{g}", snake, "merge", t.reduction, t.group)
            # the max round's result M from the PE that ends the merge back to the group's others
            others = [pos for pos in snake if pos != root]
            if others:
                bcast = self.flow(f"{tag}.attn.m{g}", root, others)
                for pos in snake:
                    self.params[pos].update(bcast_on=True, bcast_color=bcast)
            rows = [ap_frame.pe(r, c) for r in range(g * rows_per_group, (g + 1) * rows_per_group)
                    for c in range(ap.cols)]  # fmt: skip
            out = self.flow(f"{tag}.attn.out{g}", root, rows)
            for pos in snake:
                self._out(pos, "out", ALONE if pos == root else NONE, None, out if pos == root else None, 1)
            for pos in rows:
                self._into(pos, "in", out, width, rows_per_group)


def _distance(a: Pos, b: Pos) -> int:
    return abs(a[0] - b[0]) + abs(a[1] - b[1])


@contextmanager
def paused_gc() -> Iterator[None]:
    """The cyclic garbage collector off for a while: the generator makes millions of small objects
    (params, routes) and no cycles, and the collections they set off would scan the lot again and
    again (about a third of build_program's time for gpt2)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def build_program(plan: Plan) -> Program:
    """Lay out `plan` as a CSL program (raises ProgramError where the plan's geometry does not fit)."""
    with paused_gc():
        return _build_program(plan)


def _build_program(plan: Plan) -> Program:
    check_layer_norms_folded(plan)
    b = _Builder(plan)
    for replica in range(plan.replicas):
        b.replica(replica)
    assign_colors(b.flows, PALETTE)
    width = max(r.x + r.w for r in plan.regions)
    height = max(r.y + r.h for r in plan.regions)
    tiles = _tiles(b, plan)
    for y in range(height):
        for x in range(width):
            if (x, y) not in tiles:
                tiles[(x, y)] = Tile(PE_FILES["idle"], "-")
    _assign_tasks(tiles, b.flows, plan.arch.name)
    return Program(plan, width, height, tiles, b.flows, b.frames)


# Outputs a PE program declares that a plan may leave unconnected: they default to ROLE_NONE.
_GATHER_NONE = {"role": NONE, "rx": None, "tx": None, "line": 1, "rev": False}
_CHAIN_NONE = {"role": NONE, "rx": None, "tx": None}
OPTIONAL_OUTPUTS = {
    "pe/gemv.csl": {
        "out": _GATHER_NONE,
        "scatter": _CHAIN_NONE,
        "spread": {"role": NONE, "bcast": None, "rx": None, "tx": None},
    },
    "pe/layernorm.csl": {"y": _GATHER_NONE, "resid": _GATHER_NONE},
    "pe/residual.csl": {"next": _GATHER_NONE, "fwd": _GATHER_NONE},
    "pe/embed.csl": {"out": _GATHER_NONE},
    "pe/attention.csl": {"out": _CHAIN_NONE, "bcast": {"on": False, "color": None}},
    "pe/head.csl": {
        # the embedding's request and line, where a copy of wte does the embedding (`embeds` off)
        "req": {"color": None},
        "emb": _CHAIN_NONE,
        "emb_end": _CHAIN_NONE,
        "scatter": _CHAIN_NONE,
        "tree": {**_CHAIN_NONE, "side": 0},
        "tree_end": _CHAIN_NONE,
        "join": {"role": JOIN_NONE, "tx": None, "left": None, "right": None},
        "has": {"left": False, "right": False},
        "bcast": {"color": None},
        "out": {"color": None},
        # ln_f's lane, which the rounds' PEs apart do not take
        "in": {"color": None, "payload": 0, "rows_per_stream": 1},
    },
}
# Params a connection sets that a PE program names differently, or does not take.
RENAMES = {
    "pe/gemv.csl": {"in_per_stream": "in_rows_per_stream"},
    "pe/head.csl": {"in_per_stream": "in_rows_per_stream"},
    "pe/attention.csl": {"in_payload": None, "in_per_stream": None, "out_line": None, "out_rev": None},
}


def _tiles(b: _Builder, plan: Plan) -> dict[Pos, Tile]:
    """Every region's PEs with their full params (the connections' plus each kind's own)."""
    from wafer_gpt2.core.memory_layout import embed_geometry

    tiles: dict[Pos, Tile] = {}
    cfg, fp16 = plan.config, plan.dtype == "fp16"
    for region in plan.regions:
        kind = region.kind
        file = PE_FILES[region.name] if kind == "io" else PE_FILES[kind]
        key = region.name if region.replica == 0 else f"{region.name}@{region.replica}"
        frame = b.frames.get(key)
        t = region.tiling
        own: dict[str, Any] = {"frame": frame.params()} if frame is not None else {}
        if region.name == "io.in":
            own.update(from_host=H2D)
        elif region.name == "io.out":
            own.update(to_host=D2H, record_words=record_words(plan.top_k), depth=plan.records_held,
                       alternates=False, in_second=None)  # fmt: skip
        elif kind == "gemv":
            own.update(tile_k=t.tile_k, tile_n=t.tile_n, use_fp16=fp16, gelu_out=region.name.endswith(".fc"),
                       epi_pes=t.epilogue_pes, epi_slot=t.epilogue_pes, epi_multicast=t.epilogue_multicast,
                       norm_dim=t.k if t.norm_fold else 0, norm_eps=float(cfg.layer_norm_epsilon),
                       stats_color=None)  # fmt: skip
        elif kind == "embed_head":
            own.update(tile_k=t.gemv.tile_k, tile_n=t.gemv.tile_n, vocab=cfg.vocab_size, top_k=plan.top_k,
                       topk_bins=TOPK_BINS, chunk=HEAD_CHUNK, use_fp16=fp16, workers=t.workers,
                       worker_slot=t.workers, use_col_max=t.gemv.cols >= plan.top_k, weighted=True,
                       header_out=False, alternates=False, second_tx=None, sums_rx=None)  # fmt: skip
        elif kind == "embed":
            ppp, tile_k = embed_geometry(region, "wpe", cfg.n_embd)
            tpp = embed_geometry(region, "wte", cfg.n_embd)[0] if "wte" in region.symbols else 0
            own.update(tile_k=tile_k, tpp=tpp, ppp=ppp, use_fp16=fp16)
        elif kind == "layernorm":
            own.update(
                dim=t.dim,
                chunk=t.chunk,
                eps=float(cfg.layer_norm_epsilon),
                scored_only=region.layer is None,
                normalise=t.normalise,
                folded_stats=not t.normalise,
                sends_stats=False,
                stats_color=None,
            )
        elif kind == "residual":
            own.update(chunk=b.chunk(region))
        elif kind == "attention":
            own.update(replica=region.replica, hpp=t.heads_per_pe, head_dim=t.head_dim, ppp=t.positions_per_pe,
                       slots=t.slots, row_len=ceil_div(t.chain, t.fold), fold=t.fold,
                       comb=t.comb, use_fp16=fp16)  # fmt: skip
        # What every PE of the region starts from (its own params, then its optional outputs' defaults),
        # worked out once: per PE only its connections' params are merged in.
        renames = RENAMES.get(file, {})
        dropped = {name for name, to in renames.items() if to is None}
        renamed: dict[tuple[str, ...], tuple[list[str], list[bool]]] = {}  # names -> kept names, mask
        base = {**own}
        for name, defaults in OPTIONAL_OUTPUTS.get(file, {}).items():
            base.update({f"{name}_{k}": value for k, value in defaults.items()})
        base = {name: value for name, value in base.items() if name not in dropped}
        for y in range(region.y, region.y + region.h):
            for x in range(region.x, region.x + region.w):
                p = b.params.get((x, y))
                if p is None:
                    continue  # a PE of the rectangle the tiling leaves out (e.g. a partial snake row)
                if renames:
                    # the region's PEs have a few distinct sets of param names: rename each set once
                    names = tuple(p)
                    kept = renamed.get(names)
                    if kept is None:
                        to = [renames.get(n, n) for n in names]
                        mask = [r is not None and r not in dropped for r in to]
                        kept = renamed[names] = ([r for r in to if r is not None and r not in dropped], mask)
                    p = dict(zip(kept[0], compress(p.values(), kept[1]), strict=True))
                params = {**base, **p}
                tiles[(x, y)] = Tile(file, key, params)
    return tiles


def _assign_tasks(tiles: dict[Pos, Tile], flows: list[Flow], arch: str) -> None:
    """Local task IDs that no color reaching a PE's CE equals (nor memcpy's): one list per region where
    the colors reaching any of its PEs leave enough (the writer groups the PEs sharing it), else a list
    per PE from the colors reaching that PE (a large region whose links use many colors, each PE few)."""
    # The colors that reach a PE's CE are those of the flows it is a destination of: only there does
    # a route have a RAMP tx.
    at_pe: dict[Pos, set[int | None]] = {}
    for flow in flows:
        for pos in flow.destinations:
            at_pe.setdefault(pos, set()).add(flow.color)
    by_region: dict[str, list[Pos]] = {}  # in the order of their first PE
    for pos, tile in tiles.items():
        by_region.setdefault(tile.region, []).append(pos)
    for region, members in by_region.items():
        file = tiles[members[0]].file
        need = TASKS[file]
        if not need:
            continue
        reaching: set[int | None] = set().union(*(at_pe.get(pos, set()) for pos in members))
        tasks = _task_ids(reaching, need, arch)
        if tasks is not None:
            for pos in members:
                tiles[pos].params["tasks"] = tasks
            continue
        for pos in members:
            own = _task_ids(at_pe.get(pos, set()), need, arch)
            if own is None:
                colors = at_pe.get(pos, set()) | set(MEMCPY_COLORS)
                left = sum(t not in colors for t in TASK_POOL[arch])
                reserved = ", ".join(str(t) for t in ARCHS[arch].memcpy_task_ids)
                named = ", ".join(str(c) for c in sorted(c for c in colors if c is not None))
                raise ProgramError(
                    f"region {region} ({file}), PE {pos}: {need} local task IDs needed, {left} left on "
                    f"{arch.upper().replace('WSE', 'WSE-')}: memcpy keeps task IDs {reserved}, and the "
                    f"IDs of the colors that reach the PE ({named}) are kept clear of (one ID space on WSE-2)"
                )
            tiles[pos].params["tasks"] = own


def _task_ids(colors: set[int | None], need: int, arch: str) -> list[int] | None:
    """The first `need` task IDs of the architecture's pool that none of `colors` (nor memcpy's) equals,
    None where fewer are left."""
    pool = [t for t in TASK_POOL[arch] if t not in colors and t not in MEMCPY_COLORS]
    return pool[:need] if len(pool) >= need else None
