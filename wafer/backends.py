"""Choose what executes the model: `reference` (NumPy oracle), `sim` (embedded wafer simulator),
`csl` (the generated CSL on the project's CSL executor), `sdk-container` / `sdk-appliance` (the
Cerebras SDK). Every backend returns an `Executor`."""

from __future__ import annotations

from dataclasses import dataclass

from wafer.executor import Executor
from weights.params import GPT2Params

BACKENDS = ("sim", "reference", "csl", "sdk-container", "sdk-appliance")
DEFAULT_BACKEND = "sim"


@dataclass(frozen=True)
class ExecutorOptions:
    slots: int = 16
    context: int | None = None  # None: the model's n_positions
    dtype: str = "fp16"  # fp16 (hardware default) or fp32; the reference is always fp32
    top_k: int = 64
    arch: str = "wse2"
    replicas: int = 1  # pipeline replicas on the wafer (sim / SDK); slots are divided among them
    objective: str | None = None  # the plan's objective; None: latency, compact for the csl backend


def build_executor(backend: str, params: GPT2Params, options: ExecutorOptions | None = None) -> Executor:
    options = options or ExecutorOptions()
    if backend == "reference":
        from wafer.reference_executor import ReferenceExecutor

        return ReferenceExecutor(params, slots=options.slots, context=options.context, top_k=options.top_k)
    if backend == "sim":
        return build_sim_executor(params, options)
    if backend == "csl":
        from wafer import csl_backend

        return csl_backend.build_executor(params, options)
    if backend == "sdk-container":
        from wafer import sdk_container

        return sdk_container.build_executor(params, options)
    if backend == "sdk-appliance":
        from wafer import sdk_appliance

        return sdk_appliance.build_executor(params, options)
    raise ValueError(f"unknown backend {backend!r}: expected one of {', '.join(BACKENDS)}")


def build_sim_executor(params: GPT2Params, options: ExecutorOptions, progress: bool = False) -> Executor:
    """Plan the wafer for this model, start the embedded simulator on the plan, upload the weights."""
    from wafer.sim import SimRuntime

    plan = plan_for(params, options)
    return start_model(plan, SimRuntime(plan), params, progress)


def plan_for(params: GPT2Params, options: ExecutorOptions):
    """The plan every wafer backend (sim and SDK) runs for these options: slots split among the replicas."""
    from wafer.plan import build_plan

    if options.replicas < 1 or options.slots % options.replicas:
        raise ValueError(
            f"slots ({options.slots}) must be a positive multiple of replicas ({options.replicas}): "
            "every replica holds the same number of slots"
        )
    return build_plan(
        params.config,
        arch=options.arch,
        dtype=options.dtype,
        slots=options.slots // options.replicas,
        context=options.context,
        replicas=options.replicas,
        top_k=options.top_k,
        objective=options.objective or "latency",
    )


def start_model(plan, runtime, params: GPT2Params, progress: bool = False) -> Executor:
    """The host program on a runtime: load and run the wafer program, upload the weights; if any of
    that fails the runtime is stopped (no half-started wafer is left behind)."""
    from wafer.host import WaferGPT2

    try:
        return WaferGPT2(plan, runtime, params, progress=progress)
    except BaseException:
        runtime.stop()
        raise
