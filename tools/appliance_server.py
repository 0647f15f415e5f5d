"""A local server for the Cerebras SDK appliance protocol, executing on the embedded simulator.

The real `cerebras.sdk.client` (PyPI `cerebras-sdk`) talks gRPC to an SDK worker of a Wafer-Scale
Cluster: it uploads artifacts, compiles, creates a runtime for a compiled program, and streams memcpy
and RPC commands. This server implements that service (`sdk_appliance` from the protobufs shipped in
`cerebras-appliance`) on 127.0.0.1, with `wafer_gpt2.sim.SimRuntime` in place of the wafer, so the whole
client flow (`wafer_gpt2.backends.sdk_appliance`) runs unmodified here and in CI:

    .venv-appliance/bin/python -m tools.appliance_server --port 0 --root /tmp/appliance
    -> prints "listening on 127.0.0.1:PORT"

It runs in the appliance environment (`make appliance-venv`: Python 3.11, cerebras-sdk and
cerebras-appliance 2.10.0, numpy 1.25) with the repository on PYTHONPATH.

What it does with each call:
- sdk_upload_files: stores the files under ROOT/<compile hash>/; a .tar.gz is unpacked into ROOT.
- sdk_compile: "compiles" the uploaded CSL: the sources must be this repository's kernels and the
  uploaded layout.csl must be exactly what wafer_gpt2/codegen/ writes for the plan its header
  names, with the cslc options wafer_gpt2/host/compile.py would pass. No CSL is compiled: the artifact it
  writes (`.csl_bin_name`, `out/bin/out_rpc.json`, `out/bin/plan.json`) runs on the simulator.
- sdk_runtime_create / start / stop: a SimRuntime for the artifact's plan.
- get_id, memcpy_h2d (streamed in), memcpy_d2h (streamed out), call (RPC launch): forwarded to the
  SimRuntime in issue order; results of non-blocking memcpy_d2h wait for task_wait / is_task_done.
- sdk_download_files: files, or directories as a .tar.gz, in chunks.
- wafer_gpt2.loopback/identity (not part of the SDK's service): says that this worker compiles no
  CSL, so the client accepts it whatever its SDK line (wafer_gpt2.backends.sdk_appliance.check_sdk_line).
Errors from the simulator (misuse of the runtime contract) come back as SdkResponse messages, which
the client raises with that text.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tarfile
import tempfile
import threading
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from cerebras.appliance.pb.sdk import sdk_appliance_pb2 as pb
from cerebras.appliance.pb.sdk import sdk_common_pb2 as common
from cerebras.appliance.pb.sdk.sdk_appliance_pb2_grpc import (
    add_sdk_applianceServicer_to_server,
    sdk_applianceServicer,
)

from wafer_gpt2.backends.sdk_appliance import LOOPBACK_IDENTITY, LOOPBACK_SERVICE
from wafer_gpt2.core.runtime import MemcpyDataType, MemcpyOrder, WaferRuntimeError
from wafer_gpt2.errors import InvalidInput

CHUNK_BYTES = 1 << 22  # download / d2h stream pieces (the client accepts any size below 2 GB)
BIN_NAME = "out"  # the compiled program's directory inside an artifact, as cslc's `-o out`
OK = common.StatusCode.SDK_RT_SUCCESS
UPLOADS = ".uploads"  # uploaded artifact tarballs, kept apart from what they unpack to


def _response(code: int = OK, message: str = "") -> pb.SdkResponse:
    return pb.SdkResponse(code=code, message=message)


class ApplianceServicer(sdk_applianceServicer):
    """One SDK worker: one runtime at a time, commands executed in the order they arrive."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.runtime: Any = None
        self.plan: Any = None
        self.results: dict[int, np.ndarray] = {}  # op_index -> words of a non-blocking memcpy_d2h
        self.lock = threading.Lock()

    # -- files ---------------------------------------------------------------------------------------

    def _path(self, name: str) -> Path:
        path = (self.root / name).resolve()
        if self.root.resolve() not in path.parents and path != self.root.resolve():
            raise InvalidInput(f"{name!r} lies outside the worker's directory")
        return path

    def sdk_upload_files(self, request_iterator, context):
        files: dict[Path, bytearray] = {}
        compile_hash, mode = "", ""
        try:
            for chunk in request_iterator:
                compile_hash, mode = chunk.compile_hash, chunk.mode
                base = chunk.destination_rel_path or chunk.compile_hash
                if chunk.file_name.endswith(".tar.gz"):  # an artifact: unpacked into the worker's directory
                    target = self._path(f"{UPLOADS}/{base}/{chunk.file_name}")
                else:
                    target = self._path(f"{base}/{chunk.file_name}")
                files.setdefault(target, bytearray()).extend(chunk.data_chunk)
            for target, data in files.items():
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(bytes(data))
                if target.name.endswith(".tar.gz"):
                    with tarfile.open(target) as tar:
                        tar.extractall(self.root, filter="data")
        except (OSError, EOFError, ValueError, tarfile.TarError) as exc:
            return _response(common.StatusCode.SDK_RT_FILE_ERROR, f"upload failed: {exc}")
        if mode == "SDK_COMPILE" and (self._path(compile_hash) / ".csl_bin_name").is_file():
            return _response(common.StatusCode.SDK_RT_ALREADY_COMPILED, "found in the compile cache")
        return _response()

    def sdk_download_files(self, request, context):
        try:
            path = self._path(request.file_name)
        except ValueError as exc:
            yield pb.SdkArtifactResponse(status=_response(common.StatusCode.SDK_RT_FILE_ERROR, str(exc)))
            return
        if not path.exists():
            yield pb.SdkArtifactResponse(
                status=_response(common.StatusCode.SDK_RT_FILE_ERROR, f"no artifact {request.file_name!r}")
            )
            return
        name = path.name
        if path.is_dir():
            with tempfile.TemporaryDirectory() as tmp:
                tarball = Path(tmp) / f"{path.name}.tar.gz"
                with tarfile.open(tarball, "w:gz") as tar:
                    tar.add(path, arcname=path.name)
                data = tarball.read_bytes()
            name = f"{path.name}.tar.gz"
        else:
            data = path.read_bytes()
        for start in range(0, max(len(data), 1), CHUNK_BYTES):
            piece = data[start : start + CHUNK_BYTES]
            yield pb.SdkArtifactResponse(
                data=pb.SdkArtifactResponse.SdkArtifactData(
                    file_name=name, data_chunk=piece, num_bytes=len(piece), total_bytes=len(data)
                )
            )

    # -- compile -------------------------------------------------------------------------------------

    def sdk_compile(self, request, context):
        from wafer_gpt2.host.compile import check_compile_request

        src = self._path(request.compile_hash)
        try:
            artifact = check_compile_request(src, request.options)
        except (ValueError, OSError) as exc:
            return _response(common.StatusCode.SDK_RT_COMPILE_ERROR, str(exc))
        write_artifact(src, artifact)
        return _response()

    # -- runtime -------------------------------------------------------------------------------------

    def sdk_runtime_create(self, request, context):
        from wafer_gpt2.host.compile import plan_from_request
        from wafer_gpt2.sim import SimRuntime

        app = self._path(request.app_hash)
        try:
            bin_name = (app / ".csl_bin_name").read_text().strip()
            plan_request = json.loads((app / bin_name / "bin" / "plan.json").read_text())
            plan = plan_from_request(plan_request)
            runtime = SimRuntime(plan)
        except (OSError, ValueError) as exc:
            return _response(common.StatusCode.SDK_RT_FILE_ERROR, f"artifact {request.app_hash!r}: {exc}")
        with self.lock:
            if self.runtime is not None:
                self.runtime.stop()
            self.plan, self.runtime, self.results = plan, runtime, {}
        return _response()

    def _run(self, what: str, command) -> pb.SdkResponse:
        if self.runtime is None:
            return _response(
                common.StatusCode.SDK_RT_UNKNOWN, f"{what}: no runtime: call sdk_runtime_create first"
            )
        try:
            with self.lock:
                command()
        except (WaferRuntimeError, ValueError, TypeError) as exc:
            return _response(common.StatusCode.SDK_RT_UNKNOWN, str(exc))
        return _response()

    def sdk_runtime_start(self, request, context):
        return self._run("start", lambda: (self.runtime.load(), self.runtime.run()))

    def sdk_runtime_stop(self, request, context):
        return self._run("stop", lambda: self.runtime.stop())

    def sdk_runtime_get_id(self, request, context):
        if self.runtime is None:
            return pb.SdkGetIdResponse(
                status=_response(common.StatusCode.SDK_RT_UNKNOWN, "get_id: no runtime")
            )
        try:
            return pb.SdkGetIdResponse(status=_response(), id=self.runtime.get_id(request.symbol))
        except WaferRuntimeError as exc:
            return pb.SdkGetIdResponse(status=_response(common.StatusCode.SDK_RT_UNKNOWN, str(exc)))

    @staticmethod
    def _options(options) -> dict:
        return {
            "streaming": options.streaming,
            "data_type": MemcpyDataType.MEMCPY_16BIT
            if options.data_type == common.MEMCPY_16BIT
            else MemcpyDataType.MEMCPY_32BIT,
            "order": MemcpyOrder.COL_MAJOR if options.order == common.COL_MAJOR else MemcpyOrder.ROW_MAJOR,
        }

    def sdk_runtime_memcpy_h2d(self, request_iterator, context):
        first, data = None, bytearray()
        for chunk in request_iterator:
            first = first or chunk
            data.extend(chunk.src.data_chunk)
        if first is None:
            return _response(common.StatusCode.SDK_RT_UNKNOWN, "memcpy_h2d: an empty request stream")
        words = np.frombuffer(bytes(data), dtype=np.uint32)
        r = first
        return self._run("memcpy_h2d", lambda: self.runtime.memcpy_h2d(
            r.dest, words, r.x, r.y, r.w, r.h, r.elt_per_pe, **self._options(r.options), nonblock=False))  # fmt: skip

    def sdk_runtime_memcpy_d2h(self, request, context):
        r = request
        out = np.zeros(r.w * r.h * r.elt_per_pe, dtype=np.uint32)
        status = self._run("memcpy_d2h", lambda: self.runtime.memcpy_d2h(
            out, r.src, r.x, r.y, r.w, r.h, r.elt_per_pe, **self._options(r.options), nonblock=False))  # fmt: skip
        if status.code != OK:
            yield pb.SdkD2HResponse(status=status)
            return
        if r.options.nonblock:
            self.results[r.op_index] = out  # handed over by task_wait / is_task_done
            yield pb.SdkD2HResponse(status=status)
            return
        for piece in _pieces(out):
            yield pb.SdkD2HResponse(d2h_data=piece)

    def sdk_runtime_call(self, request, context):
        args = [np.uint32(p) for p in request.params]
        return self._run(f"launch({request.name!r})", lambda: self.runtime.launch(request.name, *args))

    def _task(self, request):
        # Every command ran to completion when it arrived (in issue order), so every task is done.
        out = self.results.pop(request.op_index, None)
        if out is None:
            yield pb.SdkTaskDoneResponse(
                info=pb.SdkTaskDoneResponse.SdkTaskInfo(state=pb.SdkTaskState(done=True))
            )
            return
        for piece in _pieces(out):
            yield pb.SdkTaskDoneResponse(info=pb.SdkTaskDoneResponse.SdkTaskInfo(d2h_data=piece))

    def sdk_runtime_task_wait(self, request, context):
        yield from self._task(request)

    def sdk_runtime_is_task_done(self, request, context):
        yield from self._task(request)

    def sdk_shutdown(self, request, context):
        with self.lock:
            if self.runtime is not None:
                self.runtime.stop()
            self.runtime = None
        return _response()

    def sdk_get_symbol_rect(self, request, context):
        yield pb.SdkD2HResponse(
            status=_response(
                common.StatusCode.SDK_RT_UNKNOWN, "sdk_get_symbol_rect: not served by the loopback worker"
            )
        )

    def sdk_run_command(self, request_iterator, context):
        commands = [shlex.quote(r.command) for r in request_iterator]
        return _response(common.StatusCode.SDK_COMMAND_ERROR,
                         f"the loopback worker runs no shell commands (asked for {', '.join(commands)})")  # fmt: skip


def _pieces(words: np.ndarray):
    data = words.tobytes()
    for start in range(0, max(len(data), 1), CHUNK_BYTES):
        piece = data[start : start + CHUNK_BYTES]
        yield pb.MemcpyData(data_chunk=piece, num_bytes=len(piece), total_bytes=len(data))


def write_artifact(directory: Path, files: dict[str, str]) -> None:
    """The compiled artifact's files (relative path -> text) under `directory`."""
    for relative, text in files.items():
        path = directory / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def serve(host: str = "127.0.0.1", port: int = 0, root: str | Path | None = None) -> tuple[grpc.Server, int]:
    """Start the worker; returns (server, the port it listens on)."""
    root = Path(root or tempfile.mkdtemp(prefix="wafer-appliance-"))
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=[
        ("grpc.max_send_message_length", 1 << 30), ("grpc.max_receive_message_length", 1 << 30)])  # fmt: skip
    add_sdk_applianceServicer_to_server(ApplianceServicer(root), server)
    # Tells the client that this worker compiles no CSL (wafer_gpt2.backends.sdk_appliance.check_sdk_line).
    identity = grpc.unary_unary_rpc_method_handler(lambda request, context: LOOPBACK_IDENTITY)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(LOOPBACK_SERVICE, {"identity": identity}),)
    )
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port}")
    server.start()
    return server, bound


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.appliance_server", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0: any free port (printed)")
    parser.add_argument("--root", help="the worker's directory for artifacts (default: a new temporary one)")
    args = parser.parse_args(argv)
    server, port = serve(args.host, args.port, args.root)
    print(f"listening on {args.host}:{port}", flush=True)
    try:
        server.wait_for_termination()
    except KeyboardInterrupt:
        server.stop(grace=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
