"""The simulated wafer: PEs, routers, memcpy, and the event loop that drives them.

Everything happens at integer cycles on one event heap: router steps, output-queue drains,
microthread steps, task picks, memcpy transfers. Nothing is polled, so an idle PE or router costs
nothing. The host's memcpy commands run one at a time, in issue order, each waiting until every PE
of the kernel has called `unblock_cmd_stream()` since the last launch (the SDK's "every PE must make
it"; the executor applies it to the whole rectangle, the stricter reading).

When the heap empties while a host call still waits, nothing can ever move again: `run_until` raises
`CslDeadlock` with a report of every PE, queue, microthread and router that still holds or waits for
something.
"""

from __future__ import annotations

import heapq
import itertools
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np
from greenlet import greenlet

from csl_executor import timing
from csl_executor.compiler import csl_location
from csl_executor.errors import CslDeadlock, CslError, CslRuntimeError
from csl_executor.fabric import CTRL, Channel, RouterColor, ramp_has_room
from csl_executor.layout import CompiledLayout
from csl_executor.pe import PE
from csl_executor.program import ColorConfig
from csl_executor.schedule import Schedule, parse_schedule


class Machine:
    """One run of a compiled program: the state `SdkRuntime` drives."""

    def __init__(
        self,
        compiled: CompiledLayout,
        trace_pe: tuple[int, int] | None = None,
        log_dir: str | Path | None = None,
        max_cycles: int = 10**12,
        picker: str | None = None,
        schedule: str | Schedule | None = None,
    ) -> None:
        self.compiled = compiled
        self.arch = compiled.options.arch
        self.now = 0
        self.heap: list = []
        self.seq = itertools.count()
        self.main = greenlet.getcurrent()
        self.trace_pe = trace_pe
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self.max_cycles = max_cycles
        # Which runnable task a PE takes first, and latency jitter: csl_executor.schedule.
        self.schedule = parse_schedule(schedule if schedule is not None else picker)
        self.events = 0
        self.wall = 0.0
        self.routers: dict[tuple[int, int, int], RouterColor] = {
            key: RouterColor(self, key[0], key[1], key[2], cfg) for key, cfg in compiled.routes.items()
        }
        # colors whose routes a program changes at run time: a wavelet their current route does not
        # take waits for the change instead of failing
        self.reconfigurable_colors: set[int] = set()
        for prog in compiled.programs:
            self.reconfigurable_colors |= prog.native_state.get("reset_colors", set())
        self.pes: dict[tuple[int, int], PE] = {}
        for xy, prog in compiled.pe_program.items():
            self.pes[xy] = PE(self, xy[0], xy[1], prog)
        colors = compiled.layout.memcpy_colors
        self.h2d_colors = {c for n, c in colors.items() if n.startswith("MEMCPYH2D")}
        self.d2h_colors = {c for n, c in colors.items() if n.startswith("MEMCPYD2H")}
        self.egress: dict[tuple[int, int, int], Channel] = {}
        self.commands: deque = deque()
        self.active: Command | None = None
        self.blocked_pes = 0
        self.last_command_end = 0
        # (kind, start, end) of the latest host commands, in cycles: a step's edge-to-edge time is the
        # span from its first H2D's start to its last D2H's end (tools/bench/csl_cycles.py).
        self.command_times: deque[tuple[str, int, int]] = deque(maxlen=64)
        self.log_lines: list[str] = []
        self.collectives: dict = {}
        self.warnings: list[str] = []

    # -- events ----------------------------------------------------------------------------------------
    def at(self, t: int, fn: Any) -> None:
        heapq.heappush(self.heap, (t, next(self.seq), fn))

    def run_until(self, done: Any, what: Any) -> None:
        """Process events until `done()`; a heap that empties first is a deadlock. `what` is a string
        or a callable giving one, read when the report is written (a command's progress changes)."""
        self.main = greenlet.getcurrent()
        start = time.perf_counter()
        heap = self.heap
        try:
            while not done():
                if not heap:
                    raise CslDeadlock(
                        f"deadlock at cycle {self.now} while waiting for {what() if callable(what) else what}",
                        self.report(),
                    )
                t, _, fn = heapq.heappop(heap)
                if t > self.max_cycles:
                    raise CslRuntimeError(
                        f"the program ran past {self.max_cycles} cycles waiting for "
                        f"{what() if callable(what) else what}\n{self.report()}"
                    )
                self.now = t
                self.events += 1
                fn(t)
        except CslError as exc:
            if isinstance(exc, CslDeadlock):
                raise
            where = csl_location(exc.__traceback__)
            if where and not str(exc).startswith(where):
                raise type(exc)(f"{where}: {exc}") from None
            raise
        except (IndexError, ZeroDivisionError, OverflowError, ValueError, TypeError) as exc:
            where = csl_location(exc.__traceback__)
            if where is None:
                raise
            raise CslRuntimeError(f"{where}: {type(exc).__name__}: {exc}") from exc
        finally:
            self.wall += time.perf_counter() - start

    def run_idle(self, what: str = "the fabric to settle") -> None:
        """Process every pending event (used before reading results on stop)."""
        self.run_until(lambda: not self.heap, what)

    def warn(self, message: str) -> None:
        """A run-time warning, printed once to stderr: the run goes on."""
        if message not in self.warnings:
            self.warnings.append(message)
            print(f"executor: warning: {message}", file=sys.stderr)

    def arrival(self, ch: Channel, t: int) -> int:
        """When a wavelet reaches a CE's input: at t, plus the schedule's jitter, never before the
        wavelet ahead of it in the same queue."""
        ready = t + self.schedule.delay()
        return max(ready, ch.q[-1][0]) if ch.q else ready

    def reset_routes(self, pe: PE, color: int, rx: tuple[str, ...], tx: tuple[str, ...], where: str) -> None:
        """`tile_config.color_config.reset_routes`: the PE's router takes a new route for `color`
        (its switch positions cleared); wavelets it holds go on by the new route (WaferLLM's Decode
        turns a route while its neighbours' first wavelets for the new one already wait in it)."""
        from csl_executor import arch as archs

        archs.check_routed_color(self.arch, color, where, self.compiled.options.memcpy)
        key = (pe.x, pe.y, color)
        router = self.routers.get(key)
        cfg = ColorConfig(tuple(rx), tuple(tx), where=where)
        if router is None:
            self.routers[key] = RouterColor(self, pe.x, pe.y, color, cfg)
        else:
            router.reconfigure(cfg)
        for dx, dy in ((0, 0), (1, 0), (-1, 0), (0, 1), (0, -1)):  # who may hold this router as a target
            nb = self.routers.get((pe.x + dx, pe.y + dy, color))
            if nb is not None:
                nb.targets_cache.clear()

    # -- lookups used by routers and PEs -------------------------------------------------------------
    def router(self, x: int, y: int, color: int) -> RouterColor | None:
        return self.routers.get((x, y, color))

    def pe_input(self, x: int, y: int, color: int) -> Channel:
        pe = self.pes.get((x, y))
        if pe is None:
            raise CslRuntimeError(
                f"a wavelet on color {color} is delivered to PE ({x}, {y}), which has no program"
            )
        return pe.input(color)

    def memcpy_egress(self, pe: PE, color: int) -> Channel | None:
        if color not in self.d2h_colors:
            return None
        key = (pe.x, pe.y, color)
        ch = self.egress.get(key)
        if ch is None:
            ch = Channel(self, timing.MEMCPY_PATH_DEPTH, f"memcpy D2H path of {pe} (color {color})")
            self.egress[key] = ch
        return ch

    def collective(self, pe: PE, axis, op: str, root, buf0, buf1, count, cb, where: str) -> None:
        from csl_executor.collectives import run_collective

        run_collective(self, pe, axis, op, int(root), int(buf0), int(buf1), int(count), int(cb), where)

    # -- logging -------------------------------------------------------------------------------------
    def trace(self, pe: PE, t: int, message: str) -> None:
        if self.trace_pe is not None and (pe.x, pe.y) == self.trace_pe:
            print(f"[{t:>8}] {pe}: {message}", flush=True)

    def log(self, pe: PE, line: str) -> None:
        self.log_lines.append(f"@{pe.t} P{pe.x}.{pe.y}: {line}")

    def flush_log(self) -> None:
        if self.log_dir is not None and self.log_lines:
            with open(self.log_dir / "sim.log", "a") as f:
                f.write("\n".join(self.log_lines) + "\n")
            self.log_lines.clear()

    # -- host commands -----------------------------------------------------------------------------------
    def submit(self, cmd: Command) -> Command:
        self.commands.append(cmd)
        self._next_command()
        return cmd

    def _next_command(self) -> None:
        if self.active is not None or not self.commands or self.blocked_pes:
            return
        cmd = self.commands.popleft()
        self.active = cmd
        start = max(self.now, self.last_command_end) + timing.COMMAND_LATENCY
        cmd.started_at = start
        self.at(start, cmd.start)

    def command_done(self, cmd: Command, t: int) -> None:
        cmd.done = True
        self.active = None
        self.last_command_end = t
        self.command_times.append((type(cmd).__name__, cmd.started_at, t))
        self._next_command()

    def cmd_unblocked(self, pe: PE) -> None:
        self.blocked_pes -= 1
        self._next_command()

    def launch_on_all(self, fn_name: str, args_by_pe: dict, t: int) -> None:
        for xy, pe in self.pes.items():
            fn, args = args_by_pe[xy]
            if not pe.cmd_blocked:
                self.blocked_pes += 1
            pe.launch(fn, args)

    # -- the deadlock report ---------------------------------------------------------------------------
    def report(self, limit: int = 40) -> str:
        lines: list[str] = []
        if self.active is not None:
            lines.append(f"host: {self.active.describe()} is in progress")
        for cmd in self.commands:
            lines.append(f"host: {cmd.describe()} waits behind it")
        if self.blocked_pes:
            blocked = [pe for pe in self.pes.values() if pe.cmd_blocked]
            names = ", ".join(f"({p.x}, {p.y})" for p in blocked[:8])
            lines.append(
                f"host: memcpy is blocked until every PE calls unblock_cmd_stream(); {len(blocked)} PE(s) have "
                f"not since the last launch: {names}{' ...' if len(blocked) > 8 else ''}"
            )
        for pe in self.pes.values():
            parts = []
            if pe.current is not None:
                w = pe.waiting_on
                reason = w.describe() if hasattr(w, "describe") else w
                parts.append(f"{pe.running or 'a task'} waits: {reason or 'running'}")
            for m in pe.micro:
                parts.append(f"microthread {m.describe()}")
            for tid in range(64):
                if pe.active[tid] and pe.blocked[tid]:
                    parts.append(f"task {tid} is activated but blocked")
            for color, ch in pe.inputs.items():
                if ch.q:
                    head = ch.q[0][1]
                    kind = "control" if head & CTRL else "data"
                    parts.append(f"{len(ch.q)} wavelet(s) wait at the CE on color {color} (head: {kind})")
            for q, ch in pe.outq.items():
                if ch.q:
                    parts.append(f"output queue {q} holds {len(ch.q)} wavelet(s) for color {ch.q[0][1][0]}")
            for i, f in enumerate(pe.fifos):
                if f.q:
                    parts.append(f"FIFO {i} holds {len(f.q)} element(s)")
            if parts:
                lines.append(f"PE ({pe.x}, {pe.y}) [{Path(pe.program.path).name}]: " + "; ".join(parts))
        for r in self.routers.values():
            if r.buf.q:
                blocking = []
                for d, nb, _ in r.targets():
                    if d == "RAMP":
                        ce = self.pes.get((r.x, r.y))
                        ce_in = ce.inputs.get(r.color) if ce else None
                        if ce_in is not None and ce_in.free() <= 0:
                            blocking.append("its CE input is full")
                    elif nb.buf.free() <= 0:
                        blocking.append(f"{d} neighbour full")
                lines.append(
                    f"router ({r.x}, {r.y}) color {r.color}: {len(r.buf.q)} wavelet(s) held"
                    + (f" ({', '.join(blocking)})" if blocking else "")
                )
        for (x, y, c), ch in self.egress.items():
            if ch.q:
                lines.append(
                    f"memcpy D2H path of PE ({x}, {y}) color {c} holds {len(ch.q)} wavelet(s), no D2H reads it"
                )
        if not lines:
            lines.append("nothing is pending anywhere: the host waits for something no program will do")
        if len(lines) > limit:
            lines = lines[:limit] + [f"... and {len(lines) - limit} more"]
        return "\n".join("  " + s for s in lines)

    def stats(self) -> dict[str, Any]:
        hops = sum(r.forwarded for r in self.routers.values())
        return {
            "cycles": self.now,
            "events": self.events,
            "wavelet_hops": hops,
            "wall_s": self.wall,
            "pes": len(self.pes),
            "tasks": sum(p.tasks_run for p in self.pes.values()),
            "schedule": str(self.schedule),
        }


class Command:
    done = False
    started_at = 0  # the cycle the machine started it (`_next_command`)

    def __init__(self, machine: Machine) -> None:
        self.m = machine

    def start(self, t: int) -> None:  # pragma: no cover - every command overrides it
        raise NotImplementedError

    def describe(self) -> str:
        return type(self).__name__


def roi(px: int, py: int, w: int, h: int) -> list[tuple[int, int]]:
    return [(x, y) for y in range(py, py + h) for x in range(px, px + w)]


def host_index(h: int, w: int, elems: int, order_row_major: bool) -> np.ndarray:
    """For each (y, x, e) of the rectangle in row-major (h, w, elems) order: its index in the host
    array (ROW_MAJOR: (h, w, elems); COL_MAJOR: Fortran order over (h, w, elems))."""
    ys, xs, es = np.meshgrid(np.arange(h), np.arange(w), np.arange(elems), indexing="ij")
    if order_row_major:
        return ((ys * w + xs) * elems + es).reshape(-1)
    return (ys + h * (xs + w * es)).reshape(-1)


class CopyCommand(Command):
    """Copy-mode memcpy: words straight into / out of an exported symbol of every PE of the ROI."""

    def __init__(self, m, to_device, export_name, array, rect, elems, words_per_elem, row_major) -> None:
        super().__init__(m)
        self.to_device = to_device
        self.name = export_name
        self.array = array
        self.rect = rect
        self.elems = elems
        self.wpe = words_per_elem
        self.row_major = row_major

    def describe(self) -> str:
        px, py, w, h = self.rect
        return f"memcpy_{'h2d' if self.to_device else 'd2h'}({self.name!r}, {w} x {h} PEs at ({px}, {py}), {self.elems} per PE)"

    def start(self, t: int) -> None:
        px, py, w, h = self.rect
        idx = host_index(h, w, self.elems, self.row_major).reshape(h, w, self.elems)
        flat = self.array.reshape(-1).view(np.uint32)
        for j in range(h):
            for i in range(w):
                pe = self.m.pes.get((px + i, py + j))
                if pe is None:
                    raise CslRuntimeError(f"{self.describe()}: PE ({px + i}, {py + j}) has no program")
                exp = pe.program.exports.get(self.name)
                if exp is None or exp.kind != "data":
                    raise CslRuntimeError(
                        f"{self.describe()}: PE ({px + i}, {py + j}) exports no symbol {self.name!r}"
                    )
                if self.elems > exp.length:
                    message = (
                        f"{self.describe()}: {self.elems} elements per PE, but {self.name!r} on PE "
                        f"({px + i}, {py + j}) holds {exp.length}"
                    )
                    if self.to_device or exp.addr + self.elems * self.wpe > len(pe.mem16):
                        raise CslRuntimeError(message)
                    # Reading past the symbol reads the words after it, as memcpy does on the
                    # hardware (25-pt-stencil reads 6 words of a 5-word array and uses 5).
                    self.m.warn(
                        f"{self.describe()}: {self.elems} elements per PE, but {self.name!r} holds "
                        f"{exp.length}; the words after it are read"
                    )
                sel = idx[j, i]
                a = exp.addr
                view: np.ndarray
                if self.wpe == 2:
                    view = pe.mem16[a : a + 2 * self.elems].view(np.uint32)
                    if self.to_device:
                        view[:] = flat[sel]
                    else:
                        flat[sel] = view
                else:
                    view = pe.mem16[a : a + self.elems]
                    if self.to_device:
                        view[:] = (flat[sel] & 0xFFFF).astype(np.uint16)
                    else:
                        flat[sel] = view.astype(np.uint32)
        end = t + -(-self.elems * self.wpe // timing.COPY_WORDS_PER_CYCLE)
        self.m.at(end, lambda t2: self.m.command_done(self, t2))


class StreamH2D(Command):
    """Streaming H2D: each element becomes one wavelet delivered to its PE's CE on the color."""

    def __init__(self, m, color, array, rect, elems, row_major) -> None:
        super().__init__(m)
        self.color = color
        self.rect = rect
        self.elems = elems
        px, py, w, h = rect
        idx = host_index(h, w, elems, row_major).reshape(h, w, elems)
        flat = array.reshape(-1).view(np.uint32)
        self.per_pe = {
            (px + i, py + j): deque(int(v) for v in flat[idx[j, i]]) for j in range(h) for i in range(w)
        }
        self.pending = 0

    def describe(self) -> str:
        px, py, w, h = self.rect
        left = sum(len(q) for q in self.per_pe.values())
        return f"streaming memcpy_h2d(color {self.color}, {w} x {h} PEs at ({px}, {py}), {self.elems} per PE, {left} not yet taken)"

    def start(self, t: int) -> None:
        for xy, q in self.per_pe.items():
            pe = self.m.pes.get(xy)
            if pe is None:
                raise CslRuntimeError(f"{self.describe()}: PE {xy} has no program")
            if not q:
                continue
            self.pending += 1
            feeder = _Feeder(self, pe, q)
            feeder.kick(t)
        if self.pending == 0:
            self.m.command_done(self, t)

    def feeder_done(self, t: int) -> None:
        self.pending -= 1
        if self.pending == 0:
            self.m.command_done(self, t)


class _Feeder:
    """Moves one PE's share of a streaming H2D into the PE, one wavelet per cycle, through the
    memcpy path's buffer (`timing.MEMCPY_PATH_DEPTH`)."""

    def __init__(self, cmd: StreamH2D, pe: PE, q: deque) -> None:
        self.cmd, self.pe, self.q = cmd, pe, q
        self.path = Channel(cmd.m, timing.MEMCPY_PATH_DEPTH, f"memcpy H2D path of {pe} (color {cmd.color})")
        self.at = -1
        self.mover_at = -1
        self.finished = False

    def kick(self, t: int) -> None:
        if 0 <= self.at <= t:
            return
        self.at = t
        self.cmd.m.at(t, self.step)

    def step(self, t: int) -> None:
        self.at = -1
        if self.q:
            if self.path.free() > 0:
                self.path.push(t + 1, self.q.popleft())
                self.move_kick(t + 1)
                if self.q:
                    self.kick(t + 1)
            else:
                self.path.wait_space(self.kick)
        if not self.q and not self.finished:
            self.finished = True
            self.cmd.feeder_done(t)

    def move_kick(self, t: int) -> None:
        if 0 <= self.mover_at <= t:
            return
        self.mover_at = t
        self.cmd.m.at(t, self.move)

    def move(self, t: int) -> None:
        self.mover_at = -1
        if not self.path.q:
            return
        ready, w = self.path.q[0]
        if ready > t:
            self.move_kick(ready)
            return
        ce = self.pe.input(self.cmd.color)
        if not ramp_has_room(ce):
            ce.wait_space(self.move_kick)
            return
        self.path.pop(t)
        ce.push(self.cmd.m.arrival(ce, t + timing.ROUTER_TO_CE), w)
        if self.path.q:
            self.move_kick(t + 1)


class StreamD2H(Command):
    """Streaming D2H: `elems` wavelets from each PE of the ROI, taken from its memcpy path."""

    def __init__(self, m, color, array, rect, elems, row_major) -> None:
        super().__init__(m)
        self.color = color
        self.array = array
        self.rect = rect
        self.elems = elems
        px, py, w, h = rect
        self.idx = host_index(h, w, elems, row_major).reshape(h, w, elems)
        self.got = {(px + i, py + j): 0 for j in range(h) for i in range(w)}
        self.flat = array.reshape(-1).view(np.uint32)
        self.pending = 0

    def describe(self) -> str:
        px, py, w, h = self.rect
        got = sum(self.got.values())
        return (
            f"streaming memcpy_d2h(color {self.color}, {w} x {h} PEs at ({px}, {py}), {self.elems} per PE, "
            f"{got} of {self.elems * w * h} received)"
        )

    def start(self, t: int) -> None:
        px, py, _, _ = self.rect
        for x, y in self.got:
            pe = self.m.pes.get((x, y))
            if pe is None:
                raise CslRuntimeError(f"{self.describe()}: PE ({x}, {y}) has no program")
            if self.elems == 0:
                continue
            self.pending += 1
            _Drain(self, pe, x - px, y - py).kick(t)
        if self.pending == 0:
            self.m.command_done(self, t)

    def drained(self, t: int) -> None:
        self.pending -= 1
        if self.pending == 0:
            self.m.command_done(self, t)


class _Drain:
    def __init__(self, cmd: StreamD2H, pe: PE, i: int, j: int) -> None:
        self.cmd, self.pe, self.i, self.j = cmd, pe, i, j
        ch = cmd.m.memcpy_egress(pe, cmd.color)
        assert ch is not None  # a D2H stream's color is a memcpy D2H color by construction
        self.ch = ch
        self.at = -1

    def kick(self, t: int) -> None:
        if 0 <= self.at <= t:
            return
        self.at = t
        self.cmd.m.at(t, self.step)

    def step(self, t: int) -> None:
        self.at = -1
        key = (self.pe.x, self.pe.y)
        n = self.cmd.got[key]
        if n >= self.cmd.elems:
            return
        if not self.ch.q:
            self.ch.wait_data(self.kick)
            return
        ready, w = self.ch.q[0]
        if ready > t:
            self.kick(ready)
            return
        self.ch.pop(t)
        self.cmd.flat[self.cmd.idx[self.j, self.i, n]] = w & 0xFFFFFFFF
        self.cmd.got[key] = n + 1
        if n + 1 >= self.cmd.elems:
            self.cmd.drained(t)
        else:
            self.kick(t + 1)


class LaunchCommand(Command):
    def __init__(self, m, name: str, args_by_pe: dict) -> None:
        super().__init__(m)
        self.name = name
        self.args_by_pe = args_by_pe

    def describe(self) -> str:
        return f"launch({self.name!r})"

    def start(self, t: int) -> None:
        self.m.launch_on_all(self.name, self.args_by_pe, t)
        self.m.command_done(self, t)
