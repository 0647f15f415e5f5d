"""Choose what executes the model: `reference` (NumPy oracle), `sim` (embedded wafer simulator),
`sdk-container` / `sdk-appliance` (the Cerebras SDK). Every backend returns an `Executor`."""

from __future__ import annotations

from dataclasses import dataclass

from wafer.executor import Executor
from weights.params import GPT2Params

BACKENDS = ("sim", "reference")
DEFAULT_BACKEND = "sim"


@dataclass(frozen=True)
class ExecutorOptions:
    slots: int = 16
    context: int | None = None  # None: the model's n_positions
    dtype: str = "fp16"  # fp16 (hardware default) or fp32; the reference is always fp32
    top_k: int = 64
    arch: str = "wse2"


def build_executor(backend: str, params: GPT2Params, options: ExecutorOptions | None = None) -> Executor:
    options = options or ExecutorOptions()
    if backend == "reference":
        from wafer.reference_executor import ReferenceExecutor

        return ReferenceExecutor(params, slots=options.slots, context=options.context, top_k=options.top_k)
    raise ValueError(f"unknown backend {backend!r}: expected one of {', '.join(BACKENDS)}")
