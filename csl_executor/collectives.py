"""`<collectives_2d/params>` and `<collectives_2d/pe>`, implemented by the executor.

The SDK ships this library without its source, so the executor provides it the way it provides
memcpy: natively, with the documented behaviour (the Cerebras SDK documentation's "Libraries"
page) and a modeled cost, not as wavelets on the fabric.
- `params.get_params(Px, Py, .{ .x_colors, .x_entrypoints, .y_colors, .y_entrypoints })` gives each
  PE its place on its row (x) and column (y), with two colors and two local task IDs per axis.
- `pe` is imported once per axis with `.dim_params`, `.queues` (2) and DSR ids; it exposes `pe_id`,
  `init()`, `broadcast`, `scatter`, `gather` and `reduce_fadds(root, buffers..., count, callback)`.
- Every PE of a row (column) makes the same call with the same root and count; when the last one has
  made it, the data moves and each PE's callback task is activated. Broadcast leaves the root's
  buffer as it is; scatter and gather include the root's own chunk; `reduce_fadds` adds every PE's
  vector, the root's included, in PE order.
The library's colors, entrypoints and queues are reserved: a program that binds or routes them is
refused, as it would collide with the library on the hardware.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from csl_executor import ast, timing
from csl_executor.errors import CslRuntimeError
from csl_executor.native import NativeFn, NativeModule
from csl_executor.types import (
    COMPTIME_STRUCT,
    F32,
    LOCAL_TASK_ID,
    U16,
    U32,
    VOID_T,
    ArrayType,
    ArrayValue,
    Color,
    PointerType,
    Struct,
    TaskId,
)
from csl_executor.values import CExpr, known

if TYPE_CHECKING:
    from csl_executor.compiler import Ctx


class C2dParams(NativeModule):
    spec = "collectives_2d/params"

    def __init__(self, comp, ctx: Ctx, params: Struct, node: ast.Node) -> None:
        super().__init__(comp, ctx, params, node)

        def get_params(c: Ctx, args: list[CExpr], n: ast.Node) -> CExpr:
            px, py, cfg = (c.need_known(a, n, "argument") for a in args)
            rect = getattr(c.program, "rectangle", None)
            if rect is None:
                raise c.error(n, "collectives_2d get_params needs @set_rectangle first")
            if not isinstance(cfg, Struct):
                raise c.error(
                    n, "get_params takes (Px, Py, .{ .x_colors, .x_entrypoints, .y_colors, .y_entrypoints })"
                )
            out = []
            for axis, index, size, line in (("x", px, rect[0], py), ("y", py, rect[1], px)):
                colors = cfg.get(f"{axis}_colors")
                entries = cfg.get(f"{axis}_entrypoints")
                if not (
                    isinstance(colors, Struct)
                    and len(colors.values()) == 2
                    and all(isinstance(v, Color) for v in colors.values())
                ):
                    raise c.error(n, f"get_params: .{axis}_colors must be two colors")
                if not (
                    isinstance(entries, Struct)
                    and len(entries.values()) == 2
                    and all(isinstance(v, TaskId) for v in entries.values())
                ):
                    raise c.error(n, f"get_params: .{axis}_entrypoints must be two local task IDs")
                out.append(
                    (
                        axis,
                        Struct(
                            (
                                ("axis", axis), ("index", int(index)), ("size", int(size)), ("line", int(line)),
                                ("colors", colors), ("entrypoints", entries),
                            )
                        ),
                    )
                )  # fmt: skip
            return known(Struct(tuple(out)), COMPTIME_STRUCT)

        self.members = {
            "get_params": NativeFn(
                "get_params", [U16, U16, COMPTIME_STRUCT], COMPTIME_STRUCT, comptime=get_params
            )
        }


class C2dPe(NativeModule):
    spec = "collectives_2d/pe"

    def __init__(self, comp, ctx: Ctx, params: Struct, node: ast.Node) -> None:
        super().__init__(comp, ctx, params, node)
        dim = params.get("dim_params")
        if not isinstance(dim, Struct) or not dim.has("axis"):
            raise ctx.error(node, "<collectives_2d/pe> needs .dim_params from collectives_2d get_params")
        queues = params.get("queues")
        if queues is None:  # the library's defaults (SDK release notes 0.9.0): X 2, 4 and Y 3, 5
            queues = ArrayValue(ArrayType(2, U16), [2, 4] if dim.get("axis") == "x" else [3, 5])
        if not isinstance(queues, ArrayValue) or len(queues.items) != 2:
            raise ctx.error(node, "<collectives_2d/pe> .queues must be [2]u16{...}")
        prog = ctx.program
        reserved = prog.native_state.setdefault("reserved", {"colors": {}, "tasks": {}, "queues": {}})
        where = ctx.where(node)
        for c in dim.get("colors").values():
            reserved["colors"][c.id] = where
        for t in dim.get("entrypoints").values():
            reserved["tasks"][t.id] = where
        for q in queues.items:
            reserved["queues"][int(q)] = where
        self.axis = Axis(dim.get("axis"), dim.get("index"), dim.get("size"), dim.get("line"))
        k = f"K_AXIS_{id(self)}"
        _ = k
        self.members = {
            "pe_id": known(self.axis.index, U16),
            "init": NativeFn("init", [], VOID_T, "None"),
        }
        ptr_u32 = PointerType(U32, many=True)
        ptr_f32 = PointerType(F32, many=True)
        for op, bufs in (("broadcast", [ptr_u32]), ("scatter", [ptr_u32, ptr_u32]), ("gather", [ptr_u32, ptr_u32]),
                         ("reduce_fadds", [ptr_f32, ptr_f32])):  # fmt: skip
            params_t = [U16, *bufs, U16, LOCAL_TASK_ID]
            self.members[op] = NativeFn(op, params_t, VOID_T, comptime=self._caller(op, len(bufs)))

    def _caller(self, op: str, nbufs: int):
        axis = self.axis

        def emit(ctx: Ctx, args: list[CExpr], node: ast.Node) -> CExpr:
            if not ctx.runtime:
                raise ctx.error(node, f"collectives {op} runs on the PE")
            codes = [ctx.code(a) for a in args]
            cb = args[-1]
            cb_code = str(cb.value.id) if cb.known else codes[-1]
            bufs = codes[1 : 1 + nbufs] + (["0"] if nbufs == 1 else [])
            return ctx.dyn(
                VOID_T,
                f"pe.machine.collective(pe, {ctx.fb.const(axis)}, {op!r}, {codes[0]}, {bufs[0]}, {bufs[1]}, "
                f"{codes[1 + nbufs]}, {cb_code}, {ctx.fb.const(ctx.where(node))})",
            )

        return emit


class Axis:
    """One PE's place on a row or column, for the rendezvous key."""

    def __init__(self, axis: str, index: int, size: int, line: int) -> None:
        self.axis, self.index, self.size, self.line = axis, index, size, line

    def __repr__(self) -> str:
        return f"{self.axis}[{self.line}]#{self.index}/{self.size}"


class Rendezvous:
    """The calls made so far by the PEs of one row or column for their next collective."""

    def __init__(self) -> None:
        self.calls: dict[int, tuple] = {}


def run_collective(
    machine, pe, axis: Axis, op: str, root: int, buf0: int, buf1: int, count: int, cb: int, where: str
) -> None:
    key = (axis.axis, axis.line)
    rv = machine.collectives.setdefault(key, Rendezvous())
    if axis.index in rv.calls:
        raise CslRuntimeError(
            f"{where}: {pe} starts a second {op} on its {axis.axis} axis before the first completed"
        )
    if not 0 <= root < axis.size:
        raise CslRuntimeError(
            f"{where}: {op} root {root} is outside the {axis.size} PEs of the {axis.axis} axis"
        )
    rv.calls[axis.index] = (pe, op, root, buf0, buf1, count, cb, pe.t, where)
    first = next(iter(rv.calls.values()))
    if (op, root, count) != (first[1], first[2], first[5]):
        raise CslRuntimeError(
            f"{where}: PEs of one {axis.axis} axis disagree: {first[0]} calls {first[1]}(root {first[2]}, count "
            f"{first[5]}) ({first[8]}), {pe} calls {op}(root {root}, count {count})"
        )
    if len(rv.calls) < axis.size:
        return
    calls = [rv.calls[i] for i in range(axis.size)]
    rv.calls = {}
    _move(op, root, count, calls)
    start = max(c[7] for c in calls)
    done = (
        start
        + (axis.size - 1) * timing.HOP
        + timing.ROUTER_TO_CE
        + count * (axis.size if op in ("gather", "scatter") else 1)
    )
    for c in calls:
        target = c[0]
        machine.at(done, lambda t, p=target, tid=c[6]: p.activate_at(tid, t))


def _words(pe, addr: int, n: int) -> np.ndarray:
    return pe.mem16[addr : addr + 2 * n].view(np.uint32)


def _move(op: str, root: int, count: int, calls: list[tuple]) -> None:
    rootpe, buf_root0, buf_root1 = calls[root][0], calls[root][3], calls[root][4]
    if op == "broadcast":
        data = _words(rootpe, buf_root0, count).copy()
        for i, c in enumerate(calls):
            if i != root:
                _words(c[0], c[3], count)[:] = data
    elif op == "scatter":
        data = _words(rootpe, buf_root0, count * len(calls)).copy()
        for i, c in enumerate(calls):
            _words(c[0], c[4], count)[:] = data[i * count : (i + 1) * count]
    elif op == "gather":
        out = _words(rootpe, buf_root1, count * len(calls))
        parts = [_words(c[0], c[3], count).copy() for c in calls]
        for i, part in enumerate(parts):
            out[i * count : (i + 1) * count] = part
    elif op == "reduce_fadds":
        acc = np.zeros(count, dtype=np.float32)
        for c in calls:
            acc = acc + _words(c[0], c[3], count).view(np.float32)
        _words(rootpe, buf_root1, count).view(np.float32)[:] = acc
    else:
        raise CslRuntimeError(f"internal: collective {op}")


COLLECTIVES: dict[str, Any] = {"collectives_2d/params": C2dParams, "collectives_2d/pe": C2dPe}
