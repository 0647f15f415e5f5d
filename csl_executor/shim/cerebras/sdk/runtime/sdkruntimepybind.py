"""`cerebras.sdk.runtime.sdkruntimepybind` on the project's CSL executor."""

from csl_executor.hostutil import MemcpyDataType, MemcpyOrder
from csl_executor.sdk import SdkRuntime, Task

__all__ = ["SdkRuntime", "MemcpyDataType", "MemcpyOrder", "Task"]
