"""Compile the wafer program for a plan: the `cslc` command line, or the appliance's `SdkCompiler` call.

`prepare_sources` copies the kernel library (`kernels/*.csl`) into `OUT/src` and writes the plan's
tables next to it (`plan_params.csl`, from `kernels.program`); `CompileJob.argv` is the command line
that compiles `OUT/src/layout.csl` into `OUT/bin`; `compile_program` runs it when `cslc` is on PATH
(inside the Cerebras SDK container). On a Wafer-Scale Cluster, `appliance_compile` hands the same
sources and options to `cerebras.sdk.client.SdkCompiler`.

The CSL is unverified until a real `cslc` compiles it (docs/kernels.md).
"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from kernels import csl_contract
from kernels.program import (
    MEMCPY_D2H,
    MEMCPY_H2D,
    Program,
    build_program,
    plan_params_csl,
)
from wafer.arch import Arch, resolve_arch

KERNEL_DIR = Path(__file__).resolve().parent.parent / "kernels"
# The host-callable functions every PE program exports (layout.csl's @export_name of type fn):
# name -> (argument name, type) in order, as cslc lists them in out_rpc.json.
HOST_FUNCTIONS = {
    "clear_slot": (("replica_id", "u16"), ("slot_id", "u16")),
    "reset_cycles": (),
}
PLAN_REQUEST_PREFIX = "// plan request: "
# memcpy takes three columns west and two east of the kernel plus a one-PE halo: offsets 4,1 and a
# fabric at least 7 wider and 2 taller than the kernel (csl-notes.md, "Compile and run").
FABRIC_OFFSETS = (4, 1)
FABRIC_MARGIN = (7, 2)


class CompileError(RuntimeError):
    """cslc (or the appliance compiler) refused the program, or is not available."""


@dataclass(frozen=True)
class CompileJob:
    arch: str
    src_dir: Path
    bin_dir: Path
    fabric_dims: tuple[int, int]
    params: dict[str, int]
    channels: int

    @property
    def options(self) -> list[str]:
        """Everything after the main file: what cslc and `SdkCompiler.compile` both take."""
        params = ",".join(f"{k}:{v}" for k, v in self.params.items())
        return [
            f"--arch={self.arch}",
            f"--fabric-dims={self.fabric_dims[0]},{self.fabric_dims[1]}",
            f"--fabric-offsets={FABRIC_OFFSETS[0]},{FABRIC_OFFSETS[1]}",
            f"--params={params}",
            "--memcpy",
            f"--channels={self.channels}",
        ]

    @property
    def argv(self) -> list[str]:
        return ["cslc", str(self.src_dir / "layout.csl"), *self.options, "-o", str(self.bin_dir)]

    def shell(self) -> str:
        return shlex.join(self.argv)


def layout_params(program: Program, dtype: str) -> dict[str, int]:
    """The `param`s layout.csl declares, in its order."""
    if dtype not in ("fp16", "fp32"):
        raise ValueError(f"dtype must be fp16 or fp32, got {dtype!r}")
    return {
        "kernel_w": program.kernel_w,
        "kernel_h": program.kernel_h,
        "MEMCPYH2D_DATA_1_ID": MEMCPY_H2D,
        "MEMCPYD2H_DATA_1_ID": MEMCPY_D2H,
        "use_fp16": int(dtype == "fp16"),
    }


def fabric_dims(program: Program, arch: Arch, simfabric: bool) -> tuple[int, int]:
    """The whole wafer on hardware; the smallest fabric that holds the kernel on the simulator."""
    if program.kernel_w > arch.kernel_w or program.kernel_h > arch.kernel_h:
        raise CompileError(
            f"the program needs a {program.kernel_w}x{program.kernel_h} kernel; {arch.name} allows at most "
            f"{arch.kernel_w}x{arch.kernel_h}"
        )
    if simfabric:
        return (program.kernel_w + FABRIC_MARGIN[0], program.kernel_h + FABRIC_MARGIN[1])
    return (arch.fabric_w, arch.fabric_h)


def prepare_sources(plan, out_dir: str | Path, simfabric: bool = False, channels: int = 1, write: bool = True,
                    program: Program | None = None) -> CompileJob:  # fmt: skip
    """Lay out OUT/src (kernel sources + plan_params.csl) and describe the compile of `plan`
    (its architecture, dtype and top-k). `program` saves rebuilding it when the caller has it."""
    if not 1 <= channels <= 16:
        raise ValueError(
            f"--channels must be 1..16 (the memcpy I/O channels a program may ask for), got {channels}"
        )
    program = program or build_program(plan)
    if plan.arch.name == "wse3":
        # every reduction receives through one re-bound queue (reduce.csl), so this depends on the
        # kernels' sources, not on the plan's tree depth
        problems = csl_contract.wse3_queue_problems()
        if problems:
            raise CompileError("the kernels do not fit WSE-3's input queues:\n  " + "\n  ".join(problems))
    out_dir = Path(out_dir)
    job = CompileJob(
        arch=plan.arch.name,
        src_dir=out_dir / "src",
        bin_dir=out_dir / "bin",
        fabric_dims=fabric_dims(program, plan.arch, simfabric),
        params=layout_params(program, plan.dtype),
        channels=channels,
    )
    if write:
        job.src_dir.mkdir(parents=True, exist_ok=True)
        for source in sorted(KERNEL_DIR.glob("*.csl")):
            shutil.copyfile(source, job.src_dir / source.name)
        (job.src_dir / "plan_params.csl").write_text(plan_params_csl(program))
        (out_dir / "compile.json").write_text(
            json.dumps({"argv": job.argv, "params": job.params, "fabric_dims": job.fabric_dims}, indent=2)
            + "\n"
        )
    return job


def compile_program(job: CompileJob, dry_run: bool = False) -> subprocess.CompletedProcess | None:
    """Run cslc (None for a dry run). Raises CompileError when cslc is absent or fails."""
    if dry_run:
        return None
    if shutil.which("cslc") is None:
        raise CompileError(
            "cslc is not on PATH: run inside the Cerebras SDK container (docker/Dockerfile.sdk), or use "
            "--dry-run to print the command"
        )
    result = subprocess.run(job.argv, capture_output=True, text=True)
    if result.returncode != 0:
        raise CompileError(f"cslc failed ({result.returncode}):\n{result.stdout}{result.stderr}")
    return result


def appliance_compile(job: CompileJob, artifact_dir: str | Path, **client_options) -> str:
    """Compile on a Wafer-Scale Cluster (or the loopback worker, `grpc_address=...`) with
    `cerebras.sdk.client.SdkCompiler` (PyPI cerebras-sdk); returns the artifact path to hand to the
    sdk-appliance backend."""
    from wafer.sdk_appliance import ApplianceUnavailableError, compiler

    try:
        compiler_class = compiler()
    except ApplianceUnavailableError as exc:
        raise CompileError(str(exc)) from None
    Path(artifact_dir).mkdir(parents=True, exist_ok=True)
    with compiler_class(**client_options) as sdk:
        return sdk.compile(str(job.src_dir), "layout.csl", " ".join(job.options), str(artifact_dir))


# ----------------------------------------------------------------------------------------------------
# Without cslc: the plan a program was built for, and the check the loopback appliance compiles with


def plan_from_request(request: dict):
    """The plan `kernels.program.plan_request` describes (build_plan is deterministic)."""
    from wafer.plan import build_plan
    from weights.config import GPT2Config

    try:
        config = GPT2Config(**request["model"])
        return build_plan(config, arch=request["arch"], dtype=request["dtype"], slots=request["slots"],
                          context=request["context"], objective=request["objective"], replicas=request["replicas"],
                          top_k=request["top_k"])  # fmt: skip
    except (KeyError, TypeError) as exc:
        raise ValueError(f"a plan request needs model, arch, dtype, slots, context, objective, replicas and "
                         f"top_k: {exc}") from None  # fmt: skip


def rpc_symbols() -> list[dict]:
    """out_rpc.json's `rpc_symbols`: every name layout.csl exports (functions with their arguments)."""
    symbols: list[dict] = []
    for index, name in enumerate(sorted(csl_contract.exported_names("layout.csl"))):
        if name in HOST_FUNCTIONS:
            entry = {"id": index, "kind": "Func", "name": name, "sym_name": name, "type": "void"}
            if HOST_FUNCTIONS[name]:
                entry["inputs"] = [{"name": a, "type": t} for a, t in HOST_FUNCTIONS[name]]
        else:
            entry = {
                "id": index,
                "immutable": 0,
                "kind": "Var",
                "name": name,
                "sym_name": name,
                "type": "[*]u32",
            }
        symbols.append(entry)
    return symbols


def check_compile_request(src_dir: str | Path, options: list[str]) -> dict[str, str]:
    """What the loopback appliance does instead of cslc: the uploaded sources must be this
    repository's kernels plus the plan_params.csl kernels/program/ writes for the plan its header
    names, compiled with the options `prepare_sources` gives; returns the artifact's files, which
    run on the simulator. Raises ValueError naming the first difference."""
    src_dir = Path(src_dir)
    for kernel in sorted(KERNEL_DIR.glob("*.csl")):
        uploaded = src_dir / kernel.name
        if not uploaded.is_file():
            raise ValueError(f"the upload has no {kernel.name}")
        if uploaded.read_bytes() != kernel.read_bytes():
            raise ValueError(f"{kernel.name} differs from this repository's kernels/{kernel.name}")
    tables = (src_dir / "plan_params.csl").read_text() if (src_dir / "plan_params.csl").is_file() else ""
    header = next((line for line in tables.splitlines() if line.startswith(PLAN_REQUEST_PREFIX)), None)
    if header is None:
        raise ValueError(
            "the upload has no plan_params.csl written by wafer/compile.py (no plan request in it)"
        )
    request = json.loads(header[len(PLAN_REQUEST_PREFIX) :])
    plan = plan_from_request(request)
    program = build_program(plan)
    if plan_params_csl(program) != tables:
        raise ValueError("plan_params.csl is not what kernels/program/ writes for the plan it names")
    if not options or options[0] != "layout.csl":
        raise ValueError(f"the main file must be layout.csl, got {options[:1]}")
    arch = resolve_arch(request["arch"])
    wanted = {tuple(CompileJob(arch.name, src_dir, src_dir, fabric_dims(program, arch, sim), layout_params(program,
              plan.dtype), 1).options[:4]) for sim in (False, True)}  # fmt: skip
    given = tuple(o for o in options[1:] if not o.startswith("--channels"))[:4]
    if given not in wanted or "--memcpy" not in options:
        raise ValueError(
            f"cslc options {' '.join(options[1:])} are not the ones wafer/compile.py gives this plan"
        )
    return {
        ".csl_bin_name": "out\n",
        "out/bin/out_rpc.json": json.dumps({"rpc_symbols": rpc_symbols()}, indent=1) + "\n",
        "out/bin/plan.json": json.dumps(request, indent=1, sort_keys=True) + "\n",
    }
