"""The `sdk-appliance` backend: the runtime contract over `cerebras.sdk.client.SdkRuntime` (gRPC).

For a Cerebras Wafer-Scale Cluster, or the loopback worker of `tools.appliance_server` (the same
protocol, executing on the embedded simulator). PyPI `cerebras-sdk` (2.10.0) pins numpy 1.25.0 and
ships cp311 wheels only, so it lives in its own environment (`make appliance-venv` builds
.venv-appliance), and this module imports it lazily.

Quirks of the 2.10.0 client, handled by subclassing (the installed package is never edited or
patched):
- `SdkContext.__enter__` with an explicit `grpc_address` evaluates an undefined name (NameError) and
  its `__exit__` calls a cluster-management client that was never created. `_DirectContext` connects
  straight to the address; `_DirectClient` sits between SdkRuntime / SdkCompiler and SdkClient in the
  method resolution order, so their own `__enter__` / `__exit__` run unchanged on top of it.
- `SdkRuntime.launch()` rejects plain Python ints (an AssertionError in its type check):
  `ApplianceRuntime.launch` passes numpy uint32 scalars.

One SDK line per target (`check_sdk_line`): the kernels are written for the SDK 1.4 line
(`wafer_gpt2.host.compile.KERNELS_SDK`), and cerebras-sdk 2.10.0 is a client of the 2.x line, whose compiler
removed `comptime_struct` and `@concat_structs`; a cluster of that line cannot compile them, so the
backend refuses a client whose line is not the kernels'. The loopback worker (`tools.appliance_server`)
is the exception: it compiles no CSL (it checks the upload is these kernels and runs the plan on the
embedded simulator), so it serves a client of any line, and says so when asked
(`LOOPBACK_SERVICE`); nothing else answers that call.

    python -m wafer_gpt2.backends.sdk_appliance check --address 127.0.0.1:PORT   # the host flow against a worker

Unverified against a real cluster; verified against the loopback worker (tests/test_appliance_loopback.py).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import sys
import tempfile
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from wafer_gpt2.core.runtime import MemcpyDataType, MemcpyOrder
from wafer_gpt2.errors import WaferGPT2Error

if TYPE_CHECKING:
    from wafer_gpt2.host.compile import CompileJob

CLIENT_PACKAGE = "cerebras-sdk"
# A gRPC method only the loopback worker serves: its answer says that it compiles no CSL.
LOOPBACK_SERVICE = "wafer_gpt2.loopback"
LOOPBACK_METHOD = f"/{LOOPBACK_SERVICE}/identity"
LOOPBACK_IDENTITY = b"tools.appliance_server: embedded simulator, compiles no CSL"


class ApplianceUnavailableError(WaferGPT2Error, RuntimeError):
    """cerebras-sdk is not installed in this environment."""


class SdkLineMismatchError(WaferGPT2Error, RuntimeError):
    """The appliance client is of another SDK line than the kernels."""


def client_version() -> str:
    """The installed cerebras-sdk's version (2.10.0 reports "2.10.0")."""
    try:
        return importlib.metadata.version(CLIENT_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        import_client()  # says what to install
        raise


def sdk_line(version: str) -> str:
    """The SDK line of a release: its major version ("2.10.0" -> "2", "1.4" -> "1")."""
    return version.split(".", 1)[0]


@cache
def is_loopback_worker(address: str) -> bool:
    """Whether the worker at `address` is `tools.appliance_server` (it answers LOOPBACK_METHOD; a
    Cerebras worker does not know the method)."""
    import grpc

    with grpc.insecure_channel(address) as channel:
        call = channel.unary_unary(LOOPBACK_METHOD)
        try:
            return call(b"", timeout=30) == LOOPBACK_IDENTITY
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                return False
            raise ApplianceUnavailableError(
                f"the SDK worker at {address} did not answer: {exc.code().name} {exc.details()}"
            ) from None


def check_sdk_line(client_options: dict[str, Any], version: str | None = None) -> None:
    """Refuse a client whose SDK line is not the kernels' (`version`: the client's, by default the
    installed cerebras-sdk's), unless its worker is the loopback worker (`grpc_address`), which
    compiles no CSL and so serves any line."""
    from wafer_gpt2.host.compile import KERNELS_SDK

    version = client_version() if version is None else version
    if sdk_line(version) == sdk_line(KERNELS_SDK):
        return
    address = client_options.get("grpc_address")
    if address is not None and is_loopback_worker(address):
        return
    raise SdkLineMismatchError(
        f"backend sdk-appliance: the kernels are written for the Cerebras SDK {KERNELS_SDK} line "
        f"(csl-examples rel-sdk-{KERNELS_SDK}.0: comptime_struct params, @concat_structs in layout.csl), and "
        f"this client is {CLIENT_PACKAGE} {version}, of the {sdk_line(version)}.x line, whose compiler "
        f"removed both: a cluster of that line cannot compile them. Keep kernels and client on one line: "
        f"a {CLIENT_PACKAGE} {sdk_line(KERNELS_SDK)}.x client with its cluster, or the SDK {KERNELS_SDK} "
        f"container (--backend sdk-container); docs/kernels.md, 'One SDK line per target'"
    )


def import_client() -> tuple[Any, Any, Any]:
    try:
        from cerebras.appliance.pb.sdk import sdk_common_pb2
        from cerebras.sdk.client import sdk_appliance_client
    except ImportError as exc:
        raise ApplianceUnavailableError(
            "backend sdk-appliance needs PyPI cerebras-sdk (Python 3.11, numpy 1.25) in its own environment: "
            "`make appliance-venv`, then run with .venv-appliance/bin/python and the repository on PYTHONPATH "
            "(docs/kernels.md, 'Appliance')"
        ) from exc
    return sdk_appliance_client, sdk_common_pb2.MemcpyDataType, sdk_common_pb2.MemcpyOrder


@cache
def _classes() -> tuple[type, type]:
    """(SdkRuntime, SdkCompiler) that connect to a `grpc_address` directly when one is given."""
    client: Any = import_client()[0]  # a module of the appliance venv: its classes are known at run time

    class _DirectContext(client.SdkContext):
        """The appliance context for a known worker address: no cluster management round trip."""

        def __enter__(self):
            self._created_from_with = True
            self._init_appliance_stub()
            return self

        def __exit__(self, exc_type, exc_value, exc_tb):
            self._channel.close()
            self._created_from_with = False

    class _DirectClient(client.SdkClient):
        """SdkClient's context handling, through `_DirectContext` when `grpc_address` is set."""

        def __enter__(self):
            if self._options.get("grpc_address") is None:
                return super().__enter__()
            self._created_from_with = True
            self._context = _DirectContext(self.sdk_mode, **self._options).__enter__()
            self._stub = self._context.stub()
            self._stack = None
            return self

        def __exit__(self, exc_type, exc_value, exc_tb):
            if self._options.get("grpc_address") is None:
                return super().__exit__(exc_type, exc_value, exc_tb)
            self._context.__exit__(exc_type, exc_value, exc_tb)
            self._created_from_with = False
            return None

    class DirectSdkRuntime(client.SdkRuntime, _DirectClient):
        pass

    class DirectSdkCompiler(client.SdkCompiler, _DirectClient):
        pass

    return DirectSdkRuntime, DirectSdkCompiler


def compiler() -> type:
    """`cerebras.sdk.client.SdkCompiler`, accepting `grpc_address=` (see the module docstring)."""
    return _classes()[1]


class ApplianceRuntime:
    """Our runtime contract on the appliance client (same argument conventions as the SDK)."""

    backend = "sdk-appliance"  # what `WaferGPT2.describe` reports
    # memcpy runs one command at a time, as on every target that runs the wafer program: the host sends a
    # replica at most the records its io.out holds before it reads them (wafer_gpt2.host.program).
    serial_memcpy = True
    running = False  # set by run() and stop()

    def __init__(self, artifact_path: str | Path, simulator: bool = False, **client_options: Any) -> None:
        _, self._data_types, self._orders = import_client()
        check_sdk_line(client_options)
        self._runtime = _classes()[0](str(artifact_path), simulator=simulator, **client_options)
        self.running = False

    def load(self) -> None:
        self._runtime.__enter__()  # uploads the artifact, creates the runtime on the worker, starts it

    def run(self) -> None:
        """The worker starts the program when it loads it."""
        self.running = True

    def stop(self) -> None:
        if self.running:
            self._runtime.__exit__(None, None, None)  # waits for pending tasks, stops, disconnects
            self.running = False

    def get_id(self, symbol: str) -> int:
        return self._runtime.get_id(symbol)

    def _kw(self, streaming, data_type: MemcpyDataType, order: MemcpyOrder, nonblock) -> dict:
        return {
            "streaming": streaming,
            "data_type": self._data_types.Value(data_type.name),
            "order": self._orders.Value(order.name),
            "nonblock": nonblock,
        }

    def memcpy_h2d(self, dest, src, px, py, w, h, elems_per_pe, *, streaming=False,
                   data_type=MemcpyDataType.MEMCPY_32BIT, order=MemcpyOrder.ROW_MAJOR, nonblock=False):  # fmt: skip
        src = np.ascontiguousarray(src).reshape(-1)
        return self._runtime.memcpy_h2d(dest, src, px, py, w, h, elems_per_pe,
                                        **self._kw(streaming, data_type, order, nonblock))  # fmt: skip

    def memcpy_d2h(self, dest, src, px, py, w, h, elems_per_pe, *, streaming=False,
                   data_type=MemcpyDataType.MEMCPY_32BIT, order=MemcpyOrder.ROW_MAJOR, nonblock=False):  # fmt: skip
        return self._runtime.memcpy_d2h(dest, src, px, py, w, h, elems_per_pe,
                                        **self._kw(streaming, data_type, order, nonblock))  # fmt: skip

    def launch(self, name: str, *args: Any, nonblock: bool = False):
        # 2.10.0 refuses plain ints: hand it numpy scalars of the types the program declares.
        from wafer_gpt2.core.abi import HOST_FUNCTIONS

        scalar = {"u16": np.uint16, "u32": np.uint32, "i16": np.int16, "i32": np.int32}
        declared = [scalar[t] for _, t in HOST_FUNCTIONS.get(name, ())]
        args = tuple(
            declared[i](a) if isinstance(a, int) and not isinstance(a, bool) and i < len(declared) else a
            for i, a in enumerate(args)
        )
        return self._runtime.launch(name, *args, nonblock=nonblock)

    def task_wait(self, task: Any) -> None:
        if task is not None:
            task.wait()

    def is_task_done(self, task: Any) -> bool:
        return task is None or task.done()


def build_backend(params, options, artifact_path: str | Path | None = None, work_dir: str | Path = "build/sdk-appliance",
                   **client_options: Any):  # fmt: skip
    """Plan, compile with SdkCompiler (unless an artifact is given), load, upload the weights.
    `client_options` go to the client, e.g. grpc_address="127.0.0.1:PORT" for the loopback worker
    (default: the WAFER_APPLIANCE_ADDRESS environment variable; unset: the cluster finds the worker)."""
    import_client()
    if "grpc_address" not in client_options and os.environ.get("WAFER_APPLIANCE_ADDRESS"):
        client_options = {
            "grpc_address": os.environ["WAFER_APPLIANCE_ADDRESS"],
            "simulator": True,
            **client_options,
        }
    check_sdk_line(client_options)  # before planning and compiling
    from wafer_gpt2.host.compile import prepare_sources
    from wafer_gpt2.host.program import plan_for, start_model

    plan = plan_for(params, options)
    if artifact_path is None:
        job = prepare_sources(plan, Path(work_dir) / "csl", simfabric=client_options.get("simulator", False))
        artifact_path = appliance_compile(job, Path(work_dir) / "artifact", **client_options)
    runtime = ApplianceRuntime(artifact_path, **client_options)
    return start_model(plan, runtime, params, steps_in_flight=options.steps_in_flight)


# ----------------------------------------------------------------------------------------------------
# `python -m wafer_gpt2.backends.sdk_appliance check`: the host flow against a worker, reported as JSON


def check(address: str, work_dir: str | Path) -> dict:
    """Compile a tiny GPT-2 through the worker, run the host program on it, and compare every step
    with the embedded simulator run here; also round-trip raw memcpy and launch a function."""
    from wafer_gpt2.core.runtime import from_wire, to_wire
    from wafer_gpt2.core.steps import StepInputs, StepItem
    from wafer_gpt2.host.program import BackendOptions, plan_for, start_model
    from wafer_gpt2.model.config import GPT2Config
    from wafer_gpt2.model.params import GPT2Params
    from wafer_gpt2.sim import SimRuntime

    config = GPT2Config(n_layer=2, n_head=2, n_embd=16, vocab_size=100, n_positions=32, name="tiny")
    params = GPT2Params.random(config, seed=3)
    options = BackendOptions(slots=2, context=32, dtype="fp16", top_k=8)
    report: dict[str, Any] = {"address": address}
    model = build_backend(params, options, work_dir=work_dir, simulator=True, grpc_address=address)
    local_plan = plan_for(params, options)
    local = start_model(local_plan, SimRuntime(local_plan), params)
    try:
        runtime, plan = model.runtime, model.plan
        # Raw memcpy: a pattern into one GEMV region's bias (fp16; proj has no LayerNorm folded in, so
        # its bias is `b`), read back blocking and non-blocking.
        region = plan.region("L1.proj")
        elems = region.symbols["b"].elems
        pattern = (np.arange(region.w * region.h * elems, dtype=np.float32) / 7).astype(np.float16)
        symbol = runtime.get_id("b")
        runtime.memcpy_h2d(symbol, to_wire(pattern), region.x, region.y, region.w, region.h, elems,
                           data_type=MemcpyDataType.MEMCPY_16BIT)  # fmt: skip
        back = np.zeros(pattern.size, dtype=np.uint32)
        runtime.memcpy_d2h(back, symbol, region.x, region.y, region.w, region.h, elems,
                           data_type=MemcpyDataType.MEMCPY_16BIT)  # fmt: skip
        later = np.zeros(pattern.size, dtype=np.uint32)
        task = runtime.memcpy_d2h(later, symbol, region.x, region.y, region.w, region.h, elems,
                                  data_type=MemcpyDataType.MEMCPY_16BIT, nonblock=True)  # fmt: skip
        runtime.task_wait(task)
        report["memcpy_round_trip"] = bool(np.array_equal(from_wire(back, np.float16), pattern))
        report["memcpy_nonblock_round_trip"] = bool(np.array_equal(from_wire(later, np.float16), pattern))
        model.upload(params)  # put the real bias back
        # The host flow: a prompt of 5 tokens in slot 0 and 3 in slot 1, then two decode steps.
        steps = [
            [StepItem(0, p, t) for p, t in enumerate([5, 17, 42, 8, 99])] + [StepItem(1, p, t) for p, t in enumerate([1, 2, 3])],
            [StepItem(0, 5, 11, target=7), StepItem(1, 3, 64)],
            [StepItem(0, 6, 12), StepItem(1, 4, 65, want_scores=False)],
        ]  # fmt: skip
        same, top = True, []
        for items in steps:
            inputs = StepInputs.of_items(items)
            got, want = model.step(inputs).rows(), local.step(inputs).rows()
            for g, w in zip(got, want, strict=True):
                if (g is None) != (w is None):
                    same = False
                elif g is not None and w is not None:
                    same &= bool(
                        np.array_equal(g.topk_ids, w.topk_ids)
                        and np.array_equal(g.topk_logits, w.topk_logits)
                    )
                    same &= g.logsumexp == w.logsumexp and g.target_logit == w.target_logit
            top.append([int(s.topk_ids[0]) for s in got if s is not None])
        report["steps_match_local_simulator"] = same
        report["top1"] = top
        # A launched function: clear slot 1 on the worker, then read its K cache back.
        model.free_slot(1)
        attn = plan.region("L0.attn")
        k_elems = attn.symbols["k_cache"].elems
        cache = np.zeros(attn.w * attn.h * k_elems, dtype=np.uint32)
        runtime.memcpy_d2h(cache, runtime.get_id("k_cache"), attn.x, attn.y, attn.w, attn.h, k_elems,
                           data_type=MemcpyDataType.MEMCPY_16BIT)  # fmt: skip
        per_slot = from_wire(cache, np.float16).reshape(attn.h, attn.w, plan.slots, -1)
        report["clear_slot_zeroed_slot_1"] = bool(not per_slot[:, :, 1].any() and per_slot[:, :, 0].any())
    finally:
        model.close()
        local.close()
    return report


def appliance_compile(job: CompileJob, artifact_dir: str | Path, **client_options) -> str:
    """Compile on a Wafer-Scale Cluster (or the loopback worker, `grpc_address=...`) with
    `cerebras.sdk.client.SdkCompiler` (PyPI cerebras-sdk); returns the artifact path to hand to the
    sdk-appliance backend."""
    from wafer_gpt2.host.compile import CompileError

    try:
        compiler_class = compiler()
        check_sdk_line(client_options)
    except (ApplianceUnavailableError, SdkLineMismatchError) as exc:
        raise CompileError(str(exc)) from None
    Path(artifact_dir).mkdir(parents=True, exist_ok=True)
    with compiler_class(**client_options) as sdk:
        return sdk.compile(str(job.src_dir), "layout.csl", " ".join(job.options), str(artifact_dir))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m wafer_gpt2.backends.sdk_appliance")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser(
        "check", help="run the host flow against an SDK worker and compare with the simulator"
    )
    run.add_argument("--address", required=True, help="the worker's gRPC address, HOST:PORT")
    run.add_argument("--work", help="directory for sources and artifacts (default: a temporary one)")
    args = parser.parse_args(argv)
    work = args.work or tempfile.mkdtemp(prefix="wafer-appliance-client-")
    print(json.dumps(check(args.address, work)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
