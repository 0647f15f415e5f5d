"""The embedded wafer simulator: the `sim` backend (see docs/simulator.md)."""

from wafer_gpt2.sim.sim_runtime import SimRuntime

__all__ = ["SimRuntime"]
