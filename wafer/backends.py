"""Choose what executes the model: `reference` (NumPy oracle), `sim` (embedded wafer simulator),
`csl` (the generated CSL on the project's CSL executor), `sdk-container` / `sdk-appliance` (the
Cerebras SDK), and two stand-ins that measure the host (`wafer/stand_in.py`): `null` (fixed scores at
once, no model) and `modeled` (the same after the cost model's step time for the plan: modeled, no
wafer). Every backend returns an `Executor`."""

from __future__ import annotations

from wafer.errors import InvalidInput
from wafer.executor import Executor
from wafer.host import ExecutorOptions, plan_for, start_model
from weights.params import GPT2Params

BACKENDS = ("sim", "reference", "csl", "sdk-container", "sdk-appliance", "null", "modeled")
DEFAULT_BACKEND = "sim"


def build_executor(backend: str, params: GPT2Params, options: ExecutorOptions | None = None) -> Executor:
    options = options or ExecutorOptions()
    if backend == "reference":
        from wafer.reference_executor import ReferenceExecutor

        return ReferenceExecutor(params, slots=options.slots, context=options.context, top_k=options.top_k)
    if backend == "sim":
        return build_sim_executor(params, options)
    if backend in ("null", "modeled"):
        from wafer import stand_in

        if backend == "modeled":
            return stand_in.ModeledWaferExecutor(plan_for(params, options))
        context = options.context or params.config.n_positions
        return stand_in.NullExecutor(
            params.config.vocab_size, slots=options.slots, context=context, top_k=options.top_k
        )
    if backend == "csl":
        from wafer import csl_backend

        return csl_backend.build_executor(params, options)
    if backend == "sdk-container":
        from wafer import sdk_container

        return sdk_container.build_executor(params, options)
    if backend == "sdk-appliance":
        from wafer import sdk_appliance

        return sdk_appliance.build_executor(params, options)
    raise InvalidInput(f"unknown backend {backend!r}: expected one of {', '.join(BACKENDS)}")


def build_sim_executor(params: GPT2Params, options: ExecutorOptions, progress: bool = False) -> Executor:
    """Plan the wafer for this model, start the embedded simulator on the plan, upload the weights."""
    from wafer.sim import SimRuntime

    plan = plan_for(params, options)
    return start_model(plan, SimRuntime(plan), params, progress)


__all__ = ["BACKENDS", "DEFAULT_BACKEND", "ExecutorOptions", "build_executor", "build_sim_executor"]
