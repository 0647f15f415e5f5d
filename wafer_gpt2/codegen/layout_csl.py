"""Write a Program as layout.csl: the tile codes and routes, grouped into rectangles.

PEs with identical params share one `const` params struct and are set in loops over rectangles, and
so are identical color configs: the file stays small however large the program (the measured sizes
are in docs/kernels.md). The PE programs compute their roles from their coordinates (lib/frame.csl),
so a region needs only a few distinct param sets: its chain roles and link colors.
"""

from __future__ import annotations

import json
from collections import defaultdict
from operator import itemgetter
from typing import Any

from wafer_gpt2.codegen.build import MEMCPY_COLORS, PALETTE, Program, Raw, Tile, paused_gc
from wafer_gpt2.codegen.routes import Flow, Pos
from wafer_gpt2.core.abi import D2H_COLOR, EXPORTED_ARRAYS, H2D_COLOR, HOST_FUNCTIONS

LAYOUT_HEADER = "// plan request: "


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, Raw):
        return v.csl
    if isinstance(v, Flow):
        return f"@get_color({v.color})"
    if v is None:  # an unused color param: any routable color will do
        return f"@get_color({PALETTE[0]})"
    if isinstance(v, float):
        return repr(v) if "e" in repr(v) or "." in repr(v) else f"{v}.0"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, dict):
        return ".{ " + ", ".join(f".{k} = {_value(x)}" for k, x in v.items()) + " }"
    if isinstance(v, list):
        return f"[{len(v)}]u16 {{ " + ", ".join(str(x) for x in v) + " }"
    raise TypeError(f"cannot write param {v!r}")


def _frozen(v: Any, memo: dict[int, Any]) -> Any:
    """A hashable stand-in for a param value (a flow by its color); `memo` keeps the frozen form of
    the dicts and lists that many tiles share (a region's frame, its task IDs)."""
    if isinstance(v, Flow):
        return ("color", v.color)
    if isinstance(v, dict | list):
        hit = memo.get(id(v))
        if hit is None:
            items = v.items() if isinstance(v, dict) else enumerate(v)
            hit = memo[id(v)] = (v, tuple((k, _frozen(x, memo)) for k, x in items))
        return hit[1]
    return v


# Param values _frozen leaves as they are.
_PLAIN = frozenset({int, bool, str, float, type(None)})

Lattice = tuple[int, int, int, int, int, int]  # x, y, w, h (PEs along x and y), step x, step y


def lattices(points: set[Pos], steps: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7, 8)) -> list[Lattice]:
    """Cover `points` exactly with strided rectangles: (x, y, nx, ny, sx, sy) stands for the PEs
    (x + i*sx, y + j*sy). Chains alternate their two link colors and roles every other PE, and a
    two-level reduction repeats its roles every run, so the PEs sharing params or a route often sit
    every second (or g-th) row or column: strides keep those in one loop. Greedy: from the first
    point left (in y, x order), the candidate with the most PEs."""
    if not points:
        return []
    # The points left, one bit per PE: a row's x (less x0) is a bit of rows[y]. A whole strided row of
    # a candidate is then one mask test, and taking a rectangle clears one mask per row.
    x0 = min(map(itemgetter(0), points))
    rows: dict[int, int] = {}
    for x, y in points:
        rows[y] = rows.get(y, 0) | 1 << (x - x0)
    out: list[Lattice] = []
    for y in sorted(rows):
        while rows[y]:
            r = rows[y]
            x = (r & -r).bit_length() - 1  # the first point left: every rectangle covers its start
            best: Lattice = (x, y, 1, 1, 1, 1)
            most = 1
            # The column from (x, y) every sy rows bounds ny for every sx: a candidate that cannot
            # beat the best so far (more PEs, strictly) is skipped without testing its rows.
            column: dict[int, int] = {}
            for sy in steps:
                n = 1
                while rows.get(y + n * sy, 0) >> x & 1:
                    n += 1
                column[sy] = n
            for sx in steps:
                nx = 1
                while r >> (x + nx * sx) & 1:
                    nx += 1
                mask = _strided(nx, sx) << x
                for sy in steps:
                    if nx * column[sy] <= most:
                        continue
                    ny = 1
                    while (rows.get(y + ny * sy, 0) & mask) == mask:
                        ny += 1
                    if nx * ny > most:
                        best, most = (x, y, nx, ny, sx, sy), nx * ny
            _, _, nx, ny, sx, sy = best
            mask = _strided(nx, sx) << x
            for j in range(ny):
                rows[y + j * sy] &= ~mask
            out.append((x + x0, y, nx, ny, sx, sy))
    return out


def _strided(n: int, step: int) -> int:
    """n bits, `step` apart from bit 0 (the sum of a geometric series in 2**step)."""
    return ((1 << n * step) - 1) // ((1 << step) - 1)


def _range(start: int, count: int, step: int) -> str:
    return f"@range(u16, {start}, {start + (count - 1) * step + 1}, {step})"


def _loop(lattice: Lattice, body: str) -> list[str]:
    """`body` (with @X@ and @Y@ for the coordinates) for every PE of `lattice`."""
    x, y, nx, ny, sx, sy = lattice
    if nx == 1 and ny == 1:
        return ["  " + body.replace("@X@", str(x)).replace("@Y@", str(y))]
    if ny == 1:
        return [
            f"  for ({_range(x, nx, sx)}) |x| {{",
            "    " + body.replace("@X@", "x").replace("@Y@", str(y)),
            "  }",
        ]
    if nx == 1:
        return [
            f"  for ({_range(y, ny, sy)}) |y| {{",
            "    " + body.replace("@X@", str(x)).replace("@Y@", "y"),
            "  }",
        ]
    return [
        f"  for ({_range(x, nx, sx)}) |x| {{",
        f"    for ({_range(y, ny, sy)}) |y| {{",
        "      " + body.replace("@X@", "x").replace("@Y@", "y"),
        "    }",
        "  }",
    ]


def layout_csl(program: Program, request: dict[str, Any]) -> str:
    with paused_gc():
        return _layout_csl(program, request)


def _layout_csl(program: Program, request: dict[str, Any]) -> str:
    plan = program.plan
    wtype = "f16" if plan.dtype == "fp16" else "f32"
    lines = [
        "// layout.csl: GPT-2 on the wafer, written by wafer_gpt2/codegen (do not edit: regenerate with",
        "// `wafer-gpt2 compile`). The PE programs are wafer_gpt2/kernels/pe/*.csl; docs/kernels.md explains the layout.",
        LAYOUT_HEADER + json.dumps(request, sort_keys=True),
        "",
        "param MEMCPYH2D_DATA_1_ID: i16;",
        "param MEMCPYD2H_DATA_1_ID: i16;",
        "",
        'const memcpy = @import_module("<memcpy/get_params>", .{',
        f"  .width = {program.width},",
        f"  .height = {program.height},",
        "  .MEMCPYH2D_1 = @get_color(MEMCPYH2D_DATA_1_ID),",
        "  .MEMCPYD2H_1 = @get_color(MEMCPYD2H_DATA_1_ID),",
        "});",
        "",
    ]
    by_value: dict[tuple, tuple[Tile, set[Pos]]] = {}
    memo: dict[int, Any] = {}
    for pos, tile in program.tiles.items():
        # _frozen inline for the values most params are (scalars, flows): this runs for every PE
        values = [
            v if (t := type(v)) in _PLAIN else ("color", v.color) if t is Flow else _frozen(v, memo)
            for v in tile.params.values()
        ]
        key = (tile.file, tuple(tile.params), tuple(values))
        same = by_value.get(key)
        if same is None:
            by_value[key] = (tile, {pos})
        else:
            same[1].add(pos)
    groups: dict[tuple[str, str], set[Pos]] = {}
    for tile, points in by_value.values():
        groups.setdefault((tile.file, _value(tile.params)), set()).update(points)
    names = {}
    for n, (file, params) in enumerate(sorted(groups)):
        names[(file, params)] = f"P{n}"
        lines.append(f"const P{n} = {params};")
    lines.append("")
    # PEs per (color, route) first: flows share their route tuples (routes._shape), whose hash is cheap
    by_route: defaultdict[tuple[int | None, tuple[str, frozenset[str]]], set[Pos]] = defaultdict(set)
    for flow in program.flows:
        color = flow.color
        for pos, route in flow.routes.items():
            by_route[(color, route)].add(pos)
    configs: dict[tuple[int | None, str, tuple[str, ...]], set[Pos]] = {}
    for (color, (rx, tx)), points in by_route.items():
        configs.setdefault((color, rx, tuple(sorted(tx))), set()).update(points)
    lines += ["layout {", f"  @set_rectangle({program.width}, {program.height});", ""]
    # Groups in the order of their first PE in (y, x) order, compared as (x, y): where a cover's first
    # rectangle starts.
    covers = {key: lattices(points) for key, points in groups.items()}
    for key in sorted(groups, key=lambda k: covers[k][0][:2]):
        file, _ = key
        body = (
            f'@set_tile_code(@X@, @Y@, "{file}", @concat_structs(.{{ .memcpy_params = memcpy.get_params(@X@) }}, '
            f"{names[key]}));"
        )
        for rect in covers[key]:
            lines += _loop(rect, body)
    lines.append("")
    for (color, rx, tx), points in sorted(configs.items()):
        body = f"@set_color_config(@X@, @Y@, @get_color({color}), .{{ .routes = .{{ .rx = .{{{rx}}}, .tx = .{{{', '.join(tx)}}} }} }});"
        for rect in lattices(points):
            lines += _loop(rect, body)
    lines += [
        "",
    ]
    for name, elem in EXPORTED_ARRAYS.items():
        lines.append(f'  @export_name("{name}", [*]{wtype if elem == "w" else elem}, true);')
    for name, args in HOST_FUNCTIONS.items():
        lines.append(f'  @export_name("{name}", fn({", ".join(t for _, t in args)})void);')
    lines += ["}", ""]
    return "\n".join(lines)


def layout_params() -> dict[str, int]:
    """The params layout.csl takes on the cslc command line."""
    return {"MEMCPYH2D_DATA_1_ID": H2D_COLOR, "MEMCPYD2H_DATA_1_ID": D2H_COLOR}


__all__ = [
    "LAYOUT_HEADER",
    "MEMCPY_COLORS",
    "layout_csl",
    "layout_params",
    "lattices",
]
