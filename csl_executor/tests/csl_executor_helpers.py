"""Shared by the executor's own tests (tests/test_csl_executor_*.py): compile one of the small CSL
programs under csl_executor/tests/data/ in process, run it through the SDK stand-in, and find the
line of a marked statement so that error messages can be checked to the exact `file:line`."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from csl_executor.layout import CompiledLayout, Options, compile_layout
from csl_executor.sdk import MemcpyDataType, MemcpyOrder, SdkRuntime

DATA = Path(__file__).resolve().parent / "data"
ROW = MemcpyOrder.ROW_MAJOR
COL = MemcpyOrder.COL_MAJOR


def compile_program(
    name: str,
    arch: str = "wse2",
    params: dict[str, int] | None = None,
    dims: tuple[int, int] | None = None,
    offsets: tuple[int, int] = (4, 1),
    memcpy: bool = True,
) -> CompiledLayout:
    """`cslc --arch=ARCH csl_executor/tests/data/NAME/layout.csl --memcpy ...`, in process. Without
    `dims`, the smallest fabric memcpy accepts around the rectangle (read from a first compile)."""
    layout = DATA / name / "layout.csl"
    if dims is None:
        # The rectangle is only known after evaluating the layout: compile once with room to spare.
        probe = compile_layout(
            layout, Options(arch=arch, fabric_dims=(64, 64), params=dict(params or {}), memcpy=memcpy)
        )
        w, h = probe.layout.rectangle
        dims = (offsets[0] + w + 3, offsets[1] + h + 1) if memcpy else (offsets[0] + w, offsets[1] + h)
    options = Options(
        arch=arch, fabric_dims=dims, fabric_offsets=offsets, params=dict(params or {}), memcpy=memcpy
    )
    return compile_layout(layout, options)


def line_of(path: Path, marker: str) -> int:
    """The 1-based line of the one line of `path` that contains `marker` (a `// RULE ...` comment)."""
    lines = [i + 1 for i, text in enumerate(path.read_text().splitlines()) if marker in text]
    assert len(lines) == 1, f"{marker!r} is on lines {lines} of {path}"
    return lines[0]


def where(name: str, file: str, marker: str) -> str:
    """`/abs/path/pe.csl:LINE` of a marked line, as the executor's messages start."""
    path = DATA / name / file
    return f"{path}:{line_of(path, marker)}"


class Host:
    """The host side of a run: SdkRuntime with the arguments every test passes spelled once."""

    def __init__(self, compiled: CompiledLayout, **kwargs) -> None:
        self.rt = SdkRuntime(compiled, **kwargs)
        self.rt.load()
        self.rt.run()

    def h2d(self, name: str, values: np.ndarray, rect=(0, 0, 1, 1), order=ROW, bits: int = 32) -> None:
        px, py, w, h = rect
        words = _words(values)
        dtype = MemcpyDataType.MEMCPY_32BIT if bits == 32 else MemcpyDataType.MEMCPY_16BIT
        self.rt.memcpy_h2d(
            self.rt.get_id(name), words, px, py, w, h, words.size // (w * h),
            streaming=False, data_type=dtype, order=order, nonblock=False,
        )  # fmt: skip

    def d2h(self, name: str, count: int, rect=(0, 0, 1, 1), order=ROW, bits: int = 32) -> np.ndarray:
        """`count` elements per PE of the rectangle, as uint32 words (16-bit values in the low half)."""
        px, py, w, h = rect
        out = np.zeros(count * w * h, dtype=np.uint32)
        dtype = MemcpyDataType.MEMCPY_32BIT if bits == 32 else MemcpyDataType.MEMCPY_16BIT
        self.rt.memcpy_d2h(
            out, self.rt.get_id(name), px, py, w, h, count,
            streaming=False, data_type=dtype, order=order, nonblock=False,
        )  # fmt: skip
        return out

    def launch(self, name: str, *args) -> None:
        self.rt.launch(name, *args, nonblock=False)

    def stop(self) -> None:
        self.rt.stop()


def _words(values: np.ndarray) -> np.ndarray:
    """Host values -> memcpy's 32-bit words (16-bit values zero-extended, as sdk_utils does)."""
    v = np.ascontiguousarray(values)
    if v.dtype.itemsize == 4:
        return v.view(np.uint32)
    if v.dtype.itemsize == 2:
        return v.view(np.uint16).astype(np.uint32)
    raise ValueError(f"memcpy moves 16- or 32-bit values, not {v.dtype}")


def f16_bits(words: np.ndarray) -> np.ndarray:
    """The f16 values in the low halves of memcpy words."""
    return (words & 0xFFFF).astype(np.uint16).view(np.float16)
