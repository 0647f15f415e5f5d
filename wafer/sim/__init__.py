"""The embedded wafer simulator: the `sim` backend (see docs/simulator.md)."""

from wafer.sim.runtime import SimRuntime

__all__ = ["SimRuntime"]
