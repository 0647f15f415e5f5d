"""One processing element at run time: memory, the task picker, DSD operations and microthreads.

The compute engine (CE) runs one task at a time to completion. A task is the generated Python
function of a CSL `task` (or a launched `fn`), run in a greenlet so that a synchronous DSD operation
waiting on the fabric can suspend it while the rest of the machine goes on. The CE keeps its own
clock `t`: a task advances it by `timing.TASK_START`, one cycle per statement and the cycles of its
DSD operations; what it sends leaves at the cycle it was sent.

Picker (the Cerebras SDK documentation's "Tasks" and "Task IDs" pages): a task runs when its ID is activated and not blocked.
A local task's activation is a flag (several @activate before it runs make one run). A data task is
activated by each wavelet at the head of its channel (the color on WSE-2, the input queue on WSE-3)
and runs once per wavelet with the wavelet as its argument. A control wavelet at the head of a
channel runs the control task its entrypoint names, if the channel is unblocked. Among runnable
tasks, those of the highest `tile_config` priority (HIGH or LOW) compete, and the machine's schedule
picks one (csl_executor.schedule: local tasks before wavelet-triggered ones, the lowest ID first, by
default; the SDK leaves the order open).

Asynchronous DSD operations run as microthreads beside the CE, one element per cycle when a fabric
or FIFO operand is involved, and activate or unblock a task when they finish.
"""

from __future__ import annotations

from collections import deque
from dataclasses import replace
from typing import Any

import numpy as np
from greenlet import greenlet

from csl_executor import dsd as D
from csl_executor import timing
from csl_executor.arch import rules
from csl_executor.errors import CslRuntimeError
from csl_executor.fabric import CTRL, NO_ENTRY, Channel, entrypoint
from csl_executor.memory import pack_values
from csl_executor.program import FnSym, Program
from csl_executor.rt import F2H, H2F, U2F
from csl_executor.types import F16, F32, ArrayValue, Dsd, Dsr, Fifo, IntType, Pointer, PointerType

NTASKS = 64


def wavelet_decoder(param_types: list) -> Any:
    """Payload -> the arguments of a data or control task (csl-semantics section 1: one argument gets
    the payload (its low half if 16-bit); two 16-bit arguments get the low and the high half)."""

    def one(t, bits: int, width: int) -> Any:
        if t is F32:
            return U2F(bits)
        if t is F16:
            return H2F[bits & 0xFFFF]
        if isinstance(t, IntType):
            v = bits & ((1 << min(width, t.bits)) - 1) if t.bits < 32 else bits & 0xFFFFFFFF
            return t.wrap(v)
        raise CslRuntimeError(f"a task argument of type {t} cannot come from a wavelet")

    if not param_types:
        return lambda w: ()
    if len(param_types) == 1:
        t = param_types[0]
        return lambda w: (one(t, w, 32),)
    if len(param_types) == 2 and all(getattr(t, "words", 2) == 1 for t in param_types):
        a, b = param_types
        return lambda w: (one(a, w & 0xFFFF, 16), one(b, (w >> 16) & 0xFFFF, 16))
    raise CslRuntimeError("a data task takes one argument, or two 16-bit arguments")


class PE:
    def __init__(self, machine, x: int, y: int, program: Program) -> None:
        self.machine = machine
        self.x, self.y = x, y
        self.program = program
        self.arch = rules(program.arch)
        self.mem = bytearray(program.memory_image)
        self.mem16 = np.frombuffer(self.mem, dtype=np.uint16)
        self.views = D.typed_views(self.mem16)
        mv = memoryview(self.mem)
        self.mF, self.mI, self.mi = mv.cast("f"), mv.cast("I"), mv.cast("i")
        self.mH, self.mh = mv.cast("H"), mv.cast("h")
        self.S = [self._slot_value(s.initial) for s in program.slots]
        self.t = 0
        self.busy = False
        self.current: greenlet | None = None
        self.waiting_on: Any = ""  # what the running task is suspended on: a reason, or a StreamOp
        self.running = ""  # what the CE runs now ("launched f", "task 10 (t)"), for the deadlock report
        self.pick_at = -1
        self.task_fn: list[Any] = [None] * NTASKS
        self.task_kind: list[str | None] = [None] * NTASKS
        self.task_decode: list[Any] = [None] * NTASKS
        self.active = [False] * NTASKS
        self.active_since = [0] * NTASKS
        self.activated: set[int] = set()
        self.blocked = [True] * NTASKS  # unbound IDs start blocked; bound IDs start unblocked
        self.priority = [0] * NTASKS  # tile_config's task_priority: 1 HIGH, 0 LOW
        self.data_channel: dict[int, int] = {}  # data task ID -> color
        for tid, b in program.tasks.items():
            self.task_fn[tid] = b.fn.py
            self.task_kind[tid] = b.kind
            self.blocked[tid] = False
            if b.kind in ("data", "control"):
                self.task_decode[tid] = b.fn.py.decode
            if b.kind == "data":
                self.data_channel[tid] = self._data_color(tid)
        self.inputs: dict[int, Channel] = {}
        self.outq: dict[int, Channel] = {}
        self.out_drain: dict[int, Any] = {}
        self.fifos = [Channel(machine, f.length, f"fifo {f.index}") for f in program.fifos]
        self.dsrs: dict[tuple[str, int], tuple[Dsd, dict]] = {}
        self.busy_queues: dict[tuple[str, int], Any] = {}
        self.micro: list[StreamOp | MemAsyncOp] = []
        self.cmd_blocked = False
        self.launches: deque = deque()
        self.tsc_on = False
        self.tsc_base = 0
        self.rng = 0xDEADBEEF
        self.print_buf = ""
        self.traces: dict[str, list] = {k: [] for k in program.native_state.get("debug_traces", {})}
        self.tasks_run = 0
        self.busy_cycles = 0
        self.in_map = 0  # depth of @map calls running now (their operations start with the map)
        for op, tid, _where in program.startup:
            getattr(self, op)(tid)

    def __repr__(self) -> str:
        return f"PE ({self.x}, {self.y})"

    @staticmethod
    def _slot_value(v: Any) -> Any:
        return v.addr if isinstance(v, Pointer) else v

    def _data_color(self, tid: int) -> int:
        if self.arch.data_tasks_by_queue:
            bound = self.program.queue_colors.get(("input", tid))
            if bound is None:
                raise CslRuntimeError(f"{self}: data task {tid}'s input queue is not bound to a color")
            return bound[0]
        return tid

    # -- channels --------------------------------------------------------------------------------------
    def input(self, color: int) -> Channel:
        ch = self.inputs.get(color)
        if ch is None:
            cap = self._input_depth(color)
            q = self._input_queue_of(color)
            name = (
                f"{self} input queue {q} (color {color})" if q is not None else f"{self} input color {color}"
            )
            ch = Channel(self.machine, cap, name)
            ch.on_push = self._on_input
            self.inputs[color] = ch
        return ch

    def _input_queue_of(self, color: int) -> int | None:
        for (kind, q), (c, _) in self.program.queue_colors.items():
            if kind == "input" and c == color:
                return q
        for (kind, q), colors in self.program.queue_uses.items():
            if kind == "input" and color in colors:
                return q
        return None

    def check_queue_empty(self, q: int, color: int, where: str) -> None:
        """An operation reading `color` through input queue q: the queue must hold no wavelets of
        another color that shares it (SDK "DSDs": a queue must be empty before it is reused)."""
        for other in self.program.queue_uses.get(("input", q), {}):
            ch = self.inputs.get(other)
            if other != color and ch is not None and ch.q:
                raise CslRuntimeError(
                    f"{where}: input queue {q} on {self} still holds {len(ch.q)} wavelet(s) of color {other}; "
                    f"a queue must be empty before an operation reuses it for color {color}"
                )

    def _input_depth(self, color: int) -> int:
        for (kind, q), (c, _) in self.program.queue_colors.items():
            if kind == "input" and c == color:
                return self.arch.input_queues[q]
        if self.arch.name == "wse3":
            raise CslRuntimeError(
                f"a wavelet on color {color} reaches {self}'s CE, but no input queue is bound to color {color} "
                "(WSE-3 binds input queues with @initialize_queue)"
            )
        for (kind, q), colors in self.program.queue_uses.items():
            if kind == "input" and color in colors:
                return self.arch.input_queues[q]
        return timing.DEFAULT_CE_INPUT_DEPTH

    def _on_input(self, ready: int) -> None:
        if not self.busy:
            self.schedule_pick(ready)

    def output_queue(self, q: int, color: int) -> Channel:
        ch = self.outq.get(q)
        if ch is None:
            ch = Channel(self.machine, self.arch.output_queues[q], f"{self} output queue {q}")
            self.outq[q] = ch
            self.out_drain[q] = OutDrain(self, ch)
        if self.arch.name == "wse3":
            bound = self.program.queue_colors.get(("output", q))
            if bound is None:
                raise CslRuntimeError(
                    f"{self}: output queue {q} is used but never bound with @initialize_queue"
                )
            if bound[0] != color:
                raise CslRuntimeError(f"{self}: output queue {q} is bound to color {bound[0]}, not {color}")
        return ch

    def send(self, q: int | None, color: int, payloads: list[int], t0: int) -> None:
        """Wavelets from the CE into an output queue, one per cycle from t0 (the caller checked room)."""
        ch = self.output_queue(q if q is not None else 0, color)
        for i, w in enumerate(payloads):
            ch.push(t0 + i, (color, w))
        self.out_drain[q if q is not None else 0].kick(t0)

    # -- the picker ------------------------------------------------------------------------------------
    def schedule_pick(self, t: int) -> None:
        t = max(t, self.t)
        if 0 <= self.pick_at <= t:
            return
        self.pick_at = t
        self.machine.at(t, self.pick)

    def pick(self, t: int) -> None:
        self.pick_at = -1
        if self.busy:
            return
        t = max(t, self.t)
        if self.launches:
            fn, args = self.launches.popleft()
            self.run(fn.py, args, t, f"launched {fn.name}")
            return
        choice = self.runnable(t)
        if choice is None:
            return
        tid, args = choice
        fn = self.task_fn[tid]
        if fn is None:
            return
        self.run(
            fn, args, t, f"task {tid} ({self.program.tasks[tid].fn.name}{', ' + repr(args) if args else ''})"
        )

    def runnable(self, t: int) -> tuple[int, tuple] | None:
        """The next task to run, by the machine's picker policy (see `Machine.picker`)."""
        cands: list[tuple[int, int, str, int | None]] = []  # (stamp, id, kind, color)
        color: int | None
        for color, ch in list(self.inputs.items()):
            if not ch.head_ready(t):
                continue
            ready, w = ch.q[0]
            if w & CTRL:
                if self.blocked[self._channel_id(color)]:
                    continue
                entry = entrypoint(w & 0xFFFFFFFF)
                if entry == NO_ENTRY or self.task_kind[entry] != "control":
                    ch.pop(t)  # nothing to run: the CE drops the control wavelet
                    self.schedule_pick(t)
                    continue
                if not self.blocked[entry]:
                    cands.append((ready, entry, "ctrl", color))
        for tid, color in self.data_channel.items():
            if self.blocked[tid]:
                continue
            ich = self.inputs.get(color)
            if (
                ich is not None
                and ich.head_ready(t)
                and not ich.q[0][1] & CTRL
                and not self._fabin_reading(color)
            ):
                cands.append((ich.q[0][0], tid, "data", color))
        for tid in self.activated:
            if not self.blocked[tid]:
                cands.append((self.active_since[tid], tid, "local", None))
        if not cands:
            return None
        top = max(self.priority[c[1]] for c in cands)  # HIGH tasks before LOW ones (tile_config)
        _, tid, kind, color = self.machine.schedule.choose([c for c in cands if self.priority[c[1]] == top])
        if kind == "local":
            self.active[tid] = False
            self.activated.discard(tid)
            if self.task_kind[tid] is None:
                raise CslRuntimeError(f"{self}: task ID {tid} is activated but no task is bound to it")
            return tid, ()
        assert color is not None  # "data" and "ctrl" candidates carry their color
        w = self.inputs[color].pop(t)
        return tid, self.task_decode[tid](w & 0xFFFFFFFF)

    def _channel_id(self, color: int) -> int:
        if self.arch.data_tasks_by_queue:
            for (kind, q), (c, _) in self.program.queue_colors.items():
                if kind == "input" and c == color:
                    return q
            return 0
        return color

    def _fabin_reading(self, color: int) -> bool:
        return any(m.reads_color(color) for m in self.micro)

    def run(self, fn: Any, args: tuple, t: int, what: str) -> None:
        self.busy = True
        self.tasks_run += 1
        start = t
        self.t = t + timing.TASK_START + self.machine.schedule.delay()
        g = greenlet(self._task_body, parent=self.machine.main)
        self.current = g
        self.running = what
        self.machine.trace(self, t, f"start {what}")
        g.switch(fn, args, start)

    def _task_body(self, fn: Any, args: tuple, start: int) -> None:
        fn(self, *args)
        self.busy = False
        self.current = None
        self.busy_cycles += self.t - start
        self.machine.trace(self, self.t, "task done")
        self.schedule_pick(self.t)

    def suspend(self, reason: Any) -> None:
        """Called inside a task: give the machine back until `resume` is scheduled. `reason` is a
        string or an operation whose `describe()` the deadlock report reads when it is written (an
        operation's position and what blocks it change while the task waits)."""
        if greenlet.getcurrent() is not self.current:
            raise CslRuntimeError(f"{self}: a blocking operation outside a task ({reason})")
        self.waiting_on = reason
        self.machine.main.switch()
        self.waiting_on = ""

    def resume(self, t: int) -> None:
        self.t = max(self.t, t)
        g = self.current
        if g is not None and not g.dead:
            g.switch()

    # -- builtins called by generated code ------------------------------------------------------------
    def _tid(self, tid: Any) -> int:
        if isinstance(tid, tuple):  # a task referenced by its function before it was bound
            resolved = self.program.task_fn(tid[1])
            if resolved is None:
                raise CslRuntimeError(f"{self}: task {tid[1].name} is never bound to an ID")
            return resolved
        return tid

    def activate(self, tid: Any) -> None:
        self._set_active(self._tid(tid), self.t)
        if not self.busy:
            self.schedule_pick(self.t)

    def _set_active(self, tid: int, t: int) -> None:
        """Activation is a flag: activating an activated task changes nothing (csl-semantics §1)."""
        if not self.active[tid]:
            self.active[tid] = True
            self.active_since[tid] = t
            self.activated.add(tid)

    def activate_at(self, tid: int, t: int) -> None:
        """An activation coming from outside the CE (a library's completion) at cycle t."""
        self._set_active(tid, t)
        if not self.busy:
            self.schedule_pick(t)

    def reset_routes(self, color: int, rx: tuple[str, ...], tx: tuple[str, ...], where: str) -> None:
        # at the CE's own time, which runs ahead of the event being processed: what the task sent
        # before still leaves by the old route
        self.machine.at(self.t, lambda t: self.machine.reset_routes(self, color, rx, tx, where))

    def set_task_priority(self, tid: Any, high: int | None = None) -> None:
        if high is None:  # from the program's startup list: (task ID, level)
            tid, high = tid
        self.priority[self._tid(tid)] = 1 if high else 0

    def block(self, tid: Any) -> None:
        self.blocked[self._tid(tid)] = True

    def unblock(self, tid: Any) -> None:
        self.blocked[self._tid(tid)] = False
        if not self.busy:
            self.schedule_pick(self.t)

    def check(self, ok: bool, where: str) -> None:
        if not ok:
            raise CslRuntimeError(f"{where}: @assert failed on {self}")

    def unblock_cmd_stream(self) -> None:
        if self.cmd_blocked:
            self.cmd_blocked = False
            self.machine.cmd_unblocked(self)

    def write_array(self, addr: int, value: ArrayValue) -> None:
        data = pack_values(value.type, value)
        self.mem16[addr : addr + len(data)] = data

    def tsc_enable(self) -> None:
        self.tsc_on = True
        self.tsc_base = self.t

    def tsc_disable(self) -> None:
        self.tsc_on = False

    def tsc_reset(self) -> None:
        self.tsc_base = self.t

    def tsc_read(self, addr: int, where: str) -> None:
        v = (self.t - self.tsc_base) if self.tsc_on else 0
        for k in range(3):
            self.mH[addr + k] = (v >> (16 * k)) & 0xFFFF

    def random_seed(self, seed: int) -> None:
        self.rng = seed or 0xDEADBEEF

    def random_f32(self, lo: float, hi: float) -> float:
        x = self.rng  # xorshift32: the executor's own sequence (the SDK's generator is not public)
        x ^= (x << 13) & 0xFFFFFFFF
        x ^= x >> 17
        x ^= (x << 5) & 0xFFFFFFFF
        self.rng = x
        from csl_executor.rt import F32

        return F32(lo + (hi - lo) * (x / 4294967296.0))

    def simprint(self, text: str) -> None:
        self.print_buf += text
        while "\n" in self.print_buf:
            line, self.print_buf = self.print_buf.split("\n", 1)
            self.machine.log(self, line)

    def trace(self, key: str, kind: str, value: Any) -> None:
        buf = self.traces[key]
        if kind == "timestamp":
            value = self.t
        buf.append(value)

    # -- DSD operations --------------------------------------------------------------------------------
    def load_dsr(self, dsr: Any, dsd: Dsd | None = None, opts: dict | None = None) -> None:
        if dsd is None:  # from the program's startup list: (dsr, dsd, opts)
            dsr, dsd, opts = dsr
        self.dsrs[(dsr.kind, dsr.id)] = (dsd, opts or {})

    def _resolve_dsrs(self, spec: D.OpSpec, operands: tuple) -> tuple[D.OpSpec, tuple, list]:
        """DSR operands -> the DSDs they hold; options loaded with a DSR (async, activate, ...) apply
        to the operation; `save_address` DSRs are advanced after it."""
        out, saved, extra = [], [], {}
        for position, o in enumerate(operands):
            if isinstance(o, Dsr):
                held = self.dsrs.get((o.kind, o.id))
                if held is None:
                    raise CslRuntimeError(f"{spec.where}: {o} is used before any @load_to_dsr on {self}")
                dsd, opts = held
                extra.update({k: v for k, v in opts.items() if k not in ("save_address", "single_step")})
                if opts.get("save_address"):
                    saved.append((o, position))
                out.append(dsd)
            else:
                out.append(o)
        if extra:
            spec = replace(spec, opts={**spec.opts, **extra})
        return spec, tuple(out), saved

    def _advance_dsrs(self, saved: list, n: int, words: list[int]) -> None:
        """Move each `save_address` DSR past the n elements the operation used, in its operand's own
        element width (an f16 source of @fmachs steps by 16-bit words, its f32 destination by 32)."""
        for o, position in saved:
            dsd, opts = self.dsrs[(o.kind, o.id)]
            if dsd.kind == "mem1d":
                dsd = dsd.changed(base=dsd.base + n * dsd.stride * words[position])
                self.dsrs[(o.kind, o.id)] = (dsd, opts)

    def dsd_op(self, spec: D.OpSpec, operands: tuple, index: int | None = None) -> None:
        if not self.in_map:  # an operation in a @map's function is one step of the map, started once
            self.t += timing.DSD_SETUP + self.machine.schedule.delay()
        saved: list = []
        if any(isinstance(o, Dsr) for o in operands):
            spec, operands, saved = self._resolve_dsrs(spec, operands)
        if index is not None:
            operands = tuple(
                o.changed(base=o.base + index) if isinstance(o, Dsd) and o.wavelet_index_offset else o
                for o in operands
            )
        n = D.op_length(operands)
        if self.machine.trace_pe is not None:
            self.machine.trace(self, self.t, f"@{spec.name} of {n} ({spec.where})")
        if saved:
            types = [spec.dtype, *D.src_types(spec)]
            self._advance_dsrs(
                saved, n, [D.WORDS[types[min(i, len(types) - 1)]] for i in range(len(operands))]
            )
        streaming = any(
            (isinstance(o, Dsd) and o.kind in ("fabin", "fabout")) or isinstance(o, Fifo) for o in operands
        )
        if not streaming:
            self.mem_op(spec, operands, n)
            return
        op = StreamOp(self, spec, operands, n)
        if spec.is_async:
            op.claim()
            self.micro.append(op)
            op.advance(self.t)
        else:
            op.sync = True
            op.advance(self.t)
            while not op.done:
                self.suspend(op)
            self.t = max(self.t, op.t)

    def mem_op(self, spec: D.OpSpec, operands: tuple, n: int) -> None:
        if n > 0:
            dest, srcs = operands[0], operands[1:]
            stypes = D.src_types(spec)
            width = 32 if D.WORDS[spec.dtype] == 2 else 16
            rate = timing.ELEMENTS_PER_CYCLE[(self.arch.name, width)]
            self._mem_compute(spec, dest, srcs, stypes, n)
            cycles = max(1, -(-n // rate))
        else:
            cycles = 0
        if spec.is_async:
            # An asynchronous operation over memory still occupies its microthread (an explicit
            # .ut_id) until it ends: another one started on it meanwhile is refused.
            op = MemAsyncOp(self, spec, self.t + cycles)
            op.claim()
            self.micro.append(op)
            self.machine.at(op.end, op.finish)
        else:
            self.t += cycles

    def _mem_compute(self, spec: D.OpSpec, dest: Any, srcs: tuple, stypes: list[str], n: int) -> None:
        if not self._strided_compute(spec, dest, srcs, stypes, n):
            self._indexed_compute(spec, dest, srcs, stypes, n)

    def _indexed_compute(self, spec: D.OpSpec, dest: Any, srcs: tuple, stypes: list[str], n: int) -> None:
        """Any operation over memory, through the word addresses of its operands' elements."""
        where = spec.where
        didx = D.mem_indices(dest, n, D.WORDS[spec.dtype], where)
        src_idx = [
            D.mem_indices(s, n, D.WORDS[st], where) if isinstance(s, (Dsd, D.ScalarPtr)) else None
            for s, st in zip(srcs, stypes, strict=True)
        ]
        self._bounds(didx, spec.dtype, where)
        for idx, st in zip(src_idx, stypes, strict=True):
            if idx is not None:
                self._bounds(idx, st, where)
        if isinstance(dest, D.ScalarPtr) and n > 1:
            # `@fmaxs(&m, m, v)`: a pointer destination with its own value as a scalar source is a
            # running reduction (25-pt-stencil's max and min over a vector check against golden
            # values): from the second step on, that source reads the destination.
            current = D.read_mem(self.mem16, didx[:1], spec.dtype, where)[0]
            for k, (s, st) in enumerate(zip(srcs, stypes, strict=True)):
                if isinstance(s, D.Scalar) and st == spec.dtype:
                    if D.scalar_array(s, 1, st)[0].tobytes() == current.tobytes():
                        src_idx[k] = didx
            self._sequential(spec, didx, srcs, src_idx, stypes, n)
            return
        if _hazard(didx, src_idx):
            self._sequential(spec, didx, srcs, src_idx, stypes, n)
            return
        values = []
        for s, idx, st in zip(srcs, src_idx, stypes, strict=True):
            if idx is not None:
                values.append(D.read_mem(self.mem16, idx, st, where))
            else:
                values.append(D.scalar_array(s, n, st))
        out = D.compute(spec.name, values, spec.dtype, spec.stype)
        D.write_mem(self.mem16, didx, out, spec.dtype, where)

    def _strided_compute(self, spec: D.OpSpec, dest: Any, srcs: tuple, stypes: list[str], n: int) -> bool:
        """The common operation as one NumPy step over views of the memory: a mem1d destination that no
        step reads back, sources that are mem1d DSDs, scalar pointers or values. False, with nothing
        done, for everything else (a mem4d operand, a source overlapping the destination other than in
        place, an operand out of bounds or misaligned): the indexed path does those and reports errors."""
        if not isinstance(dest, Dsd):
            return False
        size = len(self.mem16)
        dspan = D.mem_span(dest, D.WORDS[spec.dtype])
        if dspan is None or dspan[1] == 0 or not D.span_in_memory(*dspan, n, spec.dtype, size):
            return False
        out_view = D.span_view(self.views, spec.dtype, *dspan, n)
        if out_view is None:
            return False
        dkey = (*dspan, spec.dtype)
        values = []
        for s, st in zip(srcs, stypes, strict=True):
            if isinstance(s, D.Scalar):
                values.append(D.scalar_array(s, n, st))
                continue
            span = D.mem_span(s, D.WORDS[st]) if isinstance(s, (Dsd, D.ScalarPtr)) else None
            if span is None or not D.span_in_memory(*span, n, st, size):
                return False
            in_place = span == dspan and D.WORDS[st] == D.WORDS[spec.dtype]
            if not in_place and not D.spans_apart((*span, st), dkey, n):
                return False
            view = D.span_view(self.views, st, *span, n)
            if view is None:
                return False
            values.append(view)
        out_view[...] = D.compute(spec.name, values, spec.dtype, spec.stype)
        return True

    def _sequential(self, spec, didx, srcs, src_idx, stypes, n) -> None:
        """Element by element: a later step reads what an earlier one wrote (an accumulator)."""
        where = spec.where
        for i in range(n):
            vals = []
            for s, idx, st in zip(srcs, src_idx, stypes, strict=True):
                if idx is not None:
                    vals.append(D.read_mem(self.mem16, idx[i : i + 1], st, where))
                else:
                    vals.append(D.scalar_array(s, 1, st))
            out = D.compute(spec.name, vals, spec.dtype, spec.stype)
            D.write_mem(self.mem16, didx[i : i + 1], out, spec.dtype, where)

    def _bounds(self, idx: np.ndarray, etype: str, where: str) -> None:
        if len(idx) == 0:
            return
        hi = int(idx.max()) + D.WORDS[etype] - 1
        lo = int(idx.min())
        if lo < 0 or hi >= len(self.mem16):
            raise CslRuntimeError(
                f"{where}: a DSD reaches word {lo if lo < 0 else hi}, outside {self}'s 48 KB"
            )

    def op_finished(self, spec: D.OpSpec, t: int) -> None:
        act = spec.opts.get("activate")
        if act is not None:
            self._set_active(self._tid(act), t)
            if not self.busy:
                self.schedule_pick(t)
        unb = spec.opts.get("unblock")
        if unb is not None:
            self.blocked[self._tid(unb)] = False
            if not self.busy:
                self.schedule_pick(t)

    def map_op(self, spec: D.MapSpec, operands: tuple) -> None:
        """@map: call the function once per element (inputs in order, then the output, if any)."""
        self.t += timing.DSD_SETUP + self.machine.schedule.delay()
        saved: list = []
        if any(isinstance(o, Dsr) for o in operands):
            _, operands, saved = self._resolve_dsrs(D.OpSpec("map", 0, "f32", "f32", spec.where), operands)
        n = D.op_length(operands)
        if self.machine.trace_pe is not None:
            self.machine.trace(self, self.t, f"@map of {n} ({spec.where})")
        has_output = spec.ret.name != "void"
        ins = operands[:-1] if has_output else operands
        readers = []
        for o, k, t in zip(ins, spec.kinds, spec.params, strict=False):
            if k == "value":
                readers.append(lambda i, v=o: v)
            elif k == "ptr" and isinstance(t, PointerType):
                readers.append(lambda i, a=o.addr: a)  # a pointer parameter gets the address itself
            else:
                readers.append(self._element_reader(o, t.name, spec.where))
        writer = self._element_writer(operands[-1], spec.ret.name, spec.where) if has_output else None
        fn = spec.fn.py
        native = not isinstance(spec.fn, FnSym)
        self.in_map += 1
        try:
            for i in range(n):
                args = [r(i) for r in readers]
                result = fn(*args) if native else fn(self, *args)
                if writer is not None:
                    writer(i, result)
        finally:
            self.in_map -= 1
        if saved:
            self._advance_dsrs(saved, n, [2] * len(operands))
        self.t += timing.MAP_STEP * n

    def _element_reader(self, o: Any, tname: str, where: str):
        if isinstance(o, Dsd) and o.kind in ("fabin", "fabout"):
            raise CslRuntimeError(f"{where}: @map over fabric operands is not supported by the executor")
        idx = D.mem_indices(o, D.dsd_length(o) or 1, D.WORDS.get(tname, 1), where)
        get = _scalar_getter(self, tname)
        if isinstance(o, D.ScalarPtr):
            a = o.addr
            return lambda i: get(a)
        return lambda i: get(int(idx[i]))

    def _element_writer(self, o: Any, tname: str, where: str):
        idx = D.mem_indices(o, D.dsd_length(o) or 1, D.WORDS.get(tname, 1), where)
        put = _scalar_putter(self, tname)
        if isinstance(o, D.ScalarPtr):
            a = o.addr
            return lambda i, v: put(a, v)
        return lambda i, v: put(int(idx[i]), v)

    # -- launches --------------------------------------------------------------------------------------
    def launch(self, fn: FnSym, args: tuple) -> None:
        self.cmd_blocked = True
        self.launches.append((fn, args))
        if not self.busy:
            self.schedule_pick(max(self.t, self.machine.now))


def _hazard(didx: np.ndarray, src_idx: list) -> bool:
    """Does a step read a word that an earlier step of the same operation wrote?"""
    n = len(didx)
    if n <= 1:
        return False
    dmin, dmax = int(didx.min()), int(didx.max()) + 1
    unique_dest = len(np.unique(didx)) == n
    for idx in src_idx:
        if idx is None:
            continue
        if int(idx.max()) + 1 < dmin or int(idx.min()) > dmax:
            continue
        if unique_dest and np.array_equal(idx, didx):
            continue  # in place, step by step: each step reads its own element before writing it
        first_write: dict[int, int] = {}
        for i, a in enumerate(didx.tolist()):
            first_write.setdefault(a, i)
        for j, a in enumerate(idx.tolist()):
            w = first_write.get(a)
            if w is not None and w < j:
                return True
    return False


def _scalar_getter(pe: PE, tname: str):
    if tname == "f32":
        return lambda a: pe.mF[a >> 1]
    if tname == "u32":
        return lambda a: pe.mI[a >> 1]
    if tname == "i32":
        return lambda a: pe.mi[a >> 1]
    if tname == "i16":
        return lambda a: pe.mh[a]
    if tname == "f16":
        return lambda a: H2F[pe.mH[a]]
    return lambda a: pe.mH[a]


def _scalar_putter(pe: PE, tname: str):
    if tname == "f32":

        def put(a: int, v: float) -> None:
            pe.mF[a >> 1] = v

        return put
    if tname in ("u32", "i32"):

        def put32(a: int, v: int) -> None:
            pe.mI[a >> 1] = v & 0xFFFFFFFF

        return put32
    if tname == "f16":

        def put16f(a: int, v: float) -> None:
            pe.mH[a] = F2H(v)

        return put16f

    def put16(a: int, v: int) -> None:
        pe.mH[a] = v & 0xFFFF

    return put16


class OutDrain:
    """Moves wavelets from an output queue into the router (or to memcpy), one per cycle."""

    def __init__(self, pe: PE, ch: Channel) -> None:
        self.pe = pe
        self.ch = ch
        self.at = -1

    def kick(self, t: int) -> None:
        if 0 <= self.at <= t:
            return
        self.at = t
        self.pe.machine.at(t, self.step)

    def step(self, t: int) -> None:
        self.at = -1
        q = self.ch.q
        if not q:
            return
        ready, (color, w) = q[0]
        if ready > t:
            self.kick(ready)
            return
        m = self.pe.machine
        egress = m.memcpy_egress(self.pe, color)
        if egress is not None:
            if egress.free() <= 0:
                egress.wait_space(self.kick)
                return
            self.ch.pop(t)
            egress.push(t + timing.CE_TO_ROUTER, w)
        else:
            router = m.router(self.pe.x, self.pe.y, color)
            if router is None:
                raise CslRuntimeError(
                    f"{self.pe} sends on color {color}, but no route for color {color} is set at this PE"
                )
            if router.buf.free() <= 0:
                router.buf.wait_space(self.kick)
                return
            if not router.receives("RAMP") and router.waits_for("RAMP", self.kick):
                return  # the switch takes from the RAMP in another position: wait for it
            self.ch.pop(t)
            router.accept(w, t + timing.CE_TO_ROUTER, "RAMP")
        if q:
            self.kick(t + 1)


class MemAsyncOp:
    """An asynchronous DSD operation with memory operands only: its result is written when it starts
    (nothing can read it before it ends without a race the SDK leaves undefined); it holds its
    microthread until `end`, then activates or unblocks as asked."""

    def __init__(self, pe: PE, spec: D.OpSpec, end: int) -> None:
        self.pe, self.spec, self.end = pe, spec, end
        self.done = False
        ut = spec.opts.get("ut_id")
        self.ut = int(ut) if ut is not None else None

    def describe(self) -> str:
        return f"@{self.spec.name} ({self.spec.where}) on memory, ending at cycle {self.end}"

    def reads_color(self, color: int) -> bool:
        return False

    def claim(self) -> None:
        if self.ut is None:
            return
        for m in self.pe.micro:
            if not m.done and m.ut == self.ut:
                raise CslRuntimeError(
                    f"{self.spec.where}: microthread {self.ut} is busy with {m.describe()}; "
                    "concurrent operations must not share a microthread"
                )

    def finish(self, t: int) -> None:
        self.done = True
        if self in self.pe.micro:
            self.pe.micro.remove(self)
        self.pe.op_finished(self.spec, t)


def values_per_wavelet(d: Dsd) -> int:
    """16-bit values a fabric DSD puts in one wavelet: two in any SIMD mode, else one."""
    return 2 if d.simd_mode else 1


def simd_granule(d: Dsd) -> int:
    """Values one step of an operation moves through this operand (SDK "DSDs", SIMD Mode:
    `simd_64` stalls until two wavelets are ready, `simd_32_or_64` goes on with one)."""
    if not d.simd_mode:
        return 1
    return 4 if d.simd_mode == "simd_64" else 2


class StreamOp:
    """A DSD operation with a fabric or FIFO operand, moving one element per cycle as its inputs
    arrive and its outputs find room."""

    def __init__(self, pe: PE, spec: D.OpSpec, operands: tuple, n: int) -> None:
        self.pe = pe
        self.spec = spec
        self.dest = operands[0]
        self.srcs = operands[1:]
        self.stypes = D.src_types(spec)
        self.n = n
        self.pos = 0
        self.t = pe.t
        self.done = n == 0
        self.sync = False
        self.at = -1
        self.blocked_on = ""
        self.didx: np.ndarray | None = None
        self.sidx: list[np.ndarray | None] = [None] * len(self.srcs)
        # The same operands as views of the memory where their addresses step evenly (the fast path)
        self.dview: np.ndarray | None = None
        self.sview: list[np.ndarray | None] = [None] * len(self.srcs)
        where = spec.where
        if isinstance(self.dest, (Dsd, D.ScalarPtr)) and not (
            isinstance(self.dest, Dsd) and self.dest.kind == "fabout"
        ):
            self.didx = D.mem_indices(self.dest, n, D.WORDS[spec.dtype], where)
            pe._bounds(self.didx, spec.dtype, where)
            span = D.mem_span(self.dest, D.WORDS[spec.dtype])
            if span is not None and span[1] != 0:
                self.dview = D.span_view(pe.views, spec.dtype, *span, n)
        for k, (s, st) in enumerate(zip(self.srcs, self.stypes, strict=True)):
            if isinstance(s, D.ScalarPtr) or (isinstance(s, Dsd) and s.kind in ("mem1d", "mem4d")):
                sidx = D.mem_indices(s, n, D.WORDS[st], where)
                self.sidx[k] = sidx
                pe._bounds(sidx, st, where)
                span = D.mem_span(s, D.WORDS[st])
                if span is not None:
                    self.sview[k] = D.span_view(pe.views, st, *span, n)
        if isinstance(self.dest, Dsd) and self.dest.kind == "fabout":
            pe.output_queue(self.dest.queue if self.dest.queue is not None else 0, self.dest.fabric_color.id)
        for s in self.srcs:
            if isinstance(s, Dsd) and s.kind == "fabin" and s.queue is not None:
                pe.check_queue_empty(s.queue, s.fabric_color.id, where)
        if pe.arch.name == "wse3":
            for s in self.srcs:
                if isinstance(s, Dsd) and s.kind == "fabin":
                    bound = pe.program.queue_colors.get(("input", s.queue)) if s.queue is not None else None
                    if bound is None or bound[0] != s.fabric_color.id:
                        raise CslRuntimeError(
                            f"{where}: on WSE-3 input queue {s.queue} must be bound to color {s.fabric_color.id} "
                            "with @initialize_queue before an operation reads it"
                        )
        self.ut = self._microthread()
        # Elements moved per step: SIMD-32 packs two 16-bit values per wavelet, SIMD-64 waits for
        # two wavelets (four values); an operation ends with whatever part of a step is left.
        self.granule = max(
            (simd_granule(o) for o in (self.dest, *self.srcs) if isinstance(o, Dsd)), default=1
        )
        if self.done:
            self.finish(pe.t)

    def describe(self) -> str:
        return f"@{self.spec.name} ({self.spec.where}) at element {self.pos} of {self.n}: {self.blocked_on or 'running'}"

    def reads_color(self, color: int) -> bool:
        return not self.done and any(
            isinstance(s, Dsd) and s.kind == "fabin" and s.fabric_color.id == color for s in self.srcs
        )

    def queues(self) -> list[tuple[str, int]]:
        out = []
        for o in (self.dest, *self.srcs):
            if isinstance(o, Dsd) and o.kind == "fabin" and o.queue is not None:
                out.append(("input", o.queue))
            if isinstance(o, Dsd) and o.kind == "fabout" and o.queue is not None:
                out.append(("output", o.queue))
        return out

    def claim(self) -> None:
        for q in self.queues():
            other = self.pe.busy_queues.get(q)
            if other is not None and not other.done:
                raise CslRuntimeError(
                    f"{self.spec.where}: {q[0]} queue {q[1]} on {self.pe} is still used by {other.describe()}; "
                    "concurrent operations must not share a queue"
                )
            self.pe.busy_queues[q] = self
        ut = self.ut
        if ut is not None:
            for m in self.pe.micro:
                if not m.done and m.ut == ut:
                    raise CslRuntimeError(
                        f"{self.spec.where}: microthread {ut} is busy with {m.describe()}; "
                        "concurrent operations must not share a microthread"
                    )

    def _microthread(self) -> int | None:
        """The microthread an asynchronous operation runs on: its `ut_id`, or else the one its queues
        imply (csl-semantics.md, asynchronous operations): on WSE-2 the fabout's output queue, else the
        first fabin's input queue; on WSE-3 the queue of the highest-ranked fabric operand (the
        destination, then the first source, then the second). None for an operation with neither."""
        ut = self.spec.opts.get("ut_id")
        if ut is not None:
            return int(ut)
        fabric = [o for o in (self.dest, *self.srcs) if isinstance(o, Dsd) and o.kind in ("fabin", "fabout")]
        if self.pe.arch.name == "wse2":
            fabric.sort(key=lambda o: o.kind != "fabout")  # the fabout first, then the fabins in order
        for o in fabric:
            if o.queue is not None:
                return int(o.queue)
        return None

    def kick(self, t: int) -> None:
        if 0 <= self.at <= t:
            return
        self.at = t
        self.pe.machine.at(t, self.advance)

    def advance(self, t: int) -> None:
        self.at = -1
        if self.done:
            return
        pe = self.pe
        t = max(t, self.t)
        remaining = self.n - self.pos
        k = remaining
        # (kind, channel, values it can give or take now): the operands that may hold the step back
        limits: list[tuple[str, Channel, int]] = []
        later = None
        for s in self.srcs:
            if isinstance(s, Dsd) and s.kind == "fabin":
                ch = pe.input(s.fabric_color.id)
                per = values_per_wavelet(s)
                r = ch.ready_data(t, -(-remaining // per))
                limits.append(("data", ch, min(remaining, r * per)))
                if r * per < remaining and len(ch.q) > r and ch.q[r][0] > t and not ch.q[r][1] & CTRL:
                    later = ch.q[r][0] if later is None else min(later, ch.q[r][0])
            elif isinstance(s, Fifo):
                ch = pe.fifos[s.index]
                limits.append(("data", ch, len(ch.q)))
        d = self.dest
        if isinstance(d, Dsd) and d.kind == "fabout":
            ch = pe.output_queue(d.queue if d.queue is not None else 0, d.fabric_color.id)
            limits.append(("space", ch, ch.free() * values_per_wavelet(d)))
        elif isinstance(d, Fifo):
            ch = pe.fifos[d.index]
            limits.append(("space", ch, ch.free()))
        for _, _, avail in limits:
            k = min(k, avail)
        if k < remaining:
            k -= k % self.granule  # a SIMD mode moves whole steps of wavelets, except the last
        if k <= 0:
            need = min(self.granule, remaining)
            blockers = [(kind, ch) for kind, ch, avail in limits if avail < need]
            self.blocked_on = (
                ", ".join(
                    f"{'no data in' if kind == 'data' else 'no room in'} {ch.name}" for kind, ch in blockers
                )
                or "waiting for a wavelet in flight"
            )
            for kind, ch in blockers:
                (ch.wait_data if kind == "data" else ch.wait_space)(self.kick)
            # a wavelet in the input queue that is not yet ready wakes nothing: look again when it is,
            # unless room in an output is missing too (the queue's pop wakes the operation then)
            if later is not None and all(kind == "data" for kind, _ in blockers):
                self.kick(later)
            return
        self.blocked_on = ""
        self.step(k, t)
        self.pos += k
        self.t = t + self.cycles(k)
        if self.pos >= self.n:
            self.finish(self.t)
        else:
            self.kick(self.t)

    def cycles(self, k: int) -> int:
        """Cycles to move k elements: one wavelet per cycle through each fabric operand (a SIMD mode
        carries two 16-bit values in one), one element per cycle through a FIFO."""
        out = 0
        for o in (self.dest, *self.srcs):
            if isinstance(o, Dsd) and o.kind in ("fabin", "fabout"):
                out = max(out, -(-k // values_per_wavelet(o)))
            elif isinstance(o, Fifo):
                out = max(out, k)
        return max(out, 1)

    def step(self, k: int, t: int) -> None:
        pe, spec = self.pe, self.spec
        where = spec.where
        values = []
        for idx_k, (s, st) in enumerate(zip(self.srcs, self.stypes, strict=True)):
            idx = self.sidx[idx_k]
            view = self.sview[idx_k]
            if view is not None:
                values.append(view[self.pos : self.pos + k])
            elif idx is not None:
                values.append(D.read_mem(pe.mem16, idx[self.pos : self.pos + k], st, where))
            elif isinstance(s, D.Scalar):
                values.append(D.scalar_array(s, k, st))
            elif isinstance(s, Dsd) and s.kind == "fabin":
                ch = pe.input(s.fabric_color.id)
                per = values_per_wavelet(s)
                words = [ch.pop(t) & 0xFFFFFFFF for _ in range(-(-k // per))]
                values.append(D.from_wavelets(words, st, per)[:k])
            elif isinstance(s, Fifo):
                ch = pe.fifos[s.index]
                values.append(D.from_wavelets([ch.pop(t) for _ in range(k)], st))
            else:
                raise CslRuntimeError(f"{where}: unsupported source operand {s!r}")
        out = D.compute(spec.name, values, spec.dtype, spec.stype)
        d = self.dest
        if isinstance(d, Dsd) and d.kind == "fabout":
            payloads = D.to_wavelets(out, spec.dtype, values_per_wavelet(d))
            if d.control:
                payloads = [p | CTRL for p in payloads]
            pe.send(d.queue, d.fabric_color.id, payloads, t + 1)
        elif isinstance(d, Fifo):
            ch = pe.fifos[d.index]
            for i, p in enumerate(D.to_wavelets(out, spec.dtype)):
                ch.push(t + 1 + i, p)
        elif self.dview is not None:
            self.dview[self.pos : self.pos + k] = out
        else:
            assert self.didx is not None  # set in __init__ for every memory destination
            D.write_mem(pe.mem16, self.didx[self.pos : self.pos + k], out, spec.dtype, where)

    def finish(self, t: int) -> None:
        self.done = True
        pe = self.pe
        if pe.machine.trace_pe is not None:
            pe.machine.trace(pe, t, f"@{self.spec.name} ({self.spec.where}) ends")
        if self in pe.micro:
            pe.micro.remove(self)
        for q in self.queues():
            if pe.busy_queues.get(q) is self:
                del pe.busy_queues[q]
        if self.sync:
            self.t = t
            if greenlet.getcurrent() is not pe.current:
                pe.machine.at(t, pe.resume)
            return
        pe.op_finished(self.spec, t)
        if not pe.busy:
            pe.schedule_pick(t)
