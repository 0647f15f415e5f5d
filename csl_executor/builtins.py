"""CSL's `@builtins`: what each one means at comptime and the code it becomes at run time.

Sources for every rule: the Cerebras SDK documentation's "Builtins", "DSDs", "Task IDs" pages and the
`Cerebras/csl-examples` programs. Resource rules that the compiler enforces (queue ids, task
id ranges, memcpy's reservations) live in `csl_executor.arch`; this module calls them where the program
names a resource.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from csl_executor import arch as archs
from csl_executor import ast, codesize
from csl_executor.program import ColorConfig, FnSym
from csl_executor.types import (
    BOOL,
    COLOR,
    COMPTIME_INT,
    COMPTIME_STRUCT,
    CONTROL_TASK_ID,
    DATA_TASK_ID,
    DSR_DEST,
    DSR_SRC0,
    DSR_SRC1,
    F16,
    F32,
    FABIN_DSD,
    FABOUT_DSD,
    FIFO_T,
    INPUT_QUEUE,
    LOCAL_TASK_ID,
    MEM1D_DSD,
    MEM4D_DSD,
    MODULE,
    OUTPUT_QUEUE,
    TYPE,
    U16,
    UT_ID,
    VOID_T,
    ArrayType,
    ArrayValue,
    Color,
    CslType,
    Dsd,
    Dsr,
    EnumType,
    EnumValue,
    Fifo,
    FloatType,
    IntType,
    Pointer,
    PointerType,
    Queue,
    Struct,
    TaskId,
    UtId,
)
from csl_executor.values import (
    VOID_EXPR,
    CExpr,
    CVar,
    MemArray,
    MemPlace,
    is_float,
    is_int,
    known,
    scalar_of,
)

if TYPE_CHECKING:
    from csl_executor.compiler import Ctx
    from csl_executor.layout import LayoutProgram

BUILTINS: dict[str, Any] = {}


def builtin(*names: str):
    def register(fn):
        for n in names:
            BUILTINS[n] = fn
        return fn

    return register


def _argc(ctx: Ctx, node: ast.BuiltinCall, *counts: int) -> None:
    if len(node.args) not in counts:
        want = " or ".join(str(c) for c in counts)
        raise ctx.error(node, f"@{node.name} takes {want} arguments, found {len(node.args)}")


def _known_arg(ctx: Ctx, node: ast.BuiltinCall, i: int, what: str = "argument") -> Any:
    return ctx.need_known(ctx.cx(node.args[i]), node.args[i], f"@{node.name} {what}")


def _int_arg(ctx: Ctx, node: ast.BuiltinCall, i: int, what: str = "argument") -> int:
    v = _known_arg(ctx, node, i, what)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ctx.error(node.args[i], f"@{node.name} {what} must be an integer, found {v!r}")
    return v


def _comptime_only(ctx: Ctx, node: ast.BuiltinCall) -> None:
    if ctx.runtime:
        raise ctx.error(node, f"@{node.name} is only allowed at comptime")


def _pe_only(ctx: Ctx, node: ast.BuiltinCall) -> None:
    from csl_executor.program import Program

    if not isinstance(ctx.program, Program):
        raise ctx.error(node, f"@{node.name} belongs in a PE program, not in the layout")


# ---------------------------------------------------------------------------------------------------
# Types, casts and comptime helpers


@builtin("as")
def _as(ctx: Ctx, node: ast.BuiltinCall, expect: CslType | None) -> CExpr:
    _argc(ctx, node, 2)
    t = ctx.ctype(node.args[0])
    v = ctx.cx(node.args[1], t)
    return convert(ctx, v, t, node)


def convert(ctx: Ctx, v: CExpr, t: CslType, node: ast.Node) -> CExpr:
    """`@as`: numeric conversions (float->int truncates toward zero), enums from integers."""
    s = v.type
    if s == t:
        return v
    code = ctx.code(v)
    if isinstance(t, IntType):
        if is_int(s):
            return ctx.finish(t, t.wrap_code(code), v.known)
        if is_float(s):
            return ctx.finish(t, f"FTOI({code}, {t.lo}, {t.hi})", v.known)
        if s is BOOL:
            return ctx.finish(t, f"(1 if {code} else 0)", v.known)
        if isinstance(s, EnumType):
            return ctx.finish(t, t.wrap_code(code), v.known)
    if isinstance(t, FloatType):
        rnd = "F32" if t is F32 else "F16"
        if is_int(s) or is_float(s):
            return ctx.finish(t, f"{rnd}(float({code}))", v.known)
    if isinstance(t, EnumType):
        if is_int(s):
            if v.known:
                member = next((n for n, val in t.members if val == v.value), None)
                if member is None:
                    raise ctx.error(node, f"{v.value} is not a value of {t.name}")
                return known(EnumValue(t, member, v.value), t)
            return ctx.dyn(t, code)
        if isinstance(v.value, str):
            return ctx.coerce(v, t, node)
    if t is BOOL and s is BOOL:
        return v
    return ctx.coerce(v, t, node)


@builtin("bitcast")
def _bitcast(ctx: Ctx, node: ast.BuiltinCall, expect: CslType | None) -> CExpr:
    _argc(ctx, node, 2)
    t = ctx.ctype(node.args[0])
    v = ctx.cx(node.args[1])
    s = v.type
    if s.words != t.words or not (s.is_numeric and t.is_numeric):
        raise ctx.error(node, f"@bitcast from {s.name} to {t.name}: sizes or kinds differ")
    code = ctx.code(v)
    bits = code
    if s is F32:
        bits = f"F2U({code})"
    elif s is F16:
        bits = f"F2H({code})"
    elif isinstance(s, IntType):
        bits = f"({code}) & {(1 << s.bits) - 1}"
    if t is F32:
        out = f"U2F({bits})"
    elif t is F16:
        out = f"H2F[{bits}]"
    else:
        out = cast(IntType, t).wrap_code(bits)  # checked above: t is F32, F16 or an integer type
    return ctx.finish(t, out, v.known)


@builtin("ptrcast")
def _ptrcast(ctx: Ctx, node: ast.BuiltinCall, expect: CslType | None) -> CExpr:
    _argc(ctx, node, 2)
    t = ctx.ctype(node.args[0])
    v = ctx.cx(node.args[1])
    if not isinstance(t, PointerType) or not isinstance(v.type, PointerType):
        raise ctx.error(node, "@ptrcast converts a pointer to another pointer type")
    if v.known:
        return known(Pointer(v.value.addr, t, v.value.symbol), t)
    return ctx.dyn(t, ctx.code(v))


@builtin("type_of")
def _type_of(ctx: Ctx, node: ast.BuiltinCall, expect: CslType | None) -> CExpr:
    _argc(ctx, node, 1)
    return known(ctx.cx(node.args[0]).type, TYPE)


@builtin("is_same_type")
def _is_same_type(ctx: Ctx, node: ast.BuiltinCall, expect: CslType | None) -> CExpr:
    _argc(ctx, node, 2)
    return known(ctx.ctype(node.args[0]) == ctx.ctype(node.args[1]), BOOL)


@builtin("is_arch")
def _is_arch(ctx: Ctx, node: ast.BuiltinCall, expect: CslType | None) -> CExpr:
    _argc(ctx, node, 1)
    name = _known_arg(ctx, node, 0)
    if name not in ("wse2", "wse3"):
        raise ctx.error(node, f'@is_arch takes "wse2" or "wse3", not {name!r}')
    return known(ctx.comp.arch == name, BOOL)


@builtin("comptime_assert")
def _comptime_assert(ctx: Ctx, node: ast.BuiltinCall, expect: CslType | None) -> CExpr:
    _argc(ctx, node, 1, 2)
    ok = _known_arg(ctx, node, 0, "condition")
    if ok is not True:
        msg = _known_arg(ctx, node, 1) if len(node.args) > 1 else "@comptime_assert failed"
        raise ctx.error(node, f"@comptime_assert: {msg}")
    return VOID_EXPR


@builtin("assert")
def _assert(ctx: Ctx, node: ast.BuiltinCall, expect: CslType | None) -> CExpr:
    _argc(ctx, node, 1)
    c = ctx.cx(node.args[0])
    if c.known and (c.value is True or not ctx.runtime):
        if c.value is not True:
            raise ctx.error(node, "@assert failed at comptime")
        return VOID_EXPR
    # In run-time code a false assertion fails when it is reached (WaferLLM's Decode puts
    # `@assert(false)` in the branch no axis takes).
    where = ctx.fb.const(ctx.where(node))
    return ctx.dyn(VOID_T, f"pe.check({ctx.code(c)}, {where})")


@builtin("concat_structs")
def _concat_structs(ctx: Ctx, node: ast.BuiltinCall, expect: CslType | None) -> CExpr:
    _argc(ctx, node, 2)
    a, b = _known_arg(ctx, node, 0), _known_arg(ctx, node, 1)
    if not isinstance(a, Struct) or not isinstance(b, Struct):
        raise ctx.error(node, "@concat_structs takes two structs")
    dup = set(a.names()) & set(b.names())
    if dup:
        raise ctx.error(node, f"@concat_structs: both structs have field(s) {', '.join(sorted(dup))}")
    return known(Struct(a.fields + b.fields, a.types + b.types), COMPTIME_STRUCT)


@builtin("get_rectangle")
def _get_rectangle(ctx: Ctx, node: ast.BuiltinCall, expect: CslType | None) -> CExpr:
    w, h = ctx.comp.layout_info.get("rectangle", (0, 0))
    return known(Struct((("width", w), ("height", h)), (("width", U16), ("height", U16))), COMPTIME_STRUCT)


@builtin("zeros")
def _zeros(ctx: Ctx, node: ast.BuiltinCall, expect: CslType | None) -> CExpr:
    _argc(ctx, node, 1)
    t = ctx.ctype(node.args[0])
    if not isinstance(t, ArrayType):
        raise ctx.error(node, "@zeros takes an array type")
    return known(ctx.comp.zero_value(t), t)


@builtin("constants")
def _constants(ctx: Ctx, node: ast.BuiltinCall, expect: CslType | None) -> CExpr:
    _argc(ctx, node, 2)
    t = ctx.ctype(node.args[0])
    if not isinstance(t, ArrayType):
        raise ctx.error(node, "@constants takes an array type")
    v = ctx.coerce(ctx.cx(node.args[1], t.scalar), t.scalar, node.args[1])
    return known(ArrayValue(t, [ctx.need_known(v, node.args[1])] * t.count), t)


@builtin("range")
def _range(ctx: Ctx, node: ast.BuiltinCall, expect: CslType | None) -> CExpr:
    raise ctx.error(node, "@range is only allowed as the sequence of a `for`")


@builtin("import_module")
def _import_module(ctx: Ctx, node: ast.BuiltinCall, expect: CslType | None) -> CExpr:
    _argc(ctx, node, 1, 2)
    spec = _known_arg(ctx, node, 0, "path")
    params = _known_arg(ctx, node, 1, "parameters") if len(node.args) > 1 else Struct(())
    if not isinstance(spec, str) or not isinstance(params, Struct):
        raise ctx.error(node, "@import_module takes a path string and a parameter struct")
    return known(ctx.comp.import_module(ctx, spec, params, node), MODULE)


@builtin("__comptime")
def _comptime_expr(ctx: Ctx, node: ast.BuiltinCall, expect: CslType | None) -> CExpr:
    """`comptime e` as an expression: e evaluated at comptime."""
    value = ctx.cx(node.args[0], expect)
    ctx.need_known(value, node.args[0], "a `comptime` expression")
    return value


@builtin("__param")
def _param(ctx: Ctx, node: ast.BuiltinCall, expect: CslType | None) -> CExpr:
    raise ctx.error(node, "internal: param marker outside a declaration")


@builtin("__tensor_access")
def _tensor_access(ctx: Ctx, node: ast.BuiltinCall, expect: CslType | None) -> CExpr:
    raise ctx.error(node, "a tensor access is only allowed as a DSD's `.tensor_access`")


# ---------------------------------------------------------------------------------------------------
# Colors, task IDs, queues


@builtin("get_color")
def _get_color(ctx: Ctx, node: ast.BuiltinCall, expect: CslType | None) -> CExpr:
    _argc(ctx, node, 1)
    cid = _int_arg(ctx, node, 0, "color id")
    archs.check_color_id(ctx.comp.arch, cid, ctx.where(node))
    return known(Color(cid), COLOR)


@builtin("get_local_task_id")
def _get_local_task_id(ctx: Ctx, node: ast.BuiltinCall, expect: CslType | None) -> CExpr:
    _argc(ctx, node, 1)
    tid = _int_arg(ctx, node, 0, "task id")
    archs.check_local_task_id(ctx.comp.arch, tid, ctx.where(node))
    return known(TaskId("local", tid), LOCAL_TASK_ID)


@builtin("get_control_task_id")
def _get_control_task_id(ctx: Ctx, node: ast.BuiltinCall, expect: CslType | None) -> CExpr:
    _argc(ctx, node, 1)
    tid = _int_arg(ctx, node, 0, "task id")
    archs.check_control_task_id(ctx.comp.arch, tid, ctx.where(node))
    return known(TaskId("control", tid), CONTROL_TASK_ID)


@builtin("get_data_task_id")
def _get_data_task_id(ctx: Ctx, node: ast.BuiltinCall, expect: CslType | None) -> CExpr:
    _argc(ctx, node, 1)
    v = _known_arg(ctx, node, 0, "color or input queue")
    if ctx.comp.arch == "wse2":
        if not isinstance(v, Color):
            raise ctx.error(node, f"on WSE-2 a data task ID is made from a color, not {v!r}")
        return known(TaskId("data", v.id, color=v), DATA_TASK_ID)
    if not isinstance(v, Queue) or v.kind != "input":
        raise ctx.error(node, f"on WSE-3 a data task ID is made from an input queue, not {v!r}")
    return known(TaskId("data", v.id, queue=v.id), DATA_TASK_ID)


@builtin("get_input_queue")
def _get_input_queue(ctx: Ctx, node: ast.BuiltinCall, expect: CslType | None) -> CExpr:
    _argc(ctx, node, 1)
    q = _int_arg(ctx, node, 0, "queue id")
    archs.check_queue(ctx.comp.arch, "input", q, ctx.where(node), memcpy=_uses_memcpy(ctx))
    return known(Queue("input", q), INPUT_QUEUE)


@builtin("get_output_queue")
def _get_output_queue(ctx: Ctx, node: ast.BuiltinCall, expect: CslType | None) -> CExpr:
    _argc(ctx, node, 1)
    q = _int_arg(ctx, node, 0, "queue id")
    archs.check_queue(ctx.comp.arch, "output", q, ctx.where(node), memcpy=_uses_memcpy(ctx))
    return known(Queue("output", q), OUTPUT_QUEUE)


def _uses_memcpy(ctx: Ctx) -> bool:
    return bool(ctx.comp.layout_info.get("memcpy", False))


@builtin("get_int")
def _get_int(ctx: Ctx, node: ast.BuiltinCall, expect: CslType | None) -> CExpr:
    """The integer id of a color, task ID, queue or microthread."""
    _argc(ctx, node, 1)
    v = _known_arg(ctx, node, 0)
    if isinstance(v, (Color, TaskId, Queue, UtId)):
        return known(v.id, COMPTIME_INT)
    raise ctx.error(node, f"@get_int takes a color, task ID, queue or microthread ID, not {v!r}")


@builtin("get_ut_id")
def _get_ut_id(ctx: Ctx, node: ast.BuiltinCall, expect: CslType | None) -> CExpr:
    _argc(ctx, node, 1)
    u = _int_arg(ctx, node, 0, "microthread id")
    if ctx.comp.arch != "wse3":
        raise ctx.error(node, "@get_ut_id exists on WSE-3 only")
    if not 0 <= u <= 7:
        raise ctx.error(node, f"microthread id {u} out of range 0-7")
    return known(UtId(u), UT_ID)


# ---------------------------------------------------------------------------------------------------
# Tasks


def task_id_of(
    ctx: Ctx, v: Any, node: ast.Node, kinds: tuple[str, ...] = ("local", "data", "control")
) -> int | tuple[str, FnSym]:
    """The task table index an @activate/@block/... argument names (a task ID, a color on WSE-2, an
    input queue on WSE-3, or a task function that is bound)."""
    if isinstance(v, TaskId):
        return v.id
    if isinstance(v, Color):
        if ctx.comp.arch != "wse2":
            raise ctx.error(node, "on WSE-3 block/unblock an input queue, not a color")
        return v.id
    if isinstance(v, Queue) and v.kind == "input":
        if ctx.comp.arch != "wse3":
            raise ctx.error(node, "on WSE-2 block/unblock a color or a task ID, not an input queue")
        return v.id
    if isinstance(v, FnSym):
        tid = ctx.program.task_fn(v)
        if tid is None:
            return ("fn", v)  # resolved when the program is finished
        return tid
    raise ctx.error(node, f"expected a task ID, found {v!r}")


def _task_op(op: str):
    def handler(ctx: Ctx, node: ast.BuiltinCall, expect: CslType | None) -> CExpr:
        _argc(ctx, node, 1)
        _pe_only(ctx, node)
        v = ctx.cx(node.args[0])
        if not v.known:
            return ctx.dyn(VOID_T, f"pe.{op}({v.code})")
        tid = task_id_of(ctx, v.value, node)
        if ctx.runtime:
            return ctx.dyn(VOID_T, f"pe.{op}({ctx.fb.const(tid) if isinstance(tid, tuple) else tid})")
        ctx.program.startup.append((op, tid, ctx.where(node)))
        return VOID_EXPR

    return handler


BUILTINS["activate"] = _task_op("activate")
BUILTINS["block"] = _task_op("block")
BUILTINS["unblock"] = _task_op("unblock")


def _bind(kind: str):
    def handler(ctx: Ctx, node: ast.BuiltinCall, expect: CslType | None) -> CExpr:
        _argc(ctx, node, 2)
        _comptime_only(ctx, node)
        _pe_only(ctx, node)
        fn = _known_arg(ctx, node, 0, "task")
        tid = _known_arg(ctx, node, 1, "task ID")
        if not isinstance(fn, FnSym):
            raise ctx.error(node, f"@bind_{kind}_task takes a task, not {fn!r}")
        if not fn.decl.is_task:
            raise ctx.error(node, f"{fn.name!r} is a fn, not a task")
        if not isinstance(tid, TaskId) or tid.kind != kind:
            raise ctx.error(node, f"@bind_{kind}_task needs a {kind}_task_id, found {tid!r}")
        archs.check_bind(ctx.comp.arch, kind, tid, fn, ctx.where(node), memcpy=_uses_memcpy(ctx))
        ctx.program.bind_task(kind, tid.id, fn, ctx.where(node))
        if kind == "data" and tid.color is not None:
            ctx.program.native_state.setdefault("data_task_colors", {})[tid.id] = tid.color.id
        return VOID_EXPR

    return handler


BUILTINS["bind_local_task"] = _bind("local")
BUILTINS["bind_data_task"] = _bind("data")
BUILTINS["bind_control_task"] = _bind("control")


@builtin("rpc")
def _rpc(ctx: Ctx, node: ast.BuiltinCall, expect: CslType | None) -> CExpr:
    """SDK 1.0's `@rpc(@get_data_task_id(sys_mod.LAUNCH))`: the PE serves host launches on the
    LAUNCH color. The executor launches natively, so this only checks the color is memcpy's."""
    _argc(ctx, node, 1)
    _comptime_only(ctx, node)
    _pe_only(ctx, node)
    tid = _known_arg(ctx, node, 0, "data task ID")
    memcpy = ctx.program.memcpy
    launch = memcpy.get("LAUNCH") if memcpy is not None and memcpy.has("LAUNCH") else None
    if not isinstance(launch, Color):
        raise ctx.error(node, "@rpc serves the LAUNCH color, which <memcpy/get_params> was not given")
    if not isinstance(tid, TaskId) or tid.kind != "data" or tid.color is None or tid.color.id != launch.id:
        raise ctx.error(node, f"@rpc takes @get_data_task_id(LAUNCH) (color {launch.id}), not {tid!r}")
    ctx.program.native_state["rpc"] = launch.id
    return VOID_EXPR


@builtin("set_teardown_handler")
def _set_teardown_handler(ctx: Ctx, node: ast.BuiltinCall, expect: CslType | None) -> CExpr:
    raise ctx.error(node, "teardown is not supported by the executor")


@builtin("set_control_task_table")
def _set_control_task_table(ctx: Ctx, node: ast.BuiltinCall, expect: CslType | None) -> CExpr:
    raise ctx.error(node, "@set_control_task_table is not supported by the executor")


# ---------------------------------------------------------------------------------------------------
# Exports and routes


@builtin("export_symbol")
def _export_symbol(ctx: Ctx, node: ast.BuiltinCall, expect: CslType | None) -> CExpr:
    _argc(ctx, node, 1, 2)
    _comptime_only(ctx, node)
    _pe_only(ctx, node)
    arg = node.args[0]
    b = ctx.lookup(arg.name, arg) if isinstance(arg, ast.Ident) else None
    from csl_executor.program import SlotVar

    if isinstance(b, SlotVar):
        value = b.initial
    else:
        value = _known_arg(ctx, node, 0, "symbol")
    name = _known_arg(ctx, node, 1, "name") if len(node.args) > 1 else None
    if isinstance(value, FnSym):
        ctx.comp.export_fn(ctx, value, name or value.name, node)
    elif isinstance(value, Pointer):
        if name is None:
            raise ctx.error(node, "@export_symbol of a pointer needs a name")
        ctx.comp.export_data(ctx, value, name, node)
    else:
        raise ctx.error(node, f"@export_symbol takes a function or a pointer, not {value!r}")
    return VOID_EXPR


@builtin("export_name")
def _export_name(ctx: Ctx, node: ast.BuiltinCall, expect: CslType | None) -> CExpr:
    _argc(ctx, node, 2, 3)
    lp = _layout_only(ctx, node)
    name = _known_arg(ctx, node, 0, "name")
    t = ctx.ctype(node.args[1])
    mutable = _known_arg(ctx, node, 2, "mutability") if len(node.args) > 2 else False
    lp.export_name(name, t, mutable, ctx.where(node))
    return VOID_EXPR


def _layout_only(ctx: Ctx, node: ast.BuiltinCall) -> LayoutProgram:
    if not ctx.layout:
        raise ctx.error(node, f"@{node.name} is only allowed in a layout block")
    # A layout block's module belongs to the layout file, whose program is its LayoutProgram.
    return cast("LayoutProgram", ctx.program)


@builtin("set_rectangle")
def _set_rectangle(ctx: Ctx, node: ast.BuiltinCall, expect: CslType | None) -> CExpr:
    _argc(ctx, node, 2)
    lp = _layout_only(ctx, node)
    lp.set_rectangle(_int_arg(ctx, node, 0), _int_arg(ctx, node, 1), ctx.where(node))
    return VOID_EXPR


@builtin("set_tile_code")
def _set_tile_code(ctx: Ctx, node: ast.BuiltinCall, expect: CslType | None) -> CExpr:
    _argc(ctx, node, 3, 4)
    lp = _layout_only(ctx, node)
    x, y = _int_arg(ctx, node, 0), _int_arg(ctx, node, 1)
    path = _known_arg(ctx, node, 2, "file")
    params = _known_arg(ctx, node, 3, "parameters") if len(node.args) > 3 else Struct(())
    if not isinstance(path, str) or not isinstance(params, Struct):
        raise ctx.error(node, "@set_tile_code takes (x, y, file, params struct)")
    full = str((Path(ctx.mod.path).parent / path).resolve())
    lp.set_tile_code(x, y, full, params, ctx.where(node))
    return VOID_EXPR


@builtin("set_color_config")
def _set_color_config(ctx: Ctx, node: ast.BuiltinCall, expect: CslType | None) -> CExpr:
    _argc(ctx, node, 4)
    lp = _layout_only(ctx, node)
    x, y = _int_arg(ctx, node, 0), _int_arg(ctx, node, 1)
    color = _known_arg(ctx, node, 2, "color")
    config = _known_arg(ctx, node, 3, "config")
    if not isinstance(color, Color):
        raise ctx.error(node.args[2], f"expected a color, found {color!r}")
    lp.set_color_config(x, y, color, color_config(ctx, config, node), ctx.where(node))
    return VOID_EXPR


@builtin("set_local_color_config")
def _set_local_color_config(ctx: Ctx, node: ast.BuiltinCall, expect: CslType | None) -> CExpr:
    _argc(ctx, node, 2)
    _comptime_only(ctx, node)
    _pe_only(ctx, node)
    color = _known_arg(ctx, node, 0, "color")
    config = _known_arg(ctx, node, 1, "config")
    if not isinstance(color, Color):
        raise ctx.error(node.args[0], f"expected a color, found {color!r}")
    if color.id in ctx.program.local_colors:
        raise ctx.error(node, f"color {color.id} is configured twice on this PE")
    ctx.program.local_colors[color.id] = color_config(ctx, config, node)
    return VOID_EXPR


def route_directions(ctx: Ctx, v: Any, node: ast.Node, what: str) -> tuple[str, ...]:
    """A route's `.rx` or `.tx`: one direction, a tuple or an array of them."""
    if isinstance(v, ArrayValue):
        return _dirs(ctx, Struct(tuple((str(i), d) for i, d in enumerate(v.items))), node, what)
    return _dirs(ctx, v, node, what)


def _dirs(ctx: Ctx, v: Any, node: ast.Node, what: str) -> tuple[str, ...]:
    from csl_executor.types import Direction

    if isinstance(v, Direction):
        return (v.name,)
    if isinstance(v, Struct):
        out = []
        for d in v.values():
            if not isinstance(d, Direction):
                raise ctx.error(node, f"{what} must list directions, found {d!r}")
            out.append(d.name)
        return tuple(out)
    raise ctx.error(node, f"{what} must be a direction or a tuple of directions, found {v!r}")


def color_config(ctx: Ctx, config: Any, node: ast.Node) -> ColorConfig:
    if not isinstance(config, Struct):
        raise ctx.error(node, "a color config is a struct with `.routes`")
    known_fields = {"routes", "switches", "filter", "teardown"}
    extra = set(config.names()) - known_fields
    if extra:
        raise ctx.error(node, f"unknown color config field(s): {', '.join(sorted(extra))}")
    routes = config.get("routes")
    if not isinstance(routes, Struct):
        raise ctx.error(node, "a color config needs `.routes = .{ .rx = ..., .tx = ... }`")
    extra = set(routes.names()) - {"rx", "tx", "color_swap_x", "color_swap_y"}
    if extra:
        raise ctx.error(node, f"unknown route field(s): {', '.join(sorted(extra))}")
    rx = _dirs(ctx, routes.get("rx", Struct(())), node, ".rx")
    tx = _dirs(ctx, routes.get("tx", Struct(())), node, ".tx")
    switches = config.get("switches")
    if switches is not None and not isinstance(switches, Struct):
        raise ctx.error(node, ".switches must be a struct")
    filt = config.get("filter")
    if filt is not None and not isinstance(filt, Struct):
        raise ctx.error(node, ".filter must be a struct")
    teardown = bool(config.get("teardown", False))
    if teardown:
        raise ctx.error(node, "teardown is not supported by the executor")
    return ColorConfig(
        rx,
        tx,
        switches,
        filt,
        bool(routes.get("color_swap_x", False)),
        bool(routes.get("color_swap_y", False)),
        teardown,
        ctx.where(node),
    )


@builtin("initialize_queue")
def _initialize_queue(ctx: Ctx, node: ast.BuiltinCall, expect: CslType | None) -> CExpr:
    _argc(ctx, node, 2)
    _comptime_only(ctx, node)
    _pe_only(ctx, node)
    q = _known_arg(ctx, node, 0, "queue")
    cfg = _known_arg(ctx, node, 1, "config")
    if not isinstance(q, Queue) or not isinstance(cfg, Struct):
        raise ctx.error(node, "@initialize_queue takes a queue and `.{ .color = c }`")
    color = cfg.get("color")
    if not isinstance(color, Color):
        raise ctx.error(node, "@initialize_queue needs `.color`")
    key = (q.kind, q.id)
    prev = ctx.program.queue_colors.get(key)
    if prev is not None and prev[0] != color.id:
        raise ctx.error(
            node,
            f"{q.kind} queue {q.id} is already bound to color {prev[0]} ({prev[1]}): one color per queue",
        )
    ctx.program.queue_colors[key] = (color.id, ctx.where(node))
    return VOID_EXPR


# ---------------------------------------------------------------------------------------------------
# DSDs and FIFOs


@builtin("allocate_fifo")
def _allocate_fifo(ctx: Ctx, node: ast.BuiltinCall, expect: CslType | None) -> CExpr:
    _argc(ctx, node, 1)
    _comptime_only(ctx, node)
    _pe_only(ctx, node)
    p = ctx.place(node.args[0])
    if not isinstance(p, MemPlace) or not isinstance(p.type, ArrayType) or not p.addr.known:
        raise ctx.error(node, "@allocate_fifo takes a global array")
    elem = p.type.scalar
    if elem.words not in (1, 2):
        raise ctx.error(node, "a FIFO buffer holds 16- or 32-bit elements")
    fifo = Fifo(len(ctx.program.fifos), Pointer(p.addr.value, PointerType(elem, True)), p.type.count, elem)
    ctx.program.fifos.append(fifo)
    return known(fifo, FIFO_T)


_DSD_KINDS = {"mem1d_dsd": "mem1d", "mem4d_dsd": "mem4d", "fabin_dsd": "fabin", "fabout_dsd": "fabout"}


@builtin("get_dsd")
def _get_dsd(ctx: Ctx, node: ast.BuiltinCall, expect: CslType | None) -> CExpr:
    _argc(ctx, node, 2)
    kind_t = ctx.ctype(node.args[0])
    kind = _DSD_KINDS.get(kind_t.name)
    if kind is None:
        raise ctx.error(node, f"@get_dsd: unknown DSD type {kind_t.name}")
    fields_node = node.args[1]
    if not isinstance(fields_node, ast.StructLit):
        raise ctx.error(node, "@get_dsd takes a struct literal of fields")
    fields = dict(fields_node.fields)
    if kind in ("mem1d", "mem4d"):
        return _mem_dsd(ctx, node, kind, fields)
    return _fab_dsd(ctx, node, kind, fields)


_MEM_FIELDS = {"tensor_access", "base_address", "extent", "stride", "offset", "wavelet_index_offset"}
_FAB_FIELDS = {
    "fabric_color", "extent", "input_queue", "output_queue", "control", "wavelet_index_offset", "simd_mode",
    "advance_switch", "zero", "control_transform", "priority",
}  # fmt: skip


def _mem_dsd(ctx: Ctx, node: ast.BuiltinCall, kind: str, fields: dict[str, ast.Node]) -> CExpr:
    extra = set(fields) - _MEM_FIELDS
    if extra:
        raise ctx.error(node, f"@get_dsd({kind}_dsd): unknown field(s) {', '.join(sorted(extra))}")
    wio = False
    if "wavelet_index_offset" in fields:
        wio = bool(ctx.need_known(ctx.cx(fields["wavelet_index_offset"]), node))
    if "tensor_access" in fields:
        ta = fields["tensor_access"]
        if not isinstance(ta, ast.TensorAccess):
            raise ctx.error(node, "`.tensor_access` must be `|i|{N} -> A[...]`")
        return _tensor_dsd(ctx, node, kind, ta, wio)
    if kind == "mem4d":
        return _mem4d_fields(ctx, node, fields, wio)
    if "base_address" not in fields:
        raise ctx.error(node, "a mem1d_dsd needs `.tensor_access` or `.base_address`")
    base = ctx.cx(fields["base_address"])
    if not isinstance(base.type, PointerType):
        raise ctx.error(node, f"`.base_address` must be a pointer, found {base.type.name}")
    check_base_pointer(ctx, base.type, node, "`.base_address`")
    elem = scalar_of(base.type.elem)
    length = ctx.cx(fields["extent"]) if "extent" in fields else known(0, COMPTIME_INT)
    stride = ctx.cx(fields["stride"]) if "stride" in fields else known(1, COMPTIME_INT)
    offset = ctx.cx(fields["offset"]) if "offset" in fields else known(0, COMPTIME_INT)
    parts = [base, length, stride, offset]
    if all(p.known for p in parts):
        dsd = Dsd(
            "mem1d", elem, base=base.value.addr, offset=offset.value, length=length.value, stride=stride.value,
            wavelet_index_offset=wio, symbol=base.value.symbol,
        )  # fmt: skip
        check_dsd(ctx, dsd, node)
        return known(dsd, MEM1D_DSD)
    codes = [
        ctx.code(p) if not p.known else str(p.value.addr if isinstance(p.value, Pointer) else p.value)
        for p in parts
    ]
    where = ctx.fb.const(ctx.where(node))
    return ctx.dyn(MEM1D_DSD, f"DSD.mem1d({ctx.fb.const(elem)}, {', '.join(codes)}, {wio}, {where})")


def _mem4d_fields(ctx: Ctx, node: ast.BuiltinCall, fields: dict[str, ast.Node], wio: bool) -> CExpr:
    """`mem4d_dsd` from `.base_address`, `.extent = .{e0, e1, ...}` and `.stride = .{s0, s1, ...}`
    (comptime tuples, SDK 1.3+): the first dimension varies fastest, and a dimension's stride is the
    address change when it steps, counted from where the inner dimensions ended (SDK "DSDs": the
    inner dimensions are not rewound)."""
    for name in ("base_address", "extent", "stride"):
        if name not in fields:
            raise ctx.error(
                node, "a mem4d_dsd needs `.tensor_access`, or `.base_address`, `.extent` and `.stride`"
            )
    base = ctx.cx(fields["base_address"])
    if not isinstance(base.type, PointerType):
        raise ctx.error(node, f"`.base_address` must be a pointer, found {base.type.name}")
    check_base_pointer(ctx, base.type, node, "`.base_address`")
    extents = ctx.need_known(ctx.cx(fields["extent"]), node, "`.extent`")
    strides = ctx.need_known(ctx.cx(fields["stride"]), node, "`.stride`")
    ext = list(extents.values()) if isinstance(extents, Struct) else [extents]
    std = list(strides.values()) if isinstance(strides, Struct) else [strides]
    if not 1 <= len(ext) <= 4 or len(ext) != len(std) or not all(isinstance(v, int) for v in ext + std):
        raise ctx.error(node, "a mem4d_dsd takes 1-4 integer extents and as many strides")
    absolute: list[int] = []
    for k, s_k in enumerate(std):
        absolute.append(s_k + sum((ext[j] - 1) * absolute[j] for j in range(k)))
    dims = tuple(zip(reversed(ext), reversed(absolute), strict=True))  # outermost first
    elem = scalar_of(base.type.elem)
    if not base.known:
        where = ctx.fb.const(ctx.where(node))
        return ctx.dyn(
            MEM4D_DSD,
            f"DSD.mem4d({ctx.fb.const(elem)}, {ctx.code(base)}, {ctx.fb.const(dims)}, {wio}, {where})",
        )
    dsd = Dsd(
        "mem4d", elem, base=base.value.addr, dims=dims, wavelet_index_offset=wio, symbol=base.value.symbol
    )
    check_dsd(ctx, dsd, node)
    return known(dsd, MEM4D_DSD)


def _tensor_dsd(ctx: Ctx, node: ast.BuiltinCall, kind: str, ta: ast.TensorAccess, wio: bool) -> CExpr:
    extents = [ctx.cx(e) for e in ta.extents]
    if len(extents) != len(ta.vars):
        raise ctx.error(node, "a tensor access needs one extent per index variable")
    if kind == "mem1d" and len(ta.vars) != 1:
        raise ctx.error(node, "a mem1d_dsd's tensor access has one index variable (use mem4d_dsd)")
    if len(ta.vars) > 4:
        raise ctx.error(node, "a mem4d_dsd has at most 4 index variables")

    def address(values: list[int]) -> tuple[CExpr, CslType]:
        inner = ctx.child(unchecked=True)
        for var, v in zip(ta.vars, values, strict=True):
            inner.scope.names[var] = CVar(v, COMPTIME_INT)
        p = inner.place(ta.expr)
        if not isinstance(p, MemPlace):
            raise ctx.error(node, "a tensor access must index an array in memory")
        return p.addr, p.type

    zero = [0] * len(ta.vars)
    base, elem = address(zero)
    strides = []
    for k in range(len(ta.vars)):
        unit = list(zero)
        unit[k] = 1
        a1, _ = address(unit)
        two = list(zero)
        two[k] = 2
        a2, _ = address(two)
        if a1.known and base.known and a2.known:
            step = a1.value - base.value
            if a2.value - a1.value != step:
                raise ctx.error(node, "a tensor access must be affine in its index variables")
            if step % max(1, elem.words):
                raise ctx.error(node, "tensor access stride is not a whole number of elements")
            strides.append(step // max(1, elem.words))
        else:
            strides.append(None)
    if isinstance(elem, ArrayType):
        raise ctx.error(node, "a tensor access must reach scalar elements")
    if base.known and all(s is not None for s in strides) and all(e.known for e in extents):
        if kind == "mem1d":
            dsd = Dsd(
                "mem1d",
                elem,
                base=base.value,
                length=extents[0].value,
                stride=strides[0],
                wavelet_index_offset=wio,
            )
        else:
            dims = tuple((e.value, s) for e, s in zip(extents, strides, strict=True))
            dsd = Dsd("mem4d", elem, base=base.value, dims=dims, wavelet_index_offset=wio)
        check_dsd(ctx, dsd, node)
        return known(dsd, MEM1D_DSD if kind == "mem1d" else MEM4D_DSD)
    if kind != "mem1d":
        raise ctx.error(node, "a mem4d_dsd's tensor access must be comptime-known")
    if strides[0] is None:
        one, _ = address([1])
        stride_code = f"(({ctx.code(one)}) - ({ctx.code(base)})) // {max(1, elem.words)}"
    else:
        stride_code = str(strides[0])
    where = ctx.fb.const(ctx.where(node))
    return ctx.dyn(
        MEM1D_DSD,
        f"DSD.mem1d({ctx.fb.const(elem)}, {ctx.code(base)}, {ctx.code(extents[0])}, {stride_code}, 0, {wio}, {where})",
    )


def _fab_dsd(ctx: Ctx, node: ast.BuiltinCall, kind: str, fields: dict[str, ast.Node]) -> CExpr:
    extra = set(fields) - _FAB_FIELDS
    if extra:
        raise ctx.error(node, f"@get_dsd({kind}_dsd): unknown field(s) {', '.join(sorted(extra))}")
    vals: dict[str, CExpr] = {k: ctx.cx(v) for k, v in fields.items()}
    if "fabric_color" not in vals:
        raise ctx.error(node, f"a {kind}_dsd needs `.fabric_color`")
    color = ctx.need_known(vals["fabric_color"], node, "fabric color")
    if not isinstance(color, Color):
        raise ctx.error(node, f"`.fabric_color` must be a color, found {color!r}")
    qfield = "input_queue" if kind == "fabin" else "output_queue"
    queue = None
    if qfield in vals:
        q = ctx.need_known(vals[qfield], node, qfield)
        if not isinstance(q, Queue) or q.kind != qfield.split("_")[0]:
            raise ctx.error(node, f"`.{qfield}` must be an {qfield}, found {q!r}")
        queue = q.id
        from csl_executor.program import Program

        if isinstance(ctx.program, Program):
            ctx.program.note_queue(q.kind, q.id, color, ctx.where(node))
    wrong = "output_queue" if kind == "fabin" else "input_queue"
    if wrong in vals:
        raise ctx.error(node, f"a {kind}_dsd takes `.{qfield}`, not `.{wrong}`")
    control = bool(ctx.need_known(vals["control"], node)) if "control" in vals else False
    if control and kind != "fabout":
        raise ctx.error(node, "`.control` applies to fabout_dsd only")
    simd = ""
    if "simd_mode" in vals:
        simd = _simd_mode(ctx, ctx.need_known(vals["simd_mode"], node, "`.simd_mode`"), node)
    for unsupported in ("advance_switch", "zero", "control_transform", "wavelet_index_offset"):
        if unsupported in vals and ctx.need_known(vals[unsupported], node):
            raise ctx.error(node, f"`.{unsupported}` is not supported by the executor")
    length = vals.get("extent", known(0, COMPTIME_INT))
    if not is_int(length.type):
        raise ctx.error(node, "`.extent` must be an integer")
    dsd = Dsd(
        kind,
        None,
        length=length.value if length.known else 0,
        color=color,
        queue=queue,
        control=control,
        simd_mode=simd,
    )
    if length.known:
        check_dsd(ctx, dsd, node)
        return known(dsd, FABIN_DSD if kind == "fabin" else FABOUT_DSD)
    where = ctx.fb.const(ctx.where(node))
    return ctx.dyn(dsd.type, f"DSD.with_length({ctx.fb.const(dsd)}, {ctx.code(length)}, {where})")


def check_base_pointer(ctx: Ctx, t: PointerType, node: ast.Node, what: str) -> None:
    """A DSD's base address is a many-item pointer ([*]T) or a pointer to an array. A single-item
    pointer (`&a[i]`, `*T`) became one by coercion (*T -> *[1]T) only in SDK 2.10 (release notes);
    1.4 programs write `@ptrcast([*]T, &a[i])` (25-pt-stencil's task.csl does)."""
    if t.many or isinstance(t.elem, ArrayType) or sdk_line(ctx) >= (2, 10):
        return
    raise ctx.error(
        node,
        f"{what}: on SDK 1.4 a single-item pointer {t.name} is not a [*]{t.elem.name}: write "
        f"@ptrcast([*]{t.elem.name}, ...) (the *T -> *[1]T coercion arrived in SDK 2.10)",
    )


def sdk_line(ctx: Ctx) -> tuple[int, int]:
    """The SDK line the program is compiled for (csl_executor.layout.Options.sdk: 1.4 unless
    WAFER_CSL_SDK says otherwise)."""
    major, _, minor = str(ctx.comp.layout_info.get("sdk", "1.4")).partition(".")
    return int(major), int(minor or 0)


SIMD_MODES = ("simd_32", "simd_64", "simd_32_or_64")


def _simd_mode(ctx: Ctx, mode: Any, node: ast.Node) -> str:
    """`.simd_mode = .{ .simd_32 = true }` (or simd_64, simd_32_or_64): exactly one mode set."""
    if not isinstance(mode, Struct):
        raise ctx.error(node, "`.simd_mode` takes `.{ .simd_32 = true }`, `.simd_64` or `.simd_32_or_64`")
    unknown = set(mode.names()) - set(SIMD_MODES)
    if unknown:
        raise ctx.error(node, f"`.simd_mode`: unknown mode(s) {', '.join(sorted(unknown))}")
    chosen = [m for m in SIMD_MODES if mode.has(m) and mode.get(m)]
    if len(chosen) != 1:
        raise ctx.error(node, f"`.simd_mode` sets one of {', '.join(SIMD_MODES)}, found {len(chosen)}")
    return chosen[0]


def check_dsd(ctx: Ctx, dsd: Dsd, node: ast.Node) -> None:
    from csl_executor.dsd import check_fields

    problem = check_fields(dsd)
    if problem:
        raise ctx.error(node, problem)


def _dsd_mutator(name: str):
    def handler(ctx: Ctx, node: ast.BuiltinCall, expect: CslType | None) -> CExpr:
        want = 3 if name == "increment_dsd_offset" else 2
        _argc(ctx, node, want)
        d = ctx.cx(node.args[0])
        if d.type not in (MEM1D_DSD, MEM4D_DSD, FABIN_DSD, FABOUT_DSD):
            raise ctx.error(node, f"@{name} takes a DSD, found {d.type.name}")
        v = ctx.cx(node.args[1])
        where = ctx.fb.const(ctx.where(node)) if ctx.fb_opt else repr(ctx.where(node))
        if name == "increment_dsd_offset":
            t = ctx.ctype(node.args[2])
            if not is_int(v.type):
                raise ctx.error(node, "@increment_dsd_offset's offset must be an integer")
            if not (v.type is COMPTIME_INT or v.type.name in ("i16", "i8")):
                raise ctx.error(
                    node,
                    f"@increment_dsd_offset takes an i16 offset, found {v.type.name} (use @as(i16, ...))",
                )
            args = f"{ctx.code(v)}, {max(1, t.words)}"
        elif name == "set_dsd_base_addr":
            if not isinstance(v.type, PointerType):
                raise ctx.error(node, "@set_dsd_base_addr takes a pointer")
            check_base_pointer(ctx, v.type, node, "@set_dsd_base_addr")
            args = ctx.code(v) if not v.known else str(v.value.addr)
        else:
            if not is_int(v.type):
                raise ctx.error(node, f"@{name} takes an integer")
            args = ctx.code(v)
        code = f"DSD.{name}({ctx.code(d) if not d.known else (ctx.fb.const(d.value) if ctx.fb_opt else 'D')}, {args}, {where})"
        if d.known and v.known:
            from csl_executor import dsd as dsd_mod

            fn = getattr(dsd_mod, name)
            extra = [v.value.addr if isinstance(v.value, Pointer) else v.value]
            if name == "increment_dsd_offset":
                extra.append(max(1, t.words))
            try:
                return known(fn(d.value, *extra, ctx.where(node)), d.type)
            except Exception as exc:
                raise ctx.error(node, str(exc)) from None
        if not ctx.runtime:
            raise ctx.error(node, f"@{name} arguments must be comptime-known here")
        return ctx.dyn(d.type, code)

    return handler


for _m in ("increment_dsd_offset", "set_dsd_base_addr", "set_dsd_length", "set_dsd_stride"):
    BUILTINS[_m] = _dsd_mutator(_m)


# DSD operations: name -> (number of sources, destination element type, source element types)
DSD_OPS: dict[str, tuple[int, str, str]] = {
    "fadds": (2, "f32", "f32"), "faddh": (2, "f16", "f16"), "fsubs": (2, "f32", "f32"),
    "fsubh": (2, "f16", "f16"), "fmuls": (2, "f32", "f32"), "fmulh": (2, "f16", "f16"),
    "fmaxs": (2, "f32", "f32"), "fmaxh": (2, "f16", "f16"), "fmins": (2, "f32", "f32"),
    "fminh": (2, "f16", "f16"), "fmacs": (3, "f32", "f32"), "fmach": (3, "f16", "f16"),
    "fmachs": (3, "f32", "f16"), "fmovs": (1, "f32", "f32"), "fmovh": (1, "f16", "f16"),
    "fnegs": (1, "f32", "f32"), "fnegh": (1, "f16", "f16"), "fabss": (1, "f32", "f32"),
    "fabsh": (1, "f16", "f16"), "mov16": (1, "u16", "u16"), "mov32": (1, "u32", "u32"),
    "add16": (2, "u16", "u16"), "sub16": (2, "u16", "u16"), "and16": (2, "u16", "u16"),
    "or16": (2, "u16", "u16"), "xor16": (2, "u16", "u16"),
}  # fmt: skip

_OPT_FIELDS = {"async", "activate", "unblock", "ut_id", "on_control", "index", "priority"}


def _dsd_op(name: str):
    nsrc, dtype, stype = DSD_OPS[name]

    def handler(ctx: Ctx, node: ast.BuiltinCall, expect: CslType | None) -> CExpr:
        _pe_only(ctx, node)
        if not ctx.runtime:
            raise ctx.error(node, f"@{name} runs on the PE: call it from a fn or task")
        args = list(node.args)
        opts_node = None
        if len(args) == nsrc + 2 and _is_options(ctx, args[-1]):
            opts_node = args.pop()
        if len(args) != nsrc + 1:
            raise ctx.error(node, f"@{name} takes a destination and {nsrc} source(s), found {len(args) - 1}")
        operands = [operand(ctx, a, dtype if i == 0 else stype, node) for i, a in enumerate(args)]
        opts = dsd_options(ctx, opts_node, node) if opts_node is not None else {}
        from csl_executor.dsd import OpSpec

        spec = OpSpec(name, nsrc, dtype, stype, ctx.where(node), opts)
        spec.check_static(ctx, operands, node)
        ctx.fb.instructions += codesize.DSD_OP_INSTRUCTIONS
        codes = ", ".join(code for code, _ in operands)
        runtime_opts = spec.runtime_opts_code(ctx)
        return ctx.dyn(VOID_T, f"pe.dsd_op({ctx.fb.const(spec)}, ({codes},){runtime_opts})")

    return handler


for _name in DSD_OPS:
    BUILTINS[_name] = _dsd_op(_name)


def operand(ctx: Ctx, a: ast.Node, elem: str, node: ast.BuiltinCall) -> tuple[str, Any]:
    """Python code for one DSD operation operand, and its kind for the static checks."""
    ce = ctx.cx(a)
    t = ce.type
    if t in (MEM1D_DSD, MEM4D_DSD, FABIN_DSD, FABOUT_DSD):
        return (ctx.code(ce), ce.value if ce.known else t)
    if t is FIFO_T:
        return (ctx.code(ce), ce.value)
    if t in (DSR_DEST, DSR_SRC0, DSR_SRC1):
        return (ctx.code(ce), "dsr")
    if isinstance(ce, MemArray):
        raise ctx.error(a, "an array is not a DSD operand: wrap it in @get_dsd")
    if isinstance(t, PointerType):
        addr = str(ce.value.addr) if ce.known else ce.code
        scalar = scalar_of(t.elem)
        return (f"DSD.scalar_ptr({addr}, {ctx.fb.const(scalar)})", "ptr")
    if t.is_numeric or t in (COMPTIME_INT,) or t.name == "comptime_float":
        if elem in ("f32", "f16"):
            if is_int(t) and not (ce.known and t is COMPTIME_INT):
                raise ctx.error(a, f"@{node.name} scalar operand must be a float, found {t.name}")
            target = F32 if elem == "f32" else F16
            if ce.known:
                ce = known(
                    ctx.convert_value(ce.value, t, target if t.name.startswith("comptime") else t, a), target
                )
            code = ctx.code(ce)
            return (f"DSD.Scalar({code})", "scalar")
        code = ctx.code(ce)
        if is_float(t):
            bits = f"F2U({code})" if t is F32 or t.name == "comptime_float" else f"F2H({code})"
            return (f"DSD.Scalar({bits})", "scalar")
        return (f"DSD.Scalar({code})", "scalar")
    raise ctx.error(a, f"@{node.name}: unsupported operand of type {t.name}")


def _is_options(ctx: Ctx, arg: ast.Node) -> bool:
    """An operation's last argument is its options when it is a struct (a literal, or a named one:
    25-pt-stencil passes `const props = .{ .async = true, ... }`)."""
    if isinstance(arg, ast.StructLit):
        return True
    if isinstance(arg, ast.Ident):
        b = ctx.scope.find(arg.name) or ctx.comp.resolve(ctx.mod, arg.name, arg)
        value = getattr(b, "value", None)
        return isinstance(value, Struct) and not value.is_tuple
    return False


def dsd_options(ctx: Ctx, opts_node: ast.Node, node: ast.Node) -> dict[str, Any]:
    if isinstance(opts_node, ast.StructLit):
        items = [(name, vnode, None) for name, vnode in opts_node.fields]
    else:
        value = ctx.need_known(ctx.cx(opts_node), opts_node, "operation options")
        items = [(name, opts_node, v) for name, v in value.fields]
    out: dict[str, Any] = {}
    for name, vnode, given in items:
        if name not in _OPT_FIELDS:
            raise ctx.error(node, f"unknown DSD operation option `.{name}`")
        ce = ctx.cx(vnode) if given is None else known(given)
        if name == "index":
            out["index"] = ce
            continue
        value = ctx.need_known(ce, vnode, f"`.{name}`")
        if name in ("activate", "unblock"):
            value = task_id_of(ctx, value, vnode)
        elif name == "ut_id":
            if not isinstance(value, UtId):
                raise ctx.error(vnode, "`.ut_id` takes a @get_ut_id value")
            value = value.id
        elif name == "on_control":
            raise ctx.error(vnode, "`.on_control` is not supported by the executor")
        out[name] = value
    return out


@builtin("map")
def _map(ctx: Ctx, node: ast.BuiltinCall, expect: CslType | None) -> CExpr:
    """@map(fn, inputs..., [output]): fn once per element; a void fn has no output operand."""
    _pe_only(ctx, node)
    if not ctx.runtime:
        raise ctx.error(node, "@map runs on the PE: call it from a fn or task")
    if len(node.args) < 2:
        raise ctx.error(node, "@map takes a function and its operands")
    fnce = ctx.cx(node.args[0])
    from csl_executor.native import NativeFn

    if isinstance(fnce.value, FnSym):
        fn = fnce.value
        ctx.comp.ensure_compiled(fn)
        fctx = type(ctx)(ctx.comp, fn.module, "comptime")
        ptypes = [fctx.ctype(p.type) for p in fn.decl.params]
        rtype = fctx.ctype(fn.decl.ret)
        target: Any = fn
    elif isinstance(fnce.value, NativeFn):
        ptypes, rtype = list(fnce.value.params), fnce.value.ret
        target = fnce.value
    else:
        raise ctx.error(node, "@map's first argument must be a function")
    operands = []
    for a in node.args[1:]:
        ce = ctx.cx(a)
        if ce.type is FIFO_T:
            raise ctx.error(a, "@map cannot read or write a FIFO")
        if ce.type in (MEM1D_DSD, MEM4D_DSD, FABIN_DSD, FABOUT_DSD, DSR_DEST, DSR_SRC0, DSR_SRC1):
            operands.append(("dsd", ctx.code(ce)))
        elif isinstance(ce.type, PointerType):
            addr = str(ce.value.addr) if ce.known else ce.code
            operands.append(("ptr", f"DSD.scalar_ptr({addr}, {ctx.fb.const(scalar_of(ce.type.elem))})"))
        else:
            operands.append(("value", ctx.code(ce)))
    has_output = rtype is not VOID_T
    inputs = len(operands) - (1 if has_output else 0)
    if has_output and operands[-1][0] == "value":
        raise ctx.error(node, "@map's last argument (the output) must be a DSD or a pointer")
    if len(ptypes) != inputs:
        raise ctx.error(node, f"@map: the function takes {len(ptypes)} inputs, {inputs} given")
    from csl_executor.dsd import MapSpec

    spec = MapSpec(target, tuple(ptypes), rtype, tuple(k for k, _ in operands), ctx.where(node))
    ctx.fb.instructions += codesize.DSD_OP_INSTRUCTIONS
    codes = ", ".join(c for _, c in operands)
    return ctx.dyn(VOID_T, f"pe.map_op({ctx.fb.const(spec)}, ({codes},))")


DSR_COUNT = 8  # DSR ids per file (assumption: the SDK page leaves the count to the compiler)


@builtin("get_dsr")
def _get_dsr(ctx: Ctx, node: ast.BuiltinCall, expect: CslType | None) -> CExpr:
    _argc(ctx, node, 2)
    kind_t = ctx.ctype(node.args[0])
    kind = {"dsr_dest": "dest", "dsr_src0": "src0", "dsr_src1": "src1"}.get(kind_t.name)
    if kind is None:
        raise ctx.error(node, f"@get_dsr takes dsr_dest, dsr_src0 or dsr_src1, not {kind_t.name}")
    n = _int_arg(ctx, node, 1, "DSR id")
    if not 0 <= n < DSR_COUNT:
        raise ctx.error(node, f"DSR id {n} out of range 0-{DSR_COUNT - 1}")
    return known(Dsr(kind, n))


_DSR_OPTS = {"async", "activate", "unblock", "ut_id", "save_address", "single_step", "priority", "on_control"}


@builtin("load_to_dsr")
def _load_to_dsr(ctx: Ctx, node: ast.BuiltinCall, expect: CslType | None) -> CExpr:
    _argc(ctx, node, 2, 3)
    _pe_only(ctx, node)
    dsr = _known_arg(ctx, node, 0, "DSR")
    if not isinstance(dsr, Dsr):
        raise ctx.error(node, f"@load_to_dsr loads a DSR, not {dsr!r}")
    d = ctx.cx(node.args[1])
    if d.type not in (MEM1D_DSD, MEM4D_DSD, FABIN_DSD, FABOUT_DSD):
        raise ctx.error(node, f"@load_to_dsr loads a DSD, not a {d.type.name}")
    if d.known:
        if d.value.kind == "fabin" and dsr.kind == "dest":
            raise ctx.error(node, "a fabin_dsd cannot be loaded into a dsr_dest")
        if d.value.kind == "fabout" and dsr.kind != "dest":
            raise ctx.error(node, "a fabout_dsd can only be loaded into a dsr_dest")
    opts: dict[str, Any] = {}
    if len(node.args) > 2:
        onode = node.args[2]
        if not isinstance(onode, ast.StructLit):
            raise ctx.error(node, "@load_to_dsr's options must be a struct literal")
        extra = {n for n, _ in onode.fields} - _DSR_OPTS
        if extra:
            raise ctx.error(node, f"unknown @load_to_dsr option(s): {', '.join(sorted(extra))}")
        save = [(n, v) for n, v in onode.fields if n in ("save_address", "single_step", "priority")]
        rest = ast.StructLit(onode.line, None, [(n, v) for n, v in onode.fields if n not in dict(save)])
        opts = dsd_options(ctx, rest, node)
        for n, v in save:
            if n != "priority":
                opts[n] = bool(ctx.need_known(ctx.cx(v), v, f"`.{n}`"))
    if ctx.runtime:
        return ctx.dyn(VOID_T, f"pe.load_dsr({ctx.fb.const(dsr)}, {ctx.code(d)}, {ctx.fb.const(opts)})")
    if not d.known:
        raise ctx.error(node, "@load_to_dsr at comptime needs a comptime-known DSD")
    ctx.program.startup.append(("load_dsr", (dsr, d.value, opts), ctx.where(node)))
    return VOID_EXPR
