"""`cerebras.sdk.debug.debug_util` on the project's CSL executor: traces recorded by `<debug>`."""

from csl_executor.hostutil import debug_util

__all__ = ["debug_util"]
