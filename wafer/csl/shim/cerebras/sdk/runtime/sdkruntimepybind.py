"""`cerebras.sdk.runtime.sdkruntimepybind` on the project's CSL executor."""

from wafer.csl.sdk import SdkRuntime, Task
from wafer.runtime import MemcpyDataType, MemcpyOrder

__all__ = ["SdkRuntime", "MemcpyDataType", "MemcpyOrder", "Task"]
