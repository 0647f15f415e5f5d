"""The `csl` backend: the CSL program `wafer-gpt2 compile` generates, run on the project's CSL executor.

The same host program (`wafer_gpt2.host.program.WaferGPT2`) drives it through the executor's `SdkRuntime`
stand-in, exactly as it drives the SDK's in the Cerebras container (`wafer_gpt2.backends.sdk_container`). The plan
defaults to the `compact` objective: the executor simulates every PE, so the fewest PEs run fastest.
This is the check that the CSL does what the simulator does; it is not a Cerebras compiler.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from wafer_gpt2.backends.sdk_container import SdkContainerRuntime

if TYPE_CHECKING:
    from wafer_gpt2.plan.structure import Plan

BUILD_DIR = Path("build/csl-executor")
PACKAGE_DIR = Path(__file__).resolve().parent.parent  # wafer_gpt2/
# Modules outside wafer_gpt2/codegen whose code shapes the generated program (reduction orders, the
# wire format, the merge's block and the top-k's bins, the arrays the layout exports).
GENERATOR_INPUTS = [PACKAGE_DIR / "core" / name for name in ("tiling.py", "wire.py", "cost.py", "abi.py")]


def runtime_module():
    """The executor's `cerebras.sdk.runtime.sdkruntimepybind` (csl_executor/shim)."""
    from csl_executor.shim.cerebras.sdk.runtime import sdkruntimepybind

    return sdkruntimepybind


def program_sources() -> list[Path]:
    """What a plan's program is made from besides the plan: the kernels, the generator and the modules it
    reads."""
    from wafer_gpt2.host.compile import KERNEL_DIR, SOURCE_DIRS

    kernels = [source for name in SOURCE_DIRS for source in sorted((KERNEL_DIR / name).glob("*.csl"))]
    return [*kernels, *sorted((PACKAGE_DIR / "codegen").glob("*.py")), *GENERATOR_INPUTS]


def compile_plan(plan: Plan, out_dir: str | Path | None = None) -> Path:
    """Generate and compile `plan`'s CSL on the executor; returns the output folder for SdkRuntime.
    The default folder is keyed by the plan itself (its regions and tilings: a plan changed after
    `build_plan`, as tests do, is another program) and the program's sources (the kernels, the
    generator and the modules it reads), so a rebuild happens only when either changed; a folder
    given by the caller is always rebuilt."""
    from wafer_gpt2.host.compile import compile_program, plan_request, prepare_sources

    if out_dir is not None:
        job = prepare_sources(plan, out_dir, simfabric=True)
        compile_program(job, executor=True)
        return job.bin_dir
    layout = {k: v for k, v in plan.to_json().items() if k != "summary"}
    digest = hashlib.sha256(json.dumps([plan_request(plan), layout], sort_keys=True, default=str).encode())
    for source in program_sources():
        digest.update(source.read_bytes())
    out_dir = BUILD_DIR / digest.hexdigest()[:16]
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # Processes sharing the cache (test workers, servers) build a folder once, one at a time: a
    # folder with its output is never written again, so its sources stay as they were compiled.
    with open(out_dir.parent / f"{out_dir.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out_dir / "bin" / "out.json").is_file():
            compile_program(prepare_sources(plan, out_dir, simfabric=True), executor=True)
    return out_dir / "bin"


class CslExecutorRuntime(SdkContainerRuntime):
    """SdkContainerRuntime on the executor's SdkRuntime."""

    backend = "csl"  # what `WaferGPT2.describe` reports

    def __init__(self, compiled_dir: str | Path) -> None:
        super().__init__(compiled_dir, cmaddr=None, sdk=runtime_module())

    @property
    def machine(self) -> Any:
        """The executor's machine (csl_executor.machine.Machine): its clock and its record of host
        commands, which tools/bench/csl_cycles.py reads; None before the program is loaded."""
        return self._runner.machine


def build_backend(params, options, out_dir: str | Path | None = None):
    """Plan (compact unless asked otherwise), generate and compile the CSL, load it on the executor,
    upload the weights."""
    from wafer_gpt2.host.program import plan_for, start_model

    if options.objective is None:
        options = dataclasses.replace(options, objective="compact")
    plan = plan_for(params, options)
    runtime = CslExecutorRuntime(compile_plan(plan, out_dir))
    return start_model(plan, runtime, params, steps_in_flight=options.steps_in_flight)
