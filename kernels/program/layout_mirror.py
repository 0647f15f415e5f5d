"""The params layout.csl gives each PE (`pe_params`) and the colors they make it listen and send on
(`pe_routes`), computed in Python so the contract lint can check them against the routes.
"""

from __future__ import annotations

from typing import Any

from kernels.program.codes import (
    G_EXIT,
    G_HAS_RX,
    G_HDR,
    G_RX_ODD,
    G_TX_ODD,
    IN_GROUP,
    IN_LANE,
    K_ATTN,
    K_EMBED,
    K_GEMV,
    K_HEAD,
    K_IO_IN,
    K_IO_OUT,
    K_NORM,
    K_RES,
    MAX_RX,
)
from kernels.program.indices import along, snake_index
from kernels.program.roles import decode_role
from kernels.program.tables import Program, RegionRow


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
