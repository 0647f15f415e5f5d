"""The simulated PEs' memory: every region's exported symbols, at their sizes, per PE.

A region is a rectangle of PEs running one PE program; each of its symbols is one NumPy array of
shape (h, w, elems) in the symbol's own dtype (float16 stays float16). These arrays are the truth:
the host's copy-mode memcpy writes and reads them, the kernels compute from them. Building the
memory refuses a plan whose regions overlap, leave the kernel, or need more SRAM on a PE than it has.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from wafer_gpt2.core.arch import Arch
from wafer_gpt2.core.code_bytes import program_of
from wafer_gpt2.core.memory_layout import symbol_dtype
from wafer_gpt2.core.runtime import MemcpyDataType, WaferRuntimeError
from wafer_gpt2.errors import WaferGPT2Error

SRAM_BYTES = 48 * 1024  # per PE on WSE-2 and WSE-3 (Cerebras architecture papers)


class PlanMemoryError(WaferGPT2Error, ValueError):
    """A plan whose symbols do not fit the PEs (or whose regions collide)."""


@dataclass
class RegionMemory:
    """The memory of one region: (h, w, elems) per symbol, plus a write counter per symbol."""

    index: int
    region: Any  # a plan region: name, kind, layer, replica, x, y, w, h, symbols, tiling
    arrays: dict[str, np.ndarray]
    versions: dict[str, int]

    @property
    def name(self) -> str:
        return self.region.name


class WaferMemory:
    def __init__(
        self,
        regions: Sequence[Any],
        kernel_wh: tuple[int, int],
        arch: Arch | None = None,
    ) -> None:
        self.kernel_wh = kernel_wh
        self.arch = arch  # None: a PE's whole SRAM for data (no program's code taken off)
        kw, kh = kernel_wh
        self.owner = np.full((kh, kw), -1, dtype=np.int32)  # region index per PE, -1: no program
        self.regions: list[RegionMemory] = []
        self.symbol_names: list[str] = []
        self._holders: dict[str, list[int]] = {}
        for index, region in enumerate(regions):
            self._place(index, region)
            arrays = {}
            for name, symbol in region.symbols.items():
                arrays[name] = np.zeros(
                    (region.h, region.w, int(symbol.elems)), dtype=symbol_dtype(symbol.dtype)
                )
                if name not in self._holders:
                    self._holders[name] = []
                    self.symbol_names.append(name)
                self._holders[name].append(index)
            self._check_budget(region, arrays)
            self.regions.append(RegionMemory(index, region, arrays, dict.fromkeys(arrays, 0)))
        self.symbol_ids = {name: i for i, name in enumerate(self.symbol_names)}

    # -- construction checks ---------------------------------------------------------------------

    def _place(self, index: int, region: Any) -> None:
        kw, kh = self.kernel_wh
        x, y, w, h = region.x, region.y, region.w, region.h
        if w < 1 or h < 1 or x < 0 or y < 0 or x + w > kw or y + h > kh:
            raise PlanMemoryError(
                f"region {region.name!r} at x={x}..{x + w - 1}, y={y}..{y + h - 1} lies outside the "
                f"{kw} x {kh} kernel"
            )
        taken = self.owner[y : y + h, x : x + w]
        if (taken >= 0).any():
            other = self.regions[int(taken[taken >= 0][0])].name
            yy, xx = np.argwhere(taken >= 0)[0]
            raise PlanMemoryError(f"regions {other!r} and {region.name!r} overlap at PE ({x + xx}, {y + yy})")
        taken[...] = index

    def _check_budget(self, region: Any, arrays: dict[str, np.ndarray]) -> None:
        """The planned symbols (the cycle counter too) must fit the PE's data budget: 48 KB less its
        program's code and the stack (`wafer_gpt2.core.arch.Arch.data_bytes`)."""
        sizes = {n: a.shape[2] * a.dtype.itemsize for n, a in arrays.items()}
        if self.arch is None:
            budget, words = SRAM_BYTES, f"{SRAM_BYTES} B of SRAM"
        else:
            program = program_of(region.kind, region.name)
            budget, words = self.arch.data_bytes(program), f"the {self.arch.budget_words(program)}"
        used = 0
        for name, size in sizes.items():
            used += size
            if used > budget:
                largest = max(sizes, key=sizes.__getitem__)
                listing = ", ".join(f"{n} {b} B" for n, b in sizes.items())
                raise PlanMemoryError(
                    f"PE ({region.x}, {region.y}) of region {region.name!r} (and every PE of it) runs out of "
                    f"memory at symbol {name!r}: its symbols need {sum(sizes.values())} B, more than {words}; "
                    f"largest {largest!r} {sizes[largest]} B [{listing}]"
                )

    # -- lookup ------------------------------------------------------------------------------------

    def symbol_id(self, name: str) -> int:
        try:
            return self.symbol_ids[name]
        except KeyError:
            known = ", ".join(self.symbol_names[:12]) + (", ..." if len(self.symbol_names) > 12 else "")
            raise WaferRuntimeError(
                f"get_id: no symbol named {name!r} is exported (known: {known})"
            ) from None

    def symbol_name(self, symbol_id: int) -> str:
        if not isinstance(symbol_id, int | np.integer) or not 0 <= symbol_id < len(self.symbol_names):
            raise WaferRuntimeError(
                f"unknown symbol id {symbol_id!r}: ids come from get_id() (0..{len(self.symbol_names) - 1})"
            )
        return self.symbol_names[int(symbol_id)]

    def region_arrays(self, index: int) -> dict[str, np.ndarray]:
        return self.regions[index].arrays

    # -- host transfers ----------------------------------------------------------------------------

    def check_transfer(
        self, what: str, name: str, rect: tuple[int, int, int, int], elems: int, data_type: MemcpyDataType
    ) -> list[tuple[RegionMemory, tuple[slice, slice], tuple[slice, slice]]]:
        """The pieces (region, its rows/cols, the host array's rows/cols) a transfer touches;
        raises unless every PE of the rectangle holds `name` with at least `elems` elements."""
        px, py, w, h = rect
        owners = self.owner[py : py + h, px : px + w]
        pieces = []
        for index in np.unique(owners).tolist():
            if index < 0:
                yy, xx = np.argwhere(owners < 0)[0]
                raise WaferRuntimeError(
                    f"{what}: PE ({px + xx}, {py + yy}) runs no program, so it has no symbol {name!r}"
                )
            memory = self.regions[index]
            region = memory.region
            array = memory.arrays.get(name)
            if array is None:
                yy, xx = np.argwhere(owners == index)[0]
                held = ", ".join(memory.arrays) or "none"
                raise WaferRuntimeError(
                    f"{what}: PE ({px + xx}, {py + yy}) of region {region.name!r} has no symbol {name!r} "
                    f"(it exports: {held})"
                )
            if elems > array.shape[2]:
                raise WaferRuntimeError(
                    f"{what}: {elems} elements per PE do not fit symbol {name!r} of region {region.name!r} "
                    f"({array.shape[2]} elements)"
                )
            bits = 8 * array.dtype.itemsize
            if bits != data_type.value:
                raise WaferRuntimeError(
                    f"{what}: symbol {name!r} holds {bits}-bit elements ({array.dtype}); transfer it with "
                    f"data_type=MemcpyDataType.MEMCPY_{bits}BIT, not {data_type.name}"
                )
            x0, x1 = max(px, region.x), min(px + w, region.x + region.w)
            y0, y1 = max(py, region.y), min(py + h, region.y + region.h)
            pieces.append(
                (
                    memory,
                    (slice(y0 - region.y, y1 - region.y), slice(x0 - region.x, x1 - region.x)),
                    (slice(y0 - py, y1 - py), slice(x0 - px, x1 - px)),
                )
            )
        return pieces

    def write(
        self, name: str, rect: tuple[int, int, int, int], words_hwl: np.ndarray, data_type: MemcpyDataType
    ) -> None:
        elems = words_hwl.shape[2]
        for memory, (rows, cols), (host_rows, host_cols) in self.check_transfer(
            "memcpy_h2d", name, rect, elems, data_type
        ):
            array = memory.arrays[name]
            words = words_hwl[host_rows, host_cols]
            if array.dtype.itemsize == 2:
                words = (words & 0xFFFF).astype(np.uint16)  # 16-bit values travel in the low half
            array[rows, cols, :elems] = words.view(array.dtype)
            memory.versions[name] += 1

    def read(
        self, name: str, rect: tuple[int, int, int, int], elems: int, data_type: MemcpyDataType
    ) -> np.ndarray:
        px, py, w, h = rect
        out = np.zeros((h, w, elems), dtype=np.uint32)
        for memory, (rows, cols), (host_rows, host_cols) in self.check_transfer(
            "memcpy_d2h", name, rect, elems, data_type
        ):
            array = memory.arrays[name][rows, cols, :elems]
            if array.dtype.itemsize == 2:
                out[host_rows, host_cols] = array.view(np.uint16)  # zero-extended into the low half
            else:
                out[host_rows, host_cols] = array.view(np.uint32)
        return out
