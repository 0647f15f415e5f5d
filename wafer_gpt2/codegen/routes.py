"""Routes: every flow of wavelets is a tree on one color, and colors are handed out so that no router
holds two flows on one color.

A flow has one source PE (its CE sends onto the color: rx RAMP) and a set of destination PEs (tx RAMP
there). Its tree is the union of dimension-ordered paths from the source (x first then y, or y first
then x, whichever needs fewer routers): the union of such paths from one source is always a tree, so
each router of the flow has one rx direction. Two flows conflict when they share a router; colors
are assigned greedily in the order the flows were made, so a chain's links come out alternating
between two colors as public programs write them by hand.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from wafer_gpt2.errors import ProgramError

Pos = tuple[int, int]
STEP = {"EAST": (1, 0), "WEST": (-1, 0), "SOUTH": (0, 1), "NORTH": (0, -1)}
OPPOSITE = {"EAST": "WEST", "WEST": "EAST", "NORTH": "SOUTH", "SOUTH": "NORTH"}


@dataclass
class Flow:
    name: str
    source: Pos
    destinations: tuple[Pos, ...]
    routes: dict[Pos, tuple[str, frozenset[str]]] = field(default_factory=dict)  # pos -> (rx, tx set)
    color: int | None = None

    def __hash__(self) -> int:
        return id(self)

    def __eq__(self, other: object) -> bool:
        return self is other


def _tree(src: Pos, dsts: tuple[Pos, ...], x_first: bool) -> dict[Pos, tuple[str, frozenset[str]]]:
    """The union of the dimension-ordered paths from `src` to every destination. Each path is walked
    back from its destination until it meets the tree (the rest of it is already there), so the work
    is the size of the tree."""
    rx: dict[Pos, str] = {src: "RAMP"}
    tx: dict[Pos, set[str]] = {src: set()}
    for dst in dsts:
        tx.setdefault(dst, set()).add("RAMP")
        x, y = dst
        while (x, y) not in rx:
            # the step that enters (x, y) on the path from src: the second leg's first
            if x_first:
                d = (
                    ("SOUTH" if y > src[1] else "NORTH")
                    if y != src[1]
                    else ("EAST" if x > src[0] else "WEST")
                )
            else:
                d = (
                    ("EAST" if x > src[0] else "WEST")
                    if x != src[0]
                    else ("SOUTH" if y > src[1] else "NORTH")
                )
            rx[(x, y)] = OPPOSITE[d]
            x, y = x - STEP[d][0], y - STEP[d][1]
            tx.setdefault((x, y), set()).add(d)
    return {pos: (rx[pos], frozenset(tx.get(pos, ()))) for pos in rx}


def make_flow(name: str, src: Pos, dsts: list[Pos] | tuple[Pos, ...]) -> Flow:
    """A flow from `src` to every PE of `dsts` (which must not include `src`)."""
    dsts = tuple(dict.fromkeys(dsts))
    if not dsts:
        raise ProgramError(f"flow {name}: no destination")
    if src in dsts:
        raise ProgramError(f"flow {name}: the source {src} is also a destination")
    sx, sy = src
    shape = _shape(tuple([(x - sx, y - sy) for x, y in dsts]))
    return Flow(name, src, dsts, {(sx + dx, sy + dy): route for dx, dy, route in shape})


def make_path_flow(name: str, corners: list[Pos]) -> Flow:
    """A flow along straight legs from corners[0] through each corner to the last, its one
    destination: a lane that turns where a dimension-ordered path would cross its neighbours'."""
    if len(corners) < 2 or len(set(corners)) != len(corners):
        raise ProgramError(f"flow {name}: a path needs distinct corners, got {corners}")
    routes: dict[Pos, tuple[str, set[str]]] = {corners[0]: ("RAMP", set())}
    here = corners[0]
    for corner in corners[1:]:
        if here[0] != corner[0] and here[1] != corner[1]:
            raise ProgramError(f"flow {name}: the leg {here} -> {corner} is not straight")
        d = (
            ("EAST" if corner[0] > here[0] else "WEST")
            if corner[0] != here[0]
            else ("SOUTH" if corner[1] > here[1] else "NORTH")
        )
        while here != corner:
            routes[here][1].add(d)
            here = (here[0] + STEP[d][0], here[1] + STEP[d][1])
            if here in routes:
                raise ProgramError(f"flow {name}: the path crosses itself at {here}")
            routes[here] = (OPPOSITE[d], set())
    routes[here][1].add("RAMP")
    return Flow(name, corners[0], (here,), {pos: (rx, frozenset(tx)) for pos, (rx, tx) in routes.items()})


def staircase_corners(sources: list[Pos], dsts: list[Pos]) -> list[list[Pos]] | None:
    """Corners of lanes from a row of sources to a row of destinations, source i to destination i,
    where straight lanes would share routers (the rows are apart and the columns are not the same):
    lane i leaves its source along y, turns along x at a row of its own between the two rows, and
    turns again along y in its destination's column. The lane nearest the destinations' side turns
    first, so no lane's leg along x crosses another's legs along y when both rows are in the same
    column order; None where the rows are too close for a turn row each, or not rows."""
    n = len(sources)
    if n != len(dsts) or n < 2 or len({y for _, y in sources}) != 1 or len({y for _, y in dsts}) != 1:
        return None
    sy, dy = sources[0][1], dsts[0][1]
    if abs(dy - sy) <= n:
        return None
    towards_y = 1 if dy > sy else -1
    west = dsts[0][0] < sources[0][0]
    order = sorted(range(n), key=lambda i: sources[i][0], reverse=not west)
    turn = {i: sy + towards_y * (k + 1) for k, i in enumerate(order)}
    return [
        [src, (src[0], turn[i]), (dst[0], turn[i]), dst] if src[0] != dst[0] else [src, dst]
        for i, (src, dst) in enumerate(zip(sources, dsts, strict=True))
    ]


@lru_cache(maxsize=4096)
def _shape(offsets: tuple[Pos, ...]) -> tuple[tuple[int, int, tuple[str, frozenset[str]]], ...]:
    """The routes of a flow from (0, 0) to `offsets`, as (dx, dy, route) in the tree's order. A tree
    depends only on where the destinations sit from the source, and a program repeats the same few
    shapes (chain links, a layer's hand-offs) at many places: make_flow translates a cached one."""
    src = (0, 0)
    x_first = _tree(src, offsets, True)
    if all(d[0] == 0 or d[1] == 0 for d in offsets):
        routes = x_first  # straight lines from the source: both orders give the same tree
    else:
        routes = min((x_first, _tree(src, offsets, False)), key=len)
    return tuple((x, y, route) for (x, y), route in routes.items())


def assign_colors(flows: list[Flow], palette: list[int]) -> None:
    """Greedy coloring in flow order: each flow (none colored yet) takes the first color of `palette`
    that no flow sharing one of its routers has."""
    held: dict[Pos, int] = {}  # per router, the colors of the flows colored so far as a bit mask
    for flow in flows:
        taken = 0
        for pos in flow.routes:
            taken |= held.get(pos, 0)
        color = next((c for c in palette if not taken >> c & 1), None)
        if color is None:
            at: dict[Pos, list[Flow]] = {}
            for other in flows:
                for pos in other.routes:
                    at.setdefault(pos, []).append(other)
            busiest = max(flow.routes, key=lambda p: len(at[p]))
            raise ProgramError(
                f"flow {flow.name}: no color left ({len(palette)} usable); router {busiest} is shared by "
                f"{len(at[busiest])} flows ({', '.join(f.name for f in at[busiest][:8])} ...)"
            )
        flow.color = color
        bit = 1 << color
        for pos in flow.routes:
            held[pos] = held.get(pos, 0) | bit
