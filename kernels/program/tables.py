"""The program's tables: region rows, channels (one route pattern on one color), router rectangles.

`Program` is what `build_program` returns and what the CSL writer, the PE-params mirror and the
contract lint read. A channel's routers compress into the rectangles layout.csl applies (`_compress`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kernels.program.codes import OPPOSITE, RAMP, STEP, ProgramError


@dataclass
class RegionRow:
    index: int
    name: str
    kind: int
    replica: int
    layer: int | None
    x: int
    y: int
    w: int
    h: int
    axes: tuple[int, int]  # axis codes of the kind's two indices (see layout.csl)
    t: dict[str, int] = field(default_factory=dict)
    slots: dict[str, int] = field(default_factory=dict)  # slot -> color
    region: Any = None

    def tv(self, name: str) -> int:
        return self.t.get(name, 0)


@dataclass
class Channel:
    """One route pattern on one color: router settings (rx one direction, tx a set) on its PEs."""

    name: str
    users: list[tuple[int, str]]  # (region row, slot) whose PE programs send or receive on it
    xs: list = field(default_factory=list)
    ys: list = field(default_factory=list)
    rx: list = field(default_factory=list)
    tx: list = field(default_factory=list)
    color: int = -1

    def add(self, x: int, y: int, rx: int, tx: int) -> None:
        self.xs.append(x)
        self.ys.append(y)
        self.rx.append(rx)
        self.tx.append(tx)

    def add_path(
        self, cells: list[tuple[int, int]], take: set[int] | None = None, start_rx: int = RAMP
    ) -> None:
        """A path through `cells` (unit steps, any turns): the first router takes the wavelets from
        `start_rx` (its PE's ramp, or a neighbour), the last hands them to its PE; the PEs at indices
        in `take` (default: only the last) also get a copy."""
        take = {len(cells) - 1} if take is None else take
        for i, (x, y) in enumerate(cells):
            rx = start_rx if i == 0 else OPPOSITE[_direction(cells[i - 1], (x, y))]
            tx = RAMP if i in take else 0
            if i + 1 < len(cells):
                tx |= _direction((x, y), cells[i + 1])
            self.add(x, y, rx, tx)

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        return (np.asarray(self.xs, dtype=np.int32), np.asarray(self.ys, dtype=np.int32),
                np.asarray(self.rx, dtype=np.int32), np.asarray(self.tx, dtype=np.int32))  # fmt: skip


@dataclass(frozen=True)
class Rect:
    """A rectangle of routers with one setting for one color (what layout.csl applies)."""

    color: int
    x: int
    y: int
    w: int
    h: int
    rx: int
    tx: int


@dataclass
class Program:
    kernel_w: int
    kernel_h: int
    arch: str
    regions: list[RegionRow]
    channels: list[Channel]
    roles: list[int] = field(default_factory=list)  # reduction role words
    g_flags: list[int] = field(default_factory=list)  # gather tables
    g_before: list[int] = field(default_factory=list)
    g_own: list[int] = field(default_factory=list)
    g_after: list[int] = field(default_factory=list)
    idle: list[tuple[int, int, int, int]] = field(default_factory=list)  # (x, y, w, h) PEs without a region
    gathers: list[tuple[int, str, int, int, int]] = field(
        default_factory=list
    )  # (row, prefix, offset, chunks, group)
    request: dict = field(default_factory=dict)  # the plan request this program was built for (plan_request)

    def rects(self) -> list[Rect]:
        out: list[Rect] = []
        for ch in self.channels:
            out.extend(_compress(ch))
        return out

    def router_maps(self) -> tuple[np.ndarray, np.ndarray]:
        """(rx, tx) per (color, y, x): 0 where a router does not carry the color."""
        rx = np.zeros((24, self.kernel_h, self.kernel_w), dtype=np.uint8)
        tx = np.zeros((24, self.kernel_h, self.kernel_w), dtype=np.uint8)
        for ch in self.channels:
            xs, ys, r, t = ch.arrays()
            rx[ch.color, ys, xs] = r
            tx[ch.color, ys, xs] = t
        return rx, tx

    def colors_per_pe(self) -> np.ndarray:
        used = np.zeros((self.kernel_h, self.kernel_w), dtype=np.int32)
        for ch in self.channels:
            xs, ys, _, _ = ch.arrays()
            used[ys, xs] |= 1 << ch.color
        return _popcount(used)


def _popcount(a: np.ndarray) -> np.ndarray:
    a = a.astype(np.uint32)
    out = np.zeros(a.shape, dtype=np.int32)
    for bit in range(24):
        out += (a >> bit) & 1
    return out


def _direction(a: tuple[int, int], b: tuple[int, int]) -> int:
    step = (b[0] - a[0], b[1] - a[1])
    for d, s in STEP.items():
        if s == step:
            return d
    raise ProgramError(f"route step from {a} to {b} is not between neighbouring PEs")


def _compress(ch: Channel) -> list[Rect]:
    """The channel's routers as maximal row runs merged into rectangles (same setting)."""
    xs, ys, rx, tx = ch.arrays()
    if xs.size == 0:
        return []
    order = np.lexsort((xs, ys, tx, rx))
    xs, ys, rx, tx = xs[order], ys[order], rx[order], tx[order]
    brk = np.ones(xs.size, dtype=bool)
    brk[1:] = (np.diff(xs) != 1) | (np.diff(ys) != 0) | (np.diff(rx) != 0) | (np.diff(tx) != 0)
    starts = np.flatnonzero(brk)
    ends = np.append(starts[1:], xs.size) - 1
    runs = np.stack([rx[starts], tx[starts], xs[starts], xs[ends], ys[starts]], axis=1)
    runs = runs[np.lexsort((runs[:, 4], runs[:, 3], runs[:, 2], runs[:, 1], runs[:, 0]))]
    rects: list[Rect] = []
    i = 0
    while i < len(runs):
        r0, t0, x0, x1, y0 = (int(v) for v in runs[i])
        j = i + 1
        while j < len(runs) and tuple(runs[j, :4]) == (r0, t0, x0, x1) and runs[j, 4] == y0 + (j - i):
            j += 1
        rects.append(Rect(ch.color, x0, y0, x1 - x0 + 1, j - i, r0, t0))
        i = j
    return rects
