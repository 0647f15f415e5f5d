"""`_Builder`: the tables under construction while the replicas are laid out.

It hands out region rows (refusing overlaps), channels and shared role tables; the hand-off modules
(`lanes`, `bus`, `attention`, `embedding`, `reductions`) add routes and gather tables through it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kernels.program.codes import (
    K_ATTN,
    K_EMBED,
    K_GEMV,
    K_HEAD,
    K_IO_IN,
    K_IO_OUT,
    K_NORM,
    K_RES,
    ProgramError,
)
from kernels.program.indices import _axis_codes
from kernels.program.roles import reduction_roles
from kernels.program.tables import Channel, RegionRow
from wafer.memory_layout import pe_coords


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
