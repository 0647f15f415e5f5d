"""The runtime contract: the one interface through which the host program talks to a wafer.

It is shaped like the Cerebras SDK's `SdkRuntime` (Cerebras SDK documentation, the host runtime `cerebras.sdk.runtime.sdkruntimepybind`), so
the host code that drives the embedded simulator (`wafer_gpt2.sim`) drives the SDK unchanged:

    runtime.load(); runtime.run()
    sym = runtime.get_id("w")
    runtime.memcpy_h2d(sym, array, x, y, w, h, elems_per_pe, streaming=False,
                       data_type=MemcpyDataType.MEMCPY_16BIT, order=MemcpyOrder.ROW_MAJOR, nonblock=True)
    runtime.memcpy_h2d(color, words, x, y, 1, 1, n, streaming=True, ...)   # onto a memcpy color
    runtime.memcpy_d2h(out, color, x, y, 1, 1, m, streaming=True, ...)
    runtime.launch("clear_slot", np.uint32(replica), np.uint32(slot), nonblock=False)
    runtime.stop()

The SDK's conventions hold: every element on the wire is 32 bits (16-bit values travel in the low
half of a uint32, see `to_wire` / `from_wire`); the host array holds w*h*elems_per_pe elements laid
out (h, w, elems) for ROW_MAJOR and (elems, w, h) for COL_MAJOR; copy mode writes straight into an
exported symbol of every PE of the rectangle, streaming mode sends wavelets to the kernel on a memcpy
color; commands execute in issue order; a non-blocking call returns a `Task` to wait on.

`Runtime` is the contract as a `typing.Protocol`: what the host program (`wafer_gpt2.host.program`) calls. Four
classes satisfy it: the simulator's `wafer_gpt2.sim.SimRuntime`, the CSL executor's
`wafer_gpt2.backends.csl.CslExecutorRuntime`, and the SDK adapters `wafer_gpt2.backends.sdk_container.SdkContainerRuntime`
and `wafer_gpt2.backends.sdk_appliance.ApplianceRuntime` (tests/test_runtime_contract.py checks each).
`CheckedRuntime` implements the argument checks, the lifecycle and the in-order command queue once for
the simulator; a subclass supplies the primitives (`_copy_in`, `_copy_out`, `_stream_in`,
`_stream_out`, `_launch`). The SDK adapters leave those checks to the SDK they forward to.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from enum import Enum
from typing import Any, Protocol, runtime_checkable

import numpy as np

from wafer_gpt2.errors import WaferGPT2Error


class MemcpyDataType(Enum):
    MEMCPY_32BIT = 32
    MEMCPY_16BIT = 16


class MemcpyOrder(Enum):
    ROW_MAJOR = 0  # host array (h, w, elems)
    COL_MAJOR = 1  # host array (elems, w, h)


class WaferRuntimeError(WaferGPT2Error, RuntimeError):
    """Misuse of the runtime or a failure on the wafer, worded like the SDK's errors."""


class Task:
    """A non-blocking command: wait on it with `runtime.task_wait(task)` (or `task.wait()`)."""

    def __init__(self, future: Future, description: str) -> None:
        self._future = future
        self.description = description

    def done(self) -> bool:
        return self._future.done()

    def wait(self) -> Any:
        return self._future.result()


# ----------------------------------------------------------------------------------------------------
# Host-side helpers: what the SDK's `sdk_utils` offers for 16-bit values and array orders.


def to_wire(values: np.ndarray) -> np.ndarray:
    """Host values -> uint32 wire words: 32-bit values keep their bits, 16-bit ones sit in the low half."""
    values = np.ascontiguousarray(values)
    if values.dtype.itemsize == 4:
        return values.view(np.uint32)
    if values.dtype.itemsize == 2:
        return values.view(np.uint16).astype(np.uint32)
    raise WaferRuntimeError(f"cannot send {values.dtype} values: the wire carries 16- or 32-bit elements")


def from_wire(words: np.ndarray, dtype: np.dtype | type) -> np.ndarray:
    """uint32 wire words -> host values of `dtype` (16-bit dtypes take the low half of each word)."""
    dtype = np.dtype(dtype)
    words = np.ascontiguousarray(words, dtype=np.uint32)
    if dtype.itemsize == 4:
        return words.view(dtype)
    if dtype.itemsize == 2:
        return (words & 0xFFFF).astype(np.uint16).view(dtype)
    raise WaferRuntimeError(f"cannot receive {dtype} values: the wire carries 16- or 32-bit elements")


def hwl_to_flat(array_hwl: np.ndarray, order: MemcpyOrder) -> np.ndarray:
    """(h, w, elems) -> the 1-D host buffer memcpy expects in `order`."""
    array_hwl = np.asarray(array_hwl)
    return (
        array_hwl.reshape(-1) if order is MemcpyOrder.ROW_MAJOR else array_hwl.transpose(2, 1, 0).reshape(-1)
    )


def flat_to_hwl(flat: np.ndarray, h: int, w: int, elems: int, order: MemcpyOrder) -> np.ndarray:
    """The inverse of `hwl_to_flat`."""
    flat = np.asarray(flat).reshape(-1)
    if order is MemcpyOrder.ROW_MAJOR:
        return flat.reshape(h, w, elems)
    return flat.reshape(elems, w, h).transpose(2, 1, 0)


# ----------------------------------------------------------------------------------------------------


@runtime_checkable
class Runtime(Protocol):
    """The SdkRuntime-shaped contract the host program drives (see the module's docstring)."""

    @property
    def running(self) -> bool:
        """True between `run()` and `stop()`; the host loads and runs a runtime that is not running yet."""
        ...

    def load(self) -> None: ...

    def run(self) -> None: ...

    def stop(self) -> None: ...

    def get_id(self, symbol: str) -> int: ...

    def memcpy_h2d(
        self,
        dest: int,
        src: np.ndarray,
        px: int,
        py: int,
        w: int,
        h: int,
        elems_per_pe: int,
        *,
        streaming: bool = False,
        data_type: MemcpyDataType = MemcpyDataType.MEMCPY_32BIT,
        order: MemcpyOrder = MemcpyOrder.ROW_MAJOR,
        nonblock: bool = False,
    ) -> Any: ...

    def memcpy_d2h(
        self,
        dest: np.ndarray,
        src: int,
        px: int,
        py: int,
        w: int,
        h: int,
        elems_per_pe: int,
        *,
        streaming: bool = False,
        data_type: MemcpyDataType = MemcpyDataType.MEMCPY_32BIT,
        order: MemcpyOrder = MemcpyOrder.ROW_MAJOR,
        nonblock: bool = False,
    ) -> Any: ...

    def launch(self, name: str, *args: Any, nonblock: bool = False) -> Any: ...

    def task_wait(self, task: Any) -> Any: ...

    def is_task_done(self, task: Any) -> bool: ...


class CheckedRuntime(ABC):
    """`Runtime` with its checks, lifecycle and command queue; subclasses provide the wafer (or simulator)."""

    #: (width, height) of the kernel rectangle, in PEs; set by the backend.
    kernel_wh: tuple[int, int]

    def __init__(self) -> None:
        self._state = "new"  # new -> loaded -> running -> stopped
        self._queue = ThreadPoolExecutor(max_workers=1, thread_name_prefix="wafer-runtime")
        self._failure: BaseException | None = None
        self._lock = threading.Lock()

    # -- lifecycle -------------------------------------------------------------------------------

    def load(self) -> None:
        if self._state != "new":
            raise WaferRuntimeError(f"load(): the program is already {self._state}")
        self._load()
        self._state = "loaded"

    def run(self) -> None:
        if self._state != "loaded":
            raise WaferRuntimeError(
                "run(): call load() first"
                if self._state == "new"
                else f"run(): the program is already {self._state}"
            )
        self._state = "running"

    def stop(self) -> None:
        """Finish every queued command, then stop the program; later commands are refused."""
        with self._lock:  # `_submit` checks the state under this lock: no command slips in after it
            if self._state == "stopped":
                return
            self._state = "stopped"
        self._queue.shutdown(wait=True)

    @property
    def running(self) -> bool:
        return self._state == "running"

    # -- symbols ---------------------------------------------------------------------------------

    @abstractmethod
    def get_id(self, symbol: str) -> int:
        """The id of an exported symbol (valid before `load()`, as in the SDK)."""

    # -- commands --------------------------------------------------------------------------------

    def memcpy_h2d(
        self,
        dest: int,
        src: np.ndarray,
        px: int,
        py: int,
        w: int,
        h: int,
        elems_per_pe: int,
        *,
        streaming: bool = False,
        data_type: MemcpyDataType = MemcpyDataType.MEMCPY_32BIT,
        order: MemcpyOrder = MemcpyOrder.ROW_MAJOR,
        nonblock: bool = False,
    ) -> Task:
        """Host -> wafer: `dest` is a symbol id (copy mode) or a memcpy color (streaming mode)."""
        what = "memcpy_h2d"
        words = self._check_transfer(what, src, px, py, w, h, elems_per_pe, writable=False)
        hwl = flat_to_hwl(words, h, w, elems_per_pe, order).copy()  # the SDK reads src at issue time
        rect = (px, py, w, h)
        if streaming:
            self._check_stream(what, dest, rect, elems_per_pe, data_type)
            return self._submit(f"{what}(color {dest})", lambda: self._stream_in(dest, rect, hwl), nonblock)
        self._check_copy(what, dest, rect, elems_per_pe, data_type)
        return self._submit(
            f"{what}({self._describe(dest)})", lambda: self._copy_in(dest, rect, hwl, data_type), nonblock
        )

    def memcpy_d2h(
        self,
        dest: np.ndarray,
        src: int,
        px: int,
        py: int,
        w: int,
        h: int,
        elems_per_pe: int,
        *,
        streaming: bool = False,
        data_type: MemcpyDataType = MemcpyDataType.MEMCPY_32BIT,
        order: MemcpyOrder = MemcpyOrder.ROW_MAJOR,
        nonblock: bool = False,
    ) -> Task:
        """Wafer -> host: fills `dest` (w*h*elems_per_pe 32-bit elements) in place."""
        what = "memcpy_d2h"
        out = self._check_transfer(what, dest, px, py, w, h, elems_per_pe, writable=True)
        rect = (px, py, w, h)

        def deliver(hwl: np.ndarray) -> None:
            out[...] = hwl_to_flat(hwl, order)

        if streaming:
            self._check_stream(what, src, rect, elems_per_pe, data_type)
            return self._submit(
                f"{what}(color {src})", lambda: deliver(self._stream_out(src, rect, elems_per_pe)), nonblock
            )
        self._check_copy(what, src, rect, elems_per_pe, data_type)
        return self._submit(
            f"{what}({self._describe(src)})",
            lambda: deliver(self._copy_out(src, rect, elems_per_pe, data_type)),
            nonblock,
        )

    def launch(self, name: str, *args: Any, nonblock: bool = False) -> Task:
        """Run an exported host-callable function on every PE that exports it."""
        self._check_running("launch")
        values = self._check_launch(name, args)
        return self._submit(f"launch({name!r})", lambda: self._launch(name, values), nonblock)

    def task_wait(self, task: Task) -> Any:
        return task.wait()

    def is_task_done(self, task: Task) -> bool:
        return task.done()

    # -- the primitives a backend provides ---------------------------------------------------------

    @abstractmethod
    def _load(self) -> None: ...

    @abstractmethod
    def _describe(self, symbol_id: int) -> str:
        """A symbol id as a person reads it (its name)."""

    @abstractmethod
    def _check_copy(
        self,
        what: str,
        symbol_id: int,
        rect: tuple[int, int, int, int],
        elems: int,
        data_type: MemcpyDataType,
    ) -> None:
        """Raise WaferRuntimeError unless a copy-mode transfer of this shape fits the symbol on every PE."""

    @abstractmethod
    def _check_stream(
        self, what: str, color: int, rect: tuple[int, int, int, int], elems: int, data_type: MemcpyDataType
    ) -> None: ...

    @abstractmethod
    def _check_launch(self, name: str, args: tuple) -> tuple: ...

    @abstractmethod
    def _copy_in(
        self,
        symbol_id: int,
        rect: tuple[int, int, int, int],
        words_hwl: np.ndarray,
        data_type: MemcpyDataType,
    ) -> None: ...

    @abstractmethod
    def _copy_out(
        self, symbol_id: int, rect: tuple[int, int, int, int], elems: int, data_type: MemcpyDataType
    ) -> np.ndarray: ...

    @abstractmethod
    def _stream_in(self, color: int, rect: tuple[int, int, int, int], words_hwl: np.ndarray) -> None: ...

    @abstractmethod
    def _stream_out(self, color: int, rect: tuple[int, int, int, int], elems: int) -> np.ndarray: ...

    @abstractmethod
    def _launch(self, name: str, args: tuple) -> None: ...

    # -- shared checks -----------------------------------------------------------------------------

    def _check_running(self, what: str) -> None:
        if self._state == "new":
            raise WaferRuntimeError(f"{what}: the program is not loaded; call load() and run() first")
        if self._state == "loaded":
            raise WaferRuntimeError(f"{what}: the program is loaded but not running; call run() first")
        if self._state == "stopped":
            raise WaferRuntimeError(f"{what}: the runtime was stopped; no command is accepted after stop()")
        if self._failure is not None:
            raise WaferRuntimeError(
                f"{what}: an earlier command failed, the wafer state is unknown: {self._failure}"
            )

    def _check_transfer(
        self, what: str, array: np.ndarray, px: int, py: int, w: int, h: int, elems: int, writable: bool
    ) -> np.ndarray:
        """The checks every memcpy makes (state, rectangle, host array); the host array as uint32 words."""
        self._check_running(what)
        self._check_rectangle(what, px, py, w, h, elems)
        return self._host_words(what, array, w * h * elems, writable)

    def _check_rectangle(self, what: str, px: int, py: int, w: int, h: int, elems: int) -> None:
        kw, kh = self.kernel_wh
        for name, value in (("px", px), ("py", py), ("w", w), ("h", h), ("elems_per_pe", elems)):
            if not isinstance(value, int | np.integer):
                raise WaferRuntimeError(f"{what}: {name} must be an integer, got {type(value).__name__}")
        if w < 1 or h < 1 or elems < 1:
            raise WaferRuntimeError(
                f"{what}: w, h and elems_per_pe must be positive, got w={w} h={h} elems={elems}"
            )
        if px < 0 or py < 0 or px + w > kw or py + h > kh:
            raise WaferRuntimeError(
                f"{what}: rectangle x={px}..{px + w - 1}, y={py}..{py + h - 1} lies outside the kernel "
                f"(x 0..{kw - 1}, y 0..{kh - 1})"
            )

    @staticmethod
    def _host_words(what: str, array: np.ndarray, count: int, writable: bool) -> np.ndarray:
        if not isinstance(array, np.ndarray):
            raise WaferRuntimeError(
                f"{what}: the host array must be a numpy array, got {type(array).__name__}"
            )
        if array.dtype.itemsize != 4:
            raise WaferRuntimeError(
                f"{what}: the host array holds {array.dtype} ({array.dtype.itemsize * 8}-bit) elements; memcpy "
                "moves 32-bit elements (16-bit values go in the low half of a uint32)"
            )
        if array.size != count:
            raise WaferRuntimeError(
                f"{what}: the host array has {array.size} elements (shape {array.shape}); "
                f"w*h*elems_per_pe = {count}"
            )
        if writable:
            if not (array.flags.c_contiguous and array.flags.writeable):
                raise WaferRuntimeError(f"{what}: the destination array must be C-contiguous and writeable")
            return array.reshape(-1).view(np.uint32)
        return np.ascontiguousarray(array).reshape(-1).view(np.uint32)

    def _submit(self, description: str, command: Callable[[], Any], nonblock: bool) -> Task:
        def guarded() -> Any:
            if self._failure is not None:
                raise WaferRuntimeError(f"{description}: skipped, an earlier command failed: {self._failure}")
            try:
                return command()
            except BaseException as exc:
                with self._lock:
                    self._failure = self._failure or exc
                raise

        with self._lock:  # against a concurrent stop(): refuse with our own error, not the pool's
            self._check_running(description)
            future = self._queue.submit(guarded)
        task = Task(future, description)
        if not nonblock:
            task.wait()
        return task

    def __enter__(self) -> CheckedRuntime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
