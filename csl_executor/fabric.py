"""The fabric: routers that move 32-bit wavelets one hop per cycle per link per color, with finite
buffers and back-pressure, and the control-wavelet format that drives their switches.

Model (csl_executor/README.md, "Fabric"): every (router, color) is one virtual channel with a buffer of
`timing.ROUTER_DEPTH` wavelets. Each cycle it forwards its head wavelet to every direction of its
current `tx` set at once (a multicast waits until every branch has room). A wavelet entering from a
neighbour must come from a direction in the receiving router's `rx` set; arriving from two directions
in one cycle is undefined on the hardware and an error here. `RAMP` in `tx` delivers to the PE's
compute engine (after the color's filter, if any); `RAMP` in `rx` takes what the PE sends. Color swap
(WSE-2) renames a wavelet arriving from east/west (`color_swap_x`) or north/south (`color_swap_y`)
to the partner color (ids differing in the low bit).

Control wavelets carry up to eight 3-bit commands (2-bit opcode, 1 bit that keeps the wavelet from
the PE) and a 6-bit entrypoint (31: none). Bit positions follow the public 25-pt-stencil example:
entrypoint bits 16-21; command 0 in bits 22-24, 1 in 25-27, 2 in 28-29 with its ignore bit at 0, 3-7 in
bits 1-15. A router applies its head command after forwarding the wavelet (the wavelet itself travels
by the old switch position) and pops it as its `pop_mode` says.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from csl_executor import timing
from csl_executor.errors import CslCompileError, CslRuntimeError
from csl_executor.program import ColorConfig
from csl_executor.types import Direction, Struct

CTRL = 1 << 32  # the control bit rides outside the 32-bit payload
NOP, SWITCH_ADV, SWITCH_RST, TEARDOWN = 0, 1, 2, 3
NO_ENTRY = 31
_CMD_BITS = [
    (22, 24),
    (25, 27),
    (28, 0),
    (1, 3),
    (4, 6),
    (7, 9),
    (10, 12),
    (13, 15),
]  # (opcode lsb, ignore bit)

DELTA = {"NORTH": (0, -1), "SOUTH": (0, 1), "EAST": (1, 0), "WEST": (-1, 0)}
OPPOSITE = {"NORTH": "SOUTH", "SOUTH": "NORTH", "EAST": "WEST", "WEST": "EAST"}


# ---------------------------------------------------------------------------------------------------
# Control payloads


def encode_control(task_id: int) -> int:
    """`<control>.encode_control_task_payload`: activate control task `task_id`, no router commands."""
    return (task_id & 0x3F) << 16


def encode_single(op: int, ce_ignore: bool, entry: int | None, data: int) -> int:
    """`<control>.encode_single_payload`: one router command, an entrypoint (or none) and 16-bit data."""
    entry = NO_ENTRY if entry is None else entry
    return ((entry & 0x3F) << 16) | ((op & 3) << 22) | ((1 if ce_ignore else 0) << 24) | (data & 0xFFFF)


def commands(payload: int) -> list[tuple[int, int]]:
    return [((payload >> lo) & 3, (payload >> ign) & 1) for lo, ign in _CMD_BITS]


def entrypoint(payload: int) -> int:
    return (payload >> 16) & 0x3F


def pop_command(payload: int) -> int:
    """The payload with its head command removed and the others moved up (entrypoint kept)."""
    cmds = commands(payload)[1:] + [(NOP, 0)]
    out = payload & (0x3F << 16)
    for (op, ign), (lo, ib) in zip(cmds, _CMD_BITS, strict=True):
        out |= (op << lo) | (ign << ib)
    return out


# ---------------------------------------------------------------------------------------------------
# Buffers


class Channel:
    """A bounded FIFO of (ready cycle, item) with one-shot waiters for space and for data."""

    __slots__ = ("q", "cap", "name", "space_waiters", "data_waiters", "machine", "on_push")

    def __init__(self, machine, cap: int, name: str) -> None:
        self.q: deque = deque()
        self.cap = cap
        self.name = name
        self.space_waiters: list = []
        self.data_waiters: list = []
        self.machine = machine
        self.on_push: Callable[[int], None] | None = None

    def __len__(self) -> int:
        return len(self.q)

    def free(self) -> int:
        return self.cap - len(self.q)

    def push(self, ready: int, item: Any) -> None:
        self.q.append((ready, item))
        if self.data_waiters:
            waiters, self.data_waiters = self.data_waiters, []
            for w in waiters:
                self.machine.at(ready, w)
        if self.on_push is not None:
            self.on_push(ready)

    def pop(self, t: int) -> Any:
        item = self.q.popleft()[1]
        if self.space_waiters:
            waiters, self.space_waiters = self.space_waiters, []
            for w in waiters:
                self.machine.at(t, w)
        return item

    def head_ready(self, t: int) -> bool:
        return bool(self.q) and self.q[0][0] <= t

    def ready_data(self, t: int, limit: int) -> int:
        """Leading data (not control) items ready by cycle t, at most `limit`."""
        n = 0
        for ready, item in self.q:
            if n >= limit or ready > t or (isinstance(item, int) and item & CTRL):
                break
            n += 1
        return n

    def wait_space(self, fn) -> None:
        if fn not in self.space_waiters:
            self.space_waiters.append(fn)

    def wait_data(self, fn) -> None:
        if fn not in self.data_waiters:
            self.data_waiters.append(fn)


def ramp_has_room(ce: Channel) -> bool:
    """Whether a wavelet may start down the ramp into the CE's input queue `ce` (timing.STREAM_PACING):
    the queue's depth counts the wavelets on their way down, or the ramp holds them besides it."""
    ramp = timing.ROUTER_TO_CE if timing.STREAM_PACING == "link-rate" else 0
    return ce.free() + ramp > 0


# ---------------------------------------------------------------------------------------------------
# Routers


class RouterColor:
    """One color's route through one router."""

    __slots__ = (
        "machine", "x", "y", "color", "cfg", "buf", "positions", "cur", "ring", "pop_mode", "filter",
        "swap_x", "swap_y", "scheduled", "last_arrival", "targets_cache", "kick", "forwarded", "switch_waiters",
    )  # fmt: skip

    def __init__(self, machine, x: int, y: int, color: int, cfg: ColorConfig) -> None:
        self.machine = machine
        self.x, self.y, self.color, self.cfg = x, y, color, cfg
        self.buf = Channel(machine, timing.ROUTER_DEPTH, f"router ({x}, {y}) color {color}")
        base = (frozenset(cfg.rx), tuple(cfg.tx))
        self.positions: list = [base, None, None, None]
        self.cur = 0
        self.ring = False
        self.pop_mode = "no_pop"
        sw = cfg.switches
        if sw is not None:
            for k in (1, 2, 3):
                p = sw.get(f"pos{k}")
                if p is None:
                    continue
                if not isinstance(p, Struct):
                    raise CslCompileError(
                        f"{cfg.where}: switch .pos{k} must be `.{{ .rx = D }}` or `.{{ .tx = D }}`"
                    )
                # A position sets one side; the other keeps the previous position's setting
                # (cholesky's rows: pos1 `.tx = EAST` then pos2 `.rx = RAMP` inject eastward, never
                # back into the sender's own RAMP).
                prev = next(self.positions[j] for j in range(k - 1, -1, -1) if self.positions[j] is not None)
                rx = frozenset(_dirs(p.get("rx"))) if p.has("rx") else prev[0]
                tx = tuple(_dirs(p.get("tx"))) if p.has("tx") else prev[1]
                self.positions[k] = (rx, tx)
            self.cur = int(sw.get("current_switch_pos", 0))
            self.ring = bool(sw.get("ring_mode", False))
            pm = sw.get("pop_mode")
            if isinstance(pm, Struct):
                modes = [n for n in pm.names() if pm.get(n)]
                self.pop_mode = modes[0] if modes else "no_pop"
            extra = set(sw.names()) - {"pos1", "pos2", "pos3", "current_switch_pos", "ring_mode", "pop_mode"}
            if extra:
                raise CslCompileError(f"{cfg.where}: unsupported switch field(s) {', '.join(sorted(extra))}")
            if self.positions[self.cur] is None:
                raise CslCompileError(f"{cfg.where}: current_switch_pos {self.cur} names no position")
        self.filter: RangeFilter | CounterFilter | None = None
        if cfg.filter is not None:
            self.filter = make_filter(cfg.filter, cfg.where)
        self.swap_x, self.swap_y = cfg.color_swap_x, cfg.color_swap_y
        self.scheduled = -1
        self.last_arrival = (-1, "")
        self.targets_cache: dict[int, list] = {}
        self.forwarded = 0
        self.switch_waiters: list = []
        self.kick = self._kick

    def __repr__(self) -> str:
        return f"router ({self.x}, {self.y}) color {self.color}"

    def _kick(self, t: int) -> None:
        if self.scheduled >= 0 and self.scheduled <= t:
            return
        self.scheduled = t
        self.machine.at(t, self.step)

    def reconfigure(self, cfg: ColorConfig) -> None:
        """A new route at run time: one position, no switch, no filter."""
        self.cfg = cfg
        self.positions = [(frozenset(cfg.rx), tuple(cfg.tx)), None, None, None]
        self.cur = 0
        self.filter = None
        self.targets_cache.clear()
        if self.switch_waiters:
            waiters, self.switch_waiters = self.switch_waiters, []
            for fn in waiters:
                self.machine.at(self.machine.now, fn)
        if self.buf.q:
            self._kick(self.machine.now)

    def receives(self, from_dir: str) -> bool:
        """Does the current switch position take wavelets from `from_dir`?"""
        return from_dir in self.positions[self.cur][0]

    def waits_for(self, from_dir: str, fn) -> bool:
        """A wavelet from `from_dir` that the current position does not take: when another position
        of this switch takes it, or a program changes this color's routes at run time, the sender
        holds it until the switch moves or the route changes (back-pressure) and `fn` is called
        then; otherwise False (a route that never receives from there)."""
        taken = any(p is not None and from_dir in p[0] for p in self.positions)
        if not taken and self.color not in self.machine.reconfigurable_colors:
            return False
        if fn not in self.switch_waiters:
            self.switch_waiters.append(fn)
        return True

    def accept(self, w: int, ready: int, from_dir: str) -> None:
        rx = self.positions[self.cur][0]
        if from_dir not in rx:
            raise CslRuntimeError(
                f"a wavelet on color {self.color} reaches PE ({self.x}, {self.y}) from {from_dir}, but its route "
                f"receives from {{{', '.join(sorted(rx))}}} ({self.cfg.where})"
            )
        last_t, last_dir = self.last_arrival
        if last_t == ready and last_dir != from_dir and from_dir != "RAMP" and last_dir != "RAMP":
            raise CslRuntimeError(
                f"wavelets on color {self.color} reach PE ({self.x}, {self.y}) from {last_dir} and {from_dir} in "
                f"the same cycle ({ready}): undefined on the hardware ({self.cfg.where})"
            )
        self.last_arrival = (ready, from_dir)
        self.buf.push(ready, w)
        self._kick(ready)

    def targets(self) -> list:
        cached = self.targets_cache.get(self.cur)
        if cached is not None:
            return cached
        out: list[tuple[str, Any, str | None]] = []
        for d in self.positions[self.cur][1]:
            if d == "RAMP":
                out.append(("RAMP", None, None))
                continue
            dx, dy = DELTA[d]
            nx, ny = self.x + dx, self.y + dy
            arrive = OPPOSITE[d]
            nb = self.machine.router(nx, ny, self.color)
            if nb is not None:
                swap = nb.swap_x if arrive in ("EAST", "WEST") else nb.swap_y
                if swap:
                    partner = self.machine.router(nx, ny, self.color ^ 1)
                    if partner is None or not (
                        partner.swap_x if arrive in ("EAST", "WEST") else partner.swap_y
                    ):
                        raise CslRuntimeError(
                            f"color swap at PE ({nx}, {ny}) needs both colors {self.color} and {self.color ^ 1} "
                            "configured with the same swap setting"
                        )
                    nb = partner
            if nb is None:
                w, h = self.machine.compiled.layout.rectangle
                where = (
                    "off the edge of the kernel"
                    if not (0 <= nx < w and 0 <= ny < h)
                    else f"to PE ({nx}, {ny}), which has no route for color {self.color}"
                )
                raise CslRuntimeError(
                    f"a wavelet on color {self.color} is sent {d} from PE ({self.x}, {self.y}) {where} ({self.cfg.where})"
                )
            out.append((d, nb, arrive))
        self.targets_cache[self.cur] = out
        return out

    def step(self, t: int) -> None:
        self.scheduled = -1
        q = self.buf.q
        if not q:
            return
        ready, w = q[0]
        if ready > t:
            self._kick(ready)
            return
        ctrl = w & CTRL
        targets = self.targets()
        ce = None
        for d, nb, arrive in targets:
            if d == "RAMP":
                if self._to_ce(w):
                    ce = self.machine.pe_input(self.x, self.y, self.color)
                    if not ramp_has_room(ce):
                        ce.wait_space(self._kick)
                        return
            elif nb.buf.free() <= 0:
                nb.buf.wait_space(self._kick)
                return
            elif not nb.receives(arrive) and nb.waits_for(arrive, self._kick):
                return
        self.buf.pop(t)
        self.forwarded += 1
        if self.filter is not None:
            self.filter.count(w)
        out = w
        nxt = self.cur
        if ctrl:
            nxt = self._next_position(w & 0xFFFFFFFF)
            # pop_on_advance pops when the switch actually moves: a router already at its last position
            # (no ring mode) stays put and passes the command on (cholesky's row switches rely on it).
            if self.pop_mode == "always_pop" or (self.pop_mode == "pop_on_advance" and nxt != self.cur):
                out = pop_command(w & 0xFFFFFFFF) | CTRL
        for d, nb, arrive in targets:
            if d == "RAMP":
                if ce is not None:
                    ce.push(self.machine.arrival(ce, t + timing.ROUTER_TO_CE), w)
            else:
                nb.accept(out, t + timing.HOP, arrive)
        if ctrl and nxt != self.cur:
            self.cur = nxt
            if self.switch_waiters:
                waiters, self.switch_waiters = self.switch_waiters, []
                for fn in waiters:
                    self.machine.at(t + 1, fn)
        if q:
            self._kick(t + 1)

    def _to_ce(self, w: int) -> bool:
        """Whether the wavelet at the head goes down the RAMP to the CE (without changing any state:
        a counter filter moves on in `forwarded_to_ce`)."""
        if w & CTRL:
            _, ignore = commands(w & 0xFFFFFFFF)[0]
            return not ignore
        if self.filter is not None:
            return self.filter.passes(w)
        return True

    def _next_position(self, payload: int) -> int:
        """The switch position after this router applies the payload's head command (after the
        wavelet has gone through by the current position)."""
        op, _ = commands(payload)[0]
        if op == TEARDOWN:
            raise CslRuntimeError(f"{self}: teardown is not supported by the executor")
        if not any(p is not None for p in self.positions[1:]):
            return self.cur
        if op == SWITCH_RST:
            return 0
        if op != SWITCH_ADV:
            return self.cur
        nxt = self.cur + 1
        while nxt < 4 and self.positions[nxt] is None:
            nxt += 1
        if nxt >= 4:
            return 0 if self.ring else self.cur
        return nxt


class RangeFilter:
    """`.filter = .{ .kind = .{ .range = true }, .min_idx, .max_idx }`: data wavelets whose index
    (upper 16 bits) lies in [min_idx, max_idx] reach the CE (SDK "Builtins"; topic-08)."""

    def __init__(self, lo: int, hi: int) -> None:
        self.lo, self.hi = lo, hi

    def passes(self, w: int) -> bool:
        return self.lo <= (w >> 16) & 0xFFFF <= self.hi

    def count(self, w: int) -> None:
        pass


class CounterFilter:
    """`.filter = .{ .kind = .{ .counter = true }, .limit1, .max_counter, .init_counter, .count_data,
    .count_control }`: a counter steps once per counted wavelet and wraps to 0 after `limit1`; a
    counted data wavelet reaches the CE while the counter is at most `max_counter`. The SDK page lists
    the fields without their arithmetic; this reading is the one fft-1d-2d's comment describes ("each
    PE catches one element in every N-1 elements": limit1 = (N-1) x brick - 1, max_counter = brick - 1,
    init_counter placing each PE's window), and its 2-D runs check it."""

    def __init__(self, limit: int, max_counter: int, counter: int, data: bool, control: bool) -> None:
        self.limit, self.max_counter, self.counter = limit, max_counter, counter
        self.data, self.control = data, control

    def counted(self, w: int) -> bool:
        return self.control if w & CTRL else self.data

    def passes(self, w: int) -> bool:
        return not self.counted(w) or self.counter <= self.max_counter

    def count(self, w: int) -> None:
        if self.counted(w):
            self.counter = 0 if self.counter >= self.limit else self.counter + 1


FILTER_FIELDS = {
    "range": {"kind", "min_idx", "max_idx"},
    "counter": {"kind", "limit1", "max_counter", "init_counter", "count_data", "count_control", "fast_mode"},
}


def make_filter(f: Struct, where: str) -> RangeFilter | CounterFilter:
    kind = f.get("kind")
    chosen = [
        k for k in ("range", "counter", "sparse_counter") if isinstance(kind, Struct) and kind.get(k, False)
    ]
    if len(chosen) != 1:
        raise CslCompileError(f"{where}: a filter's `.kind` sets one of range, counter, sparse_counter")
    if chosen[0] not in FILTER_FIELDS:
        raise CslCompileError(f"{where}: {chosen[0]} filters are not supported by the executor")
    extra = set(f.names()) - FILTER_FIELDS[chosen[0]]
    if extra:
        raise CslCompileError(f"{where}: unknown {chosen[0]} filter field(s) {', '.join(sorted(extra))}")
    if chosen[0] == "range":
        return RangeFilter(int(f.get("min_idx", 0)), int(f.get("max_idx", 0xFFFF)))
    return CounterFilter(
        int(f.get("limit1", 0)),
        int(f.get("max_counter", 0)),
        int(f.get("init_counter", 0)),
        bool(f.get("count_data", True)),
        bool(f.get("count_control", False)),
    )


def _dirs(v: Any) -> list[str]:
    if isinstance(v, Direction):
        return [v.name]
    if isinstance(v, Struct):
        return [d.name for d in v.values()]
    raise CslCompileError(f"expected a direction, found {v!r}")
