"""The `sdk-container` backend: the runtime contract on the Cerebras SDK's own `SdkRuntime`.

Inside the Cerebras SDK container (`cs_python`, or a Python that can import
`cerebras.sdk.runtime.sdkruntimepybind`) this runs the compiled CSL program on simfabric, or on a CS
system when a `cmaddr` ("IP:port") is given (argument or the WAFER_CMADDR environment variable).
The SDK is imported lazily: everywhere else the backend says what is missing instead of failing on
import. The host program (`wafer_gpt2.host.program.WaferGPT2`) drives it exactly as it drives the simulator.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from wafer_gpt2.core.runtime import MemcpyDataType, MemcpyOrder, WaferRuntimeError
from wafer_gpt2.errors import WaferGPT2Error

SDK_MODULE = "cerebras.sdk.runtime.sdkruntimepybind"


class SdkUnavailableError(WaferGPT2Error, RuntimeError):
    """The Cerebras SDK is not installed here."""


def import_sdk() -> Any:
    try:
        import importlib

        return importlib.import_module(SDK_MODULE)
    except ImportError as exc:
        raise SdkUnavailableError(
            f"backend sdk-container needs the Cerebras SDK ({SDK_MODULE}); run inside the SDK container "
            "(docker/Dockerfile.sdk, see docs/kernels.md) or use --backend sim"
        ) from exc


class SdkContainerRuntime:
    """`load/run/stop/get_id/memcpy_h2d/memcpy_d2h/launch` forwarded to the SDK's SdkRuntime, with our
    enums translated to the SDK's. Same argument conventions (the contract was shaped after it)."""

    backend = "sdk-container"  # what `WaferGPT2.describe` reports

    # memcpy runs one command at a time: the host sends a replica at most the records its io.out holds
    # before it reads them (wafer_gpt2.host.program, `Plan.records_held`).
    serial_memcpy = True
    running = False  # set by run() and stop()

    def __init__(self, compiled_dir: str | Path, cmaddr: str | None = None, sdk: Any = None) -> None:
        self._sdk = sdk or import_sdk()
        compiled_dir = Path(compiled_dir)
        if not (compiled_dir / "out.json").is_file():
            raise WaferRuntimeError(
                f"{compiled_dir} is not a cslc output directory (no out.json): compile first"
            )
        self.cmaddr = cmaddr if cmaddr is not None else os.environ.get("WAFER_CMADDR") or None
        self._runner = self._sdk.SdkRuntime(str(compiled_dir), cmaddr=self.cmaddr)
        self.running = False

    def _data_type(self, data_type: MemcpyDataType) -> Any:
        return getattr(self._sdk.MemcpyDataType, data_type.name)

    def _order(self, order: MemcpyOrder) -> Any:
        return getattr(self._sdk.MemcpyOrder, order.name)

    def load(self) -> None:
        self._runner.load()

    def run(self) -> None:
        self._runner.run()
        self.running = True

    def stop(self) -> None:
        if self.running:
            self._runner.stop()
            self.running = False

    def get_id(self, symbol: str) -> int:
        return self._runner.get_id(symbol)

    def memcpy_h2d(self, dest, src: np.ndarray, px, py, w, h, elems_per_pe, *, streaming=False,
                   data_type=MemcpyDataType.MEMCPY_32BIT, order=MemcpyOrder.ROW_MAJOR, nonblock=False):  # fmt: skip
        return self._runner.memcpy_h2d(
            dest, np.ascontiguousarray(src).reshape(-1), px, py, w, h, elems_per_pe, streaming=streaming,
            data_type=self._data_type(data_type), order=self._order(order), nonblock=nonblock,
        )  # fmt: skip

    def memcpy_d2h(self, dest: np.ndarray, src, px, py, w, h, elems_per_pe, *, streaming=False,
                   data_type=MemcpyDataType.MEMCPY_32BIT, order=MemcpyOrder.ROW_MAJOR, nonblock=False):  # fmt: skip
        return self._runner.memcpy_d2h(
            dest, src, px, py, w, h, elems_per_pe, streaming=streaming,
            data_type=self._data_type(data_type), order=self._order(order), nonblock=nonblock,
        )  # fmt: skip

    def launch(self, name: str, *args: Any, nonblock: bool = False):
        return self._runner.launch(name, *args, nonblock=nonblock)

    def task_wait(self, task: Any) -> None:
        self._runner.task_wait(task)

    def is_task_done(self, task: Any) -> bool:
        return self._runner.is_task_done(task)


def build_backend(params, options, out_dir: str | Path = "build/sdk-container", cmaddr: str | None = None):
    """Plan, compile with cslc (simfabric-sized unless a cmaddr is set), load, upload the weights."""
    import_sdk()  # fail first, with the clear message, before planning or compiling
    from wafer_gpt2.host.compile import compile_program, prepare_sources
    from wafer_gpt2.host.program import plan_for, start_model

    cmaddr = cmaddr if cmaddr is not None else os.environ.get("WAFER_CMADDR") or None
    plan = plan_for(params, options)
    job = prepare_sources(plan, out_dir, simfabric=cmaddr is None)
    compile_program(job)
    runtime = SdkContainerRuntime(job.bin_dir, cmaddr=cmaddr)
    return start_model(plan, runtime, params, steps_in_flight=options.steps_in_flight)
