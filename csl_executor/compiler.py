"""The CSL compiler: comptime evaluation and Python code generation for run-time functions.

One expression compiler serves both: `Ctx.cx(node)` returns a `CExpr`, which is either a value known
at comptime or a piece of Python code with its static CSL type. At comptime (top-level declarations,
`comptime` and `layout` blocks, calls made from them) every expression must come back known, and
statements are interpreted. In a run-time function (a `fn` or `task` that a PE executes) statements
become Python statements: locals are Python locals, memory is a `memoryview` of the PE's 48 KB,
DSD operations and task builtins are calls on the PE (`csl_executor.pe`). Known subexpressions are
folded by evaluating the very code that would be generated (`rt.HELPERS`), so folding and run time
round and wrap alike.

Integer arithmetic wraps to its type's width; floats are binary32 / binary16 with round-to-nearest-
even after every operation, never fused (see csl_executor/README.md, "Numbers").
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from csl_executor import ast, codesize, rt, timing
from csl_executor.errors import CslCompileError, CslError
from csl_executor.parse import parse_file
from csl_executor.program import Const, FnSym, MemVar, ModuleInstance, Program, SlotVar
from csl_executor.types import (
    ANYTYPE,
    BOOL,
    COLOR,
    COMPTIME_FLOAT,
    COMPTIME_INT,
    COMPTIME_STRUCT,
    DIRECTIONS,
    DSD_TYPES,
    F16,
    F32,
    FIFO_T,
    FN_ANY,
    I16,
    MODULE,
    NAMED_TYPES,
    STRING,
    TYPE,
    U16,
    U32,
    VOID_T,
    ArrayType,
    ArrayValue,
    CslType,
    Dsd,
    EnumType,
    EnumValue,
    Fifo,
    FloatType,
    FnType,
    IntType,
    Pointer,
    PointerType,
    SimpleType,
    Struct,
    StructType,
    TaskId,
    Void,
    type_of_value,
)
from csl_executor.values import (  # below the compiler: the builtins and libraries build on them too
    NOT,
    VOID_EXPR,
    CExpr,
    CVar,
    MemArray,
    MemPlace,
    int_fits,
    is_float,
    is_int,
    is_num,
    known,
    scalar_of,
)

# ---------------------------------------------------------------------------------------------------
# Bindings of local names


@dataclass
class Local:
    """A run-time local variable: a Python local of the generated function."""

    py: str
    type: CslType
    mutable: bool


@dataclass
class LocalArray:
    """A run-time local array: placed statically in the program's memory (CSL has no recursion)."""

    var: MemVar


class Scope:
    def __init__(self, parent: Scope | None = None) -> None:
        self.parent = parent
        self.names: dict[str, Any] = {}

    def find(self, name: str) -> Any:
        s: Scope | None = self
        while s is not None:
            if name in s.names:
                return s.names[name]
            s = s.parent
        return None


class _Break(Exception):
    def __init__(self, label: str | None) -> None:
        self.label = label


class _Continue(Exception):
    pass


class _Return(Exception):
    def __init__(self, value: CExpr) -> None:
        self.value = value


# ---------------------------------------------------------------------------------------------------
# Generated code


class FnBuilder:
    """The Python source of one generated function, with its constants and CSL line map."""

    def __init__(self, name: str, path: str) -> None:
        self.name = name
        self.path = path
        self.lines: list[str] = []
        self.csl_lines: list[int] = []
        self.consts: list[Any] = []
        self._const_ids: dict[int, int] = {}
        self.indent = 1
        self.temps = itertools.count()
        self.views: set[str] = set()
        self.loops: list[dict] = []
        self.addressed: set[str] = set()  # locals whose address the function takes
        self.instructions = 0  # the code size estimate's count (csl_executor.codesize)

    def emit(self, code: str, line: int) -> None:
        self.lines.append("    " * self.indent + code)
        self.csl_lines.append(line)

    def const(self, value: Any) -> str:
        key = id(value)
        if key not in self._const_ids:
            self._const_ids[key] = len(self.consts)
            self.consts.append(value)
        return f"K[{self._const_ids[key]}]"

    def temp(self, stem: str = "t") -> str:
        return f"_{stem}{next(self.temps)}"


def lit(value: Any, fb: FnBuilder | None) -> str:
    """Python source for a known value inside generated code."""
    if isinstance(value, bool):
        return "True" if value else "False"
    if isinstance(value, int):
        return repr(value)
    if isinstance(value, float):
        if value != value:
            return "NAN"
        if value in (float("inf"), float("-inf")):
            return "INF" if value > 0 else "NINF"
        return repr(value)
    if isinstance(value, Pointer):
        return repr(value.addr)
    if isinstance(value, EnumValue):
        return repr(value.value)
    if fb is None:
        raise CslError(f"internal: cannot inline {value!r} outside a function")
    return fb.const(value)


@functools.lru_cache(maxsize=65536)
def _compiled(code: str):
    return compile(code, "<fold>", "eval")


def fold(code: str) -> Any:
    return eval(_compiled(code), rt.HELPERS)


# ---------------------------------------------------------------------------------------------------
# Type helpers


VIEW_OF = {"f32": "mF", "u32": "mI", "i32": "mi", "u16": "mH", "i16": "mh", "f16": "mH", "bool": "mH"}


def wrap(t: CslType, code: str) -> str:
    if isinstance(t, IntType):
        return t.wrap_code(code)
    if t is F32:
        return f"F32({code})"
    if t is F16:
        return f"F16({code})"
    return code


# ---------------------------------------------------------------------------------------------------
# The compilation context


class Ctx:
    """Where an expression or statement is compiled: its module, mode, scope and (at run time) the
    function being generated."""

    def __init__(
        self,
        comp: Compiler,
        mod: ModuleInstance,
        mode: str,
        scope: Scope | None = None,
        fb: FnBuilder | None = None,
        fn: FnSym | None = None,
        layout: bool = False,
    ) -> None:
        self.comp = comp
        self.mod = mod
        self.mode = mode
        self.scope = scope or Scope()
        self.fb_opt = fb  # the function being generated; None at comptime and in layouts
        self.fn = fn
        self.layout = layout
        self.ret_type: CslType = VOID_T
        self.steps = 0
        self.unchecked = False  # address probes of a tensor access skip bounds checks

    @property
    def runtime(self) -> bool:
        return self.mode == "runtime"

    @property
    def fb(self) -> FnBuilder:
        """The function being generated; only a run-time function's context has one."""
        if self.fb_opt is None:
            raise RuntimeError(f"internal: {self.mod.path}: a {self.mode} context has no function builder")
        return self.fb_opt

    @property
    def program(self) -> Program:
        return self.mod.program

    def where(self, node: ast.Node | int) -> str:
        line = node if isinstance(node, int) else node.line
        return f"{self.mod.path}:{line}"

    def error(self, node: ast.Node | int, message: str) -> CslCompileError:
        return CslCompileError(f"{self.where(node)}: {message}")

    def child(self, **kw: Any) -> Ctx:
        c = Ctx(self.comp, self.mod, self.mode, Scope(self.scope), self.fb_opt, self.fn, self.layout)
        c.ret_type = self.ret_type
        c.unchecked = self.unchecked
        for k, v in kw.items():
            setattr(c, k, v)
        return c

    # -- code ----------------------------------------------------------------------------------------
    def code(self, ce: CExpr) -> str:
        if ce.known:
            return lit(ce.value, self.fb_opt)
        assert ce.code is not None
        return ce.code

    def emit(self, code: str, line: int) -> None:
        self.fb.emit(code, line)

    def dyn(self, ctype: CslType, code: str) -> CExpr:
        """A run-time expression; at comptime this means the expression is not comptime-known."""
        return CExpr(ctype, NOT, code)

    def need_known(self, ce: CExpr, node: ast.Node, what: str = "value") -> Any:
        if not ce.known:
            raise self.error(node, f"{what} must be comptime-known")
        return ce.value

    def view(self, name: str) -> str:
        self.fb.views.add(name)
        return name

    # -- types ---------------------------------------------------------------------------------------
    def ctype(self, node: ast.Node) -> CslType:
        if isinstance(node, ast.Ident) and node.name in NAMED_TYPES:
            if self.scope.find(node.name) is None and node.name not in self.mod.decls:
                return NAMED_TYPES[node.name]
        if isinstance(node, ast.ArrayTypeExpr):
            elem = self.ctype(node.elem)
            if node.length is None:
                raise self.error(node, "an array type `[_]T` needs an initializer to fix its length")
            n = self.need_known(self.cx(node.length), node.length, "array length")
            if not isinstance(n, int) or n < 0:
                raise self.error(node, f"array length must be a non-negative integer, not {n!r}")
            return ArrayType(n, elem)
        if isinstance(node, ast.PointerTypeExpr):
            return PointerType(self.ctype(node.elem), node.many, node.const)
        if isinstance(node, ast.FnTypeExpr):
            return FnType(tuple(self.ctype(p) for p in node.params), self.ctype(node.ret))
        if isinstance(node, ast.EnumDecl):
            tag = self.ctype(node.tag) if node.tag is not None else U16
            if not isinstance(tag, IntType):
                raise self.error(node, "an enum's tag type must be an integer type")
            members, nxt = [], 0
            for name, value in node.members:
                if value is not None:
                    nxt = self.need_known(self.cx(value), value, "enum value")
                members.append((name, tag.wrap(nxt)))
                nxt += 1
            return EnumType(tag, tuple(members))
        if isinstance(node, ast.StructDecl):
            fields = []
            for name, tnode, default in node.fields:
                ft = self.ctype(tnode)
                dv = self.coerce(self.cx(default), ft, default).value if default is not None else NOT
                fields.append((name, ft, dv))
            return StructType(tuple(fields))
        ce = self.cx(node)
        value = self.need_known(ce, node, "type")
        if isinstance(value, CslType):
            return value
        raise self.error(node, f"expected a type, found {value!r}")

    # -- coercion ------------------------------------------------------------------------------------
    def coerce(self, ce: CExpr, target: CslType, node: ast.Node) -> CExpr:
        """Implicit conversion of `ce` to `target` (Zig's rules, with CSL's extra kinds)."""
        src = ce.type
        if src == target or target is ANYTYPE:
            return ce
        if ce.known:
            return known(self.convert_value(ce.value, src, target, node), target)
        if isinstance(target, IntType) and isinstance(src, IntType) and int_fits(src, target):
            return CExpr(target, NOT, ce.code)
        if target is F32 and src is F16:
            return CExpr(target, NOT, ce.code)
        if isinstance(target, PointerType) and isinstance(src, PointerType):
            if self._pointer_coerces(src, target):
                return CExpr(target, NOT, ce.code)
        if isinstance(target, EnumType) and src is target:
            return ce
        raise self.error(node, f"expected type {target.name}, found {src.name}")

    @staticmethod
    def _pointer_coerces(src: PointerType, dst: PointerType) -> bool:
        if src.const and not dst.const:
            return False
        if src.elem == dst.elem and src.many == dst.many:
            return True
        # *[N]T -> [*]T, and *[N]T -> *[N]T const
        if dst.many and not src.many and isinstance(src.elem, ArrayType):
            return scalar_of(src.elem) == scalar_of(dst.elem) or src.elem.elem == dst.elem
        return False

    def convert_value(self, v: Any, src: CslType, target: CslType, node: ast.Node) -> Any:
        if target is ANYTYPE or target == src:
            return v
        if isinstance(target, IntType):
            if isinstance(v, bool) or not isinstance(v, int):
                if isinstance(v, EnumValue):
                    raise self.error(node, f"expected type {target.name}, found {src.name} (use @as)")
                raise self.error(node, f"expected type {target.name}, found {src.name} ({v!r})")
            if isinstance(src, IntType) and not int_fits(src, target) and not (target.lo <= v <= target.hi):
                raise self.error(node, f"expected type {target.name}, found {src.name}")
            if not target.lo <= v <= target.hi:
                raise self.error(node, f"value {v} does not fit type {target.name}")
            return v
        if isinstance(target, FloatType):
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise self.error(node, f"expected type {target.name}, found {src.name}")
            if isinstance(src, IntType):
                raise self.error(node, f"expected type {target.name}, found {src.name} (use @as)")
            if src is F32 and target is F16:
                raise self.error(node, "expected type f16, found f32 (use @as)")
            return rt.F32(float(v)) if target is F32 else rt.F16(float(v))
        if target is BOOL:
            if isinstance(v, bool):
                return v
        elif target is VOID_T:
            if isinstance(v, Void):
                return v
        elif isinstance(target, EnumType):
            if isinstance(v, EnumValue) and v.type is target:
                return v
            if isinstance(v, str):  # an enum literal `.name`
                value = target.value_of(v)
                if value is None:
                    raise self.error(node, f"enum {target.name} has no member {v!r}")
                return EnumValue(target, v, value)
        elif isinstance(target, PointerType):
            if isinstance(v, Pointer) and (
                v.type == target or self._pointer_coerces(v.type, target) or target.elem is ANYTYPE
            ):
                return Pointer(v.addr, target, v.symbol)
        elif isinstance(target, ArrayType):
            if isinstance(v, ArrayValue) and v.type.count == target.count:
                items = [self.convert_value(i, v.type.scalar, target.scalar, node) for i in v.items]
                return ArrayValue(target, items)
        elif target is COMPTIME_STRUCT:
            if isinstance(v, Struct):
                return v
        elif target is TYPE:
            if isinstance(v, CslType):
                return v
        elif target is COMPTIME_INT:
            if isinstance(v, int) and not isinstance(v, bool):
                return v
        elif target is COMPTIME_FLOAT:
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                return float(v)
        elif isinstance(target, (SimpleType, FnType)):
            from csl_executor.native import NativeFn

            if type_of_value(v) == target or (
                isinstance(target, FnType) and isinstance(v, (FnSym, NativeFn))
            ):
                return v
            if isinstance(v, TaskId) and target.name.endswith("task_id"):
                kinds = {"local_task_id": "local", "data_task_id": "data", "control_task_id": "control"}
                if v.kind == kinds.get(target.name):
                    return v
            if isinstance(v, Dsd) and target in DSD_TYPES and v.type == target:
                return v
            if target is FN_ANY:
                return v
        elif isinstance(target, StructType):
            if isinstance(v, Struct):
                return self.struct_of_type(v, target, node)
        raise self.error(node, f"expected type {target.name}, found {type_of_value(v).name} ({v!r})")

    def struct_of_type(self, v: Struct, t: StructType, node: ast.Node) -> Struct:
        fields = []
        for name, ft, default in t.fields:
            if v.has(name):
                fields.append((name, self.convert_value(v.get(name), type_of_value(v.get(name)), ft, node)))
            elif default is not NOT:
                fields.append((name, default))
            else:
                raise self.error(node, f"missing struct field {name!r}")
        return Struct(tuple(fields), tuple((n, ft) for n, ft, _ in t.fields), struct_type=t)

    def peer(self, a: CExpr, b: CExpr, node: ast.Node) -> CslType:
        ta, tb = a.type, b.type
        if ta == tb:
            return ta
        if ta is COMPTIME_INT and (is_num(tb)):
            return tb
        if tb is COMPTIME_INT and is_num(ta):
            return ta
        if ta is COMPTIME_FLOAT and is_float(tb):
            return tb
        if tb is COMPTIME_FLOAT and is_float(ta):
            return ta
        if ta is COMPTIME_FLOAT and tb is COMPTIME_INT or tb is COMPTIME_FLOAT and ta is COMPTIME_INT:
            return COMPTIME_FLOAT
        if isinstance(ta, IntType) and isinstance(tb, IntType):
            if int_fits(ta, tb):
                return tb
            if int_fits(tb, ta):
                return ta
            # A comptime-known operand that fits the other type coerces to it (Zig's rule).
            if a.known and tb.lo <= a.value <= tb.hi:
                return tb
            if b.known and ta.lo <= b.value <= ta.hi:
                return ta
        if isinstance(ta, FloatType) and isinstance(tb, FloatType):
            return F32
        if isinstance(ta, EnumType) and tb is ta:
            return ta
        raise self.error(node, f"incompatible types {ta.name} and {tb.name}")

    # -- names ---------------------------------------------------------------------------------------
    def lookup(self, name: str, node: ast.Node) -> Any:
        b = self.scope.find(name)
        if b is not None:
            return b
        sym = self.comp.resolve(self.mod, name, node)
        if sym is not None:
            return sym
        if name in NAMED_TYPES:
            return Const(NAMED_TYPES[name], TYPE)
        if name in DIRECTIONS:
            return Const(DIRECTIONS[name], type_of_value(DIRECTIONS[name]))
        raise self.error(node, f"use of undeclared identifier {name!r}")

    def binding_expr(self, b: Any, node: ast.Node) -> CExpr:
        if isinstance(b, Const):
            return CExpr(b.type, b.value)
        if isinstance(b, CVar):
            return CExpr(b.type, b.value)
        if isinstance(b, Local):
            if not self.runtime:
                raise self.error(node, "run-time variable used at comptime")
            return self.dyn(b.type, b.py)
        if isinstance(b, MemVar):
            return self.load(self.mem_place(b, node), node)
        if isinstance(b, LocalArray):
            return self.load(self.mem_place(b.var, node), node)
        if isinstance(b, SlotVar):
            if not self.runtime:
                raise self.error(node, f"run-time variable {b.name!r} read at comptime")
            return self.dyn(b.type, f"S[{b.index}]")
        if isinstance(b, FnSym):
            return CExpr(b.csl_type or FN_ANY, b)
        if isinstance(b, ModuleInstance):
            return CExpr(MODULE, b)
        from csl_executor.native import NativeFn

        if isinstance(b, NativeFn):
            return CExpr(FN_ANY, b)
        raise self.error(node, f"internal: unknown binding {b!r}")

    # -- places (things that can be assigned or addressed) -------------------------------------------
    def mem_place(self, var: MemVar, node: ast.Node) -> MemPlace:
        return MemPlace(var.type, CExpr(U32, var.addr), var, not var.mutable)

    def place(self, node: ast.Node) -> Any:
        if isinstance(node, ast.Ident):
            b = self.lookup(node.name, node)
            if isinstance(b, MemVar):
                return self.mem_place(b, node)
            if isinstance(b, LocalArray):
                return self.mem_place(b.var, node)
            if isinstance(b, (Local, CVar, SlotVar)):
                return b
            if isinstance(b, Const):
                raise self.error(node, f"cannot assign to constant {node.name!r}")
            raise self.error(node, f"{node.name!r} is not a variable")
        if isinstance(node, ast.Index):
            base = self.place_or_value(node.obj)
            idx = self.cx(node.index)
            if not is_int(idx.type):
                raise self.error(node.index, f"array index must be an integer, not {idx.type.name}")
            return self.index_place(base, idx, node)
        if isinstance(node, ast.Deref):
            ptr = self.cx(node.obj)
            if not isinstance(ptr.type, PointerType):
                raise self.error(node, f"cannot dereference a {ptr.type.name}")
            return MemPlace(
                ptr.type.elem, CExpr(U32, ptr.value.addr) if ptr.known else ptr, None, ptr.type.const
            )
        if isinstance(node, ast.Field):
            obj = self.place_or_value(node.obj)
            if isinstance(obj, CVar) and isinstance(obj.value, Struct):
                return StructFieldPlace(obj, node.name)
            if isinstance(obj, CExpr) and isinstance(obj.value, ModuleInstance) and obj.value.native is None:
                # a variable of an imported module: `&mod.buf`, `mod.count = 0`
                b = self.comp.resolve(obj.value, node.name, node)
                if isinstance(b, MemVar):
                    return self.mem_place(b, node)
                if isinstance(b, LocalArray):
                    return self.mem_place(b.var, node)
                if isinstance(b, (CVar, SlotVar)):
                    return b
            raise self.error(node, "assignment to a struct field is only supported for comptime structs")
        raise self.error(node, "expression is not assignable")

    def place_or_value(self, node: ast.Node) -> Any:
        """The place an index or field applies to: a place when `node` denotes storage, else a value."""
        if isinstance(node, (ast.Ident, ast.Index, ast.Deref)):
            if isinstance(node, ast.Ident):
                b = self.lookup(node.name, node)
                if isinstance(b, (MemVar, LocalArray)):
                    return self.place(node)
                if isinstance(b, CVar):
                    return b
                return self.binding_expr(b, node)
            return self.place(node)
        return self.cx(node)

    def index_place(self, base: Any, idx: CExpr, node: ast.Index) -> Any:
        if isinstance(base, MemArray):
            base = MemPlace(base.type, base.addr, base.var, base.var is not None and not base.var.mutable)
        if isinstance(base, CVar):
            if isinstance(base.value, ArrayValue):
                return ArrayElemPlace(base, self.need_known(idx, node.index, "index into a comptime array"))
            if isinstance(base.value, Struct) and base.value.is_tuple:
                return known(base.value.values()[self.need_known(idx, node.index)])
            raise self.error(node, f"cannot index a {base.type.name}")
        if isinstance(base, MemPlace):
            t = base.type
            if isinstance(t, ArrayType):
                elem, n = t.elem, t.length
            elif isinstance(t, PointerType) and t.many:
                ptr = self.load(base, node)
                return self.index_place(ptr, idx, node)
            else:
                raise self.error(node, f"cannot index a value of type {t.name}")
            offset = self.bounded(idx, n, node)
            return MemPlace(elem, self.add_addr(base.addr, offset, elem.words), base.var, base.const)
        if isinstance(base, CExpr):
            t = base.type
            if isinstance(t, PointerType):
                elem = t.elem
                if isinstance(elem, ArrayType) and not t.many:  # *[N]T
                    offset = self.bounded(idx, elem.length, node)
                    addr = CExpr(U32, base.value.addr) if base.known else base
                    return MemPlace(elem.elem, self.add_addr(addr, offset, elem.elem.words), None, t.const)
                if not t.many:
                    raise self.error(node, "cannot index a single-item pointer")
                addr = CExpr(U32, base.value.addr) if base.known else base
                offset = idx if idx.known else self.dyn(idx.type, self.code(idx))
                return MemPlace(elem, self.add_addr(addr, offset, elem.words), None, t.const)
            if isinstance(base.value, ArrayValue):
                i = self.need_known(idx, node.index, "index into a comptime array")
                return ValuePlace(self.array_item(base.value, i, node))
            if isinstance(base.value, Struct) and base.value.is_tuple:
                i = self.need_known(idx, node.index, "index into a tuple")
                vals = base.value.values()
                if not 0 <= i < len(vals):
                    raise self.error(node, f"index {i} out of bounds for a tuple of {len(vals)}")
                return ValuePlace(known(vals[i]))
            raise self.error(node, f"cannot index a value of type {t.name}")
        if isinstance(base, ValuePlace):
            return self.index_place(base.value, idx, node)
        if isinstance(base, (ArrayElemPlace,)):
            return self.index_place(known(base.get()), idx, node)
        raise self.error(node, "cannot index this expression")

    def array_item(self, arr: ArrayValue, i: int, node: ast.Node) -> CExpr:
        if not 0 <= i < arr.type.length:
            raise self.error(node, f"index {i} out of bounds for an array of {arr.type.length}")
        elem = arr.type.elem
        if isinstance(elem, ArrayType):
            n = elem.count
            return known(ArrayValue(elem, arr.items[i * n : (i + 1) * n]), elem)
        return known(arr.items[i], elem)

    def bounded(self, idx: CExpr, n: int, node: ast.Node) -> CExpr:
        if idx.known:
            if not 0 <= idx.value < n and not self.unchecked:
                raise self.error(node, f"index {idx.value} out of bounds for an array of {n} elements")
            return idx
        if not self.runtime:
            raise self.error(node, "index must be comptime-known here")
        t = self.fb.temp("i")
        where = lit(self.where(node), self.fb_opt)
        return self.dyn(
            idx.type, f"({t} if 0 <= ({t} := {self.code(idx)}) < {n} else OOB({t}, {n}, {where}))"
        )

    def add_addr(self, addr: CExpr, offset: CExpr, words: int) -> CExpr:
        if addr.known and offset.known:
            return CExpr(U32, addr.value + offset.value * words)
        off = self.code(offset) if words == 1 else f"({self.code(offset)}) * {words}"
        if addr.known and addr.value == 0:
            return self.dyn(U32, off)
        return self.dyn(U32, f"{self.code(addr)} + {off}")

    def load(self, place: Any, node: ast.Node) -> CExpr:
        if isinstance(place, MemPlace):
            t = place.type
            if isinstance(t, ArrayType):
                # An array in memory used as a value: known contents when it is a const array.
                if place.addr.known and place.var is not None and not place.var.mutable:
                    init = self.comp.initial_value(place.var)
                    if init is not None and place.addr.value == place.var.addr:
                        return known(init, t)
                return MemArray(t, place.addr, place.var)
            if not self.runtime:
                if place.var is not None and not place.var.mutable and place.addr.known:
                    v = self.comp.initial_scalar(place.var, place.addr.value, t)
                    if v is not None:
                        return known(v, t)
                raise self.error(node, "memory is only readable at run time")
            return self.dyn(t, self.mem_read(place.addr, t, node))
        if isinstance(place, Local):
            return self.dyn(place.type, place.py)
        if isinstance(place, CVar):
            return CExpr(place.type, place.value)
        if isinstance(place, SlotVar):
            return self.dyn(place.type, f"S[{place.index}]")
        if isinstance(place, (ArrayElemPlace, StructFieldPlace)):
            return place.expr()
        if isinstance(place, ValuePlace):
            return place.value
        if isinstance(place, CExpr):
            return place
        raise self.error(node, f"internal: cannot load {place!r}")

    def mem_read(self, addr: CExpr, t: CslType, node: ast.Node) -> str:
        view = VIEW_OF.get(t.name)
        if isinstance(t, EnumType):
            view = VIEW_OF[t.tag.name]
        if isinstance(t, PointerType):
            view = "mH"
        if view is None:
            raise self.error(node, f"cannot read a {t.name} from memory")
        self.view(view)
        idx = self._view_index(addr, view)
        if t is F16:
            return f"H2F[mH[{idx}]]"
        if t is BOOL:
            return f"(mH[{idx}] != 0)"
        return f"{view}[{idx}]"

    def _view_index(self, addr: CExpr, view: str) -> str:
        wide = view in ("mF", "mI", "mi")
        if addr.known:
            return str(addr.value >> 1 if wide else addr.value)
        code = self.code(addr)  # not known: its run-time expression
        return f"({code}) >> 1" if wide else code

    def mem_write(self, addr: CExpr, t: CslType, value_code: str, node: ast.Node) -> str:
        if isinstance(t, EnumType):
            t = t.tag
        if isinstance(t, PointerType):
            t = U16
        view = {
            "f32": "mF",
            "u32": "mI",
            "i32": "mI",
            "u16": "mH",
            "i16": "mH",
            "f16": "mH",
            "bool": "mH",
        }.get(t.name)
        if view is None:
            raise self.error(node, f"cannot store a {t.name} in memory")
        self.view(view)
        idx = self._view_index(addr, view)
        if t is F16:
            return f"mH[{idx}] = F2H({value_code})"
        if t.name in ("i16", "i32"):
            mask = "0xFFFF" if t.name == "i16" else "0xFFFFFFFF"
            return f"{view}[{idx}] = ({value_code}) & {mask}"
        if t is BOOL:
            return f"mH[{idx}] = 1 if ({value_code}) else 0"
        return f"{view}[{idx}] = {value_code}"

    # -- expressions ---------------------------------------------------------------------------------
    def cx(self, node: ast.Node, expect: CslType | None = None) -> CExpr:
        method = getattr(self, "x_" + type(node).__name__, None)
        if method is None:
            raise self.error(node, f"unsupported expression {type(node).__name__}")
        try:
            return method(node, expect) if method.__code__.co_argcount == 3 else method(node)
        except CslError:
            raise

    def x_Ident(self, node: ast.Ident) -> CExpr:
        if node.name == "_":
            raise self.error(node, "`_` cannot be read")
        return self.binding_expr(self.lookup(node.name, node), node)

    def x_IntLit(self, node: ast.IntLit) -> CExpr:
        return known(node.value, COMPTIME_INT)

    def x_FloatLit(self, node: ast.FloatLit) -> CExpr:
        return known(node.value, COMPTIME_FLOAT)

    def x_BoolLit(self, node: ast.BoolLit) -> CExpr:
        return known(node.value, BOOL)

    def x_StrLit(self, node: ast.StrLit) -> CExpr:
        return known(node.value, STRING)

    def x_VoidLit(self, node: ast.VoidLit) -> CExpr:
        return VOID_EXPR

    def x_UndefinedLit(self, node: ast.UndefinedLit) -> CExpr:
        raise self.error(node, "`undefined` is only allowed as a variable's initializer")

    def x_EnumLit(self, node: ast.EnumLit, expect: CslType | None) -> CExpr:
        if isinstance(expect, EnumType):
            v = expect.value_of(node.name)
            if v is None:
                raise self.error(node, f"enum {expect.name} has no member {node.name!r}")
            return known(EnumValue(expect, node.name, v), expect)
        return known(node.name, SimpleType("enum_literal"))

    def x_TensorAccess(self, node: ast.TensorAccess) -> CExpr:
        raise self.error(node, "a tensor access is only allowed as a DSD's `.tensor_access`")

    def x_ArrayTypeExpr(self, node: ast.Node) -> CExpr:
        return known(self.ctype(node), TYPE)

    x_PointerTypeExpr = x_FnTypeExpr = x_EnumDecl = x_StructDecl = x_ArrayTypeExpr

    def x_Unary(self, node: ast.Unary) -> CExpr:
        if node.op == "()":
            return self.cx(node.operand)
        if node.op == "&":
            return self.address_of(node.operand, node)
        v = self.cx(node.operand)
        if node.op == "!":
            if v.type is not BOOL:
                raise self.error(node, f"`!` needs a bool, found {v.type.name}")
            return self.finish(BOOL, f"(not {self.code(v)})", v.known)
        if node.op == "-":
            if not is_num(v.type):
                raise self.error(node, f"cannot negate a {v.type.name}")
            return self.finish(v.type, wrap(v.type, f"-({self.code(v)})"), v.known)
        if node.op == "~":
            if not isinstance(v.type, IntType):
                raise self.error(node, f"`~` needs a sized integer, found {v.type.name}")
            return self.finish(v.type, wrap(v.type, f"~({self.code(v)})"), v.known)
        raise self.error(node, f"unary operator {node.op!r}")

    x__Not = x_Unary  # the parser's re-associated `!`

    def finish(self, t: CslType, code: str, all_known: bool) -> CExpr:
        """Fold when every operand is known, else return run-time code."""
        if all_known:
            return known(fold(code), t)
        return self.dyn(t, code)

    def address_of(self, target: ast.Node, node: ast.Node) -> CExpr:
        p = self.place(target)
        if isinstance(p, MemPlace):
            ptype = PointerType(p.type, False, p.const)
            if p.addr.known:
                name = p.var.name if p.var is not None else ""
                return known(Pointer(p.addr.value, ptype, name), ptype)
            return self.dyn(ptype, self.code(p.addr))
        if isinstance(p, (Local, CVar)):
            raise self.error(
                node, "cannot take the address of a scalar local; the executor keeps locals in registers"
            )
        raise self.error(node, "cannot take the address of this expression")

    _CMP = {"==", "!=", "<", "<=", ">", ">="}
    _ARITH = {"+", "-", "*", "/", "%"}
    _BITS = {"&", "|", "^"}

    def x_Binary(self, node: ast.Binary) -> CExpr:
        op = node.op
        if op in ("and", "or"):
            a = self.cx(node.left)
            if a.type is not BOOL:
                raise self.error(node, f"`{op}` needs bools, found {a.type.name}")
            if a.known and (a.value is False if op == "and" else a.value is True):
                return a
            b = self.cx(node.right)
            if b.type is not BOOL:
                raise self.error(node, f"`{op}` needs bools, found {b.type.name}")
            return self.finish(BOOL, f"({self.code(a)} {op} {self.code(b)})", a.known and b.known)
        a = self.cx(node.left)
        b = self.cx(node.right, a.type if isinstance(a.type, EnumType) else None)
        if isinstance(b.type, EnumType) and isinstance(node.left, ast.EnumLit):
            a = self.cx(node.left, b.type)
        if op in ("<<", ">>"):
            if not is_int(a.type) or not is_int(b.type):
                raise self.error(node, f"`{op}` needs integers")
            t = a.type
            if t is COMPTIME_INT:
                return self.finish(t, f"({self.code(a)} {op} {self.code(b)})", a.known and b.known)
            helper = "SHL" if op == "<<" else "SHR"
            bits = cast(IntType, t).bits  # is_int and not comptime_int: a sized integer type
            code = f"{helper}({self.code(a)}, {self.code(b)}, {bits})"
            return self.finish(t, wrap(t, code) if op == "<<" else code, a.known and b.known)
        if isinstance(a.type, (PointerType,)) or isinstance(b.type, PointerType):
            if op in ("==", "!="):
                return self.finish(BOOL, f"({self.code(a)} {op} {self.code(b)})", a.known and b.known)
            raise self.error(
                node,
                "CSL has no pointer arithmetic: index the array, or move a DSD with @increment_dsd_offset",
            )
        if op in self._CMP:
            if op in ("==", "!=") and a.known and b.known and not (is_num(a.type) and is_num(b.type)):
                same = a.value == b.value  # colors, directions, task IDs, enum values, types
                return known(same if op == "==" else not same, BOOL)
            if a.type is BOOL and b.type is BOOL and op in ("==", "!="):
                return self.finish(BOOL, f"({self.code(a)} {op} {self.code(b)})", a.known and b.known)
            if not (a.type == b.type and isinstance(a.type, (EnumType, SimpleType))):
                t = self.peer(a, b, node)
                if not (is_num(t) or isinstance(t, EnumType)):
                    raise self.error(node, f"cannot compare {a.type.name} and {b.type.name}")
                a, b = self.coerce(a, t, node), self.coerce(b, t, node)
            return self.finish(BOOL, f"({self.code(a)} {op} {self.code(b)})", a.known and b.known)
        t = self.peer(a, b, node)
        if not is_num(t):
            raise self.error(node, f"operator `{op}` needs numbers, found {a.type.name} and {b.type.name}")
        a, b = self.coerce(a, t, node), self.coerce(b, t, node)
        ca, cb = self.code(a), self.code(b)
        both = a.known and b.known
        if op in self._BITS:
            if not is_int(t):
                raise self.error(node, f"`{op}` needs integers")
            return self.finish(t, wrap(t, f"({ca} {op} {cb})"), both)
        if op == "/":
            if is_int(t):
                if t is COMPTIME_INT or (isinstance(t, IntType) and t.signed):
                    return self.finish(t, wrap(t, f"IDIV({ca}, {cb})"), both)
                return self.finish(t, f"IDIV({ca}, {cb})", both)
            return self.finish(t, wrap(t, f"FDIV({ca}, {cb})"), both)
        if op == "%":
            if is_int(t):
                return self.finish(t, f"IREM({ca}, {cb})", both)
            return self.finish(t, wrap(t, f"FREM({ca}, {cb})"), both)
        if op in ("+", "-", "*"):
            return self.finish(t, wrap(t, f"({ca} {op} {cb})"), both)
        if op == "++":
            raise self.error(node, "`++` is not supported")
        raise self.error(node, f"operator {op!r}")

    def x_IfExpr(self, node: ast.IfExpr, expect: CslType | None = None) -> CExpr:
        c = self.cx(node.cond)
        if c.type is not BOOL:
            raise self.error(node, f"condition must be a bool, found {c.type.name}")
        if c.known:
            if c.value:
                return self.cx(node.then, expect)
            if node.other is None:
                return VOID_EXPR
            return self.cx(node.other, expect)
        a = self.cx(node.then, expect)
        b = self.cx(node.other, expect) if node.other is not None else VOID_EXPR
        if expect is not None and is_num(expect) and a.type in (COMPTIME_INT, COMPTIME_FLOAT):
            a = self.coerce(a, expect, node.then)
        if (
            expect is not None
            and is_num(expect)
            and b.type in (COMPTIME_INT, COMPTIME_FLOAT)
            and node.other is not None  # else b is void
        ):
            b = self.coerce(b, expect, node.other)
        t = self.peer(a, b, node)
        a, b = self.coerce(a, t, node), self.coerce(b, t, node)
        return self.dyn(t, f"({self.code(a)} if {self.code(c)} else {self.code(b)})")

    def x_Field(self, node: ast.Field) -> CExpr:
        obj = self.place_or_value(node.obj)
        if isinstance(obj, CVar):
            obj = CExpr(obj.type, obj.value)
        if isinstance(obj, MemPlace):
            raise self.error(node, f"field {node.name!r} of a value in memory is not supported")
        if not isinstance(obj, CExpr):
            obj = self.load(obj, node)
        v = obj.value
        if isinstance(v, ModuleInstance):
            return self.comp.module_member(self, v, node.name, node)
        if isinstance(v, Struct):
            if not v.has(node.name):
                raise self.error(node, f"struct has no field {node.name!r} (fields: {', '.join(v.names())})")
            fv = v.get(node.name)
            ft = v.type_of(node.name) or type_of_value(fv)
            return known(fv, ft)
        if isinstance(v, EnumType):
            member = v.value_of(node.name)
            if member is None:
                raise self.error(node, f"enum has no member {node.name!r}")
            return known(EnumValue(v, node.name, member), v)
        if isinstance(v, ArrayValue) and node.name == "len":
            return known(v.type.length, COMPTIME_INT)
        if isinstance(obj, MemArray) and node.name == "len":
            return known(obj.type.length, COMPTIME_INT)
        if isinstance(obj.type, ArrayType) and node.name == "len":
            return known(obj.type.length, COMPTIME_INT)
        from csl_executor.libs import field_of_native

        result = field_of_native(self, obj, node.name, node)
        if result is not None:
            return result
        raise self.error(node, f"no field {node.name!r} on a value of type {obj.type.name}")

    def x_Index(self, node: ast.Index) -> CExpr:
        p = self.place(node) if not isinstance(node.obj, (ast.Call, ast.BuiltinCall)) else None
        if p is None:
            base = self.cx(node.obj)
            p = self.index_place(base, self.cx(node.index), node)
        return self.load(p, node)

    def x_Deref(self, node: ast.Deref) -> CExpr:
        return self.load(self.place(node), node)

    def x_StructLit(self, node: ast.StructLit, expect: CslType | None = None) -> CExpr:
        fields, types, dyn = [], [], []
        for name, vnode in node.fields:
            ce = self.cx(vnode)
            if not ce.known:
                dyn.append(name)
            fields.append((name, ce))
            types.append((name, ce.type))
        if node.type is not None:
            st = self.ctype(node.type)
            if not isinstance(st, StructType):
                raise self.error(node, f"{st.name} is not a struct type")
            if dyn:
                raise self.error(node, "run-time struct values are not supported")
            value = Struct(tuple((n, c.value) for n, c in fields), tuple(types))
            return known(self.struct_of_type(value, st, node), st)
        if dyn:
            raise self.error(node, f"struct field(s) {', '.join(dyn)} must be comptime-known")
        return known(Struct(tuple((n, c.value) for n, c in fields), tuple(types)), COMPTIME_STRUCT)

    def x_ListLit(self, node: ast.ListLit, expect: CslType | None = None) -> CExpr:
        items = [self.cx(i) for i in node.items]
        if node.type is None:
            if any(not i.known for i in items):
                raise self.error(node, "tuple elements must be comptime-known")
            return known(
                Struct(
                    tuple((str(k), i.value) for k, i in enumerate(items)),
                    tuple((str(k), i.type) for k, i in enumerate(items)),
                    is_tuple=True,
                ),
                COMPTIME_STRUCT,
            )
        tnode = node.type
        at: CslType
        if isinstance(tnode, ast.ArrayTypeExpr) and tnode.length is None:
            at = ArrayType(len(items), self.ctype(tnode.elem))
        else:
            at = self.ctype(tnode)
        if not isinstance(at, ArrayType):
            raise self.error(node, f"{at.name}{{...}} is not an array literal")
        if len(items) != at.length:
            raise self.error(node, f"array literal has {len(items)} elements, its type {at.name} {at.length}")
        flat: list[Any] = []
        for ce, inode in zip(items, node.items, strict=True):
            if isinstance(at.elem, ArrayType):
                v = self.coerce(ce, at.elem, inode)
                flat.extend(self.need_known(v, inode, "array element").items)
            else:
                v = self.coerce(ce, at.elem, inode)
                flat.append(self.need_known(v, inode, "array element"))
        return known(ArrayValue(at, flat), at)

    def x_Call(self, node: ast.Call) -> CExpr:
        callee = self.cx(node.func)
        v = callee.value
        from csl_executor.native import NativeFn

        if isinstance(v, NativeFn):
            return v.call(self, node.args, node)
        if isinstance(v, FnSym):
            return self.comp.call(self, v, node.args, node)
        raise self.error(node, f"cannot call a value of type {callee.type.name}")

    def x_BuiltinCall(self, node: ast.BuiltinCall, expect: CslType | None = None) -> CExpr:
        from csl_executor.builtins import BUILTINS

        handler = BUILTINS.get(node.name)
        if handler is None:
            raise self.error(node, f"unsupported builtin @{node.name}")
        return handler(self, node, expect)

    def x_SwitchExpr(self, node: ast.SwitchExpr) -> CExpr:
        raise self.error(node, "switch is only supported as a statement")

    # -- statements: comptime interpretation ---------------------------------------------------------
    def run(self, stmts: list[ast.Node]) -> None:
        for s in stmts:
            self.step(s)

    def step(self, s: ast.Node) -> None:
        self.steps += 1
        if self.steps > self.comp.comptime_step_limit:
            raise self.error(s, f"comptime evaluation exceeded {self.comp.comptime_step_limit} steps")
        if isinstance(s, ast.VarDecl):
            self.local_decl_comptime(s)
        elif isinstance(s, ast.Assign):
            self.assign_comptime(s)
        elif isinstance(s, ast.ExprStmt):
            ce = self.cx(s.expr)
            if not ce.known:
                raise self.error(s, "expression is not comptime-known")
        elif isinstance(s, ast.Block):
            inner = self.child()
            try:
                inner.run(s.stmts)
            except _Break as b:
                if b.label is None or b.label != s.label:
                    raise
            self.steps = inner.steps
        elif isinstance(s, ast.ComptimeBlock):
            self.step(s.body)
        elif isinstance(s, ast.If):
            c = self.cx(s.cond)
            if c.type is not BOOL:
                raise self.error(s, f"condition must be a bool, found {c.type.name}")
            if self.need_known(c, s.cond, "condition"):
                self.step(s.then)
            elif s.other is not None:
                self.step(s.other)
        elif isinstance(s, ast.While):
            while True:
                c = self.cx(s.cond)
                if not self.need_known(c, s.cond, "condition"):
                    break
                try:
                    self.step(s.body)
                except _Break as b:
                    if b.label is not None:
                        raise
                    break
                except _Continue:
                    pass
                if s.cont is not None:
                    self.step(s.cont)
        elif isinstance(s, ast.For):
            self.for_comptime(s)
        elif isinstance(s, ast.SwitchExpr):
            self.switch_comptime(s)
        elif isinstance(s, ast.Return):
            value = self.cx(s.value, self.ret_type) if s.value is not None else VOID_EXPR
            raise _Return(self.coerce(value, self.ret_type, s) if self.ret_type is not ANYTYPE else value)
        elif isinstance(s, ast.Break):
            raise _Break(s.label)
        elif isinstance(s, ast.Continue):
            raise _Continue()
        else:
            raise self.error(s, f"unsupported statement {type(s).__name__}")

    def local_decl_comptime(self, s: ast.VarDecl) -> None:
        if s.name in self.scope.names:
            raise self.error(s, f"redeclaration of {s.name!r}")
        declared = self.ctype(s.type) if s.type is not None else None
        if s.init is None:
            if declared is None:
                raise self.error(s, f"variable {s.name!r} needs a type or an initializer")
            value = self.comp.zero_value(declared)
        else:
            ce = self.cx(s.init, declared)
            if declared is not None:
                ce = self.coerce(ce, declared, s.init)
            value = self.need_known(ce, s.init, f"initializer of {s.name!r}")
            declared = declared or ce.type
        if isinstance(value, ArrayValue):
            value = ArrayValue(value.type, list(value.items))
        self.scope.names[s.name] = CVar(value, declared, s.kind == "var")

    def assign_comptime(self, s: ast.Assign) -> None:
        if isinstance(s.target, ast.Ident) and s.target.name == "_":
            self.cx(s.value)
            return
        p = self.place(s.target)
        if isinstance(p, CVar):
            if not p.mutable:
                raise self.error(s, "cannot assign to a constant")
            value = self.assigned_value(s, CExpr(p.type, p.value), p.type)
            p.value = value
        elif isinstance(p, (ArrayElemPlace, StructFieldPlace)):
            cur = p.expr()
            p.set(self.assigned_value(s, cur, cur.type))
        else:
            raise self.error(s, "only comptime variables can be assigned at comptime")

    def assigned_value(self, s: ast.Assign, current: CExpr, t: CslType) -> Any:
        if s.op == "=":
            ce = self.cx(s.value, t)
        else:
            ce = self.cx(ast.Binary(s.line, s.op[:-1], _Known(s.line, current), s.value))
        ce = self.coerce(ce, t, s.value)
        value = self.need_known(ce, s.value)
        if isinstance(value, ArrayValue):
            value = ArrayValue(value.type, list(value.items))
        return value

    def for_comptime(self, s: ast.For) -> None:
        seq, elem_t = self.iteration(s)
        for i, v in enumerate(seq):
            inner = self.child()
            if s.captures:
                inner.scope.names[s.captures[0]] = CVar(v, elem_t)
            if len(s.captures) > 1:
                inner.scope.names[s.captures[1]] = CVar(i, COMPTIME_INT)
            try:
                inner.step(s.body)
            except _Break as b:
                if b.label is not None:
                    raise
                break
            except _Continue:
                pass
            finally:
                self.steps = inner.steps

    def iteration(self, s: ast.For) -> tuple[list, CslType]:
        it = s.iterable
        if isinstance(it, ast.BuiltinCall) and it.name == "range":
            t, args = self.range_args(it)
            return list(range(*args)), t
        ce = self.cx(it)
        if isinstance(ce.value, ArrayValue):
            arr = ce.value
            return [self.array_item(arr, i, s).value for i in range(arr.type.length)], arr.type.elem
        if isinstance(ce.value, Struct) and ce.value.is_tuple:
            return ce.value.values(), ANYTYPE
        raise self.error(s, "a comptime `for` iterates over @range, a comptime array or a tuple")

    def range_args(self, it: ast.BuiltinCall) -> tuple[CslType, list[int]]:
        if len(it.args) not in (2, 4):
            raise self.error(it, "@range takes (T, end) or (T, start, end, step)")
        t = self.ctype(it.args[0])
        vals = [self.need_known(self.coerce(self.cx(a), t, a), a, "range bound") for a in it.args[1:]]
        if len(vals) == 1:
            return t, [0, vals[0], 1]
        if vals[2] == 0:
            raise self.error(it, "@range step must not be zero")
        return t, vals

    def switch_comptime(self, s: ast.SwitchExpr) -> None:
        subj = self.cx(s.subject)
        sv = self.need_known(subj, s.subject, "switch subject")
        chosen = None
        for case in s.cases:
            if not case.values:
                chosen = chosen or case
                continue
            for vnode in case.values:
                cv = self.coerce(self.cx(vnode, subj.type), subj.type, vnode).value
                if cv == sv:
                    chosen = case
                    break
            if chosen is case:
                break
        else:
            chosen = next((c for c in s.cases if not c.values), None)
        if chosen is not None:
            self.step(chosen.body)

    # -- statements: code generation -----------------------------------------------------------------
    def gen(self, stmts: list[ast.Node]) -> None:
        for s in stmts:
            self.gen_stmt(s)

    def gen_stmt(self, s: ast.Node) -> None:
        fb = self.fb
        assert fb is not None
        if not isinstance(s, (ast.Block, ast.ComptimeBlock)):
            self.emit(f"pe.t += {statement_cycles(s)}", s.line)
            fb.instructions += statement_instructions(s)
        if isinstance(s, ast.VarDecl):
            self.local_decl_runtime(s)
        elif isinstance(s, ast.Assign):
            self.assign_runtime(s)
        elif isinstance(s, ast.ExprStmt):
            ce = self.cx(s.expr)
            if not ce.known:
                self.emit(self.code(ce), s.line)
        elif isinstance(s, ast.Block):
            if s.label is not None:
                raise self.error(s, "labeled blocks are not supported in run-time code")
            self.child().gen(s.stmts)
        elif isinstance(s, ast.ComptimeBlock):
            self.child(mode="comptime").step(s.body)
        elif isinstance(s, ast.If):
            self.if_runtime(s)
        elif isinstance(s, ast.While):
            self.while_runtime(s)
        elif isinstance(s, ast.For):
            self.for_runtime(s)
        elif isinstance(s, ast.SwitchExpr):
            self.switch_runtime(s)
        elif isinstance(s, ast.Return):
            if s.value is None:
                if self.ret_type not in (VOID_T, ANYTYPE):
                    raise self.error(s, f"missing return value of type {self.ret_type.name}")
                self.emit("return", s.line)
            else:
                v = self.coerce(self.cx(s.value, self.ret_type), self.ret_type, s.value)
                self.emit(f"return {self.code(v)}", s.line)
        elif isinstance(s, ast.Break):
            if s.label is not None:
                raise self.error(s, "labeled break is not supported in run-time code")
            if not fb.loops:
                raise self.error(s, "break outside a loop")
            loop = fb.loops[-1]
            if loop.get("flag"):
                self.emit(f"{loop['flag']} = True", s.line)
            self.emit("break", s.line)
        elif isinstance(s, ast.Continue):
            if not fb.loops:
                raise self.error(s, "continue outside a loop")
            loop = fb.loops[-1]
            if loop.get("flag"):
                self.emit("break", s.line)  # leaves the one-pass inner loop; the continue clause runs
            else:
                self.emit("continue", s.line)
        else:
            raise self.error(s, f"unsupported statement {type(s).__name__}")

    def block_body(self, s: ast.Node, line: int) -> None:
        """Emit an indented body; an empty one gets `pass`."""
        fb = self.fb
        fb.indent += 1
        before = len(fb.lines)
        stmts = s.stmts if isinstance(s, ast.Block) else [s]
        self.child().gen(stmts)
        if len(fb.lines) == before:
            fb.emit("pass", line)
        fb.indent -= 1

    def if_runtime(self, s: ast.If) -> None:
        c = self.cx(s.cond)
        if c.type is not BOOL:
            raise self.error(s, f"condition must be a bool, found {c.type.name}")
        if c.known:
            if c.value:
                self.child().gen(s.then.stmts if isinstance(s.then, ast.Block) else [s.then])
            elif s.other is not None:
                self.child().gen(s.other.stmts if isinstance(s.other, ast.Block) else [s.other])
            return
        self.emit(f"if {c.code}:", s.line)
        self.block_body(s.then, s.line)
        if s.other is not None:
            self.emit("else:", s.line)
            self.block_body(s.other, s.line)

    def while_runtime(self, s: ast.While) -> None:
        fb = self.fb
        c = self.cx(s.cond)
        if c.type is not BOOL:
            raise self.error(s, f"condition must be a bool, found {c.type.name}")
        needs_flag = s.cont is not None and _contains(s.body, ast.Continue)
        self.emit(f"while {self.code(c)}:", s.line)
        fb.indent += 1
        self.emit(f"pe.t += {max(timing.STATEMENT, operations(s.cond))}", s.line)
        if needs_flag:
            flag = fb.temp("brk")
            self.emit(f"{flag} = False", s.line)
            self.emit("for _once in (0,):", s.line)
            fb.loops.append({"flag": flag})
            self.block_body(s.body, s.line)
            fb.loops.pop()
            self.emit(f"if {flag}:", s.line)
            self.emit("    break", s.line)
        else:
            fb.loops.append({})
            fb.indent -= 1
            self.block_body(s.body, s.line)
            fb.indent += 1
            fb.loops.pop()
        if s.cont is not None:
            self.child().gen_stmt(s.cont)
        fb.indent -= 1

    def for_runtime(self, s: ast.For) -> None:
        fb = self.fb
        it = s.iterable
        inner = self.child()
        if isinstance(it, ast.BuiltinCall) and it.name == "range":
            if len(it.args) not in (2, 4):
                raise self.error(it, "@range takes (T, end) or (T, start, end, step)")
            t = self.ctype(it.args[0])
            bounds = [self.code(self.coerce(self.cx(a), t, a)) for a in it.args[1:]]
            var = fb.temp("v")
            if s.captures and s.captures[0] != "_":
                inner.scope.names[s.captures[0]] = Local(var, t, False)
            self.emit(f"for {var} in range({', '.join(bounds)}):", s.line)
        else:
            ce = self.cx(it)
            if isinstance(ce, MemArray):
                at = ce.type
                var, idx = fb.temp("v"), fb.temp("k")
                self.emit(f"for {idx} in range({at.length}):", s.line)
                place = MemPlace(
                    at.elem, self.add_addr(ce.addr, self.dyn(U16, idx), at.elem.words), ce.var, True
                )
                fb.indent += 1
                if s.captures and s.captures[0] != "_":
                    elem = inner.load(place, s)
                    inner.emit(f"{var} = {inner.code(elem)}", s.line)
                    inner.scope.names[s.captures[0]] = Local(var, at.elem, False)
                fb.indent -= 1
                if len(s.captures) > 1:
                    inner.scope.names[s.captures[1]] = Local(idx, U16, False)
            else:
                seq, elem_t = self.iteration(s)
                # A comptime-known sequence at run time: unrolled, as Zig's inline for.
                for i, v in enumerate(seq):
                    body = self.child()
                    if s.captures:
                        body.scope.names[s.captures[0]] = CVar(v, elem_t)
                    if len(s.captures) > 1:
                        body.scope.names[s.captures[1]] = CVar(i, COMPTIME_INT)
                    if _contains(s.body, (ast.Break, ast.Continue)):
                        raise self.error(s, "break/continue inside a loop over a comptime sequence")
                    body.gen(s.body.stmts if isinstance(s.body, ast.Block) else [s.body])
                return
        fb.loops.append({})
        inner.block_body(s.body, s.line)
        fb.loops.pop()

    def switch_runtime(self, s: ast.SwitchExpr) -> None:
        subj = self.cx(s.subject)
        if subj.known:
            self.child(mode=self.mode).switch_known(s, subj)
            return
        t = self.fb.temp("sw")
        self.emit(f"{t} = {subj.code}", s.line)
        first = True
        other = None
        for case in s.cases:
            if not case.values:
                other = case
                continue
            conds = []
            for vnode in case.values:
                cv = self.coerce(self.cx(vnode, subj.type), subj.type, vnode)
                conds.append(f"{t} == {self.code(cv)}")
            self.emit(f"{'if' if first else 'elif'} {' or '.join(conds)}:", case.line)
            self.block_body(case.body, case.line)
            first = False
        if other is not None:
            if first:
                self.child().gen([other.body])
            else:
                self.emit("else:", other.line)
                self.block_body(other.body, other.line)

    def switch_known(self, s: ast.SwitchExpr, subj: CExpr) -> None:
        for case in s.cases:
            for vnode in case.values:
                if self.coerce(self.cx(vnode, subj.type), subj.type, vnode).value == subj.value:
                    self.child().gen([case.body])
                    return
        for case in s.cases:
            if not case.values:
                self.child().gen([case.body])
                return

    def local_decl_runtime(self, s: ast.VarDecl) -> None:
        if self.scope.names.get(s.name) is not None:
            raise self.error(s, f"redeclaration of {s.name!r}")
        declared = self.ctype(s.type) if s.type is not None else None
        if s.comptime:
            self.child(mode="comptime").local_decl_comptime(s)
            self.scope.names[s.name] = self.scope.names.get(s.name)
            return
        init = None
        if s.init is not None:
            init = self.cx(s.init, declared)
            if declared is not None:
                init = self.coerce(init, declared, s.init)
        t = declared or (init.type if init is not None else None)
        if t is None:
            raise self.error(s, f"variable {s.name!r} needs a type or an initializer")
        if t in (COMPTIME_INT, COMPTIME_FLOAT) and s.kind == "var":
            raise self.error(s, f"variable {s.name!r} of type {t.name} must be const or have a sized type")
        if isinstance(t, ArrayType):
            var = self.comp.local_array(self, s, t)
            self.scope.names[s.name] = LocalArray(var)
            if init is not None:
                assert s.init is not None  # init is s.init compiled
                value = self.need_known(init, s.init, "local array initializer")
                self.emit(f"pe.write_array({var.addr}, {self.fb.const(value)})", s.line)
            return
        if s.name in self.fb.addressed and (t.is_numeric or t is BOOL):
            # Its address is taken: it lives in memory (placed statically, as local arrays are).
            var = self.comp.local_array(self, s, t)
            self.scope.names[s.name] = LocalArray(var)
            value = self.code(init) if init is not None else lit(self.comp.zero_value(t), self.fb_opt)
            self.emit(self.mem_write(CExpr(U32, var.addr), t, value, s), s.line)
            return
        if s.kind == "const" and init is not None and init.known:
            self.scope.names[s.name] = CVar(init.value, t)
            return
        py = self.fb.temp(s.name)
        self.scope.names[s.name] = Local(py, t, s.kind == "var")
        if init is not None:
            self.emit(f"{py} = {self.code(init)}", s.line)
        else:
            self.emit(f"{py} = {lit(self.comp.zero_value(t), self.fb_opt)}", s.line)

    def assign_runtime(self, s: ast.Assign) -> None:
        if isinstance(s.target, ast.Ident) and s.target.name == "_":
            ce = self.cx(s.value)
            if not ce.known:
                self.emit(self.code(ce), s.line)
            return
        p = self.place(s.target)
        if isinstance(p, CVar):
            raise self.error(s, "cannot assign to a comptime value at run time")
        if isinstance(p, Local) and not p.mutable:
            raise self.error(s, "cannot assign to a constant")
        t = p.type
        if s.op == "=":
            value = self.coerce(self.cx(s.value, t), t, s.value)
        else:
            current = self.load(p, s)
            value = self.cx(ast.Binary(s.line, s.op[:-1], _Known(s.line, current), s.value))
            value = self.coerce(value, t, s.value)
        code = self.code(value)
        if isinstance(p, Local):
            self.emit(f"{p.py} = {code}", s.line)
        elif isinstance(p, SlotVar):
            self.emit(f"S[{p.index}] = {code}", s.line)
        elif isinstance(p, MemPlace):
            if p.const:
                raise self.error(s, "cannot assign through a const pointer or to a const array")
            if isinstance(t, ArrayType):
                raise self.error(s, "whole-array assignment is not supported; use a DSD @mov")
            self.emit(self.mem_write(p.addr, t, code, s), s.line)
        else:
            raise self.error(s, "expression is not assignable at run time")

    def x__Known(self, node: _Known) -> CExpr:
        return node.ce


@dataclass(eq=False)
class _Known(ast.Node):
    """An already compiled operand, spliced into a synthesized node (compound assignment)."""

    ce: CExpr


def _evaluated_eagerly(decl: ast.Node) -> bool:
    """Top-level declarations are analysed when something refers to them (as in Zig), except those
    with effects of their own: exports, and module imports (an import may bind tasks and set routes)."""
    if getattr(decl, "exported", False):
        return True
    init = getattr(decl, "init", None)
    return isinstance(init, ast.BuiltinCall) and init.name == "import_module"


def _addressed_names(node: Any) -> set[str]:
    """Names that appear as `&name` (or `&name[...]`) in a function body."""
    out: set[str] = set()

    def walk(n: Any) -> None:
        if isinstance(n, ast.Unary) and n.op == "&" and isinstance(n.operand, ast.Ident):
            out.add(n.operand.name)
        if isinstance(n, ast.Node):
            for value in vars(n).values():
                if isinstance(value, list):
                    for v in value:
                        walk(v)
                elif isinstance(value, ast.Node):
                    walk(value)

    walk(node)
    return out


def _contains(node: Any, kinds: Any) -> bool:
    if isinstance(node, kinds):
        return True
    if isinstance(node, (ast.While, ast.For)) and kinds in (
        ast.Continue,
        ast.Break,
        (ast.Break, ast.Continue),
    ):
        return False  # a nested loop owns its own break/continue
    if isinstance(node, ast.Node):
        for value in vars(node).values():
            if isinstance(value, list):
                if any(_contains(v, kinds) for v in value if isinstance(v, ast.Node)):
                    return True
            elif isinstance(value, ast.Node) and _contains(value, kinds):
                return True
    return False


# ---------------------------------------------------------------------------------------------------
# Places


@dataclass
class ValuePlace:
    value: CExpr


@dataclass
class ArrayElemPlace:
    cvar: CVar
    index: int

    def get(self) -> Any:
        arr: ArrayValue = self.cvar.value
        n = arr.type.elem.count if isinstance(arr.type.elem, ArrayType) else 1
        if n == 1:
            return arr.items[self.index]
        elem = cast(ArrayType, arr.type.elem)  # n > 1 only for an array of arrays
        return ArrayValue(elem, arr.items[self.index * n : (self.index + 1) * n])

    def expr(self) -> CExpr:
        arr: ArrayValue = self.cvar.value
        if not 0 <= self.index < arr.type.length:
            raise CslCompileError(f"index {self.index} out of bounds for an array of {arr.type.length}")
        return known(self.get(), arr.type.elem)

    def set(self, value: Any) -> None:
        if not self.cvar.mutable:
            raise CslCompileError("cannot assign to an element of a constant array")
        arr: ArrayValue = self.cvar.value
        if not 0 <= self.index < arr.type.length:
            raise CslCompileError(f"index {self.index} out of bounds for an array of {arr.type.length}")
        if isinstance(value, ArrayValue):
            n = len(value.items)
            arr.items[self.index * n : (self.index + 1) * n] = value.items
        else:
            arr.items[self.index] = value


@dataclass
class StructFieldPlace:
    cvar: CVar
    name: str

    def expr(self) -> CExpr:
        s: Struct = self.cvar.value
        v = s.get(self.name)
        return known(v, s.type_of(self.name) or type_of_value(v))

    def set(self, value: Any) -> None:
        self.cvar.value = self.cvar.value.with_field(self.name, value)

    @property
    def type(self) -> CslType:
        return self.expr().type


# ---------------------------------------------------------------------------------------------------
# The compiler


class Compiler:
    """Builds Programs for one architecture: resolves files and libraries, evaluates declarations,
    generates and caches the Python of run-time functions."""

    comptime_step_limit = 50_000_000

    def __init__(self, arch: str, layout_info: dict | None = None) -> None:
        if arch not in ("wse2", "wse3"):
            raise CslCompileError(f"unknown architecture {arch!r}: expected wse2 or wse3")
        self.arch = arch
        self.layout_info = layout_info or {}
        self._initial: dict[int, Any] = {}  # id(MemVar) -> initial ArrayValue / scalar
        self.warnings: list[str] = []  # `file:line: message`, what cslc prints and still compiles

    def warn(self, where: str, message: str) -> None:
        text = f"{where}: {message}"
        if text not in self.warnings:
            self.warnings.append(text)

    # -- modules -------------------------------------------------------------------------------------
    def new_module(self, program: Any, path: str, params: Struct) -> ModuleInstance:
        return ModuleInstance(program, path, parse_file(path), params)

    def import_module(self, ctx: Ctx, spec: str, params: Struct, node: ast.Node) -> ModuleInstance:
        from csl_executor.libs import native_module

        program = ctx.program
        if spec.startswith("<") and spec.endswith(">"):
            key = (spec, freeze(params))
            if key in program.modules:
                return program.modules[key]
            mod = native_module(self, ctx, spec[1:-1], params, node)
            program.modules[key] = mod
            return mod
        path = str((Path(ctx.mod.path).parent / spec).resolve())
        if not Path(path).is_file():
            raise ctx.error(node, f"@import_module: no file {spec!r} next to {ctx.mod.path}")
        key = (path, freeze(params))
        if key in program.modules:
            return program.modules[key]
        mod = self.new_module(program, path, params)
        program.modules[key] = mod
        self.evaluate_module(mod)
        return mod

    def evaluate_module(self, mod: ModuleInstance, layout: bool = False) -> None:
        """Evaluate every top-level declaration and comptime block, in source order."""
        ctx = Ctx(self, mod, "comptime", layout=layout)
        self._check_params(mod)
        assert mod.file is not None  # a native module is never evaluated from source
        for decl in mod.file.decls:
            if isinstance(decl, (ast.VarDecl, ast.FnDecl)) and _evaluated_eagerly(decl):
                self.resolve(mod, decl.name, decl)
            elif isinstance(decl, ast.ComptimeBlock):
                block_ctx = ctx.child(layout=layout and decl.is_layout)
                if decl.is_layout and not layout:
                    raise ctx.error(decl, "a layout block is only allowed in the layout file")
                block_ctx.step(decl.body)

    def _check_params(self, mod: ModuleInstance) -> None:
        declared = {n for n, d in mod.decls.items() if isinstance(d, ast.VarDecl) and d.kind == "param"}
        for name in mod.params.names():
            if name not in declared:
                # The SDK's "Modules" page: a parameter the module does not declare is ignored with a
                # warning (public layouts pass one struct to several modules).
                self.warn(
                    f"{mod.path}:1",
                    f"parameter {name!r} is given but the file declares no `param {name}`; ignored",
                )

    def resolve(self, mod: ModuleInstance, name: str, node: ast.Node) -> Any:
        if name in mod.symbols:
            return mod.symbols[name]
        if mod.native is not None:
            return None
        decl = mod.decls.get(name)
        if decl is None:
            return None
        if name in mod.evaluating:
            raise CslCompileError(f"{mod.path}:{decl.line}: {name!r} depends on itself")
        mod.evaluating.add(name)
        try:
            sym = self.declare(mod, decl)
        finally:
            mod.evaluating.discard(name)
        mod.symbols[name] = sym
        return sym

    def declare(self, mod: ModuleInstance, decl: ast.Node) -> Any:
        ctx = Ctx(self, mod, "comptime")
        if isinstance(decl, ast.FnDecl):
            fn = FnSym(decl, mod)
            if decl.exported:
                self.export_fn(ctx, fn, decl.name, decl)
            return fn
        assert isinstance(decl, ast.VarDecl)
        declared = ctx.ctype(decl.type) if decl.type is not None else None
        if decl.kind == "param":
            if mod.params.has(decl.name):
                value = mod.params.get(decl.name)
                vtype = mod.params.type_of(decl.name) or type_of_value(value)
                ce = CExpr(vtype, value)
            elif decl.init is not None:
                ce = ctx.cx(decl.init, declared)
            else:
                raise ctx.error(
                    decl, f"param {decl.name!r} has no value: pass it with --params or in the struct"
                )
            if declared is not None:
                ce = ctx.coerce(ce, declared, decl)
            return Const(ce.value, ce.type)
        if decl.init is not None:
            ce = ctx.cx(decl.init, declared)
            if declared is not None:
                ce = ctx.coerce(ce, declared, decl.init)
            ctx.need_known(ce, decl.init, f"initializer of {decl.name!r}")
            t = declared or ce.type
            value = ce.value
        else:
            if declared is None:
                raise ctx.error(decl, f"{decl.name!r} needs a type or an initializer")
            t, value = declared, None
        if not isinstance(mod.program, Program):  # the layout file: everything is comptime
            if decl.kind == "var":
                return CVar(value if value is not None else self.zero_value(t), t, True)
            return Const(value, t)
        storable = (t.is_numeric or t is BOOL or isinstance(t, (ArrayType, EnumType))) and t not in (
            COMPTIME_INT,
            COMPTIME_FLOAT,
        )
        if decl.kind == "const" and not isinstance(t, ArrayType):
            if value is None:
                raise ctx.error(decl, f"constant {decl.name!r} needs an initializer")
            return Const(value, t)
        if decl.kind == "var" and t in (COMPTIME_INT, COMPTIME_FLOAT):
            raise ctx.error(
                decl, f"variable {decl.name!r} of type {t.name} must be const or have a sized type"
            )
        if storable:
            var = mod.program.allocate(decl.name, t, decl.kind == "var", (mod.path, decl.line))
            if value is not None:
                self.write_initial(mod.program, var, value)
            if decl.exported:
                self.export_data(ctx, Pointer(var.addr, PointerType(t), decl.name), decl.name, decl)
            return var
        if decl.kind == "var":
            slot = mod.program.add_slot(decl.name, t, value)
            return slot
        return Const(value, t)

    def write_initial(self, program: Program, var: MemVar, value: Any) -> None:
        import numpy as np

        from csl_executor.memory import pack_values

        self._initial[id(var)] = value
        data = pack_values(var.type, value)
        mem = np.frombuffer(program.memory_image, dtype=np.uint16)
        mem[var.addr : var.addr + len(data)] = data

    def initial_value(self, var: MemVar) -> Any:
        return self._initial.get(id(var))

    def initial_scalar(self, var: MemVar, addr: int, t: CslType) -> Any:
        init = self._initial.get(id(var))
        if init is None:
            return None
        if not isinstance(init, ArrayValue):
            return init if addr == var.addr else None
        k = (addr - var.addr) // max(1, t.words)
        return init.items[k] if 0 <= k < len(init.items) else None

    def local_array(self, ctx: Ctx, s: ast.VarDecl, t: CslType) -> MemVar:
        fn = ctx.fn.name if ctx.fn else "?"
        return ctx.program.allocate(f"{fn}.{s.name}", t, True, (ctx.mod.path, s.line))

    def zero_value(self, t: CslType) -> Any:
        if isinstance(t, IntType):
            return 0
        if isinstance(t, FloatType):
            return 0.0
        if t is BOOL:
            return False
        if isinstance(t, ArrayType):
            return ArrayValue(t, [self.zero_value(t.scalar)] * t.count)
        if isinstance(t, EnumType):
            return EnumValue(t, t.members[0][0], t.members[0][1]) if t.members else 0
        if isinstance(t, PointerType):
            return Pointer(0, t)
        return None

    # -- exports -------------------------------------------------------------------------------------
    def export_data(self, ctx: Ctx, ptr: Pointer, name: str, node: ast.Node) -> None:
        from csl_executor.program import Export

        elem = ptr.type.elem
        var = next((s for s in ctx.program.symbols if s.addr <= ptr.addr < s.addr + s.type.words), None)
        length = 0
        if var is not None:
            scalar = scalar_of(elem)
            length = (var.addr + var.type.words - ptr.addr) // max(1, scalar.words)
            elem = scalar
        ctx.program.export(Export(name, "data", ptr.addr, elem, length, where=ctx.where(node)))

    def export_fn(self, ctx: Ctx, fn: FnSym, name: str, node: ast.Node) -> None:
        from csl_executor.program import Export

        ctx.program.export(Export(name, "fn", fn=fn, where=ctx.where(node)))
        ctx.program.functions.append(fn)

    # -- module members ------------------------------------------------------------------------------
    def module_member(self, ctx: Ctx, mod: ModuleInstance, name: str, node: ast.Node) -> CExpr:
        if mod.native is not None:
            return mod.native.member(ctx, name, node)
        sym = self.resolve(mod, name, node)
        if sym is None:
            raise ctx.error(node, f"module {Path(mod.path).name} has no member {name!r}")
        inner = Ctx(self, mod, ctx.mode, fb=ctx.fb_opt, fn=ctx.fn)
        return inner.binding_expr(sym, node)

    # -- calls ---------------------------------------------------------------------------------------
    def call(self, ctx: Ctx, fn: FnSym, arg_nodes: list[ast.Node], node: ast.Node) -> CExpr:
        decl = fn.decl
        if len(arg_nodes) != len(decl.params):
            raise ctx.error(node, f"{decl.name} expects {len(decl.params)} arguments, found {len(arg_nodes)}")
        fctx = Ctx(self, fn.module, "comptime")
        comptime_params: dict[str, Any] = {}
        args: list[CExpr] = []
        for p, a in zip(decl.params, arg_nodes, strict=True):
            scope_ctx = Ctx(self, fn.module, "comptime", Scope(), layout=False)
            scope_ctx.scope.names.update(comptime_params)
            pt = scope_ctx.ctype(p.type)
            ce = ctx.cx(a, pt)
            if pt is not ANYTYPE:
                ce = ctx.coerce(ce, pt, a)
            if p.comptime or pt in (TYPE, COMPTIME_INT, COMPTIME_FLOAT, COMPTIME_STRUCT):
                comptime_params[p.name] = CVar(
                    ctx.need_known(ce, a, f"comptime argument {p.name!r}"), ce.type
                )
            args.append(ce)
        del fctx
        if not ctx.runtime:
            return self.call_comptime(ctx, fn, args, node)
        target = self.specialise(fn, tuple((k, freeze(v.value)) for k, v in comptime_params.items()))
        target.comptime_args = tuple(comptime_params.items())
        self.ensure_compiled(target)
        runtime_args = [
            ctx.code(a) for p, a in zip(decl.params, args, strict=True) if p.name not in comptime_params
        ]
        call = f"{ctx.fb.const(target)}.py(pe{''.join(', ' + c for c in runtime_args)})"
        ret = self.return_type(target)
        return ctx.dyn(ret, call)

    def specialise(self, fn: FnSym, key: tuple) -> FnSym:
        if not key:
            return fn
        cache = fn.module.symbols.setdefault(("__spec__", fn.decl.name), {})
        if key not in cache:
            cache[key] = FnSym(fn.decl, fn.module)
        return cache[key]

    def return_type(self, fn: FnSym) -> CslType:
        ctx = Ctx(self, fn.module, "comptime")
        ctx.scope.names.update(dict(fn.comptime_args))
        return ctx.ctype(fn.decl.ret)

    def call_comptime(self, ctx: Ctx, fn: FnSym, args: list[CExpr], node: ast.Node) -> CExpr:
        decl = fn.decl
        inner = Ctx(self, fn.module, "comptime", layout=False)
        for p, a in zip(decl.params, args, strict=True):
            value = ctx.need_known(a, node, f"argument {p.name!r} of a comptime call to {decl.name}")
            inner.scope.names[p.name] = CVar(value, a.type)
        inner.ret_type = inner.ctype(decl.ret)
        try:
            inner.run(decl.body.stmts)
        except _Return as r:
            return r.value
        if inner.ret_type not in (VOID_T, ANYTYPE):
            raise ctx.error(decl, f"{decl.name} ended without returning a {inner.ret_type.name}")
        return VOID_EXPR

    # -- code generation -----------------------------------------------------------------------------
    def ensure_compiled(self, fn: FnSym) -> None:
        if fn.py is not None or fn.compiling:
            return
        fn.compiling = True
        try:
            fn.py = self.generate(fn)
        finally:
            fn.compiling = False
        program = fn.module.program
        if isinstance(program, Program):
            program.compiled_fns.append(fn)

    def generate(self, fn: FnSym, wavelet_args: bool = False) -> Any:
        decl = fn.decl
        fb = FnBuilder(decl.name, fn.module.path)
        ctx = Ctx(self, fn.module, "runtime", fb=fb, fn=fn)
        ctx.scope.names.update(dict(fn.comptime_args))
        params = []
        for p in decl.params:
            if p.name in dict(fn.comptime_args):
                continue
            pt = ctx.ctype(p.type)
            py = fb.temp(p.name)
            ctx.scope.names[p.name] = Local(py, pt, False)
            params.append((py, pt))
        ctx.ret_type = ctx.ctype(decl.ret)
        fb.addressed = _addressed_names(decl.body)
        ctx.gen(decl.body.stmts)
        fn.code_instructions = fb.instructions + codesize.FUNCTION_INSTRUCTIONS
        return self.assemble(fb, [py for py, _ in params])

    def assemble(self, fb: FnBuilder, params: list[str], prologue: Sequence[str] = ()) -> Any:
        head = [f"def {_pyname(fb.name)}(pe{''.join(', ' + p for p in params)}):"]
        setup = (
            ["    S = pe.S"]
            + [f"    {v} = pe.{v}" for v in sorted(fb.views)]
            + [f"    {p}" for p in prologue]
        )
        body = fb.lines or ["    pass"]
        source = "\n".join(head + setup + body) + "\n"
        csl_lines = tuple([0] * (1 + len(setup)) + fb.csl_lines)
        code = _function_code(source, fb.path, csl_lines)
        namespace: dict[str, Any] = dict(rt.HELPERS)
        namespace.update(_runtime_namespace())
        namespace["K"] = fb.consts
        exec(code, namespace)
        func = namespace[_pyname(fb.name)]
        func.csl_lines = list(csl_lines)
        func.csl_path = fb.path
        func.csl_source = source
        return func


_code_serial = itertools.count()


@functools.lru_cache(maxsize=8192)
def _function_code(source: str, path: str, csl_lines: tuple[int, ...]) -> Any:
    """The code object of one generated function. A layout gives most PEs the same program, so the same
    source comes again and again: it is compiled once (compiling was a tenth of a large layout's run),
    and the constants that differ between PEs stay out of it (the namespace's K). The line map is
    registered under the code's own file name, which tracebacks through it carry."""
    filename = f"<csl {path}#{next(_code_serial)}>"
    LINE_MAPS[filename] = (path, list(csl_lines))
    return compile(source, filename, "exec")


LINE_MAPS: dict[str, tuple[str, list[int]]] = {}


@functools.cache
def _runtime_namespace() -> dict[str, Any]:
    from csl_executor import fabric
    from csl_executor.dsd import DsdModule
    from csl_executor.mathlib import MATH_FUNCS

    return {"DSD": DsdModule, "MATH": MATH_FUNCS, "CTRL": fabric}


def csl_location(tb) -> str | None:
    """The innermost CSL `file:line` of a traceback through generated code."""
    where = None
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename
        if name in LINE_MAPS:
            path, lines = LINE_MAPS[name]
            lineno = tb.tb_lineno - 1
            if 0 <= lineno < len(lines) and lines[lineno]:
                where = f"{path}:{lines[lineno]}"
        tb = tb.tb_next
    return where


def _pyname(name: str) -> str:
    return "csl_" + "".join(c if c.isalnum() else "_" for c in name)


def freeze(v: Any) -> Any:
    """A hashable form of a comptime value: the key of a module instance, a specialised function or a
    layout's tile code."""
    if isinstance(v, Struct):
        return ("struct", tuple((k, freeze(x)) for k, x in v.fields), v.is_tuple)
    if isinstance(v, ArrayValue):
        return ("array", v.type, tuple(v.items))
    if isinstance(v, list):
        return tuple(freeze(x) for x in v)
    if isinstance(v, (FnSym, ModuleInstance)):
        return ("id", id(v))
    try:
        hash(v)
    except TypeError:
        return ("id", id(v))
    return v


# Names exported for builtins/libs
__all__ = [
    "CExpr", "Ctx", "Compiler", "CVar", "Local", "MemPlace", "MemArray", "NOT", "known", "VOID_EXPR",
    "is_int", "is_float", "is_num", "scalar_of", "lit", "fold", "wrap", "Fifo", "FIFO_T", "COLOR",
    "I16", "U32", "F16", "F32", "TaskId",
]  # fmt: skip


# ---------------------------------------------------------------------------------------------------
# What a scalar statement costs: one cycle per operation it performs (an arithmetic or logic operator,
# a memory access through an index or a pointer, a call), at least one. The CE issues about one
# scalar instruction per cycle; DSD operations are priced by the elements they step through instead.

_COUNTED = (ast.Binary, ast.Unary, ast.Index, ast.Deref, ast.Call)


def operations(node: ast.Node | None) -> int:
    """Operators, memory accesses and calls in an expression (not in nested statement blocks)."""
    if node is None or isinstance(node, (ast.Block, ast.ComptimeBlock)):
        return 0
    count = 1 if isinstance(node, _COUNTED) else 0
    for value in vars(node).values():
        if isinstance(value, ast.Node):
            count += operations(value)
        elif isinstance(value, list):
            count += sum(operations(v) for v in value if isinstance(v, ast.Node))
    return count


def statement_operations(s: ast.Node) -> int:
    """Operations a scalar statement performs, at least one (a loop counts its test once)."""
    if isinstance(s, ast.If):
        return max(1, operations(s.cond))
    if isinstance(s, (ast.While, ast.For)):
        return 1
    if isinstance(s, ast.VarDecl):
        return max(1, operations(s.init))
    if isinstance(s, ast.Assign):
        # a compound assignment reads the target, operates and writes it back
        extra = 1 if s.op != "=" else 0
        return max(1, operations(s.target) + operations(s.value) + extra)
    return max(1, operations(getattr(s, "expr", None) or getattr(s, "value", None)))


def statement_cycles(s: ast.Node) -> int:
    return max(timing.STATEMENT, statement_operations(s) * timing.STATEMENT)


def statement_instructions(s: ast.Node) -> int:
    """Instructions a statement adds to the code size estimate (csl_executor.codesize): its operations,
    plus a loop's test and branch or an `if`'s branch. A DSD operation inside adds its own (counted
    where the operation is compiled)."""
    if isinstance(s, ast.While):
        return max(1, operations(s.cond)) + codesize.LOOP_INSTRUCTIONS
    if isinstance(s, ast.For):
        return 1 + codesize.LOOP_INSTRUCTIONS
    if isinstance(s, ast.If):
        return statement_operations(s) + codesize.IF_INSTRUCTIONS
    return statement_operations(s)
