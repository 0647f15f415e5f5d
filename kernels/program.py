"""From a plan to the wafer program: region rows, per-PE roles, every route and its color.

`build_program(plan)` is the single source of what `kernels/layout.csl` builds. The compile driver
writes it as `plan_params.csl` (the layout reads nothing else besides `--params`); the contract lint
(tests/test_csl_contract.py) checks the same tables: routes connected, colors in range and never two
on one router, every PE's params consistent with the routes through it, array sizes equal to the
plan's memory map.

Where things are comes only from the plan: the regions' rectangles, tilings and `axes`, read through
`wafer.memory_layout.pe_coords` (the same map the host uploads with and the simulator computes from).
A hand-off between two regions is one of:
- lanes: every producer PE sits next to the line of consumer PEs that needs its chunk (LayerNorm ->
  the K-lines of a GEMV, a GEMV's roots -> the next strip, ...): one straight lane each, all lanes on
  one color, every PE on a lane keeps a copy;
- a bus: the producers' chunks are gathered along their line into one stream ([header | values] in
  index order), routed to the consumer region and multicast over it; every consumer keeps its window.
  The planner's long hand-offs are buses (the residual stream, the turn between bands of layers,
  embedding -> layer 0, last layer -> ln_f), and so is any hand-off whose lanes do not line up.
Reductions follow the tiling (`wafer.tiling`): a chain ends at the last index, a tree (the rounds of
`tree_rounds`) at index 0. Colors are assigned per channel, first fit, from 0-20 without memcpy's
streaming colors 14 and 15 (memcpy keeps 21-23); a color is never used twice on one router.

What the CSL does not do (docs/kernels.md): the reduce-scatter refinement of the planner's trees
(`scatter` > 1) runs as the plain tree of the same pairs (bit-identical sums; the modeled timing
differs), and a head group spans one attention PE's heads (`heads_per_pe` is any value the plan picks).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from wafer.memory_layout import pe_coords
from wafer.tiling import AttentionTiling, GemvTiling, HeadTiling, NormTiling, ceil_div
from wafer.wire import D2H_COLOR, H2D_COLOR, HEADER_WORDS, ITEM_WORDS, record_words

# ---- codes shared with layout.csl (written into plan_params.csl, so both sides use one definition) ----
KINDS = ("io_in", "io_out", "embed", "embed_head", "layernorm", "gemv", "attention", "residual")
PROGRAM_FILE = {k: f"{k}.csl" for k in KINDS}
K_IO_IN, K_IO_OUT, K_EMBED, K_HEAD, K_NORM, K_GEMV, K_ATTN, K_RES = range(len(KINDS))

# Router directions (layout.csl's `dirs` masks).
RAMP, EAST, WEST, NORTH, SOUTH = 1, 2, 4, 8, 16
STEP = {EAST: (1, 0), WEST: (-1, 0), NORTH: (0, -1), SOUTH: (0, 1)}
OPPOSITE = {EAST: WEST, WEST: EAST, NORTH: SOUTH, SOUTH: NORTH}

MEMCPY_H2D, MEMCPY_D2H = H2D_COLOR, D2H_COLOR
MEMCPY_RESERVED = (21, 22, 23)
ROUTABLE = tuple(c for c in range(21) if c not in (MEMCPY_H2D, MEMCPY_D2H))
NONE = 0xFFFF
MAX_RX = 10  # receives of one reduction on one PE (reduce.csl)
HDR = 5  # item header words on every message between regions
REQ = 6  # an embedding request: header + token

# Axis codes: how a tiling index grows across the region ("+x": eastward from the west edge, ...).
AXIS_CODE = {"+x": 0, "-x": 1, "+y": 2, "-y": 3}

# Color slots of a region (its row of the `slot_color` table).
SLOTS = (
    "in", "out", "og0", "og1", "bc", "rin", "rg0", "rg1", "rb", "req", "ech0", "ech1",
    *(f"red{j}" for j in range(MAX_RX)), *(f"mg{j}" for j in range(MAX_RX)),
)  # fmt: skip
SLOT = {name: i for i, name in enumerate(SLOTS)}

# Per-region numbers (the `t` table); which ones a kind uses is documented in layout.csl.
T_FIELDS = (
    "dim", "k", "n", "tile_k", "tile_n", "rows", "cols", "use_fp16", "epilogue",
    "in_mode", "in_len", "root", "red_off", "mg_off", "mroot", "og_off", "rg_off", "out_gather", "out_q16",
    "has_rg", "drop", "chunk", "pes", "heads", "head_dim", "slots", "hpp", "ppp", "chain", "fold", "lc",
    "st", "vocab", "top_k", "ch_y0", "ch_len", "replica", "rec_words",
)  # fmt: skip
T = {name: i for i, name in enumerate(T_FIELDS)}
IN_LANE, IN_GROUP, IN_BUS = 0, 1, 2  # input modes: exact chunk, window of a group's stream, window of a bus

# Role words (the `roles` table, one per index of a reduction line).
ROLE_TX_SHIFT, ROLE_HAS_TX, ROLE_STREAM = 10, 1 << 14, 1 << 15
# Gather flags (the `g_flags` table, one per chunk index of a gather line).
G_HDR, G_HAS_RX, G_EXIT, G_TX_ODD, G_RX_ODD = 1, 2, 4, 8, 16


class ProgramError(ValueError):
    """The plan cannot be laid out as the kernels expect (the message names the region or route)."""


# ----------------------------------------------------------------------------------------------------
# Tables


@dataclass
class RegionRow:
    index: int
    name: str
    kind: int
    replica: int
    layer: int | None
    x: int
    y: int
    w: int
    h: int
    axes: tuple[int, int]  # axis codes of the kind's two indices (see layout.csl)
    t: dict[str, int] = field(default_factory=dict)
    slots: dict[str, int] = field(default_factory=dict)  # slot -> color
    region: Any = None

    def tv(self, name: str) -> int:
        return self.t.get(name, 0)


@dataclass
class Channel:
    """One route pattern on one color: router settings (rx one direction, tx a set) on its PEs."""

    name: str
    users: list[tuple[int, str]]  # (region row, slot) whose PE programs send or receive on it
    xs: list = field(default_factory=list)
    ys: list = field(default_factory=list)
    rx: list = field(default_factory=list)
    tx: list = field(default_factory=list)
    color: int = -1

    def add(self, x: int, y: int, rx: int, tx: int) -> None:
        self.xs.append(x)
        self.ys.append(y)
        self.rx.append(rx)
        self.tx.append(tx)

    def add_path(
        self, cells: list[tuple[int, int]], take: set[int] | None = None, start_rx: int = RAMP
    ) -> None:
        """A path through `cells` (unit steps, any turns): the first router takes the wavelets from
        `start_rx` (its PE's ramp, or a neighbour), the last hands them to its PE; the PEs at indices
        in `take` (default: only the last) also get a copy."""
        take = {len(cells) - 1} if take is None else take
        for i, (x, y) in enumerate(cells):
            rx = start_rx if i == 0 else OPPOSITE[_direction(cells[i - 1], (x, y))]
            tx = RAMP if i in take else 0
            if i + 1 < len(cells):
                tx |= _direction((x, y), cells[i + 1])
            self.add(x, y, rx, tx)

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        return (np.asarray(self.xs, dtype=np.int32), np.asarray(self.ys, dtype=np.int32),
                np.asarray(self.rx, dtype=np.int32), np.asarray(self.tx, dtype=np.int32))  # fmt: skip


@dataclass(frozen=True)
class Rect:
    """A rectangle of routers with one setting for one color (what layout.csl applies)."""

    color: int
    x: int
    y: int
    w: int
    h: int
    rx: int
    tx: int


@dataclass
class Program:
    kernel_w: int
    kernel_h: int
    arch: str
    regions: list[RegionRow]
    channels: list[Channel]
    roles: list[int] = field(default_factory=list)  # reduction role words
    g_flags: list[int] = field(default_factory=list)  # gather tables
    g_before: list[int] = field(default_factory=list)
    g_own: list[int] = field(default_factory=list)
    g_after: list[int] = field(default_factory=list)
    idle: list[tuple[int, int, int, int]] = field(default_factory=list)  # (x, y, w, h) PEs without a region
    gathers: list[tuple[int, str, int, int, int]] = field(
        default_factory=list
    )  # (row, prefix, offset, chunks, group)
    request: dict = field(default_factory=dict)  # the plan request this program was built for (plan_request)

    def rects(self) -> list[Rect]:
        out: list[Rect] = []
        for ch in self.channels:
            out.extend(_compress(ch))
        return out

    def router_maps(self) -> tuple[np.ndarray, np.ndarray]:
        """(rx, tx) per (color, y, x): 0 where a router does not carry the color."""
        rx = np.zeros((24, self.kernel_h, self.kernel_w), dtype=np.uint8)
        tx = np.zeros((24, self.kernel_h, self.kernel_w), dtype=np.uint8)
        for ch in self.channels:
            xs, ys, r, t = ch.arrays()
            rx[ch.color, ys, xs] = r
            tx[ch.color, ys, xs] = t
        return rx, tx

    def colors_per_pe(self) -> np.ndarray:
        used = np.zeros((self.kernel_h, self.kernel_w), dtype=np.int32)
        for ch in self.channels:
            xs, ys, _, _ = ch.arrays()
            used[ys, xs] |= 1 << ch.color
        return _popcount(used)


def _popcount(a: np.ndarray) -> np.ndarray:
    a = a.astype(np.uint32)
    out = np.zeros(a.shape, dtype=np.int32)
    for bit in range(24):
        out += (a >> bit) & 1
    return out


def _direction(a: tuple[int, int], b: tuple[int, int]) -> int:
    step = (b[0] - a[0], b[1] - a[1])
    for d, s in STEP.items():
        if s == step:
            return d
    raise ProgramError(f"route step from {a} to {b} is not between neighbouring PEs")


def _compress(ch: Channel) -> list[Rect]:
    """The channel's routers as maximal row runs merged into rectangles (same setting)."""
    xs, ys, rx, tx = ch.arrays()
    if xs.size == 0:
        return []
    order = np.lexsort((xs, ys, tx, rx))
    xs, ys, rx, tx = xs[order], ys[order], rx[order], tx[order]
    brk = np.ones(xs.size, dtype=bool)
    brk[1:] = (np.diff(xs) != 1) | (np.diff(ys) != 0) | (np.diff(rx) != 0) | (np.diff(tx) != 0)
    starts = np.flatnonzero(brk)
    ends = np.append(starts[1:], xs.size) - 1
    runs = np.stack([rx[starts], tx[starts], xs[starts], xs[ends], ys[starts]], axis=1)
    runs = runs[np.lexsort((runs[:, 4], runs[:, 3], runs[:, 2], runs[:, 1], runs[:, 0]))]
    rects: list[Rect] = []
    i = 0
    while i < len(runs):
        r0, t0, x0, x1, y0 = (int(v) for v in runs[i])
        j = i + 1
        while j < len(runs) and tuple(runs[j, :4]) == (r0, t0, x0, x1) and runs[j, 4] == y0 + (j - i):
            j += 1
        rects.append(Rect(ch.color, x0, y0, x1 - x0 + 1, j - i, r0, t0))
        i = j
    return rects


# ----------------------------------------------------------------------------------------------------
# Per-PE indices: the formulas layout.csl uses, checked against memory_layout.pe_coords


def along(code: int, lx: int, ly: int, w: int, h: int) -> int:
    return (lx, w - 1 - lx, ly, h - 1 - ly)[code]


def snake_index(row: RegionRow, lx: int, ly: int) -> tuple[int, int]:
    """(head group, chain index) of an attention PE (memory_layout._snake)."""
    v = along(row.axes[1], lx, ly, row.w, row.h)
    g, j = divmod(v, row.tv("fold"))
    a = along(row.axes[0], lx, ly, row.w, row.h)
    lc = row.tv("lc")
    return g, j * lc + (a if j % 2 == 0 else lc - 1 - a)


def _axis_codes(region: Any, names: tuple[str, str]) -> tuple[int, int]:
    axes = region.axes or {}
    codes = []
    for name in names:
        spec = axes.get(name)
        if spec is None:
            if name == "i" or (name == "position" and region.kind == "embed"):
                spec = "+x" if name == "i" else "+y"
            else:
                raise ProgramError(f"region {region.name}: its axes give no direction for {name!r}")
        codes.append(AXIS_CODE[spec])
    return codes[0], codes[1]


# ----------------------------------------------------------------------------------------------------
# Reduction roles (reduce.csl): who receives on which colors, who sends on which


def tree_receives(i: int, n: int) -> list[int]:
    """Rounds j in which index i is a destination of tree_rounds(n) (it then adds i + 2^j)."""
    out, s, j = [], 1, 0
    while s < n:
        if i % (2 * s) == 0 and i + s < n:
            out.append(j)
        s, j = 2 * s, j + 1
    return out


def tree_send_round(i: int, n: int) -> int | None:
    s, j = 1, 0
    while s < n:
        if i % (2 * s) == s:
            return j
        s, j = 2 * s, j + 1
    return None


def rounds(n: int) -> int:
    return math.ceil(math.log2(n)) if n > 1 else 0


def reduction_roles(kind: str, n: int) -> list[int]:
    """One role word per index: receive-slot mask, send slot, flags (layout.csl decodes them)."""
    words = []
    for i in range(n):
        if kind == "chain":
            mask = 1 << ((i - 1) % 2) if i > 0 else 0
            word = mask
            if i < n - 1:
                word |= ((i % 2) << ROLE_TX_SHIFT) | ROLE_HAS_TX
            if 0 < i < n - 1:
                word |= ROLE_STREAM
        else:
            mask = sum(1 << j for j in tree_receives(i, n))
            word = mask
            send = tree_send_round(i, n)
            if send is not None:
                word |= (send << ROLE_TX_SHIFT) | ROLE_HAS_TX
        words.append(word)
    return words


def decode_role(word: int) -> tuple[list[int], int | None, bool]:
    """(receive slots in order, send slot or None, stream) of a role word."""
    rx = [j for j in range(MAX_RX) if word >> j & 1]
    tx = (word >> ROLE_TX_SHIFT) & 0xF if word & ROLE_HAS_TX else None
    return rx, tx, bool(word & ROLE_STREAM)


def reduction_root(kind: str, n: int) -> int:
    return n - 1 if kind == "chain" else 0


# ----------------------------------------------------------------------------------------------------
# Building


class _Builder:
    def __init__(self, plan: Any) -> None:
        self.plan = plan
        self.fp16 = plan.dtype == "fp16"
        self.rows: list[RegionRow] = []
        self.channels: list[Channel] = []
        self.roles: list[int] = []
        self._role_tables: dict[tuple[str, int], int] = {}
        self.g_flags: list[int] = []
        self.g_before: list[int] = []
        self.g_own: list[int] = []
        self.g_after: list[int] = []
        self.gathers: list[tuple[int, str, int, int, int]] = []
        self.owner: dict[tuple[int, int], int] = {}  # PE -> region row

    # -- tables ------------------------------------------------------------------------------------

    def role_table(self, kind: str, n: int) -> int:
        key = (kind, n)
        if key not in self._role_tables:
            self._role_tables[key] = len(self.roles)
            self.roles.extend(reduction_roles(kind, n))
        return self._role_tables[key]

    def channel(self, name: str, *users: tuple[RegionRow, str]) -> Channel:
        ch = Channel(name, [(row.index, slot) for row, slot in users])
        self.channels.append(ch)
        return ch

    # -- regions -----------------------------------------------------------------------------------

    def add_row(self, region: Any) -> RegionRow:
        kind = {"io": None, "embed": K_EMBED, "embed_head": K_HEAD, "layernorm": K_NORM, "gemv": K_GEMV,
                "attention": K_ATTN, "residual": K_RES}.get(region.kind, -1)  # fmt: skip
        if kind is None:
            kind = K_IO_IN if region.name.startswith("io.in") else K_IO_OUT
        if kind == -1:
            raise ProgramError(f"region {region.name}: no PE program for kind {region.kind!r}")
        names = {K_GEMV: ("k", "n"), K_HEAD: ("k", "n"), K_NORM: ("i", "i"), K_RES: ("i", "i"),
                 K_EMBED: ("k", "position"), K_ATTN: ("position", "head_group")}.get(kind)  # fmt: skip
        axes = _axis_codes(region, names) if names else (0, 0)
        row = RegionRow(len(self.rows), region.name, kind, int(region.replica), region.layer, int(region.x),
                        int(region.y), int(region.w), int(region.h), axes, region=region)  # fmt: skip
        self.rows.append(row)
        for y in range(row.y, row.y + row.h):
            for x in range(row.x, row.x + row.w):
                if (x, y) in self.owner:
                    raise ProgramError(
                        f"regions {self.rows[self.owner[(x, y)]].name} and {row.name} overlap at PE ({x}, {y})"
                    )
                self.owner[(x, y)] = row.index
        return row

    def grid(self, row: RegionRow) -> tuple[np.ndarray, np.ndarray]:
        """Absolute (xs, ys) of the region's PEs, indexed like its tiling (memory_layout.pe_coords)."""
        ys, xs = pe_coords(row.region)
        return xs + row.x, ys + row.y


def build_program(plan: Any) -> Program:
    """Region rows, roles and routes for every replica of the plan, colors assigned."""
    b = _Builder(plan)
    for replica in range(plan.replicas):
        _build_replica(b, plan, replica)
    kw = max(r.x + r.w for r in b.rows)
    kh = max(r.y + r.h for r in b.rows)
    program = Program(kw, kh, plan.arch.name, b.rows, b.channels, b.roles, b.g_flags, b.g_before, b.g_own, b.g_after,
                      gathers=b.gathers)  # fmt: skip
    for ch in b.channels:
        xs, ys, _, _ = ch.arrays()
        if xs.size and (xs.min() < 0 or ys.min() < 0 or xs.max() >= kw or ys.max() >= kh):
            raise ProgramError(f"{ch.name}: the route leaves the {kw}x{kh} kernel rectangle")
        _check_unique(ch)
    _assign_colors(program)
    program.idle = _idle_rects(b.owner, kw, kh)
    program.request = plan_request(plan)
    return program


def plan_request(plan: Any) -> dict:
    """What `wafer.plan.build_plan` was asked for (it is deterministic, so this rebuilds the plan)."""
    c = plan.config
    return {
        "model": {"n_layer": c.n_layer, "n_head": c.n_head, "n_embd": c.n_embd, "vocab_size": c.vocab_size,
                  "n_positions": c.n_positions, "layer_norm_epsilon": c.layer_norm_epsilon, "name": c.name},
        "arch": plan.arch.name, "dtype": plan.dtype, "slots": plan.slots, "context": plan.context,
        "objective": plan.objective, "replicas": plan.replicas, "top_k": plan.top_k,
    }  # fmt: skip


def _check_unique(ch: Channel) -> None:
    seen: dict[tuple[int, int], tuple[int, int]] = {}
    for x, y, rx, tx in zip(ch.xs, ch.ys, ch.rx, ch.tx, strict=True):
        if (x, y) in seen and seen[(x, y)] != (rx, tx):
            raise ProgramError(f"{ch.name}: two settings for one router at PE ({x}, {y})")
        seen[(x, y)] = (rx, tx)


def _assign_colors(program: Program) -> None:
    """First fit, most constrained channel first: channels through the busiest routers pick first."""
    load = np.zeros((program.kernel_h, program.kernel_w), dtype=np.int32)
    cells = [ch.arrays()[:2] for ch in program.channels]
    for xs, ys in cells:
        np.add.at(load, (ys, xs), 1)
    pressure = [int(load[ys, xs].max()) if xs.size else 0 for xs, ys in cells]
    order = sorted(range(len(program.channels)), key=lambda k: (-pressure[k], -cells[k][0].size, k))
    used = np.zeros((program.kernel_h, program.kernel_w), dtype=np.int64)
    allowed = sum(1 << c for c in ROUTABLE)
    for k in order:
        ch = program.channels[k]
        xs, ys = cells[k]
        taken = int(np.bitwise_or.reduce(used[ys, xs])) if xs.size else 0
        free = allowed & ~taken
        if not free:
            worst = int(np.argmax(load[ys, xs]))
            raise ProgramError(
                f"{ch.name}: no free color: its routers already use all {len(ROUTABLE)} usable colors "
                f"(0-20 without memcpy's 14 and 15); PE ({xs[worst]}, {ys[worst]}) carries {load[ys[worst], xs[worst]]} routes"
            )
        ch.color = (free & -free).bit_length() - 1
        used[ys, xs] |= 1 << ch.color
    for ch in program.channels:
        for index, slot in ch.users:
            row = program.regions[index]
            if row.slots.get(slot, ch.color) != ch.color:
                raise ProgramError(f"region {row.name}: slot {slot!r} would need two colors ({ch.name})")
            row.slots[slot] = ch.color


def _idle_rects(owner: dict[tuple[int, int], int], kw: int, kh: int) -> list[tuple[int, int, int, int]]:
    taken = np.zeros((kh, kw), dtype=bool)
    for x, y in owner:
        taken[y, x] = True
    rects = []
    for y in range(kh):
        free = np.flatnonzero(~taken[y])
        if free.size == 0:
            continue
        brk = np.flatnonzero(np.diff(free) != 1)
        for s, e in zip(np.r_[0, brk + 1], np.r_[brk, free.size - 1], strict=True):
            rects.append((int(free[s]), y, int(free[e] - free[s] + 1), 1))
    merged: list[tuple[int, int, int, int]] = []
    open_: dict[tuple[int, int], int] = {}
    for x, y, w, _ in rects:
        key = (x, w)
        if key in open_ and merged[open_[key]][1] + merged[open_[key]][3] == y:
            mx, my, mw, mh = merged[open_[key]]
            merged[open_[key]] = (mx, my, mw, mh + 1)
        else:
            open_[key] = len(merged)
            merged.append((x, y, w, 1))
    return merged


# ----------------------------------------------------------------------------------------------------
# One replica


def _build_replica(b: _Builder, plan: Any, replica: int) -> None:
    regions = {r.name: r for r in plan.regions if r.replica == replica}
    needed = ["io.in", "io.out", "embed", "head", "ln_f"]
    needed += [f"L{i}.{op}" for i in range(plan.config.n_layer)
               for op in ("ln_1", "qkv", "attn", "attn_proj", "res_1", "ln_2", "fc", "proj", "res_2")]  # fmt: skip
    missing = [name for name in needed if name not in regions]
    if missing:
        raise ProgramError(f"replica {replica}: the plan has no region {missing[0]!r}")
    rows = {name: b.add_row(regions[name]) for name in needed}
    for row in rows.values():
        _fill_numbers(b, plan, row)

    _io_and_embedding(b, plan, rows)
    for i in range(plan.config.n_layer):
        L = {
            op: rows[f"L{i}.{op}"]
            for op in ("ln_1", "qkv", "attn", "attn_proj", "res_1", "ln_2", "fc", "proj", "res_2")
        }
        src = rows["embed"] if i == 0 else rows[f"L{i - 1}.res_2"]
        if i > 0:
            _strip_to_strip(b, src, L["ln_1"], f"L{i - 1}.res_2 -> L{i}.ln_1")
        _norm_to_gemv(b, L["ln_1"], L["qkv"])
        _bus(b, L["ln_1"], "rg", "rb", L["res_1"], "rin", f"L{i}.resid_1")
        _qkv_to_attention(b, L["qkv"], L["attn"])
        _reduction(b, L["attn"])
        _attention_to_gemv(b, L["attn"], L["attn_proj"])
        _gemv_to_strip(b, L["attn_proj"], L["res_1"])
        _strip_to_strip(b, L["res_1"], L["ln_2"], f"L{i}.res_1 -> ln_2")
        _bus(b, L["res_1"], "rg", "rb", L["res_2"], "rin", f"L{i}.resid_2")
        _norm_to_gemv(b, L["ln_2"], L["fc"])
        _gemv_to_gemv(b, L["fc"], L["proj"])
        _gemv_to_strip(b, L["proj"], L["res_2"])
        for op in ("ln_1", "ln_2", "qkv", "attn_proj", "fc", "proj"):
            _reduction(b, L[op])
    _strip_to_strip(b, rows[f"L{plan.config.n_layer - 1}.res_2"], rows["ln_f"], "final")
    _reduction(b, rows["ln_f"])
    _norm_to_gemv(b, rows["ln_f"], rows["head"])
    _reduction(b, rows["head"])
    _head_merge_and_scores(b, rows["head"], rows["io.out"])


def _fill_numbers(b: _Builder, plan: Any, row: RegionRow) -> None:
    t = row.region.tiling
    cfg = plan.config
    row.t.update(use_fp16=int(b.fp16), dim=cfg.n_embd, replica=row.replica)
    if row.kind in (K_GEMV, K_HEAD):
        g = t.gemv if isinstance(t, HeadTiling) else t
        if not isinstance(g, GemvTiling):
            raise ProgramError(f"region {row.name}: expected a GEMV tiling, found {type(t).__name__}")
        row.t.update(k=g.k, n=g.n, tile_k=g.tile_k, tile_n=g.tile_n, rows=g.rows, cols=g.cols,
                     root=reduction_root(g.reduction, g.rows), red_off=b.role_table(g.reduction, g.rows),
                     epilogue=int(row.name.endswith(".fc")))  # fmt: skip
        if isinstance(t, HeadTiling):
            if rounds(g.cols) > MAX_RX or rounds(g.rows) > MAX_RX:
                raise ProgramError(f"region {row.name}: a tree over more than 2^{MAX_RX} PEs")
            row.t.update(vocab=t.vocab, top_k=t.top_k, mroot=reduction_root(t.merge, g.cols),
                         mg_off=b.role_table(t.merge, g.cols))  # fmt: skip
        elif rounds(g.rows) > MAX_RX:
            raise ProgramError(f"region {row.name}: a tree over {g.rows} PEs needs more than {MAX_RX} rounds")
    elif row.kind == K_NORM:
        if not isinstance(t, NormTiling):
            raise ProgramError(f"region {row.name}: expected a NormTiling, found {type(t).__name__}")
        row.t.update(chunk=t.chunk, pes=t.pes, root=reduction_root(t.reduction, t.pes),
                     red_off=b.role_table(t.reduction, t.pes), drop=int(row.name == "ln_f"))  # fmt: skip
    elif row.kind == K_RES:
        ln = plan.layers[row.layer].ln_1
        row.t.update(chunk=ln.chunk, pes=ln.pes)
    elif row.kind == K_ATTN:
        if not isinstance(t, AttentionTiling):
            raise ProgramError(f"region {row.name}: expected an AttentionTiling, found {type(t).__name__}")
        hd = t.heads_per_pe * t.head_dim
        if hd % t.fold:
            raise ProgramError(
                f"region {row.name}: a group's {hd} values do not split into {t.fold} fold rows"
            )
        row.t.update(heads=t.n_head, head_dim=t.head_dim, slots=t.slots, hpp=t.heads_per_pe,
                     ppp=t.positions_per_pe, chain=t.chain, fold=t.fold, lc=ceil_div(t.chain, t.fold), st=hd // t.fold,
                     root=reduction_root(t.reduction, t.chain), red_off=b.role_table(t.reduction, t.chain))  # fmt: skip
    elif row.kind == K_EMBED:
        tile_k = ceil_div(cfg.n_embd, row.w)
        ppp = row.region.symbols["wpe"].elems // tile_k
        row.t.update(tile_k=tile_k, ppp=ppp, chunk=tile_k)
    elif row.kind == K_IO_OUT:
        row.t.update(rec_words=record_words(plan.top_k), top_k=plan.top_k)


# ---- lanes and buses ------------------------------------------------------------------------------


def _lanes(
    producers: list[tuple[int, int]], lines: list[list[tuple[int, int]]]
) -> list[list[tuple[int, int]]] | None:
    """Each producer's lane (itself, then its line in fabric order), or None if a lane would not be
    straight and start next to its producer."""
    paths = []
    for p, line in zip(producers, lines, strict=True):
        ordered = sorted(line, key=lambda c: abs(c[0] - p[0]) + abs(c[1] - p[1]))
        path = [p, *ordered]
        steps = {(bx - ax, by - ay) for (ax, ay), (bx, by) in zip(path, path[1:], strict=False)}
        if len(steps) != 1 or next(iter(steps)) not in STEP.values():
            return None
        paths.append(path)
    return paths


def _lane_channel(
    b: _Builder,
    name: str,
    src: RegionRow,
    src_slot: str,
    dst: RegionRow,
    dst_slot: str,
    paths: list[list[tuple[int, int]]],
) -> None:
    ch = b.channel(name, (src, src_slot), (dst, dst_slot))
    for path in paths:
        ch.add_path(path, take=set(range(1, len(path))))


def _strip_cells(b: _Builder, row: RegionRow) -> list[tuple[int, int]]:
    """A strip's PEs (LayerNorm / residual) in index order."""
    if row.kind not in (K_NORM, K_RES):
        raise ProgramError(f"region {row.name}: not a strip")
    xs, ys = b.grid(row)
    return list(zip(np.ravel(xs).tolist(), np.ravel(ys).tolist(), strict=True))


def _strip_to_strip(b: _Builder, src: RegionRow, dst: RegionRow, name: str) -> None:
    """Residual -> LayerNorm (same chunks): lanes when they touch, else a bus."""
    src_cells = _strip_cells(b, src) if src.kind != K_EMBED else None
    dst_cells = _strip_cells(b, dst)
    if src_cells is not None:
        paths = _lanes(src_cells, [[c] for c in dst_cells])
        if paths is not None:
            _lane_channel(b, name, src, "out", dst, "in", paths)
            src.t["out_gather"] = 0
            dst.t["in_mode"] = IN_LANE
            return
    _bus(b, src, "og", "out", dst, "in", name)


def _feed_k_lines(b: _Builder, src: RegionRow, cells: list[tuple[int, int]], gemv: RegionRow) -> None:
    """src's PE i (chunk i) -> every PE of the GEMV's K-line i: lanes when they line up, else a bus."""
    xs, ys = b.grid(gemv)
    lines = [list(zip(xs[r].tolist(), ys[r].tolist(), strict=True)) for r in range(gemv.tv("rows"))]
    name = f"{src.name} -> {gemv.name}"
    paths = _lanes(cells, lines) if len(cells) == len(lines) else None
    if paths is None:
        _bus(b, src, "og", "out", gemv, "in", name)
        return
    _lane_channel(b, name, src, "out", gemv, "in", paths)
    src.t["out_gather"] = 0
    gemv.t.update(in_mode=IN_LANE, in_len=gemv.tv("tile_k"))


def _norm_to_gemv(b: _Builder, ln: RegionRow, gemv: RegionRow) -> None:
    """LayerNorm chunk i -> the GEMV's K-line i."""
    if gemv.tv("tile_k") != ln.tv("chunk"):
        raise ProgramError(f"{ln.name} -> {gemv.name}: chunk {ln.tv('chunk')} != tile_k {gemv.tv('tile_k')}")
    _feed_k_lines(b, ln, _strip_cells(b, ln), gemv)


def _root_line(b: _Builder, gemv: RegionRow) -> list[tuple[int, int]]:
    """The PEs holding a GEMV's sums (the reduction root of every output column), in column order."""
    xs, ys = b.grid(gemv)
    root = gemv.tv("root")
    return list(zip(xs[root].tolist(), ys[root].tolist(), strict=True))


def _gemv_to_strip(b: _Builder, gemv: RegionRow, strip: RegionRow) -> None:
    """attn_proj / proj roots -> the residual strip next to them (column c -> chunk c)."""
    if gemv.tv("tile_n") != strip.tv("chunk"):
        raise ProgramError(
            f"{gemv.name} -> {strip.name}: tile_n {gemv.tv('tile_n')} != chunk {strip.tv('chunk')}"
        )
    roots = _root_line(b, gemv)
    paths = _lanes(roots, [[c] for c in _strip_cells(b, strip)])
    if paths is None:
        raise ProgramError(
            f"{gemv.name} -> {strip.name}: the GEMV's output column c does not sit next to the "
            f"strip's PE c (axes {gemv.region.axes} vs {strip.region.axes})"
        )
    _lane_channel(b, f"{gemv.name} -> {strip.name}", gemv, "out", strip, "in", paths)
    gemv.t["out_gather"] = 0


def _gemv_to_gemv(b: _Builder, fc: RegionRow, proj: RegionRow) -> None:
    """fc's roots (output column c) -> proj's K-line c: lanes when they line up, else a bus."""
    if fc.tv("tile_n") != proj.tv("tile_k"):
        raise ProgramError(
            f"{fc.name} -> {proj.name}: tile_n {fc.tv('tile_n')} != tile_k {proj.tv('tile_k')}"
        )
    fc.t["out_q16"] = fc.tv("tile_n") if b.fp16 else 0
    _feed_k_lines(b, fc, _root_line(b, fc), proj)


def _centre(cells: set[tuple[int, int]]) -> tuple[float, float]:
    return (sum(x for x, _ in cells) / len(cells), sum(y for _, y in cells) / len(cells))


def _gather(
    b: _Builder,
    src: RegionRow,
    prefix: str,
    exit_slot: str,
    cells: list[tuple[int, int]],
    tile: int,
    total: int,
    towards: list[tuple[float, float]],
    group: int | None = None,
) -> list[tuple[int, int]]:
    """Gather the chunks of `cells` (chunk order) into streams of `group` chunks ([header | values] in
    chunk order), group k leaving at the end nearer `towards[k]`. Fills the gather tables; returns the
    exit PE of every group."""
    group = group or len(cells)
    off = len(b.g_flags)
    b.gathers.append((src.index, prefix, off, len(cells), group))
    src.t[f"{prefix}_off"] = off
    b.g_flags.extend([0] * len(cells))
    b.g_before.extend([0] * len(cells))
    b.g_own.extend([0] * len(cells))
    b.g_after.extend([0] * len(cells))
    links = [b.channel(f"{src.name} gather ({prefix}0)", (src, f"{prefix}0")),
             b.channel(f"{src.name} gather ({prefix}1)", (src, f"{prefix}1"))]  # fmt: skip
    exits = []
    for k, g0 in enumerate(range(0, len(cells), group)):
        members = list(range(g0, min(g0 + group, len(cells))))
        first, last = cells[members[0]], cells[members[-1]]
        point = towards[k]
        dist = lambda c: abs(c[0] - point[0]) + abs(c[1] - point[1])  # noqa: E731,B023
        append = dist(last) <= dist(first)
        order = members if append else members[::-1]  # chain order: first sender ... exit
        for pos, q in enumerate(order):
            local = q - g0
            before = min(local * tile, total)
            own = max(0, min(total - local * tile, tile))
            after = total - min((local + 1) * tile, total)
            flags = 0
            exit_ = pos == len(order) - 1
            if (append and pos == 0) or (not append and exit_):
                flags |= G_HDR
            if pos > 0:
                flags |= G_HAS_RX | (G_RX_ODD if (pos - 1) % 2 else 0)
            if exit_:
                flags |= G_EXIT
            elif pos % 2:
                flags |= G_TX_ODD
            b.g_flags[off + q] = flags
            b.g_own[off + q] = own
            b.g_before[off + q] = (HDR + before) if (append and pos > 0) else 0
            b.g_after[off + q] = after if (not append and pos > 0) else 0
            if not exit_:
                links[pos % 2].add_path([cells[order[pos]], cells[order[pos + 1]]])
        exits.append(cells[order[-1]])
    src.t["has_rg" if prefix == "rg" else "out_gather"] = 1
    return exits


def _path_to(
    b: _Builder, start: tuple[int, int], block: set[tuple[int, int]], avoid: set[tuple[int, int]]
) -> list[tuple[int, int]]:
    """A path from `start` to the nearest PE of `block` (x first, or y first: whichever crosses fewer
    PEs of other regions), staying out of `block` and `avoid` until its last step."""
    target = min(block, key=lambda c: (abs(c[0] - start[0]) + abs(c[1] - start[1]), c[1], c[0]))
    best = None
    for first in ("x", "y"):
        path = [start]
        x, y = start
        legs = ("x", "y") if first == "x" else ("y", "x")
        for leg in legs:
            while (x if leg == "x" else y) != (target[0] if leg == "x" else target[1]):
                if leg == "x":
                    x += 1 if target[0] > x else -1
                else:
                    y += 1 if target[1] > y else -1
                path.append((x, y))
        inner = path[1:-1]
        if any(c in block or c in avoid for c in inner):
            continue
        crossed = sum(1 for c in inner if c in b.owner)
        if best is None or crossed < best[0]:
            best = (crossed, path)
    if best is None:
        raise ProgramError(f"no straight-legged route from PE {start} to PE {target}")
    return best[1]


def _multicast(ch: Channel, path: list[tuple[int, int]], block: set[tuple[int, int]]) -> None:
    """`path` from the sending PE (its first cell) to the block's entry PE (its last), then a tree over
    the block: along the entry's column both ways, and from there along every row both ways. Every
    block PE keeps a copy; the routers on the way only pass the wavelets on."""
    if len(path) < 2:
        raise ProgramError(f"{ch.name}: the sender lies inside the region it multicasts to")
    xs = sorted({x for x, _ in block})
    ys = sorted({y for _, y in block})
    if len(block) != len(xs) * len(ys) or xs[-1] - xs[0] + 1 != len(xs) or ys[-1] - ys[0] + 1 != len(ys):
        raise ProgramError(f"{ch.name}: the multicast target is not a rectangle")
    x0, x1, y0, y1 = xs[0], xs[-1], ys[0], ys[-1]
    ex, ey = path[-1]
    for i, (x, y) in enumerate(path[:-1]):
        rx = RAMP if i == 0 else OPPOSITE[_direction(path[i - 1], (x, y))]
        ch.add(x, y, rx, _direction((x, y), path[i + 1]))
    for y in range(y0, y1 + 1):
        if y == ey:
            rx = OPPOSITE[_direction(path[-2], path[-1])]
            vertical = (NORTH if y > y0 else 0) | (SOUTH if y < y1 else 0)
        elif y < ey:
            rx, vertical = SOUTH, (NORTH if y > y0 else 0)
        else:
            rx, vertical = NORTH, (SOUTH if y < y1 else 0)
        ch.add(ex, y, rx, RAMP | vertical | (EAST if ex < x1 else 0) | (WEST if ex > x0 else 0))
        for x in range(ex + 1, x1 + 1):
            ch.add(x, y, WEST, RAMP | (EAST if x < x1 else 0))
        for x in range(ex - 1, x0 - 1, -1):
            ch.add(x, y, EAST, RAMP | (WEST if x > x0 else 0))


def _bus(
    b: _Builder, src: RegionRow, prefix: str, exit_slot: str, dst: RegionRow, dst_slot: str, name: str
) -> None:
    """src's chunks gathered along its line, routed to dst and multicast over it."""
    if src.kind in (K_NORM, K_RES):
        cells, tile = _strip_cells(b, src), src.tv("chunk")
        total = src.tv("dim")
    elif src.kind == K_EMBED:
        cells, tile, total = _embed_end_row(b, src), src.tv("tile_k"), src.tv("dim")
    elif src.kind == K_GEMV:
        cells, tile, total = _root_line(b, src), src.tv("tile_n"), src.tv("n")
    else:
        raise ProgramError(f"{name}: no bus from a {KINDS[src.kind]} region")
    xs, ys = b.grid(dst)
    block = set(zip(np.ravel(xs).tolist(), np.ravel(ys).tolist(), strict=True))
    (exit_pe,) = _gather(b, src, prefix, exit_slot, cells, tile, total, [_centre(block)])
    path = _path_to(b, exit_pe, block, set(cells))
    ch = b.channel(name, (src, exit_slot), (dst, dst_slot))
    _multicast(ch, path, block)
    if dst.kind in (K_GEMV, K_NORM):
        dst.t.update(in_mode=IN_BUS, in_len=total)


def _embed_end_row(b: _Builder, embed: RegionRow) -> list[tuple[int, int]]:
    """The embed PEs where the embedding chains end (the row farthest from the head), in K order."""
    ch_y0, ch_len = embed.tv("ch_y0"), embed.tv("ch_len")
    end_y = ch_y0 + (ch_len - 1) * (1 if embed.y > ch_y0 else -1)
    xs, ys = b.grid(embed)  # [position rows, k]
    (row,) = [r for r in range(ys.shape[0]) if int(ys[r, 0]) == end_y]
    return list(zip(xs[row].tolist(), ys[row].tolist(), strict=True))


# ---- the input port, the embedding chains, the head ----------------------------------------------


def _io_and_embedding(b: _Builder, plan: Any, rows: dict[str, RegionRow]) -> None:
    io_in, embed, head = rows["io.in"], rows["embed"], rows["head"]
    if embed.x != head.x or embed.w != head.w:
        raise ProgramError("embed and head must span the same columns (the embedding chains run up them)")
    ex, ey = b.grid(embed)  # [positions, k]
    hx, hy = b.grid(head)  # [k, n]
    for i in range(embed.w):
        if set(ex[:, i].tolist()) != set(hx[i].tolist()) or len(set(ex[:, i].tolist())) != 1:
            raise ProgramError(f"embed chunk {i} and head K-line {i} are not in one column of PEs")
    # Chains run along y, from the head's row farthest from the embed region to the embed's far row.
    up = embed.y < head.y
    ch_y0 = head.y + head.h - 1 if up else head.y
    ch_len = head.h + embed.h
    for row in (embed, head):
        row.t.update(ch_y0=ch_y0, ch_len=ch_len)
    d = NORTH if up else SOUTH
    links = [b.channel("embedding chain (ech0)", (embed, "ech0"), (head, "ech0")),
             b.channel("embedding chain (ech1)", (embed, "ech1"), (head, "ech1"))]  # fmt: skip
    dy = -1 if up else 1
    for x in range(embed.x, embed.x + embed.w):
        for pos in range(ch_len - 1):
            y = ch_y0 + pos * dy
            links[pos % 2].add(x, y, RAMP, d)
            links[pos % 2].add(x, y + dy, OPPOSITE[d], RAMP)
    # Requests: from the input port down (or up) the first column of embed + head, then along rows.
    block = {(x, y) for x in range(embed.x, embed.x + embed.w) for y in range(min(embed.y, head.y),
             max(embed.y + embed.h, head.y + head.h))}  # fmt: skip
    port = (io_in.x, io_in.y)
    path = _path_to(b, port, block, set())
    ch = b.channel("requests", (io_in, "req"), (embed, "req"), (head, "req"))
    _multicast(ch, path, block)
    # Embedding -> layer 0's ln_1.
    _bus(b, embed, "og", "out", rows["L0.ln_1"], "in", "embed.out")


def _head_merge_and_scores(b: _Builder, head: RegionRow, io_out: RegionRow) -> None:
    roots = _root_line(b, head)  # K-roots in column order
    _line_reduction(b, head, [roots], "mg", head.region.tiling.merge)
    root = roots[head.tv("mroot")]
    path = _path_to(b, root, {(io_out.x, io_out.y)}, set())
    ch = b.channel("scores", (head, "out"), (io_out, "in"))
    ch.add_path(path)


# ---- attention ------------------------------------------------------------------------------------


def _snake_cells(b: _Builder, attn: RegionRow) -> list[list[tuple[int, int]]]:
    xs, ys = b.grid(attn)  # [groups, chain]
    return [list(zip(xs[g].tolist(), ys[g].tolist(), strict=True)) for g in range(xs.shape[0])]


def _qkv_to_attention(b: _Builder, qkv: RegionRow, attn: RegionRow) -> None:
    """qkv's roots of each head group's fold rows gather [q | k | v] slices into one stream per group,
    which is multicast over the group's block of the attention region."""
    t: AttentionTiling = attn.region.tiling
    g: GemvTiling = qkv.region.tiling
    fold, hd = t.fold, t.heads_per_pe * t.head_dim
    if g.n_split != 3 or g.segment_tile * fold != hd or g.cols != t.head_groups * fold:
        raise ProgramError(
            f"{qkv.name} -> {attn.name}: qkv's output columns do not map onto head groups "
            f"x fold rows ({g.cols} columns of {g.segment_tile}; {t.head_groups} groups x {fold})"
        )
    qkv.t["out_q16"] = g.segment_tile if b.fp16 else 0
    roots = _root_line(b, qkv)
    blocks = [set(cells) for cells in _snake_cells(b, attn)]
    centres = [_centre(block) for block in blocks]
    exits = _gather(b, qkv, "og", "out", roots, g.tile_n, fold * g.tile_n, centres, group=fold)
    ch = b.channel(f"{qkv.name} -> {attn.name}", (qkv, "out"), (attn, "in"))
    for exit_pe, block in zip(exits, blocks, strict=True):
        _multicast(ch, _path_to(b, exit_pe, block, set(roots)), block)


def _attention_to_gemv(b: _Builder, attn: RegionRow, gemv: RegionRow) -> None:
    """Each group's merge root -> the attn_proj K-lines of that group's values (a multicast)."""
    t: AttentionTiling = attn.region.tiling
    g: GemvTiling = gemv.region.tiling
    hd = t.heads_per_pe * t.head_dim
    if hd % g.tile_k:
        raise ProgramError(
            f"{attn.name} -> {gemv.name}: a group's {hd} values are not whole tiles of {g.tile_k}"
        )
    xs, ys = b.grid(gemv)
    per_group = hd // g.tile_k
    ch = b.channel(f"{attn.name} -> {gemv.name}", (attn, "out"), (gemv, "in"))
    gemv.t.update(in_mode=IN_GROUP, in_len=hd)
    for grp, cells in enumerate(_snake_cells(b, attn)):
        root = cells[attn.tv("root")]
        lines = range(grp * per_group, min((grp + 1) * per_group, g.rows))
        block = {(int(xs[r, c]), int(ys[r, c])) for r in lines for c in range(g.cols)}
        path = _path_to(b, root, block, set())
        _multicast(ch, path, block)


# ---- reductions -----------------------------------------------------------------------------------


def _reduction(b: _Builder, row: RegionRow) -> None:
    t = row.region.tiling
    if row.kind in (K_GEMV, K_HEAD):
        g = t.gemv if isinstance(t, HeadTiling) else t
        xs, ys = b.grid(row)  # [rows, cols]
        lines = [list(zip(xs[:, c].tolist(), ys[:, c].tolist(), strict=True)) for c in range(g.cols)]
        _line_reduction(b, row, lines, "red", g.reduction)
    elif row.kind == K_NORM:
        cells = _strip_cells(b, row)
        _line_reduction(b, row, [cells], "red", t.reduction)
        if len(cells) > 1:  # the root multicasts the statistics back along the strip
            ch = b.channel(f"{row.name} statistics", (row, "bc"))
            order = cells if row.tv("root") == 0 else cells[::-1]  # the root is an end of the strip
            ch.add_path(order, take=set(range(1, len(order))))
    elif row.kind == K_ATTN:
        _line_reduction(b, row, _snake_cells(b, row), "red", t.reduction)


def _line_reduction(
    b: _Builder, row: RegionRow, lines: list[list[tuple[int, int]]], prefix: str, kind: str
) -> None:
    """Routes of a chain or tree reduction along every line (cells in index order)."""
    n = len(lines[0])
    if n <= 1:
        return
    if kind == "chain":
        links = [b.channel(f"{row.name} {prefix} chain ({prefix}{j})", (row, f"{prefix}{j}")) for j in (0, 1)]
        for cells in lines:
            for i in range(n - 1):
                links[i % 2].add_path([cells[i], cells[i + 1]])
        return
    for j in range(rounds(n)):
        s = 1 << j
        ch = b.channel(f"{row.name} {prefix} tree round {j}", (row, f"{prefix}{j}"))
        for cells in lines:
            for p in range(0, n - s, 2 * s):
                ch.add_path(cells[p : p + s + 1][::-1])  # from index p + s down to p


# ----------------------------------------------------------------------------------------------------
# The PE params layout.csl computes (mirrored here for the contract lint)


def pe_params(program: Program, row: RegionRow, lx: int, ly: int) -> dict[str, Any]:
    """The params layout.csl gives the PE at (lx, ly) of the region (colors as ids, NONE-free)."""
    tv = row.tv

    def color(slot: str) -> int:
        return row.slots.get(slot, 0)

    def reduction(off_name: str, idx: int, prefix: str) -> dict[str, Any]:
        rx_slots, tx_slot, stream = decode_role(program.roles[tv(off_name) + idx])
        colors = [color(f"{prefix}{j}") for j in rx_slots] + [0] * (MAX_RX - len(rx_slots))
        return {"n_rx": len(rx_slots), "rx": colors, "has_tx": tx_slot is not None,
                "tx": color(f"{prefix}{tx_slot}") if tx_slot is not None else 0, "stream": stream}  # fmt: skip

    def gather(
        off_name: str, q: int, prefix: str, exit_slot: str, lane_own: int, active: bool
    ) -> dict[str, Any]:
        if not active:
            return {
                "tx": color(exit_slot),
                "rx": 0,
                "has_rx": False,
                "hdr": True,
                "before": 0,
                "own": lane_own,
                "after": 0,
            }
        k = tv(off_name) + q
        flags = program.g_flags[k]
        tx = color(exit_slot) if flags & G_EXIT else color(f"{prefix}{1 if flags & G_TX_ODD else 0}")
        return {"tx": tx, "rx": color(f"{prefix}{1 if flags & G_RX_ODD else 0}") if flags & G_HAS_RX else 0,
                "has_rx": bool(flags & G_HAS_RX), "hdr": bool(flags & G_HDR), "before": program.g_before[k],
                "own": program.g_own[k], "after": program.g_after[k]}  # fmt: skip

    def window(idx: int, tile: int, total: int) -> tuple[int, int, int]:
        mode = tv("in_mode")
        if mode == IN_LANE:
            return tile, 0, tile
        if mode == IN_GROUP:
            return total, (idx * tile) % total, tile
        lo = min(idx * tile, total)
        return total, lo, min(tile, total - lo)

    p: dict[str, Any] = {}
    if row.kind == K_GEMV:
        r = along(row.axes[0], lx, ly, row.w, row.h)
        c = along(row.axes[1], lx, ly, row.w, row.h)
        in_len, in_lo, in_take = window(r, tv("tile_k"), tv("in_len"))
        is_root = r == tv("root")
        red = reduction("red_off", r, "red")
        out = gather("og_off", c, "og", "out", tv("tile_n"), bool(tv("out_gather")))
        p.update(k_total=tv("k"), n_total=tv("n"), tile_k=tv("tile_k"), tile_n=tv("tile_n"), r=r, c=c,
                 use_fp16=tv("use_fp16"), epilogue=tv("epilogue"), in_color=color("in"), in_len=in_len, in_lo=in_lo,
                 in_take=in_take, red_n_rx=red["n_rx"], red_rx=red["rx"], red_has_tx=red["has_tx"], red_tx=red["tx"],
                 red_stream=red["stream"], is_root=is_root, out_tx=out["tx"], out_rx=out["rx"],
                 out_has_rx=out["has_rx"] and is_root, out_hdr=out["hdr"], out_before=out["before"],
                 out_own=out["own"], out_after=out["after"], out_q16=tv("out_q16"))  # fmt: skip
    elif row.kind == K_NORM:
        i = along(row.axes[0], lx, ly, row.w, row.h)
        chunk, dim = tv("chunk"), tv("dim")
        own = max(0, min(chunk, dim - i * chunk))
        in_len, in_lo, in_take = window(i, chunk, dim)
        is_root = i == tv("root")
        red = reduction("red_off", i, "red")
        out = gather("og_off", i, "og", "out", chunk, bool(tv("out_gather")))
        rs = gather("rg_off", i, "rg", "rb", chunk, bool(tv("has_rg")))
        multi = tv("pes") > 1
        p.update(dim=dim, chunk=chunk, i=i, own=own, use_fp16=tv("use_fp16"), drop_unscored=tv("drop"), is_root=is_root,
                 in_color=color("in"), in_len=in_len, in_lo=in_lo, in_take=in_take,
                 red_n_rx=red["n_rx"], red_rx=red["rx"], red_has_tx=red["has_tx"], red_tx=red["tx"],
                 red_stream=red["stream"], bc_color=color("bc"), bc_rx=multi and not is_root, bc_tx=multi and is_root,
                 out_tx=out["tx"], out_rx=out["rx"], out_has_rx=out["has_rx"], out_hdr=out["hdr"],
                 out_before=out["before"], out_own=out["own"], out_after=out["after"], has_resid=bool(tv("has_rg")),
                 rs_tx=rs["tx"], rs_rx=rs["rx"], rs_has_rx=rs["has_rx"] and bool(tv("has_rg")), rs_hdr=rs["hdr"],
                 rs_before=rs["before"], rs_own=rs["own"] if tv("has_rg") else 0, rs_after=rs["after"])  # fmt: skip
    elif row.kind == K_RES:
        i = along(row.axes[0], lx, ly, row.w, row.h)
        chunk, dim = tv("chunk"), tv("dim")
        own = max(0, min(chunk, dim - i * chunk))
        out = gather("og_off", i, "og", "out", chunk, bool(tv("out_gather")))
        rs = gather("rg_off", i, "rg", "rb", chunk, bool(tv("has_rg")))
        p.update(dim=dim, chunk=chunk, i=i, own=own, in_color=color("in"), rin_color=color("rin"),
                 rin_lo=min(i * chunk, dim), rin_take=own, out_tx=out["tx"], out_rx=out["rx"], out_has_rx=out["has_rx"],
                 out_hdr=out["hdr"], out_before=out["before"], out_own=out["own"], out_after=out["after"],
                 has_rout=bool(tv("has_rg")), rs_tx=rs["tx"], rs_rx=rs["rx"], rs_has_rx=rs["has_rx"] and bool(tv("has_rg")),
                 rs_hdr=rs["hdr"], rs_before=rs["before"], rs_own=rs["own"] if tv("has_rg") else 0, rs_after=rs["after"])  # fmt: skip
    elif row.kind == K_ATTN:
        g, pidx = snake_index(row, lx, ly)
        red = reduction("red_off", pidx, "red")
        p.update(n_head=tv("heads"), head_dim=tv("head_dim"), slots=tv("slots"), hpp=tv("hpp"), ppp=tv("ppp"),
                 fold=tv("fold"), st=tv("st"), p=pidx, g=g, use_fp16=tv("use_fp16"), replica=tv("replica"),
                 is_root=pidx == tv("root"), in_color=color("in"), red_n_rx=red["n_rx"], red_rx=red["rx"],
                 red_has_tx=red["has_tx"], red_tx=red["tx"], out_tx=color("out"))  # fmt: skip
    elif row.kind == K_EMBED:
        i = along(row.axes[0], lx, ly, row.w, row.h)
        e = along(row.axes[1], lx, ly, row.w, row.h)
        tile_k, dim = tv("tile_k"), tv("dim")
        pos = abs(row.y + ly - tv("ch_y0"))
        last = pos == tv("ch_len") - 1
        out = gather("og_off", i, "og", "out", tile_k, True)
        p.update(dim=dim, tile_k=tile_k, own_k=max(0, min(tile_k, dim - i * tile_k)), ppp=tv("ppp"), e=e,
                 use_fp16=tv("use_fp16"), req_color=color("req"), ch_rx=color(f"ech{(pos - 1) % 2}"),
                 ch_tx=color(f"ech{pos % 2}") if not last else 0, ch_last=last, out_tx=out["tx"] if last else 0,
                 out_rx=out["rx"] if last else 0, out_has_rx=out["has_rx"] and last, out_hdr=out["hdr"],
                 out_before=out["before"], out_own=out["own"], out_after=out["after"])  # fmt: skip
    elif row.kind == K_HEAD:
        r = along(row.axes[0], lx, ly, row.w, row.h)
        c = along(row.axes[1], lx, ly, row.w, row.h)
        tile_k, tile_n = tv("tile_k"), tv("tile_n")
        pos = abs(row.y + ly - tv("ch_y0"))
        red = reduction("red_off", r, "red")
        k_root = r == tv("root")
        mg = reduction("mg_off", c, "mg")
        p.update(dim=tv("dim"), vocab=tv("vocab"), tile_k=tile_k, tile_n=tile_n, r=r, c=c,
                 own_k=max(0, min(tile_k, tv("dim") - r * tile_k)), own_n=max(0, min(tile_n, tv("vocab") - c * tile_n)),
                 top_k=tv("top_k"), use_fp16=tv("use_fp16"), req_color=color("req"), ch_first=pos == 0,
                 ch_rx=color(f"ech{(pos - 1) % 2}") if pos > 0 else 0, ch_tx=color(f"ech{pos % 2}"),
                 in_color=color("in"), red_n_rx=red["n_rx"], red_rx=red["rx"], red_has_tx=red["has_tx"],
                 red_tx=red["tx"], red_stream=red["stream"], k_root=k_root, mg_n_rx=mg["n_rx"] if k_root else 0,
                 mg_rx=mg["rx"], mg_has_tx=k_root and mg["has_tx"], mg_tx=mg["tx"] if k_root else 0,
                 m_root=k_root and c == tv("mroot"),
                 out_tx=color("out"))  # fmt: skip
    elif row.kind == K_IO_IN:
        p.update(req_color=color("req"))
    elif row.kind == K_IO_OUT:
        p.update(in_color=color("in"), record_words=tv("rec_words"))
    return p


def pe_routes(p: dict[str, Any], kind: int) -> tuple[set[int], set[int]]:
    """(colors the PE program receives on, colors it sends on) according to its params: what the
    routes through its router must hand down (tx RAMP) and take up (rx RAMP)."""
    rx, tx = set(), set()

    def red(prefix: str, has: bool = True) -> None:
        if not has:
            return
        rx.update(p[f"{prefix}_rx"][: p[f"{prefix}_n_rx"]])
        if p[f"{prefix}_has_tx"]:
            tx.add(p[f"{prefix}_tx"])

    def out(prefix: str, active: bool) -> None:
        if not active:
            return
        tx.add(p[f"{prefix}_tx"])
        if p[f"{prefix}_has_rx"]:
            rx.add(p[f"{prefix}_rx"])

    if kind == K_GEMV:
        rx.add(p["in_color"])
        red("red")
        out("out", p["is_root"])
    elif kind == K_NORM:
        rx.add(p["in_color"])
        red("red")
        if p["bc_rx"]:
            rx.add(p["bc_color"])
        if p["bc_tx"]:
            tx.add(p["bc_color"])
        out("out", True)
        out("rs", p["has_resid"])
    elif kind == K_RES:
        rx.update({p["in_color"], p["rin_color"]})
        out("out", True)
        out("rs", p["has_rout"])
    elif kind == K_ATTN:
        rx.add(p["in_color"])
        red("red")
        if p["is_root"]:
            tx.add(p["out_tx"])
    elif kind == K_EMBED:
        rx.update({p["req_color"], p["ch_rx"]})
        if p["ch_last"]:
            out("out", True)
        else:
            tx.add(p["ch_tx"])
    elif kind == K_HEAD:
        rx.update({p["req_color"], p["in_color"]})
        if not p["ch_first"]:
            rx.add(p["ch_rx"])
        tx.add(p["ch_tx"])
        red("red")
        red("mg", p["k_root"])
        if p["m_root"]:
            tx.add(p["out_tx"])
    elif kind == K_IO_IN:
        tx.add(p["req_color"])
    elif kind == K_IO_OUT:
        rx.add(p["in_color"])
    return rx, tx


# ----------------------------------------------------------------------------------------------------
# plan_params.csl


def plan_params_csl(program: Program) -> str:
    """The `plan_params.csl` module layout.csl imports: codes, region rows, roles, routes."""
    rows = program.regions
    rects = program.rects()

    def array(name: str, values: list[int], ty: str = "u16") -> str:
        body = ", ".join(str(int(v)) for v in values) if values else "0"
        return f"const {name} = [{max(len(values), 1)}]{ty}{{ {body} }};"

    lines = [
        "// plan_params.csl: generated by wafer/compile.py from the plan (kernels/program.py). Do not edit.",
        f"// plan request: {json.dumps(program.request, sort_keys=True)}",
        f"const NONE: u16 = {NONE};",
        *(f"const K_{k.upper()}: u16 = {i};" for i, k in enumerate(KINDS)),
        f"const NT: u16 = {len(T_FIELDS)};",
        *(f"const T_{name.upper()}: u16 = {i};" for i, name in enumerate(T_FIELDS)),
        f"const NS: u16 = {len(SLOTS)};",
        *(f"const S_{name.upper()}: u16 = {i};" for i, name in enumerate(SLOTS)),
        f"const IN_LANE: u16 = {IN_LANE};",
        f"const IN_GROUP: u16 = {IN_GROUP};",
        f"const IN_BUS: u16 = {IN_BUS};",
        f"const n_regions: u16 = {len(rows)};",
        array("kind", [r.kind for r in rows]),
        array("x", [r.x for r in rows]),
        array("y", [r.y for r in rows]),
        array("w", [r.w for r in rows]),
        array("h", [r.h for r in rows]),
        array("axis0", [r.axes[0] for r in rows]),
        array("axis1", [r.axes[1] for r in rows]),
        array("t", [r.tv(name) for r in rows for name in T_FIELDS]),
        array("slot_color", [r.slots.get(s, NONE) for r in rows for s in SLOTS]),
        array("roles", program.roles),
        array("g_flags", program.g_flags),
        array("g_before", program.g_before),
        array("g_own", program.g_own),
        array("g_after", program.g_after),
        f"const n_rects: u32 = {len(rects)};",
        array("rect_color", [r.color for r in rects]),
        array("rect_x", [r.x for r in rects]),
        array("rect_y", [r.y for r in rects]),
        array("rect_w", [r.w for r in rects]),
        array("rect_h", [r.h for r in rects]),
        array("rect_rx", [r.rx for r in rects]),
        array("rect_tx", [r.tx for r in rects]),
        f"const n_idle: u16 = {len(program.idle)};",
        array("idle_x", [r[0] for r in program.idle]),
        array("idle_y", [r[1] for r in program.idle]),
        array("idle_w", [r[2] for r in program.idle]),
        array("idle_h", [r[3] for r in program.idle]),
    ]
    return "\n".join(lines) + "\n"


__all__ = [
    "HDR", "ITEM_WORDS", "HEADER_WORDS", "MEMCPY_D2H", "MEMCPY_H2D", "MEMCPY_RESERVED", "Program", "ProgramError",
    "build_program", "pe_params", "pe_routes", "plan_params_csl",
]  # fmt: skip
