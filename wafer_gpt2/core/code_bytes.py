"""What each PE program's code takes of a PE's 48 KB, for the planner.

"Each PE has its own executable code in its memory" (Cerebras SDK, "A Conceptual View"): a PE's
arrays share the 48 KB with its program's code, memcpy's component and the stack. The planner holds a
region's data to 48 KB less its own program's code (`CODE_BYTES`) and the stack (`STACK_BYTES`):
`wafer_gpt2.core.arch.Arch.data_bytes`.

`CODE_BYTES` is the CSL executor's estimate (`csl_executor.codesize.program_code_bytes`: an instruction
count of every function at 4 bytes, plus memcpy's component 1 KB), the largest over every param set
of the PE program in a few reference plans (both dtypes, and the roles a plan may give: chains,
two-level reductions, a shared epilogue, the head's workers and its tree in two
levels). It is a table so that planning never imports the executor; `tools/bench/code_bytes.py`
measures it, `tests/test_plan_constraints.py` checks that it was measured on today's sources (a
digest, `CODE_SOURCES`) and, with `-m executor_full`, against a fresh measurement, and

    python tools/bench/code_bytes.py --write

rewrites it after a change to the kernels or to the estimator. Like every cycle figure of the
project, the estimate is modeled: `cslc` reports no code size.
"""

from __future__ import annotations

# The stack beside the code: no public figure. Assumption: 1 KB (the kernels call a few levels deep,
# with scalar locals only; the executor allocates local arrays statically, counted as data).
STACK_BYTES = 1024

# Per architecture and PE program (the region kind, or the io region's name), in bytes.
# BEGIN GENERATED (python tools/bench/code_bytes.py --write)
CODE_SOURCES = "28288c38075452f1"  # tools/bench/code_bytes.py sources_digest()
CODE_BYTES: dict[str, dict[str, int]] = {
    "wse2": {
        "attention": 4588,
        "embed": 3152,
        "embed_head": 6848,
        "gemv": 4420,
        "idle": 1096,
        "io.in": 1444,
        "io.out": 1916,
        "layernorm": 4324,
        "residual": 4276,
    },
    "wse3": {
        "attention": 4588,
        "embed": 3152,
        "embed_head": 6848,
        "gemv": 4420,
        "idle": 1096,
        "io.in": 1444,
        "io.out": 1916,
        "layernorm": 4324,
        "residual": 4276,
    },
}
# END GENERATED


def program_of(kind: str, name: str) -> str:
    """The PE program a region runs, as `CODE_BYTES` keys it: its kind, or for io its name."""
    return name if kind == "io" else kind
