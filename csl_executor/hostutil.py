"""Host helpers of the SDK (`sdk_utils`, `debug_util`), written from their documented behaviour.

- `memcpy_view(arr, dtype)`: the values of a 32-bit host array seen as `dtype` (for 16-bit types, the
  low half of each element, where memcpy puts 16-bit data).
- `input_array_to_u32(arr, sentinel, fast_dim_sz)`: 16-bit values into the low half of 32-bit words;
  with a sentinel, the upper half holds each element's index within the fastest dimension.
- `calculate_cycles(buf)`: the difference of two 48-bit timestamps packed in three f32 words.
- `debug_util(out_dir).read_trace(x, y, key)`: the values a PE recorded with `<debug>`, by absolute
  fabric coordinates (the kernel sits at `--fabric-offsets`).
- `MemcpyDataType`, `MemcpyOrder`: the host runtime's enums (`SdkRuntime` reads them by name, so a
  caller's own enums with the SDK's member names work as well).
"""

from __future__ import annotations

import json
from enum import Enum
from pathlib import Path
from typing import Any

import numpy as np

from csl_executor.errors import CslRuntimeError


def memcpy_view(arr: np.ndarray, dtype: np.dtype) -> np.ndarray:
    if arr.itemsize != 4:
        raise CslRuntimeError("memcpy_view: the array must hold 32-bit elements")
    dtype = np.dtype(dtype)
    if dtype.itemsize not in (1, 2, 4):
        raise CslRuntimeError("memcpy_view: the view's type must be 1, 2 or 4 bytes")
    view = arr.view(dtype)
    return np.lib.stride_tricks.as_strided(view, strides=arr.strides, shape=arr.shape)


def input_array_to_u32(np_arr: np.ndarray, sentinel: int | None, fast_dim_sz: int) -> np.ndarray:
    arr = np.asarray(np_arr)
    if arr.ndim != 1:
        raise CslRuntimeError(f"input_array_to_u32: the array must be flat, not of shape {arr.shape}")
    if arr.itemsize == 4:
        return arr.view(np.uint32)
    if arr.itemsize != 2:
        raise CslRuntimeError("input_array_to_u32: only 16- and 32-bit arrays")
    low = arr.view(np.uint16).astype(np.uint32)
    if sentinel is None:
        return low
    index = (np.arange(arr.size, dtype=np.uint32) % np.uint32(fast_dim_sz)) << np.uint32(16)
    return index | low


def calculate_cycles(buf: np.ndarray) -> int:
    words = np.asarray(buf[:3], dtype=np.float32).view(np.uint32)
    h = [half for w in words for half in (int(w) & 0xFFFF, int(w) >> 16)]
    start = h[0] + (h[1] << 16) + (h[2] << 32)
    end = h[3] + (h[4] << 16) + (h[5] << 32)
    return end - start


class debug_util:  # noqa: N801 - the SDK's name
    def __init__(self, out_dir: str | Path, cmaddr: str | None = None) -> None:
        self.out = Path(out_dir)
        meta = json.loads((self.out / "out.json").read_text())
        self.offsets = tuple(meta["executor"]["options"]["fabric_offsets"])
        path = self.out / "executor_traces.json"
        self.traces: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {}

    def read_trace(self, col: int, row: int, key: str) -> list:
        x, y = col - self.offsets[0], row - self.offsets[1]
        pe = self.traces.get(f"{x},{y}")
        if pe is None or key not in pe:
            raise CslRuntimeError(f"read_trace: PE at fabric ({col}, {row}) recorded no trace {key!r}")
        return pe[key]


class MemcpyDataType(Enum):
    MEMCPY_32BIT = 32
    MEMCPY_16BIT = 16


class MemcpyOrder(Enum):
    ROW_MAJOR = 0  # host array (h, w, elems)
    COL_MAJOR = 1  # host array (elems, w, h)
