"""`<math>`: the SDK's math library, as its "Libraries" page lists it.

Every function comes in three spellings: generic (`math.floor(x)`, dispatching on the argument's
type), and non-generic `_f16` / `_f32` forms. `abs`, `max`, `min` and `sign` also take integers.
Results are correctly rounded to the argument's type (the hardware's are approximations; the
executor's are the exactly rounded values, which is what a program's tolerance is checked against).
The page says `cos`, `exp`, `inv`, `invsqrt`, `log`, `pow`, `sin` and `sqrt` "can only be evaluated
at runtime": called at comptime they are refused. `isSignaling` and `sig` are listed without a
meaning the executor can reproduce (the executor's values carry no signaling-NaN bit, and `sig` is
not defined on the page), so they are refused by name.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from csl_executor import ast
from csl_executor.native import NativeFn, NativeModule
from csl_executor.rt import F16 as round16
from csl_executor.rt import F32 as round32
from csl_executor.types import (
    ANYTYPE,
    BOOL,
    COMPTIME_FLOAT,
    F16,
    F32,
    I16,
    TYPE,
    CslType,
    IntType,
    Struct,
)
from csl_executor.values import CExpr, known

if TYPE_CHECKING:
    from csl_executor.compiler import Ctx


def _finite_or_self(fn: Callable[[float], float]) -> Callable[[float], float]:
    """Rounding functions: infinities and NaN come back unchanged, a zero result keeps x's sign."""

    def rounded(x: float) -> float:
        if not math.isfinite(x):
            return x
        r = float(fn(x))
        return math.copysign(0.0, x) if r == 0 else r

    return rounded


def _sign(x: float) -> float:
    if x != x:
        return x
    return 1.0 if x > 0 else (-1.0 if x < 0 else x)


def _max(a: float, b: float) -> float:
    if a != a:
        return b
    if b != b:
        return a
    return max(a, b)


def _min(a: float, b: float) -> float:
    if a != a:
        return b
    if b != b:
        return a
    return min(a, b)


def _fscale(f: float, s: int) -> float:
    try:
        return math.ldexp(f, int(s))
    except OverflowError:
        return math.copysign(math.inf, f)


def _exp(x: float) -> float:
    try:
        return math.exp(x)
    except OverflowError:
        return math.inf


def _log(x: float) -> float:
    if x == 0:
        return -math.inf
    if x < 0 or x != x:
        return math.nan
    return math.log(x) if x != math.inf else x


def _sqrt(x: float) -> float:
    if x < 0 or x != x:
        return math.nan
    return math.sqrt(x)


def _inv(x: float) -> float:
    if x == 0:
        return math.copysign(math.inf, x)
    return 1.0 / x


def _invsqrt(x: float) -> float:
    if x == 0:
        return math.copysign(math.inf, x)
    if x < 0 or x != x:
        return math.nan
    return 1.0 / math.sqrt(x)


def _pow(x: float, y: float) -> float:
    try:
        return math.pow(x, y)
    except (OverflowError, ValueError, ZeroDivisionError):
        if x == 0 and y < 0:
            return math.inf
        return math.nan if x < 0 else math.inf


def _trig(fn: Callable[[float], float]) -> Callable[[float], float]:
    def safe(x: float) -> float:
        return fn(x) if math.isfinite(x) else math.nan

    return safe


# name -> (arity, function over Python floats, result kind: "float" rounded to the argument type, or "bool")
FLOAT_FUNCTIONS: dict[str, tuple[int, Callable[..., Any], str]] = {
    "abs": (1, abs, "float"),
    "max": (2, _max, "float"),
    "min": (2, _min, "float"),
    "sign": (1, _sign, "float"),
    "ceil": (1, _finite_or_self(math.ceil), "float"),
    "floor": (1, _finite_or_self(math.floor), "float"),
    "fscale": (2, _fscale, "float"),
    "isNaN": (1, lambda x: x != x, "bool"),
    "isInf": (1, math.isinf, "bool"),
    "isFinite": (1, math.isfinite, "bool"),
    "signbit": (1, lambda x: math.copysign(1.0, x) < 0, "bool"),
    "tanh": (1, math.tanh, "float"),
    "cos": (1, _trig(math.cos), "float"),
    "exp": (1, _exp, "float"),
    "inv": (1, _inv, "float"),
    "invsqrt": (1, _invsqrt, "float"),
    "log": (1, _log, "float"),
    "pow": (2, _pow, "float"),
    "sin": (1, _trig(math.sin), "float"),
    "sqrt": (1, _sqrt, "float"),
}
RUNTIME_ONLY = frozenset({"cos", "exp", "inv", "invsqrt", "log", "pow", "sin", "sqrt"})
INTEGER_TOO = frozenset({"abs", "max", "min", "sign"})
REFUSED = {
    "isSignaling": "the executor's values carry no signaling-NaN bit",
    "sig": "the Libraries page does not say what it computes",
}


def _typed(name: str, t: CslType) -> Callable[..., Any]:
    """The function `name` on values of float type t: rounded to t (fscale's second argument is an
    i16 and is not rounded)."""
    _, fn, kind = FLOAT_FUNCTIONS[name]
    rnd = round32 if t is F32 else round16
    if kind == "bool":
        return lambda *a: bool(fn(*a))
    if name == "fscale":
        return lambda f, s: rnd(fn(f, s))

    def run(*a: float) -> float:
        try:
            return rnd(fn(*a))
        except (OverflowError, ValueError):
            return math.nan

    return run


def _int_function(name: str, t: IntType) -> Callable[..., int]:
    if name == "abs":
        return lambda x: t.wrap(abs(x))
    if name == "max":
        return lambda a, b: max(a, b)
    if name == "min":
        return lambda a, b: min(a, b)
    return lambda x: (x > 0) - (x < 0)


# Run-time entry points: what generated code calls as MATH[name](...).
MATH_FUNCS: dict[str, Callable[..., Any]] = {}
for _name in FLOAT_FUNCTIONS:
    MATH_FUNCS[f"{_name}_f16"] = _typed(_name, F16)
    MATH_FUNCS[f"{_name}_f32"] = _typed(_name, F32)


def _param_types(name: str, t: CslType) -> list[CslType]:
    arity = FLOAT_FUNCTIONS[name][0]
    if name == "fscale":
        return [t, I16]
    return [t] * arity


def _result_type(name: str, t: CslType) -> CslType:
    return BOOL if FLOAT_FUNCTIONS[name][2] == "bool" else t


class Math(NativeModule):
    spec = "math"

    def __init__(self, comp, ctx: Ctx, params: Struct, node: ast.Node) -> None:
        super().__init__(comp, ctx, params, node)
        members: dict[str, Any] = {
            "PI": known(math.pi, COMPTIME_FLOAT),
            "E": known(math.e, COMPTIME_FLOAT),
        }
        for suffix, t in (("f16", F16), ("f32", F32)):
            members[f"POSITIVE_INF_{suffix}"] = known(math.inf, t)
            members[f"NEGATIVE_INF_{suffix}"] = known(-math.inf, t)
            members[f"NaN_{suffix}"] = known(math.nan, t)
            for name in FLOAT_FUNCTIONS:
                full = f"{name}_{suffix}"
                members[full] = _typed_member(full, name, t)
        for name in FLOAT_FUNCTIONS:
            members[name] = NativeFn(
                name, [ANYTYPE] * FLOAT_FUNCTIONS[name][0], ANYTYPE, comptime=_generic(name)
            )
        for name, value in (("POSITIVE_INF", math.inf), ("NEGATIVE_INF", -math.inf), ("NaN", math.nan)):
            members[name] = NativeFn(name, [TYPE], ANYTYPE, comptime=_constant_of_type(name, value))
        self.members = members

    def member(self, ctx: Ctx, name: str, node: ast.Node) -> CExpr:
        base = name.removesuffix("_f16").removesuffix("_f32")
        if base in REFUSED:
            raise ctx.error(node, f"math.{name} is not supported by the executor: {REFUSED[base]}")
        return super().member(ctx, name, node)


def _typed_member(full: str, name: str, t: CslType) -> NativeFn:
    fn = MATH_FUNCS[full]
    ptypes = _param_types(name, t)
    args = ", ".join(f"{{{i}}}" for i in range(len(ptypes)))
    native = NativeFn(full, ptypes, _result_type(name, t), f"MATH[{full!r}]({args})", fold=fn)
    if name in RUNTIME_ONLY:
        native.comptime = _runtime_only(native)
    return native


def _runtime_only(native: NativeFn) -> Callable[[Ctx, list[CExpr], ast.Node], CExpr]:
    """A function the SDK evaluates only at run time: refused in a comptime context, folded when a
    run-time call has known arguments (as any compiler folds constants)."""

    def comptime(ctx: Ctx, args: list[CExpr], node: ast.Node) -> CExpr:
        if not ctx.runtime:
            raise ctx.error(
                node, f"math.{native.name} can only be evaluated at run time (SDK Libraries page)"
            )
        if all(a.known for a in args):
            return known(native.fold(*[a.value for a in args]), native.ret)
        assert native.runtime is not None
        code = native.runtime.format(*[ctx.code(a) for a in args])
        return ctx.dyn(native.ret, code)

    return comptime


def _generic(name: str) -> Callable[[Ctx, list[CExpr], ast.Node], CExpr]:
    """`math.name(x, ...)`: the f16 or f32 function for a float argument, an integer one for
    `abs`/`max`/`min`/`sign`; further arguments are coerced to the first one's type."""

    def comptime(ctx: Ctx, args: list[CExpr], node: ast.Node) -> CExpr:
        t = args[0].type
        if t is COMPTIME_FLOAT:
            t = F32
        if isinstance(t, IntType) and name in INTEGER_TOO:
            coerced = [args[0]] + [ctx.coerce(a, t, node) for a in args[1:]]
            fn = _int_function(name, t)
            if all(a.known for a in coerced):
                return known(fn(*[a.value for a in coerced]), t)
            if not ctx.runtime:
                raise ctx.error(node, f"math.{name} needs comptime-known arguments here")
            a = [ctx.code(c) for c in coerced]
            code = {
                "abs": t.wrap_code(f"abs({a[0]})"),
                "max": f"max({a[0]}, {a[-1]})",
                "min": f"min({a[0]}, {a[-1]})",
                "sign": f"((({a[0]}) > 0) - (({a[0]}) < 0))",
            }[name]
            return ctx.dyn(t, code)
        if t not in (F16, F32):
            raise ctx.error(
                node,
                f"math.{name} takes f16 or f32{' or an integer' if name in INTEGER_TOO else ''}, found {t.name}",
            )
        suffix = "f16" if t is F16 else "f32"
        native = _typed_member(f"{name}_{suffix}", name, t)
        ptypes = native.params
        coerced = [ctx.coerce(a, pt, node) for a, pt in zip(args, ptypes, strict=True)]
        if native.comptime is not None:
            return native.comptime(ctx, coerced, node)
        if all(a.known for a in coerced):
            return known(native.fold(*[a.value for a in coerced]), native.ret)
        if not ctx.runtime:
            raise ctx.error(node, f"math.{name} needs comptime-known arguments here")
        assert native.runtime is not None
        return ctx.dyn(native.ret, native.runtime.format(*[ctx.code(a) for a in coerced]))

    return comptime


def _constant_of_type(name: str, value: float) -> Callable[[Ctx, list[CExpr], ast.Node], CExpr]:
    def comptime(ctx: Ctx, args: list[CExpr], node: ast.Node) -> CExpr:
        t = ctx.need_known(args[0], node, "type")
        if t not in (F16, F32):
            raise ctx.error(node, f"math.{name} takes f16 or f32, not {getattr(t, 'name', t)}")
        return known(value, t)

    return comptime
