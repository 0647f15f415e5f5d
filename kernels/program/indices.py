"""Per-PE indices: the formulas layout.csl uses, checked against `memory_layout.pe_coords`.

A region's two tiling indices grow along its axis codes (`AXIS_CODE`); an attention PE's (group,
chain index) follows the snake `memory_layout._snake` lays out.
"""

from __future__ import annotations

from typing import Any

from kernels.program.codes import AXIS_CODE, ProgramError
from kernels.program.tables import RegionRow


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
