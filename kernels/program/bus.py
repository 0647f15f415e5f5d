"""Buses: the producers' chunks gathered along their line into one stream, routed to the consumer
region and multicast over it.

A stream is [header | values] in index order; every consumer PE keeps its window. The planner's long
hand-offs are buses (the residual stream, the turn between bands of layers, embedding -> layer 0, last
layer -> ln_f), and so is any hand-off whose lanes do not line up (`lanes`).
"""

from __future__ import annotations

import numpy as np

from kernels.program.builder import _Builder
from kernels.program.cells import _embed_end_row, _root_line, _strip_cells
from kernels.program.codes import (
    EAST,
    G_EXIT,
    G_HAS_RX,
    G_HDR,
    G_RX_ODD,
    G_TX_ODD,
    HDR,
    IN_BUS,
    K_EMBED,
    K_GEMV,
    K_NORM,
    K_RES,
    KINDS,
    NORTH,
    OPPOSITE,
    RAMP,
    SOUTH,
    WEST,
    ProgramError,
)
from kernels.program.tables import Channel, RegionRow, _direction


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
