"""The SDK libraries a CSL program imports with `@import_module("<...>")`, implemented natively.

Their sources are not public; what each function does is taken from the SDK's "Libraries" page and
from how `Cerebras/csl-examples` use them:
- `<memcpy/get_params>` (layout) and `<memcpy/memcpy>` (PE): the streaming colors, `unblock_cmd_stream`.
- `<layout>`: the PE's coordinates in the kernel rectangle.
- `<time>`: the 48-bit timestamp counter (TSC), as three u16 words, counting the executor's cycles.
- `<math>`: `csl_executor.mathlib`, correctly rounded f16 and f32 functions (the hardware's are approximations).
- `<random>`: a per-PE generator seeded as the SDK's is (0xdeadbeef); its sequence is the executor's own.
- `<control>`: control wavelet payloads (layout of the bits in `csl_executor.fabric`).
- `<simprint>` and `<debug>`: prints to `sim.log`, traces read back with `debug_util`.
- `<collectives_2d/params>` and `<collectives_2d/pe>`: see `csl_executor.collectives`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from csl_executor import ast
from csl_executor.mathlib import Math
from csl_executor.native import NativeFn, NativeModule
from csl_executor.program import ModuleInstance
from csl_executor.types import (
    ANYTYPE,
    BOOL,
    COLOR,
    COMPTIME_INT,
    COMPTIME_STRUCT,
    CONTROL_TASK_ID,
    F16,
    F32,
    I16,
    I32,
    MODULE,
    STRING,
    TYPE,
    U16,
    U32,
    VOID,
    VOID_T,
    Color,
    EnumType,
    EnumValue,
    PointerType,
    Struct,
    TaskId,
    Void,
    type_of_value,
)
from csl_executor.values import CExpr, known

if TYPE_CHECKING:
    from csl_executor.compiler import Ctx


def field_of_native(ctx: Ctx, obj: CExpr, name: str, node: ast.Node) -> CExpr | None:
    return None


MEMCPY_STREAMS = [f"MEMCPYH2D_{i}" for i in range(1, 5)] + [f"MEMCPYD2H_{i}" for i in range(1, 5)]
# SDK 1.0 and older also take the color of the RPC server that host launches arrive on (`.LAUNCH`,
# served by `@rpc`); from 1.1 memcpy builds that server in (release notes 1.1.0).
MEMCPY_COLORS = [*MEMCPY_STREAMS, "LAUNCH"]


class MemcpyGetParams(NativeModule):
    """`<memcpy/get_params>`: imported by the layout with the kernel size and streaming colors."""

    spec = "memcpy/get_params"

    def __init__(self, comp, ctx: Ctx, params: Struct, node: ast.Node) -> None:
        super().__init__(comp, ctx, params, node)
        for name in params.names():
            if name not in ("width", "height", *MEMCPY_COLORS):
                raise ctx.error(node, f"<memcpy/get_params> has no parameter {name!r}")
            if name in MEMCPY_COLORS and not isinstance(params.get(name), Color):
                raise ctx.error(node, f"<memcpy/get_params> .{name} must be a color")
        for name in ("width", "height"):
            if not params.has(name):
                raise ctx.error(node, f"<memcpy/get_params> needs .{name}")
        self.width = params.get("width")
        self.height = params.get("height")
        fields = [(name, params.get(name, VOID)) for name in MEMCPY_COLORS]
        types = [(name, COLOR if params.has(name) else VOID_T) for name in MEMCPY_COLORS]
        # The per-PE struct carries no column index: the executor's memcpy needs none, and equal
        # structs let every column share one compiled program.
        self.pe_params = Struct(
            tuple(fields) + (("__memcpy__", True),), tuple(types) + (("__memcpy__", BOOL),)
        )
        colors = {n: params.get(n).id for n in MEMCPY_COLORS if params.has(n)}
        program = ctx.program
        if hasattr(program, "set_memcpy"):
            program.set_memcpy(self.width, self.height, colors, ctx.where(node))

        def get_params(c: Ctx, args: list[CExpr], n: ast.Node) -> CExpr:
            x = c.need_known(args[0], n, "column")
            if not 0 <= x < self.width:
                raise c.error(n, f"memcpy.get_params({x}): column outside the kernel width {self.width}")
            return known(self.pe_params, COMPTIME_STRUCT)

        self.members = {
            "get_params": NativeFn("get_params", [ANYTYPE], COMPTIME_STRUCT, comptime=get_params),
            **{name: CExpr(t, v) for (name, v), (_, t) in zip(fields, types, strict=True)},
        }


class Memcpy(NativeModule):
    """`<memcpy/memcpy>`: the PE side of memcpy."""

    spec = "memcpy/memcpy"

    def __init__(self, comp, ctx: Ctx, params: Struct, node: ast.Node) -> None:
        super().__init__(comp, ctx, params, node)
        if not params.get("__memcpy__"):
            raise ctx.error(
                node, "<memcpy/memcpy> takes the struct that the layout's memcpy.get_params(x) returns"
            )
        ctx.program.memcpy = params
        self.members = {
            name: CExpr(params.type_of(name) or type_of_value(params.get(name)), params.get(name))
            for name in MEMCPY_COLORS
        }
        self.members["unblock_cmd_stream"] = NativeFn(
            "unblock_cmd_stream", [], VOID_T, "pe.unblock_cmd_stream()"
        )


class Layout(NativeModule):
    spec = "layout"

    def __init__(self, comp, ctx: Ctx, params: Struct, node: ast.Node) -> None:
        super().__init__(comp, ctx, params, node)
        self.members = {
            "get_x_coord": NativeFn("get_x_coord", [], U16, "pe.x"),
            "get_y_coord": NativeFn("get_y_coord", [], U16, "pe.y"),
        }


class Time(NativeModule):
    spec = "time"

    def __init__(self, comp, ctx: Ctx, params: Struct, node: ast.Node) -> None:
        super().__init__(comp, ctx, params, node)
        self.members = {
            "tsc_size_words": known(3, COMPTIME_INT),
            "enable_tsc": NativeFn("enable_tsc", [], VOID_T, "pe.tsc_enable()"),
            "disable_tsc": NativeFn("disable_tsc", [], VOID_T, "pe.tsc_disable()"),
            "reset_tsc_counter": NativeFn("reset_tsc_counter", [], VOID_T, "pe.tsc_reset()"),
            "get_timestamp": NativeFn(
                "get_timestamp", [PointerType(ArrayOf3)], VOID_T, "pe.tsc_read({0}, {where})"
            ),
        }


class Random(NativeModule):
    spec = "random"

    def __init__(self, comp, ctx: Ctx, params: Struct, node: ast.Node) -> None:
        super().__init__(comp, ctx, params, node)
        self.members = {
            "random_f32": NativeFn("random_f32", [F32, F32], F32, "pe.random_f32({0}, {1})"),
            "set_global_prng_seed": NativeFn("set_global_prng_seed", [U32], VOID_T, "pe.random_seed({0})"),
        }


OPCODE = EnumType(U16, (("NOP", 0), ("SWITCH_ADV", 1), ("SWITCH_RST", 2), ("TEARDOWN", 3)), "opcode")


class Control(NativeModule):
    spec = "control"

    def __init__(self, comp, ctx: Ctx, params: Struct, node: ast.Node) -> None:
        super().__init__(comp, ctx, params, node)
        from csl_executor.fabric import encode_control, encode_single

        def entry(v: Any) -> int | None:
            if isinstance(v, Void):
                return None
            if isinstance(v, TaskId):
                return v.id
            return int(v)

        self.members = {
            "opcode": known(OPCODE, TYPE),
            "encode_control_task_payload": NativeFn(
                "encode_control_task_payload", [CONTROL_TASK_ID], U32, fold=lambda t: encode_control(t.id)
            ),
            "encode_single_payload": NativeFn(
                "encode_single_payload",
                [OPCODE, BOOL, ANYTYPE, U16],
                U32,
                "CTRL.encode_single({0}, {1}, {2}, {3})",
                fold=lambda op, ign, ep, data: encode_single(_op(op), ign, entry(ep), data),
            ),
        }


def _op(v: Any) -> int:
    return v.value if isinstance(v, EnumValue) else int(v)


class Simprint(NativeModule):
    spec = "simprint"

    def __init__(self, comp, ctx: Ctx, params: Struct, node: ast.Node) -> None:
        super().__init__(comp, ctx, params, node)
        fmt = {
            "print_string": (STRING, "{0}"),
            "print_u16_decimal": (U16, "d"),
            "print_u32_decimal": (U32, "d"),
            "print_i16_decimal": (I16, "d"),
            "print_i32_decimal": (I32, "d"),
            "print_u16_hex": (U16, "x"),
            "print_u32_hex": (U32, "x"),
            "print_f32": (F32, "g"),
        }
        self.members = {}
        for name, (t, f) in fmt.items():
            if t is STRING:
                self.members[name] = NativeFn(name, [STRING], VOID_T, "pe.simprint({0})")
            else:
                self.members[name] = NativeFn(name, [t], VOID_T, f"pe.simprint(format({{0}}, {f!r}))")


class Debug(NativeModule):
    spec = "debug"

    def __init__(self, comp, ctx: Ctx, params: Struct, node: ast.Node) -> None:
        super().__init__(comp, ctx, params, node)
        key = params.get("key")
        size = params.get("buffer_size")
        if not isinstance(key, str) or not isinstance(size, int):
            raise ctx.error(node, '<debug> takes .{ .key = "name", .buffer_size = N }')
        traces = ctx.program.native_state.setdefault("debug_traces", {})
        if key in traces:
            raise ctx.error(node, f"<debug> key {key!r} is imported twice")
        traces[key] = size
        ctx.program.allocate(f"debug.{key}", ArrayOfWords(size), True, (ctx.mod.path, node.line))
        k = repr(key)
        self.members = {
            "trace_string": NativeFn("trace_string", [STRING], VOID_T, f"pe.trace({k}, 'str', {{0}})")
        }
        for name, t in (("u16", U16), ("i16", I16), ("u32", U32), ("i32", I32), ("f32", F32), ("f16", F16)):
            self.members[f"trace_{name}"] = NativeFn(
                f"trace_{name}", [t], VOID_T, f"pe.trace({k}, {name!r}, {{0}})"
            )
        self.members["trace_bool"] = NativeFn("trace_bool", [BOOL], VOID_T, f"pe.trace({k}, 'bool', {{0}})")
        self.members["trace_timestamp"] = NativeFn(
            "trace_timestamp", [], VOID_T, f"pe.trace({k}, 'timestamp', 0)"
        )


def ArrayOfWords(n: int):
    from csl_executor.types import ArrayType

    return ArrayType(n, U16)


from csl_executor.types import ArrayType as _ArrayType  # noqa: E402

ArrayOf3 = _ArrayType(3, U16)


PRIORITY = EnumType(U16, (("LOW", 0), ("HIGH", 1)), "level")


class TileConfig(NativeModule):
    """`<tile_config>`: the PE's configuration registers. Importing it is fine (WaferLLM's Decode does
    and uses nothing); `task_priority` is implemented (the picker runs HIGH tasks before LOW ones);
    every other submodule is refused at the first member a program uses, by name."""

    spec = "tile_config"
    SUBMODULES = (
        "color_config", "control_transform", "exceptions", "filters", "input_queue_status",
        "main_thread_priority", "output_queue_status", "switch_config", "teardown",
    )  # fmt: skip

    def __init__(self, comp, ctx: Ctx, params: Struct, node: ast.Node) -> None:
        super().__init__(comp, ctx, params, node)
        self.members = {}
        for name in self.SUBMODULES:
            sub = ModuleInstance(ctx.program, f"<tile_config>.{name}", None, Struct(()))
            sub.native = (
                ColorConfigLib(comp, ctx)
                if name == "color_config"
                else _Refused(comp, ctx, f"tile_config.{name}")
            )
            self.members[name] = known(sub, MODULE)
        prio = ModuleInstance(ctx.program, "<tile_config>.task_priority", None, Struct(()))
        prio.native = TaskPriority(comp, ctx, params, node)
        self.members["task_priority"] = known(prio, MODULE)


class _Refused(NativeModule):
    def __init__(self, comp, ctx: Ctx, name: str) -> None:
        super().__init__(comp, ctx, Struct(()), ast.Node(0))
        self.spec = name

    def member(self, ctx: Ctx, name: str, node: ast.Node) -> CExpr:
        raise ctx.error(node, f"{self.spec}.{name} is not supported by the executor")


class ColorConfigLib(_Refused):
    """`<tile_config>.color_config`: `reset_routes(color, .{ .rx = ..., .tx = ... })` replaces the
    PE's route for a color at run time (WaferLLM's Decode turns its all-reduce between axes so); the
    other members, and a color given as a register address, are refused by name."""

    def __init__(self, comp, ctx: Ctx) -> None:
        super().__init__(comp, ctx, "tile_config.color_config")

        def reset_routes(c: Ctx, args: list[CExpr], n: ast.Node) -> CExpr:
            from csl_executor.builtins import route_directions

            color = c.need_known(args[0], n, "color")
            if not isinstance(color, Color):
                raise c.error(
                    n, "color_config.reset_routes takes a color (a register address is not supported)"
                )
            routes = c.need_known(args[1], n, "routes")
            if not isinstance(routes, Struct) or set(routes.names()) - {"rx", "tx"}:
                raise c.error(n, "color_config.reset_routes takes `.{ .rx = ..., .tx = ... }`")
            rx = route_directions(c, routes.get("rx", Struct(())), n, ".rx")
            tx = route_directions(c, routes.get("tx", Struct(())), n, ".tx")
            if c.comp.arch == "wse3" and len(rx) > 1:
                raise c.error(n, "on WSE-3 color_config.reset_routes takes one `.rx` direction")
            if not c.runtime:
                raise c.error(
                    n,
                    "color_config.reset_routes changes a route at run time; at comptime use @set_local_color_config",
                )
            c.program.native_state.setdefault("reset_colors", set()).add(color.id)
            where = c.fb.const(c.where(n))
            return c.dyn(VOID_T, f"pe.reset_routes({color.id}, {rx!r}, {tx!r}, {where})")

        self.reset = NativeFn("reset_routes", [ANYTYPE, ANYTYPE], VOID_T, comptime=reset_routes)

    def member(self, ctx: Ctx, name: str, node: ast.Node) -> CExpr:
        if name == "reset_routes":
            return CExpr(type_of_value(self.reset), self.reset)
        return super().member(ctx, name, node)


class TaskPriority(NativeModule):
    """`<tile_config>.task_priority`: HIGH or LOW per task ID (a data or local task ID, or the color
    on WSE-2 / input queue on WSE-3 that carries a task's wavelets), at comptime or at run time."""

    spec = "tile_config.task_priority"

    def __init__(self, comp, ctx: Ctx, params: Struct, node: ast.Node) -> None:
        super().__init__(comp, ctx, params, node)

        def setter(fixed: int | None):
            def comptime(c: Ctx, args: list[CExpr], n: ast.Node) -> CExpr:
                from csl_executor.builtins import task_id_of

                tid = task_id_of(c, c.need_known(args[0], n, "task ID"), n)
                if fixed is None:
                    level = c.need_known(args[1], n, "priority")
                    high = int(level.value if isinstance(level, EnumValue) else level)
                else:
                    high = fixed
                if c.runtime:
                    ref = c.fb.const(tid) if isinstance(tid, tuple) else tid
                    return c.dyn(VOID_T, f"pe.set_task_priority({ref}, {high})")
                c.program.startup.append(("set_task_priority", (tid, high), c.where(n)))
                return known(VOID, VOID_T)

            return comptime

        self.members = {
            "level": known(PRIORITY, TYPE),
            "set_task_priority": NativeFn("set_task_priority", [ANYTYPE], VOID_T, comptime=setter(1)),
            "clear_task_priority": NativeFn("clear_task_priority", [ANYTYPE], VOID_T, comptime=setter(0)),
            "update_task_priority": NativeFn(
                "update_task_priority", [ANYTYPE, PRIORITY], VOID_T, comptime=setter(None)
            ),
        }


class Directions(NativeModule):
    """`<directions>`: `flip(d)` is the opposite direction."""

    spec = "directions"

    def __init__(self, comp, ctx: Ctx, params: Struct, node: ast.Node) -> None:
        super().__init__(comp, ctx, params, node)
        from csl_executor.types import DIRECTION, DIRECTIONS

        opposite = {"NORTH": "SOUTH", "SOUTH": "NORTH", "EAST": "WEST", "WEST": "EAST", "RAMP": "RAMP"}
        self.members = {
            "flip": NativeFn("flip", [DIRECTION], DIRECTION, fold=lambda d: DIRECTIONS[opposite[d.name]])
        }


LIBRARIES = {
    "memcpy/get_params": MemcpyGetParams,
    "memcpy/memcpy": Memcpy,
    "layout": Layout,
    "time": Time,
    "math": Math,
    "random": Random,
    "control": Control,
    "simprint": Simprint,
    "debug": Debug,
    "directions": Directions,
    "tile_config": TileConfig,
}


def native_module(comp, ctx: Ctx, name: str, params: Struct, node: ast.Node) -> ModuleInstance:
    from csl_executor.collectives import COLLECTIVES

    factory = LIBRARIES.get(name) or COLLECTIVES.get(name)
    if factory is None:
        raise ctx.error(node, f"library <{name}> is not supported by the executor")
    mod = ModuleInstance(ctx.program, f"<{name}>", None, params)
    mod.native = factory(comp, ctx, params, node)
    return mod
