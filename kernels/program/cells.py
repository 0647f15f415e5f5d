"""Which PEs of a region take part in a hand-off, in index order: a strip's PEs, a GEMV's root line,
the embed row where the embedding chains end, an attention region's snakes (one per head group).
"""

from __future__ import annotations

import numpy as np

from kernels.program.builder import _Builder
from kernels.program.codes import K_NORM, K_RES, ProgramError
from kernels.program.tables import RegionRow


def _strip_cells(b: _Builder, row: RegionRow) -> list[tuple[int, int]]:
    """A strip's PEs (LayerNorm / residual) in index order."""
    if row.kind not in (K_NORM, K_RES):
        raise ProgramError(f"region {row.name}: not a strip")
    xs, ys = b.grid(row)
    return list(zip(np.ravel(xs).tolist(), np.ravel(ys).tolist(), strict=True))


def _root_line(b: _Builder, gemv: RegionRow) -> list[tuple[int, int]]:
    """The PEs holding a GEMV's sums (the reduction root of every output column), in column order."""
    xs, ys = b.grid(gemv)
    root = gemv.tv("root")
    return list(zip(xs[root].tolist(), ys[root].tolist(), strict=True))


def _embed_end_row(b: _Builder, embed: RegionRow) -> list[tuple[int, int]]:
    """The embed PEs where the embedding chains end (the row farthest from the head), in K order."""
    ch_y0, ch_len = embed.tv("ch_y0"), embed.tv("ch_len")
    end_y = ch_y0 + (ch_len - 1) * (1 if embed.y > ch_y0 else -1)
    xs, ys = b.grid(embed)  # [position rows, k]
    (row,) = [r for r in range(ys.shape[0]) if int(ys[r, 0]) == end_y]
    return list(zip(xs[row].tolist(), ys[row].tolist(), strict=True))


def _snake_cells(b: _Builder, attn: RegionRow) -> list[list[tuple[int, int]]]:
    xs, ys = b.grid(attn)  # [groups, chain]
    return [list(zip(xs[g].tolist(), ys[g].tolist(), strict=True)) for g in range(xs.shape[0])]
