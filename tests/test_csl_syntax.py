"""The CSL syntax gate (kernels/csl_syntax.py): every kernel parses, broken CSL does not."""

from __future__ import annotations

import pytest

from kernels.csl_syntax import check_file, check_source, kernel_files, to_zig

pytest.importorskip("tree_sitter_zig", reason="the syntax gate needs tree-sitter-zig (test extra)")

KERNELS = kernel_files()


def test_the_kernel_library_is_all_there():
    names = {p.name for p in KERNELS}
    programs = {"io_in.csl", "io_out.csl", "embed.csl", "embed_head.csl", "layernorm.csl", "gemv.csl",
                "attention.csl", "residual.csl", "idle.csl"}  # fmt: skip
    libraries = {"layout.csl", "stream.csl", "reduce.csl", "topk.csl", "gelu.csl", "timing.csl"}
    assert programs | libraries == names


@pytest.mark.parametrize("path", KERNELS, ids=lambda p: p.name)
def test_every_kernel_parses(path):
    assert check_file(path) == []


def test_rewrite_keeps_lines_in_place():
    source = (KERNELS[0].parent / "gemv.csl").read_text()
    assert to_zig(source).count("\n") == source.count("\n")


def test_csl_only_forms_are_accepted():
    source = """
param n: u16;
param c: color = @get_color(3);
param cb: task () void;
var scratch: f32;
var A = @zeros([n, 4]f32);
const d = @get_dsd(mem1d_dsd, .{ .tensor_access = |i, j|{n, 4} -> A[i, j] });
task t(w: u32) void { A[0, 1] = @bitcast(f32, w); }
layout { @set_rectangle(2, 1); }
"""
    assert check_source(source) == []


GEMV = (KERNELS[0].parent / "gemv.csl").read_text()
BROKEN = {
    "missing closing brace": GEMV.replace(
        "task work_next() void {", "task work_next() void {\n  if (x) {", 1
    ),
    "param without colon": GEMV.replace("param tile_k: u16;", "param tile_k u16;", 1),
    "missing semicolon": GEMV.replace("var work_step: u16 = 0;", "var work_step: u16 = 0", 1),
    "unbalanced parenthesis": GEMV.replace("@activate(init_id);", "@activate(init_id;", 1),
    "stray token": GEMV.replace("const HDR: u16 = 5;", "const HDR: u16 = 5 5;", 1),
    "bad tensor access": GEMV.replace("|i|{tile_n} -> acc[i]", "|i|{tile_n} -> acc[i", 1),
}


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_broken_csl_fails_the_gate(name):
    source = BROKEN[name]
    assert source != GEMV, f"the {name} mutation did not apply"
    problems = check_source(source, "gemv.csl")
    assert problems, f"{name}: the gate accepted broken CSL"
    assert all(p.path == "gemv.csl" and p.line >= 1 for p in problems)
