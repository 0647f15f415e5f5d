"""Helpers the generated Python code calls, and that constant folding evaluates with.

The compiler folds a comptime expression by evaluating the very code it would generate for it, with
these helpers, so that comptime and run time round and wrap identically.
"""

from __future__ import annotations

import array
import math
import struct

from csl_executor.errors import CslRuntimeError

_f32_cell = array.array("f", [0.0])
_u32_cell = array.array("I", [0])
_F16 = struct.Struct("<e")
_U16 = struct.Struct("<H")

INF = math.inf
NINF = -math.inf
NAN = math.nan


def F32(v: float) -> float:
    """Round to binary32, ties to even (a C cast on x86: overflow gives +-inf)."""
    _f32_cell[0] = v
    return _f32_cell[0]


def F16(v: float) -> float:
    try:
        return _F16.unpack(_F16.pack(v))[0]
    except OverflowError:
        return math.copysign(math.inf, v)


H2F: list[float] = [_F16.unpack(_U16.pack(b))[0] for b in range(1 << 16)]


def F2H(v: float) -> int:
    """f16 bits of a value (rounded to f16)."""
    try:
        return _U16.unpack(_F16.pack(v))[0]
    except OverflowError:
        return 0x7C00 if v > 0 else 0xFC00


_bits_f = array.array("f", [0.0])
_bits_i = memoryview(_bits_f).cast("B").cast("I")


def F2U(v: float) -> int:
    """binary32 bits of a value."""
    _bits_f[0] = v
    return _bits_i[0]


def U2F(b: int) -> float:
    _bits_i[0] = b & 0xFFFFFFFF
    return _bits_f[0]


def IDIV(a: int, b: int) -> int:
    if b == 0:
        raise CslRuntimeError("integer division by zero")
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b >= 0) else -q


def IREM(a: int, b: int) -> int:
    if b == 0:
        raise CslRuntimeError("integer remainder by zero")
    return a - IDIV(a, b) * b


def FDIV(a: float, b: float) -> float:
    try:
        return a / b
    except ZeroDivisionError:
        if a != a or a == 0:
            return math.nan
        return math.copysign(math.inf, a) * math.copysign(1.0, b)


def FREM(a: float, b: float) -> float:
    if b == 0 or a != a or math.isinf(a):
        return math.nan
    return math.fmod(a, b)


def FTOI(v: float, lo: int, hi: int) -> int:
    """`@as(int, float)`: truncate toward zero; NaN and out-of-range values saturate."""
    if v != v:
        return 0
    if v >= hi:
        return hi
    if v <= lo:
        return lo
    return int(v)


def OOB(index: int, length: int, where: str) -> int:
    raise CslRuntimeError(f"{where}: index {index} out of bounds for an array of {length} elements")


def SHL(v: int, n: int, bits: int) -> int:
    if n < 0 or n >= bits:
        raise CslRuntimeError(f"shift by {n} does not fit a {bits}-bit value")
    return v << n


def SHR(v: int, n: int, bits: int) -> int:
    if n < 0 or n >= bits:
        raise CslRuntimeError(f"shift by {n} does not fit a {bits}-bit value")
    return v >> n


HELPERS = {
    "F32": F32, "F16": F16, "H2F": H2F, "F2H": F2H, "F2U": F2U, "U2F": U2F, "IDIV": IDIV, "IREM": IREM,
    "FDIV": FDIV, "FREM": FREM, "FTOI": FTOI, "OOB": OOB, "SHL": SHL, "SHR": SHR, "INF": INF,
    "NINF": NINF, "NAN": NAN, "math": math,
}  # fmt: skip
