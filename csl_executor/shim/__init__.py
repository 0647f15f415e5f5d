"""Not imported as `csl_executor.shim`: `csl-executor cs_python` puts this folder on `sys.path` so that
`cerebras.sdk...` resolves to the stand-ins in `cerebras/` (this file only makes the wheel ship them)."""
