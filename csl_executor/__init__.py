"""The CSL executor: compiles and runs CSL programs without the Cerebras SDK (README.md).

`csl-executor cslc ...` and `csl-executor cs_python run.py ...` take the SDK's commands' arguments;
in Python, `csl_executor.layout.compile_layout` compiles and `csl_executor.sdk.SdkRuntime` runs. It
imports nothing of wafer-gpt2 and can be used (and published) alone."""
