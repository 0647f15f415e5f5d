"""The defects a review of the first GPT-2 kernels found, each reproduced on the CSL executor.

tests/data/csl_defects/ is a two-PE program whose `variant` param switches on one defect at a time,
written the way the old kernels wrote it; variant 0 has none. The executor must refuse each one with
a message that names the file, the line and the rule; the kernels that replaced the old ones compile
and run on both architectures (tests/test_kernel_examples.py, tests/test_csl_program.py). The
defect of the host (every H2D before any D2H) is reproduced in tests/test_csl_program.py, and the
scale of the generated layout is measured below. Defects of the generated program that no executor
rule catches on both architectures are checked on the generator's output (task IDs below).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kernels.program import build_program
from kernels.program.build import Tile, _assign_tasks
from kernels.program.errors import ProgramError
from kernels.program.routes import make_flow
from wafer.arch import ARCHS
from wafer.csl.errors import CslCompileError
from wafer.csl.layout import Options, compile_layout
from wafer.plan import build_plan
from weights.config import GPT2Config

PROGRAM = Path(__file__).resolve().parent / "data" / "csl_defects" / "layout.csl"
KERNELS = Path(__file__).resolve().parent.parent / "kernels"

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
    from kernels.program import build_program, layout_csl
    from wafer.plan import build_plan
    from weights.config import PRESETS

    program = build_program(build_plan(PRESETS["gpt2"], arch="wse3"))
    text = layout_csl(program, {})
    param_sets = text.count("\nconst P")  # what cslc compiles: one program per distinct param set
    # 1,458 (WSE-3) since fc's GELU and the head's exps are shared by the last PEs of their K-lines
    # (each its own slice and roles)
    assert param_sets < 2000
    # 3,555 / 6,933 and 2.55 MB: LayerNorm's two half-strip reductions (comm/allreduce.csl) doubled
    # its param sets per strip; the guard is against per-PE codes (190k), not a few hundred more
    assert text.count("@set_tile_code") < 4000 and text.count("@set_color_config") < 8000
    assert len(text) < 3_000_000
    assert max(flow.color for flow in program.flows) < 21


@pytest.mark.parametrize("arch", ["wse2", "wse3"])
def test_no_pe_program_binds_memcpys_task_ids(arch):
    """memcpy keeps task IDs 21-23 and 27-31 on both architectures (csl-examples 1.4's WSE-2 and WSE-3
    task-ID maps); the generator's pool used to hand out 21-23 to every program that binds tasks."""
    config = GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=100, n_positions=32, name="tiny")
    program = build_program(build_plan(config, arch=arch, slots=2, context=32, top_k=8))
    bound = {t for tile in program.tiles.values() for t in tile.params.get("tasks", ())}
    assert bound and not bound & set(ARCHS[arch].memcpy_task_ids), sorted(bound)
    assert bound <= set(ARCHS[arch].local_task_ids)


@pytest.mark.parametrize("arch", ["wse2", "wse3"])
def test_a_region_that_would_need_memcpys_task_ids_is_refused(arch):
    """A head PE (11 task IDs) reached by colors 0-12: with 24-26 and 13-20 (less memcpy's streaming
    colors 14 and 15) there are 9 IDs left on WSE-2 (and fewer on WSE-3, whose local IDs start at 8);
    the old pool made up the difference with memcpy's 21-23."""
    tile = Tile("pe/head.csl", "head")
    flows = [make_flow(f"f{c}", (1, 0), [(0, 0)]) for c in range(13)]
    for color, flow in enumerate(flows):
        flow.color = color
    with pytest.raises(ProgramError, match=r"region head \(pe/head\.csl\): 11 local task IDs needed, \d left "
                       r"on WSE-\d: memcpy keeps task IDs 21, 22, 23, 27, 28, 29, 30, 31"):  # fmt: skip
        _assign_tasks({(0, 0): tile}, flows, arch)


# A mem1d DSD whose tensor access does not move with its induction variable: every element is one word.
_DSD = re.compile(
    r"(?:var|const)\s+(\w+)\s*=\s*@get_dsd\(\s*mem1d_dsd\s*,\s*\.\{\s*\.tensor_access\s*=\s*"
    r"\|(\w+)\|\s*\{[^}]*\}\s*->\s*\w+\[([^\]]*)\]"
)
_WRAPPERS = ("@set_dsd_length(", "@set_dsd_base_addr(", "@increment_dsd_offset(", "@set_dsd_stride(")
# A maximum is the same in any order: csl-examples' 25-pt-stencil takes one as @fmaxs(&m, m, v).
_ORDER_FREE = {"fmaxs", "fmaxh"}


def _arguments(text: str, start: int) -> list[str]:
    """The top-level arguments of the call whose "(" is at text[start]."""
    depth, args, current = 0, [], []
    for ch in text[start + 1 :]:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            if depth == 0:
                args.append("".join(current).strip())
                return args
            depth -= 1
        if ch == "," and depth == 0:
            args.append("".join(current).strip())
            current = []
        else:
            current.append(ch)
    raise AssertionError("unbalanced call")


def _operand(arg: str) -> str:
    """The DSD or scalar an operand names, through the DSD mutators (`@set_dsd_length(d, n)` -> d)."""
    while arg.startswith(_WRAPPERS):
        arg = _arguments(arg, arg.index("("))[0]
    return arg


def stride0_accumulations(text: str) -> list[str]:
    """DSD operations whose destination is one word that they also read: a stride-0 mem1d DSD, or a
    pointer to a scalar (which the SDK treats as one), named again among the sources."""
    code = "\n".join(line.split("//", 1)[0] for line in text.splitlines())
    words = {m[1] for m in _DSD.finditer(code) if not re.search(rf"\b{m[2]}\b", m[3])}
    words |= {
        m[1] for m in re.finditer(r"(?:var|const)\s+(\w+)\s*=\s*@get_dsd\([^;]*\.stride\s*=\s*0\b", code)
    }
    found = []
    for call in re.finditer(r"@(f\w+|mov16|mov32|add16|sub16)\(", code):
        args = [_operand(a) for a in _arguments(code, call.end() - 1)]
        dest, sources = args[0], args[1:]
        if dest.startswith("&"):
            # the public form (a scalar destination, its value the first source) only where the
            # order of the reduction cannot matter
            if dest[1:].strip() in sources and call[1] not in _ORDER_FREE:
                found.append(f"@{call[1]}({', '.join(args)})")
        elif dest in words and dest in sources:
            found.append(f"@{call[1]}({', '.join(args)})")
    return found


def test_the_stride0_scan_finds_the_forms_it_refuses():
    program = """
      const acc = @get_dsd(mem1d_dsd, .{ .tensor_access = |i|{8} -> sums[0] });
      const vec = @get_dsd(mem1d_dsd, .{ .tensor_access = |i|{8} -> x[i] });
      @fadds(@set_dsd_length(acc, n), @set_dsd_length(acc, n), vec);
      @fadds(&s, s, vec);
      @fmaxs(&m, m, vec);        // order-free, the public form: allowed
      @fmaxs(acc, acc, vec);     // order-free, but no public form
      @fadds(vec, vec, vec);     // element by element: allowed
    """
    assert stride0_accumulations(program) == [
        "@fadds(acc, acc, vec)",
        "@fadds(&s, s, vec)",
        "@fmaxs(acc, acc, vec)",
    ]


def test_no_kernel_reads_and_writes_one_word_in_a_dsd_operation():
    """A DSD operation whose destination is one stride-0 word that it also reads (a running sum) has
    no public precedent, and a pipelined operation need not add in the order the executor does. The
    kernels sum into scalars inside a @map's steps instead (lib/norm_stats.csl, lib/fmac.csl), and
    take a maximum as @fmaxs(&m, m, v), as csl-examples does."""
    found = {
        str(path.relative_to(KERNELS)): hits
        for path in sorted(KERNELS.rglob("*.csl"))
        if (hits := stride0_accumulations(path.read_text()))
    }
    assert not found, found
