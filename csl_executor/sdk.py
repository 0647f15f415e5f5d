"""A stand-in for the SDK's host runtime (`cerebras.sdk.runtime.sdkruntimepybind.SdkRuntime`) and
for the compiler's output folder, so that `cslc` + `cs_python run.py` scripts run on the executor.

`write_output` is what `cslc -o OUT` leaves behind: `OUT/out.json` with the `params` and `colors`
that run.py scripts read, and an `executor` section that records the layout, options and a digest of
every source, so that `SdkRuntime(OUT)` can rebuild the program (and refuses if a source changed).

`SdkRuntime` follows the SDK's API (Cerebras SDK documentation, `cerebras.sdk.runtime.sdkruntimepybind`): `load()`, `run()`,
`get_id()`, `memcpy_h2d` / `memcpy_d2h` in copy and streaming mode, `launch`, `task_wait`,
`is_task_done`, `stop()`. Commands are serialized; `nonblock=True` returns a task at once and the
command runs the next time the host waits. Host arrays hold 32-bit elements; 16-bit data sits in the
low half (MEMCPY_16BIT).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from csl_executor.errors import CslRuntimeError
from csl_executor.hostutil import MemcpyDataType, MemcpyOrder
from csl_executor.layout import CompiledLayout, Options, compile_layout
from csl_executor.machine import CopyCommand, LaunchCommand, Machine, StreamD2H, StreamH2D
from csl_executor.types import BOOL, F16, F32, IntType, PointerType

OUT_JSON = "out.json"
TRACES_JSON = "executor_traces.json"

# The layout `write_output` wrote last in this process, by its folder: the next `load_output` of that
# folder takes it instead of compiling the same sources again (a compile then a run in one process, as
# tests and servers do). Taken once, so a runtime never shares its program with another; only the last
# is kept, so a compile that is never run holds no more than one layout.
_WRITTEN: dict[Path, tuple[str, CompiledLayout]] = {}


def _sources(compiled: CompiledLayout) -> dict[str, str]:
    files = {compiled.layout.path}
    for prog in compiled.programs:
        for _key, mod in prog.modules.items():
            if mod.file is not None:
                files.add(mod.path)
    return {f: hashlib.sha256(Path(f).read_bytes()).hexdigest() for f in sorted(files)}


def write_output(compiled: CompiledLayout, out_dir: str | Path) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bin").mkdir(exist_ok=True)
    opts = compiled.options
    meta = {
        "params": {k: str(v) for k, v in opts.params.items()},
        "colors": {k: str(v) for k, v in opts.colors.items()},
        "executor": {
            "note": "written by csl-executor cslc (the project's CSL executor), not by Cerebras cslc",
            "layout": compiled.layout.path,
            "options": asdict(opts),
            "sources": _sources(compiled),
            "rectangle": list(compiled.rectangle),
            "programs": len(compiled.programs),
            "memory_words": {Path(p.path).name: p.memory_words for p in compiled.programs},
        },
    }
    (out / OUT_JSON).write_text(json.dumps(meta, indent=2))
    _WRITTEN.clear()
    _WRITTEN[out.resolve()] = (json.dumps(meta["executor"], sort_keys=True), compiled)
    return out


def load_output(out_dir: str | Path) -> CompiledLayout:
    path = Path(out_dir) / OUT_JSON
    if not path.is_file():
        raise CslRuntimeError(f"{path}: no compiler output here (run cslc -o {out_dir} first)")
    meta = json.loads(path.read_text())
    ex = meta.get("executor")
    if ex is None:
        raise CslRuntimeError(f"{path}: written by another compiler; the executor needs its own cslc output")
    for src, digest in ex["sources"].items():
        if not Path(src).is_file() or hashlib.sha256(Path(src).read_bytes()).hexdigest() != digest:
            raise CslRuntimeError(f"{src} changed since cslc compiled {out_dir}: compile again")
    written = _WRITTEN.pop(path.parent.resolve(), None)
    if written is not None and written[0] == json.dumps(ex, sort_keys=True):  # the same compile
        return written[1]
    o = ex["options"]
    options = Options(
        arch=o["arch"],
        fabric_dims=tuple(o["fabric_dims"]) if o["fabric_dims"] else None,
        fabric_offsets=tuple(o["fabric_offsets"]),
        params=o["params"],
        colors=o["colors"],
        memcpy=o["memcpy"],
        channels=o["channels"],
        width_west_buf=o["width_west_buf"],
        width_east_buf=o["width_east_buf"],
        sdk=o.get("sdk", "1.4"),
    )
    return compile_layout(ex["layout"], options)


class Task:
    def __init__(self, runtime: SdkRuntime, cmd) -> None:
        self.runtime = runtime
        self.cmd = cmd

    def done(self) -> bool:
        return self.cmd.done


class SdkRuntime:
    """`SdkRuntime(out_dir)`: the executor's wafer behind the SDK's host API."""

    def __init__(self, bindir: str | Path | CompiledLayout, cmaddr: str | None = None, **kwargs: Any) -> None:
        if cmaddr:
            raise CslRuntimeError(
                f"cmaddr={cmaddr!r}: the executor runs programs in this process, not on a CS system"
            )
        self.bindir = None if isinstance(bindir, CompiledLayout) else Path(bindir)
        self.compiled = bindir if isinstance(bindir, CompiledLayout) else load_output(bindir)
        self.trace_pe = kwargs.get("trace_pe") or _trace_from_env()
        # The schedule (csl_executor.schedule): a policy ("local-first", "highest", ...) or "seed:N"; None reads
        # WAFER_CSL_SCHEDULE / WAFER_CSL_PICKER, so unmodified host scripts can be run under seeds.
        self.schedule = kwargs.get("schedule")
        self.machine: Machine | None = None
        self.state = "new"
        self.symbols = list(self.compiled.layout.export_names)

    # -- lifecycle -------------------------------------------------------------------------------------
    def load(self) -> None:
        if self.state != "new":
            raise CslRuntimeError("SdkRuntime.load() is called once, before run()")
        self.machine = Machine(
            self.compiled,
            trace_pe=self.trace_pe,
            log_dir=self.bindir.parent if self.bindir else None,
            schedule=self.schedule,
        )
        self.state = "loaded"

    def run(self) -> None:
        if self.state != "loaded":
            raise CslRuntimeError("SdkRuntime.run() needs load() first")
        self.state = "running"

    def _loaded(self) -> Machine:
        """The machine load() made; callers check the state first, so a missing one is an internal error."""
        if self.machine is None:
            raise RuntimeError(f"internal: SdkRuntime is {self.state} but has no machine")
        return self.machine

    def stop(self) -> None:
        if self.state != "running":
            raise CslRuntimeError("SdkRuntime.stop() needs a running program")
        m = self._loaded()
        try:
            m.run_until(
                lambda: m.active is None and not m.commands, "the pending memcpy commands before stop()"
            )
        finally:
            m.flush_log()
            self._save_traces()
            self.state = "stopped"
        stats_path = os.environ.get("WAFER_CSL_STATS")
        if stats_path:
            # One JSON object per run, appended: the examples runner and csl_executor/README.md read them.
            with open(stats_path, "a") as f:
                f.write(json.dumps({"bindir": str(self.bindir), **m.stats()}) + "\n")

    def _save_traces(self) -> None:
        if self.bindir is None:
            return
        traces = {f"{x},{y}": pe.traces for (x, y), pe in self._loaded().pes.items() if pe.traces}
        if traces:
            (self.bindir / TRACES_JSON).write_text(json.dumps(traces))

    def _running(self, what: str) -> Machine:
        if self.state != "running":
            raise CslRuntimeError(f"{what}: the runtime is {self.state}; call load() and run() first")
        return self._loaded()

    def get_id(self, name: str) -> int:
        if name not in self.compiled.layout.export_names:
            known = ", ".join(self.compiled.layout.export_names) or "none"
            raise CslRuntimeError(f"get_id({name!r}): the layout exports no such name (it exports: {known})")
        return self.symbols.index(name)

    # -- memcpy --------------------------------------------------------------------------------------
    def _rect(self, what: str, px: int, py: int, w: int, h: int) -> tuple[int, int, int, int]:
        W, H = self.compiled.rectangle
        px, py, w, h = int(px), int(py), int(w), int(h)
        if w <= 0 or h <= 0 or px < 0 or py < 0 or px + w > W or py + h > H:
            raise CslRuntimeError(
                f"{what}: rectangle {w} x {h} at ({px}, {py}) is not inside the {W} x {H} kernel"
            )
        return px, py, w, h

    @staticmethod
    def _array(what: str, arr: Any, n: int) -> np.ndarray:
        if not isinstance(arr, np.ndarray):
            raise CslRuntimeError(f"{what}: the host buffer must be a numpy array, not {type(arr).__name__}")
        if arr.dtype.itemsize != 4:
            raise CslRuntimeError(
                f"{what}: memcpy moves 32-bit elements; the host array is {arr.dtype} (put 16-bit data in the "
                "low half of a uint32 array, e.g. with sdk_utils.input_array_to_u32)"
            )
        if arr.size < n:
            raise CslRuntimeError(f"{what}: the host array has {arr.size} elements, the transfer needs {n}")
        if not arr.flags.c_contiguous:
            raise CslRuntimeError(f"{what}: the host array must be contiguous")
        return arr

    def _symbol(self, what: str, sym: Any) -> tuple[str, Any]:
        try:
            name = self.symbols[int(sym)]
        except (IndexError, ValueError, TypeError):
            raise CslRuntimeError(f"{what}: {sym!r} is not a symbol id from get_id()") from None
        return name, self.compiled.layout.export_names[name]

    def _submit(self, cmd, nonblock: bool):
        m = self._loaded()
        m.submit(cmd)
        task = Task(self, cmd)
        if not nonblock:
            m.run_until(lambda: cmd.done, cmd.describe)
        return task

    def memcpy_h2d(self, dest, src, px, py, w, h, elem_per_pe, streaming=False, data_type=None,
                   order=None, nonblock=False):  # fmt: skip
        return self._memcpy(True, dest, src, px, py, w, h, elem_per_pe, streaming, data_type, order, nonblock)

    def memcpy_d2h(self, dest, src, px, py, w, h, elem_per_pe, streaming=False, data_type=None,
                   order=None, nonblock=False):  # fmt: skip
        return self._memcpy(
            False, src, dest, px, py, w, h, elem_per_pe, streaming, data_type, order, nonblock
        )

    def memcpy_h2d_rowbcast(self, dest, src, px, py, w, h, elem_per_pe, streaming=False, data_type=None,
                            order=None, nonblock=False):  # fmt: skip
        """One column of values (h x elems): row y of the rectangle gets value y on every PE."""
        return self._bcast(True, dest, src, px, py, w, h, elem_per_pe, streaming, data_type, order, nonblock)

    def memcpy_h2d_colbcast(self, dest, src, px, py, w, h, elem_per_pe, streaming=False, data_type=None,
                            order=None, nonblock=False):  # fmt: skip
        """One row of values (w x elems): column x of the rectangle gets value x on every PE."""
        return self._bcast(False, dest, src, px, py, w, h, elem_per_pe, streaming, data_type, order, nonblock)

    def _bcast(self, by_row, dest, src, px, py, w, h, elems, streaming, data_type, order, nonblock):
        what = "memcpy_h2d_rowbcast" if by_row else "memcpy_h2d_colbcast"
        w, h, elems = int(w), int(h), int(elems)
        n = h if by_row else w
        arr = self._array(what, src, n * elems)
        row_major = _enum_name(order) == "ROW_MAJOR"
        shape = (n, 1, elems) if by_row else (1, n, elems)
        part = arr.reshape(-1)[: n * elems].reshape(shape, order="C" if row_major else "F")
        full = np.ascontiguousarray(np.broadcast_to(part, (h, w, elems)))
        flat = full.reshape(-1) if row_major else full.reshape(-1, order="F")
        return self._memcpy(True, dest, np.ascontiguousarray(flat), px, py, w, h, elems, streaming, data_type,
                            order, nonblock)  # fmt: skip

    def _memcpy(self, to_device, target, host, px, py, w, h, elems, streaming, data_type, order, nonblock):
        what = "memcpy_h2d" if to_device else "memcpy_d2h"
        m = self._running(what)
        rect = self._rect(what, px, py, w, h)
        elems = int(elems)
        if elems < 0:
            raise CslRuntimeError(f"{what}: elem_per_pe must not be negative")
        n = rect[2] * rect[3] * elems
        arr = self._array(what, host, n)
        if order is None:
            raise CslRuntimeError(f"{what}: order= (MemcpyOrder.ROW_MAJOR or COL_MAJOR) is required")
        row_major = _enum_name(order) == "ROW_MAJOR"
        if streaming:
            color = int(target)
            colors = m.h2d_colors if to_device else m.d2h_colors
            if color not in colors:
                kind = "H2D" if to_device else "D2H"
                raise CslRuntimeError(
                    f"{what}: color {color} is not a memcpy {kind} streaming color of this program "
                    f"(the layout's <memcpy/get_params> gives {sorted(colors) or 'none'})"
                )
            cls = StreamH2D if to_device else StreamD2H
            cmd = cls(m, color, arr, rect, elems, row_major)
        else:
            if data_type is None:
                raise CslRuntimeError(
                    f"{what}: data_type= (MemcpyDataType.MEMCPY_32BIT or _16BIT) is required"
                )
            name, (ptype, mutable, _) = self._symbol(what, target)
            if not isinstance(ptype, PointerType):
                raise CslRuntimeError(f"{what}: {name!r} is a function, not data")
            if to_device and not mutable:
                raise CslRuntimeError(
                    f"{what}: {name!r} is exported immutable: the host may read it, not write it"
                )
            wpe = 2 if ptype.elem.words == 2 else 1
            want = "MEMCPY_32BIT" if wpe == 2 else "MEMCPY_16BIT"
            if _enum_name(data_type) != want:
                raise CslRuntimeError(f"{what}: {name!r} holds {ptype.elem.name} values: use {want}")
            cmd = CopyCommand(m, to_device, name, arr, rect, elems, wpe, row_major)
        return self._submit(cmd, nonblock)

    # -- launch --------------------------------------------------------------------------------------
    def launch(self, name: str, *args: Any, nonblock: bool = False):
        m = self._running("launch")
        if name not in self.compiled.layout.export_names:
            raise CslRuntimeError(f"launch({name!r}): the layout exports no such function")
        args_by_pe = {}
        for xy, pe in m.pes.items():
            exp = pe.program.exports.get(name)
            if exp is None or exp.kind != "fn":
                raise CslRuntimeError(
                    f"launch({name!r}): PE {xy} ({Path(pe.program.path).name}) does not export it"
                )
            args_by_pe[xy] = (exp.fn, self._launch_args(name, exp.fn, args))
        return self._submit(LaunchCommand(m, name, args_by_pe), nonblock)

    def _launch_args(self, name: str, fn, args: tuple) -> tuple:
        from csl_executor.compiler import Compiler, Ctx

        params = fn.decl.params
        if len(args) != len(params):
            raise CslRuntimeError(
                f"launch({name!r}): the function takes {len(params)} arguments, {len(args)} given"
            )
        ctx = Ctx(Compiler(self.compiled.options.arch), fn.module, "comptime")
        out = []
        for p, a in zip(params, args, strict=True):
            t = ctx.ctype(p.type)
            v = a.item() if isinstance(a, np.generic) else a
            if isinstance(t, IntType):
                if isinstance(v, bool) or not isinstance(v, int) or not t.lo <= v <= t.hi:
                    raise CslRuntimeError(
                        f"launch({name!r}): argument {p.name!r} must be a {t.name}, got {a!r}"
                    )
            elif t in (F32, F16):
                if not isinstance(v, (float, int)) or isinstance(v, bool):
                    raise CslRuntimeError(
                        f"launch({name!r}): argument {p.name!r} must be a {t.name}, got {a!r}"
                    )
                from csl_executor.rt import F16 as r16
                from csl_executor.rt import F32 as r32

                v = r32(float(v)) if t is F32 else r16(float(v))
            elif t is BOOL:
                v = bool(v)
            else:
                raise CslRuntimeError(
                    f"launch({name!r}): parameter {p.name!r} of type {t.name} cannot come from the host"
                )
            out.append(v)
        return tuple(out)

    # -- tasks -----------------------------------------------------------------------------------------
    def call(self, name: str, args: list, nonblock: bool = False):
        """The SDK's older RPC form: arguments as a list of 32-bit integers (an f32 argument is its
        bits)."""
        m = self._running("call")
        exports = next((pe.program.exports.get(name) for pe in m.pes.values()), None)
        if exports is None or exports.kind != "fn":
            raise CslRuntimeError(f"call({name!r}): no PE exports such a function")
        assert exports.fn is not None  # a "fn" export always carries its FnSym
        from csl_executor.compiler import Compiler, Ctx
        from csl_executor.rt import H2F, U2F

        ctx = Ctx(Compiler(self.compiled.options.arch), exports.fn.module, "comptime")
        values = []
        for p, a in zip(exports.fn.decl.params, list(args), strict=False):
            t = ctx.ctype(p.type)
            bits = int(a) & 0xFFFFFFFF
            values.append(
                U2F(bits)
                if t is F32
                else H2F[bits & 0xFFFF]
                if t is F16
                else t.wrap(bits)
                if isinstance(t, IntType)
                else a
            )
        if len(values) != len(list(args)):
            raise CslRuntimeError(
                f"call({name!r}): the function takes {len(exports.fn.decl.params)} arguments"
            )
        return self.launch(name, *values, nonblock=nonblock)

    def task_wait(self, task: Task) -> None:
        m = self._running("task_wait")
        m.run_until(lambda: task.cmd.done, task.cmd.describe)

    def is_task_done(self, task: Task) -> bool:
        return task.cmd.done

    # -- the executor's own extras ---------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        return self.machine.stats() if self.machine else {}


def _trace_from_env() -> tuple[int, int] | None:
    """WAFER_CSL_TRACE=x,y traces one PE (kernel coordinates) of a run started by a host script."""
    spec = os.environ.get("WAFER_CSL_TRACE")
    if not spec:
        return None
    try:
        x, y = (int(v) for v in spec.split(","))
    except ValueError:
        raise CslRuntimeError(f"WAFER_CSL_TRACE={spec!r}: expected X,Y") from None
    return x, y


def _enum_name(v: Any) -> str:
    return getattr(v, "name", str(v)).split(".")[-1]


__all__ = ["SdkRuntime", "MemcpyDataType", "MemcpyOrder", "Task", "write_output", "load_output"]
