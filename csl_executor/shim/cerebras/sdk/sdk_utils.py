"""`cerebras.sdk.sdk_utils` on the project's CSL executor."""

from csl_executor.hostutil import calculate_cycles, input_array_to_u32, memcpy_view

__all__ = ["memcpy_view", "input_array_to_u32", "calculate_cycles"]
