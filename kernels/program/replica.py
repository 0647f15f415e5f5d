"""One replica: its region rows, their numbers (the `t` table), then every hand-off in pipeline order.

The numbers come from the regions' tilings (`wafer.tiling`); the hand-offs from `embedding`, `lanes`,
`bus`, `attention` and `reductions`.
"""

from __future__ import annotations

from typing import Any

from kernels.program.attention import _attention_to_gemv, _qkv_to_attention
from kernels.program.builder import _Builder
from kernels.program.bus import _bus
from kernels.program.codes import (
    K_ATTN,
    K_EMBED,
    K_GEMV,
    K_HEAD,
    K_IO_OUT,
    K_NORM,
    K_RES,
    MAX_RX,
    ProgramError,
)
from kernels.program.embedding import _head_merge_and_scores, _io_and_embedding
from kernels.program.lanes import _gemv_to_gemv, _gemv_to_strip, _norm_to_gemv, _strip_to_strip
from kernels.program.reductions import _reduction
from kernels.program.roles import reduction_root, rounds
from kernels.program.tables import RegionRow
from wafer.tiling import AttentionTiling, GemvTiling, HeadTiling, NormTiling, ceil_div
from wafer.wire import record_words


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
