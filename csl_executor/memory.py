"""Values <-> PE memory words (16-bit, little-endian halves for 32-bit values, as memcpy moves them)."""

from __future__ import annotations

from typing import Any

import numpy as np

from csl_executor.types import (
    BOOL,
    F16,
    F32,
    ArrayType,
    ArrayValue,
    CslType,
    EnumType,
    EnumValue,
    IntType,
    Pointer,
    PointerType,
)

NUMPY_OF = {
    "f32": np.float32, "f16": np.float16, "i16": np.int16, "u16": np.uint16, "i32": np.int32, "u32": np.uint32,
    "i8": np.int16, "u8": np.uint16, "bool": np.uint16,
}  # fmt: skip


def scalar_type(t: CslType) -> CslType:
    while isinstance(t, ArrayType):
        t = t.elem
    if isinstance(t, EnumType):
        return t.tag
    if isinstance(t, PointerType):
        from csl_executor.types import U16

        return U16
    return t


def pack_values(t: CslType, value: Any) -> np.ndarray:
    """The memory words (uint16) of a value of type `t`."""
    scalar = scalar_type(t)
    items = value.items if isinstance(value, ArrayValue) else [value]
    items = [_scalar_number(v) for v in items]
    if scalar is F32:
        return np.asarray(items, dtype=np.float32).view(np.uint16)
    if scalar is F16:
        return np.asarray(items, dtype=np.float16).view(np.uint16)
    if scalar is BOOL:
        return np.asarray([1 if v else 0 for v in items], dtype=np.uint16)
    if isinstance(scalar, IntType):
        if scalar.bits == 32:
            return np.asarray([v & 0xFFFFFFFF for v in items], dtype=np.uint32).view(np.uint16)
        if scalar.bits <= 16:
            return np.asarray([v & 0xFFFF for v in items], dtype=np.uint16)
    raise ValueError(f"cannot place values of type {t} in memory")


def _scalar_number(v: Any) -> Any:
    if isinstance(v, EnumValue):
        return v.value
    if isinstance(v, Pointer):
        return v.addr
    return v


def view_words(words: np.ndarray, scalar: CslType) -> np.ndarray:
    """Memory words read as values of `scalar` (the inverse of `pack_values` for arrays)."""
    name = scalar_type(scalar).name
    return words.view(NUMPY_OF[name]) if name not in ("i8", "u8", "bool") else words
