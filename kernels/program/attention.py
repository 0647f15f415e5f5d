"""Attention's hand-offs: qkv's [q | k | v] slices into each head group's block, each group's merge
root into the attn_proj K-lines of its values.
"""

from __future__ import annotations

from kernels.program.builder import _Builder
from kernels.program.bus import _centre, _gather, _multicast, _path_to
from kernels.program.cells import _root_line, _snake_cells
from kernels.program.codes import IN_GROUP, ProgramError
from kernels.program.tables import RegionRow
from wafer.tiling import AttentionTiling, GemvTiling


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
