"""The input port, the embedding chains and the head's output: io.in's requests multicast over embed +
head, one chain per column from the head's far row to the embed's far row (on two alternating colors),
the embedding's bus to layer 0, and the head's merge across its columns with the scores sent to io.out.
"""

from __future__ import annotations

from typing import Any

from kernels.program.builder import _Builder
from kernels.program.bus import _bus, _multicast, _path_to
from kernels.program.cells import _root_line
from kernels.program.codes import NORTH, OPPOSITE, RAMP, SOUTH, ProgramError
from kernels.program.reductions import _line_reduction
from kernels.program.tables import RegionRow


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
