"""Reduction routes along a region's lines (`wafer.tiling`): a chain on two alternating colors, a tree
on one color per round so rounds in flight never share a link; LayerNorm's root multicasts the
statistics back along its strip. Who receives and sends on which is in `roles`.
"""

from __future__ import annotations

from kernels.program.builder import _Builder
from kernels.program.cells import _snake_cells, _strip_cells
from kernels.program.codes import K_ATTN, K_GEMV, K_HEAD, K_NORM
from kernels.program.roles import rounds
from kernels.program.tables import RegionRow
from wafer.tiling import HeadTiling


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
