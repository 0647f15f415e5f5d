"""The defects a review of the first GPT-2 kernels found, each reproduced on the CSL executor.

tests/data/csl_defects/ is a two-PE program whose `variant` param switches on one defect at a time,
written the way the old kernels wrote it; variant 0 has none. The executor must refuse each one with
a message that names the file, the line and the rule; the kernels that replaced the old ones compile
and run on both architectures (tests/test_kernel_examples.py, tests/test_csl_program.py). The
defect of the host (every H2D before any D2H) is reproduced in tests/test_csl_program.py, and the
scale of the generated layout is measured below.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from csl_executor.errors import CslCompileError
from csl_executor.layout import Options, compile_layout

PROGRAM = Path(__file__).resolve().parent / "data" / "csl_defects" / "layout.csl"

DEFECTS = [
    # (variant, arch, what the executor says) -- what the old kernels did
    (1, "wse2", r"pe\.csl:\d+: output queue 6 does not exist on WSE-2"),  # layernorm/embed_head: oq 6, 7
    (2, "wse3", r"pe\.csl:\d+: input queue 1 is reserved by memcpy on WSE-3"),  # io_in/io_out: queue 1
    (3, "wse2", r"pe\.csl:\d+: input queue 2 serves 2 colors .*one color per queue"),  # reduce.csl
    (3, "wse3", r"pe\.csl:\d+: input queue 2 is already bound to color 3"),  # reduce.csl, re-bound
    (
        4,
        "wse2",
        r"pe\.csl:\d+: on WSE-2 colors and task IDs share one ID space: local task ID 3 is also color 3",
    ),
    (5, "wse2", r"pe\.csl:\d+: @increment_dsd_offset takes an i16 offset, found u16"),  # attention.csl
    (6, "wse2", r"pe\.csl:\d+: CSL has no pointer arithmetic"),  # gemv.csl acc_of(...) + out_q16
]


def compile_variant(variant: int, arch: str):
    return compile_layout(
        str(PROGRAM), Options(arch=arch, fabric_dims=(9, 3), params={"variant": variant}, memcpy=True)
    )


@pytest.mark.parametrize("arch", ["wse2", "wse3"])
def test_the_program_without_defects_compiles(arch):
    compile_variant(0, arch)


@pytest.mark.parametrize(("variant", "arch", "message"), DEFECTS)
def test_each_defect_is_refused_with_its_rule(variant, arch, message):
    with pytest.raises(CslCompileError, match=message):
        compile_variant(variant, arch)


@pytest.mark.slow  # among the slowest tests (make test-fast leaves it out)
def test_the_gpt2_layout_computes_roles_from_coordinates():
    """The old layout had about 190k distinct tile codes and 1.9M @set_color_config calls for GPT-2
    124M on WSE-2 (each its own statement). The PE programs now compute their indices from their coordinates (lib/frame.csl),
    so the PEs of a region share a few param sets (chain roles, link colors), which layout.csl sets
    in strided loops (figures in docs/kernels.md)."""
    from wafer_gpt2.codegen import build_program, layout_csl
    from wafer_gpt2.model.config import PRESETS
    from wafer_gpt2.plan import build_plan

    program = build_program(build_plan(PRESETS["gpt2"], arch="wse3"))
    text = layout_csl(program, {})
    param_sets = text.count("\nconst P")  # what cslc compiles: one program per distinct param set
    # fc's GELU and the head's exps, shared by the last PEs of their K-lines, give those PEs param sets of
    # their own (each its own slice and roles)
    assert param_sets < 2000
    # LayerNorm's two half-strip reductions (comm/allreduce.csl) double its param sets per strip; the
    # guard is against per-PE codes (one per PE), not a few hundred more
    assert text.count("@set_tile_code") < 4000 and text.count("@set_color_config") < 8000
    assert len(text) < 3_000_000
    assert max(flow.color for flow in program.flows) < 21
