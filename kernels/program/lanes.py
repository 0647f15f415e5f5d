"""Lanes: every producer PE sits next to the line of consumer PEs that needs its chunk.

LayerNorm -> the K-lines of a GEMV, a GEMV's roots -> the next strip or GEMV, residual -> LayerNorm:
one straight lane each, all lanes on one color, every PE on a lane keeps a copy. Where the lanes do
not line up the hand-off falls back to a bus (`bus`), except GEMV -> residual strip, which must.
"""

from __future__ import annotations

from kernels.program.builder import _Builder
from kernels.program.bus import _bus
from kernels.program.cells import _root_line, _strip_cells
from kernels.program.codes import IN_LANE, K_EMBED, STEP, ProgramError
from kernels.program.tables import RegionRow


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
