"""Choose what executes the model: `reference` (NumPy oracle), `sim` (embedded wafer simulator),
`csl` (the generated CSL on the project's CSL executor), `sdk-container` / `sdk-appliance` (the
Cerebras SDK), and two stand-ins that measure the host (`wafer_gpt2/backends/stand_ins.py`): `null` (fixed scores at
once, no model) and `modeled` (the same after the cost model's step time for the plan: modeled, no
wafer). Every backend returns an `Backend`."""

from __future__ import annotations

from wafer_gpt2.core.steps import Backend
from wafer_gpt2.errors import InvalidInput
from wafer_gpt2.host.program import BackendOptions, plan_for, start_model
from wafer_gpt2.model.params import GPT2Params

BACKENDS = ("sim", "reference", "csl", "sdk-container", "sdk-appliance", "null", "modeled")
DEFAULT_BACKEND = "sim"


def build_backend(backend: str, params: GPT2Params, options: BackendOptions | None = None) -> Backend:
    options = options or BackendOptions()
    if backend == "reference":
        from wafer_gpt2.backends.reference import ReferenceBackend

        return ReferenceBackend(params, slots=options.slots, context=options.context, top_k=options.top_k)
    if backend == "sim":
        return build_sim_backend(params, options)
    if backend in ("null", "modeled"):
        from wafer_gpt2.backends import stand_ins

        if backend == "modeled":
            return stand_ins.ModeledWaferBackend(
                plan_for(params, options), steps_in_flight=options.steps_in_flight
            )
        context = options.context or params.config.n_positions
        return stand_ins.NullBackend(
            params.config.vocab_size, slots=options.slots, context=context, top_k=options.top_k
        )
    if backend == "csl":
        from wafer_gpt2.backends import csl as csl_backend

        return csl_backend.build_backend(params, options)
    if backend == "sdk-container":
        from wafer_gpt2.backends import sdk_container

        return sdk_container.build_backend(params, options)
    if backend == "sdk-appliance":
        from wafer_gpt2.backends import sdk_appliance

        return sdk_appliance.build_backend(params, options)
    raise InvalidInput(f"unknown backend {backend!r}: expected one of {', '.join(BACKENDS)}")


def build_sim_backend(params: GPT2Params, options: BackendOptions, progress: bool = False) -> Backend:
    """Plan the wafer for this model, start the embedded simulator on the plan, upload the weights."""
    from wafer_gpt2.sim import SimRuntime

    plan = plan_for(params, options)
    return start_model(plan, SimRuntime(plan), params, progress, options.steps_in_flight)


__all__ = ["BACKENDS", "DEFAULT_BACKEND", "BackendOptions", "build_backend", "build_sim_backend"]
