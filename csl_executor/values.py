"""The values the CSL compiler passes around, and the type predicates on them.

A `CExpr` is either a value known at comptime or a piece of Python code with its static CSL type
(`csl_executor.compiler`). The compiler, the builtins (`csl_executor.builtins`) and the native libraries
(`csl_executor.libs`, `csl_executor.collectives`) all build on these, so this module sits below them: the
compiler imports the builtins and libraries, they import this, and imports run one way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from csl_executor.program import MemVar
from csl_executor.types import (
    COMPTIME_FLOAT,
    COMPTIME_INT,
    VOID,
    VOID_T,
    ArrayType,
    CslType,
    FloatType,
    IntType,
    type_of_value,
)

NOT = object()  # "not known at comptime"


@dataclass
class CExpr:
    type: CslType
    value: Any = NOT
    code: str | None = None

    @property
    def known(self) -> bool:
        return self.value is not NOT


def known(value: Any, ctype: CslType | None = None) -> CExpr:
    return CExpr(ctype if ctype is not None else type_of_value(value), value)


VOID_EXPR = CExpr(VOID_T, VOID)


@dataclass
class CVar:
    """A name bound at comptime (a comptime local, a parameter of a comptime call, a loop variable)."""

    value: Any
    type: CslType
    mutable: bool = False


def is_int(t: CslType) -> bool:
    return isinstance(t, IntType) or t is COMPTIME_INT


def is_float(t: CslType) -> bool:
    return isinstance(t, FloatType) or t is COMPTIME_FLOAT


def is_num(t: CslType) -> bool:
    return is_int(t) or is_float(t)


def int_fits(src: IntType, dst: IntType) -> bool:
    """Zig's implicit integer widening."""
    if src.signed == dst.signed:
        return dst.bits >= src.bits
    return (not src.signed) and dst.signed and dst.bits > src.bits


def scalar_of(t: CslType) -> CslType:
    while isinstance(t, ArrayType):
        t = t.elem
    return t


@dataclass
class MemPlace:
    type: CslType
    addr: CExpr  # word address, known or run-time
    var: MemVar | None
    const: bool = False


class MemArray(CExpr):
    """An array in memory used as a value (for DSDs, `.len`, iteration): its address and type."""

    type: ArrayType

    def __init__(self, t: ArrayType, addr: CExpr, var: MemVar | None) -> None:
        super().__init__(t, NOT, None)
        self.addr = addr
        self.var = var
