"""Compile the wafer program for a plan: the `cslc` command line, the executor, or the appliance's
`SdkCompiler` call.

`prepare_sources` copies the PE programs and their libraries (`wafer_gpt2/kernels/pe`, `wafer_gpt2/kernels/comm`,
`wafer_gpt2/kernels/lib`) into `OUT/src` and writes the plan's `layout.csl` beside them (`wafer_gpt2.codegen`);
`CompileJob.argv` is the command line that compiles it into `OUT/bin`. `compile_program` runs it:
with Cerebras `cslc` when it is on PATH (inside the Cerebras SDK container), or with the project's
CSL executor (`csl_executor`, `executor=True`), which checks the program as a compiler would and runs
it, but is not `cslc`. On a Wafer-Scale Cluster, `appliance_compile` hands the same sources and
options to `cerebras.sdk.client.SdkCompiler` (`wafer_gpt2.backends.sdk_appliance.appliance_compile`).
"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from wafer_gpt2.codegen import LAYOUT_HEADER, build_program, layout_csl, layout_params
from wafer_gpt2.codegen.build import Program
from wafer_gpt2.core.abi import EXPORTED_ARRAYS, HOST_FUNCTIONS
from wafer_gpt2.core.arch import Arch, resolve_arch
from wafer_gpt2.errors import InvalidInput, WaferGPT2Error

if TYPE_CHECKING:
    from wafer_gpt2.plan.structure import Plan

KERNEL_DIR = Path(__file__).resolve().parent.parent / "kernels"
# The Cerebras SDK release whose CSL the kernels are written in: that of csl-examples rel-sdk-1.4.0
# (`comptime_struct` params, `@concat_structs` in layout.csl, which the 2.x line removed). Compile and
# run them with a toolchain of the same line (docs/kernels.md, "One SDK line per target").
KERNELS_SDK = "1.4"
SOURCE_DIRS = ("pe", "comm", "lib")  # what a compile needs besides the generated layout.csl
# memcpy takes three columns west and two east of the kernel plus a one-PE halo: offsets 4,1 and a
# fabric at least 7 wider and 2 taller than the kernel (csl-notes.md, "Compile and run").
FABRIC_OFFSETS = (4, 1)
FABRIC_MARGIN = (7, 2)


class CompileError(WaferGPT2Error, RuntimeError):
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


def fabric_dims(program: Program, arch: Arch, simfabric: bool) -> tuple[int, int]:
    """The whole wafer on hardware; the smallest fabric that holds the kernel on the simulator."""
    if program.width > arch.kernel_w or program.height > arch.kernel_h:
        raise CompileError(
            f"the program needs a {program.width}x{program.height} kernel; {arch.name} allows at most "
            f"{arch.kernel_w}x{arch.kernel_h}"
        )
    if simfabric:
        return (program.width + FABRIC_MARGIN[0], program.height + FABRIC_MARGIN[1])
    return (arch.fabric_w, arch.fabric_h)


def plan_request(plan: Plan) -> dict:
    """What `plan_from_request` needs to build the same plan again (build_plan is deterministic)."""
    c = plan.config
    return {
        "model": {"n_layer": c.n_layer, "n_head": c.n_head, "n_embd": c.n_embd, "vocab_size": c.vocab_size,
                  "n_positions": c.n_positions, "layer_norm_epsilon": c.layer_norm_epsilon, "name": c.name},
        "arch": plan.arch.name, "dtype": plan.dtype, "slots": plan.slots, "context": plan.context,
        "objective": plan.objective, "replicas": plan.replicas, "top_k": plan.top_k,
    }  # fmt: skip


def write_sources(src_dir: Path, layout: str) -> None:
    """OUT/src: the kernel library as it is in the repository, and the generated layout.csl."""
    src_dir.mkdir(parents=True, exist_ok=True)
    for name in SOURCE_DIRS:
        shutil.rmtree(src_dir / name, ignore_errors=True)
        shutil.copytree(KERNEL_DIR / name, src_dir / name)
    (src_dir / "layout.csl").write_text(layout)


def prepare_sources(plan: Plan, out_dir: str | Path, simfabric: bool = False, channels: int = 1, write: bool = True,
                    program: Program | None = None) -> CompileJob:  # fmt: skip
    """Lay out OUT/src (the PE programs + the plan's layout.csl) and describe the compile of `plan`
    (its architecture, dtype and top-k). `program` saves rebuilding it when the caller has it."""
    if not 1 <= channels <= 16:
        raise InvalidInput(
            f"--channels must be 1..16 (the memcpy I/O channels a program may ask for), got {channels}"
        )
    program = program or build_program(plan)
    out_dir = Path(out_dir)
    job = CompileJob(
        arch=plan.arch.name,
        src_dir=out_dir / "src",
        bin_dir=out_dir / "bin",
        fabric_dims=fabric_dims(program, plan.arch, simfabric),
        params=layout_params(),
        channels=channels,
    )
    if write:
        write_sources(job.src_dir, layout_csl(program, plan_request(plan)))
        (out_dir / "compile.json").write_text(
            json.dumps({"argv": job.argv, "params": job.params, "fabric_dims": job.fabric_dims}, indent=2)
            + "\n"
        )
    return job


def compile_program(
    job: CompileJob, dry_run: bool = False, executor: bool = False
) -> subprocess.CompletedProcess | None:
    """Run cslc (None for a dry run), or with `executor` compile on the project's CSL executor.
    Raises CompileError when cslc is absent or either refuses the program."""
    if dry_run:
        return None
    if executor:
        from csl_executor.errors import CslError
        from csl_executor.layout import Options, compile_layout
        from csl_executor.sdk import write_output

        options = Options(arch=job.arch, fabric_dims=job.fabric_dims, fabric_offsets=FABRIC_OFFSETS,
                          params=dict(job.params), memcpy=True, channels=job.channels)  # fmt: skip
        try:
            write_output(compile_layout(str(job.src_dir / "layout.csl"), options), job.bin_dir)
        except CslError as exc:
            raise CompileError(f"the CSL executor refused the program: {exc}") from None
        return None
    if shutil.which("cslc") is None:
        raise CompileError(
            "cslc is not on PATH: run inside the Cerebras SDK container (docker/Dockerfile.sdk), use "
            "--executor to compile with the project's CSL executor, or --dry-run to print the command"
        )
    result = subprocess.run(job.argv, capture_output=True, text=True)
    if result.returncode != 0:
        raise CompileError(f"cslc failed ({result.returncode}):\n{result.stdout}{result.stderr}")
    return result


# ----------------------------------------------------------------------------------------------------
# Without cslc: the plan a program was built for, and the check the loopback appliance compiles with


def plan_from_request(request: dict):
    """The plan `plan_request` describes (build_plan is deterministic)."""
    from wafer_gpt2.model.config import GPT2Config
    from wafer_gpt2.plan import build_plan

    try:
        config = GPT2Config(**request["model"])
        return build_plan(config, arch=request["arch"], dtype=request["dtype"], slots=request["slots"],
                          context=request["context"], objective=request["objective"], replicas=request["replicas"],
                          top_k=request["top_k"])  # fmt: skip
    except (KeyError, TypeError) as exc:
        raise InvalidInput(f"a plan request needs model, arch, dtype, slots, context, objective, replicas and "
                         f"top_k: {exc}") from None  # fmt: skip


def exported_names() -> list[str]:
    """Every name the generated layout.csl exports (wafer_gpt2/codegen/layout_csl.py)."""
    return sorted([*EXPORTED_ARRAYS, *HOST_FUNCTIONS])


def rpc_symbols() -> list[dict]:
    """out_rpc.json's `rpc_symbols`: every name layout.csl exports (functions with their arguments)."""
    symbols: list[dict] = []
    for index, name in enumerate(exported_names()):
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
    repository's kernel library plus the layout.csl wafer_gpt2/codegen/ writes for the plan its header
    names, compiled with the options `prepare_sources` gives; returns the artifact's files, which
    run on the simulator. Raises ValueError naming the first difference."""
    src_dir = Path(src_dir)
    for name in SOURCE_DIRS:
        for kernel in sorted((KERNEL_DIR / name).glob("*.csl")):
            uploaded = src_dir / name / kernel.name
            if not uploaded.is_file():
                raise InvalidInput(f"the upload has no {name}/{kernel.name}")
            if uploaded.read_bytes() != kernel.read_bytes():
                raise InvalidInput(
                    f"{name}/{kernel.name} differs from this repository's kernels/{name}/{kernel.name}"
                )
    layout = (src_dir / "layout.csl").read_text() if (src_dir / "layout.csl").is_file() else ""
    header = next((line for line in layout.splitlines() if line.startswith(LAYOUT_HEADER)), None)
    if header is None:
        raise InvalidInput(
            "the upload has no layout.csl written by wafer_gpt2/host/compile.py (no plan request in it)"
        )
    request = json.loads(header[len(LAYOUT_HEADER) :])
    plan = plan_from_request(request)
    program = build_program(plan)
    if layout_csl(program, plan_request(plan)) != layout:
        raise InvalidInput("layout.csl is not what wafer_gpt2/codegen/ writes for the plan it names")
    if not options or options[0] != "layout.csl":
        raise InvalidInput(f"the main file must be layout.csl, got {options[:1]}")
    arch = resolve_arch(request["arch"])
    wanted = {tuple(CompileJob(arch.name, src_dir, src_dir, fabric_dims(program, arch, sim), layout_params(),
              1).options[:4]) for sim in (False, True)}  # fmt: skip
    given = tuple(o for o in options[1:] if not o.startswith("--channels"))[:4]
    if given not in wanted or "--memcpy" not in options:
        raise InvalidInput(
            f"cslc options {' '.join(options[1:])} are not the ones wafer_gpt2/host/compile.py gives this plan"
        )
    return {
        ".csl_bin_name": "out\n",
        "out/bin/out_rpc.json": json.dumps({"rpc_symbols": rpc_symbols()}, indent=1) + "\n",
        "out/bin/plan.json": json.dumps(request, indent=1, sort_keys=True) + "\n",
    }
