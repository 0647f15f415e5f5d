"""The executor's resource rules, one test per rule and architecture, on a program of our own.

csl_executor/tests/data/rules/ is a three-PE program ((0, 0) sends four f32 on color 4 to (1, 0),
(2, 0) is idle) whose `variant` param breaks one rule at a time; the broken line carries a
`// RULE name` comment, and every refusal must start with that file's path and line and name the
rule. The rules are the SDK's (its "Task IDs", "DSDs" and "Tensor streaming" pages), as
csl_executor/README.md lists them: queue counts per architecture and the queues memcpy keeps (input queue 0 on WSE-2; input and
output queues 0-1 on WSE-3), routable colors 0-23 and memcpy's 21-23, WSE-2's one ID space of
colors and task IDs, WSE-3's local task IDs 8-30, memcpy's task IDs, one color per input queue,
one route per color and PE, 48 KB per PE, the fabric memcpy needs, `@comptime_assert`, and
constructs the executor does not implement, which it must refuse by name.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from csl_executor_helpers import DATA, Host, compile_program, where

from csl_executor import codesize
from csl_executor.cli import cslc_main
from csl_executor.codesize import program_code_bytes
from csl_executor.errors import CslCompileError, CslError, CslRuntimeError, CslSyntaxError
from csl_executor.parse import parse_source
from csl_executor.program import PE_MEMORY_WORDS

DIMS = (10, 3)  # a 3 x 1 kernel at offsets 4,1 with memcpy: 4 + 3 + 3 columns, 1 + 1 + 1 rows


def refusal(variant: int, arch: str, **params) -> str:
    with pytest.raises(CslError) as info:
        compile_program("rules", arch=arch, params={"variant": variant, **params}, dims=DIMS)
    return str(info.value)


def accepted(variant: int, arch: str, **params):
    return compile_program("rules", arch=arch, params={"variant": variant, **params}, dims=DIMS)


# (variant, arch, file, marker, the message after "path:line: ")
REFUSED = [
    # queue counts: WSE-2 has output queues 0-5, WSE-3 0-7; both have input queues 0-7
    (1, "wse2", "pe.csl", "RULE output-queue", "output queue 6 does not exist on WSE-2 (output queues 0-5)"),
    (2, "wse3", "pe.csl", "RULE output-queue", "output queue 8 does not exist on WSE-3 (output queues 0-7)"),
    (3, "wse2", "pe.csl", "RULE input-queue", "input queue 8 does not exist on WSE-2 (input queues 0-7)"),
    (3, "wse3", "pe.csl", "RULE input-queue", "input queue 8 does not exist on WSE-3 (input queues 0-7)"),
    # the queues memcpy keeps
    (4, "wse2", "pe.csl", "RULE input-queue", "input queue 0 is reserved by memcpy on WSE-2 (0); use queue 2 or up"),
    (4, "wse3", "pe.csl", "RULE input-queue", "input queue 0 is reserved by memcpy on WSE-3 (0, 1); use queue 2 or up"),
    (5, "wse3", "pe.csl", "RULE input-queue", "input queue 1 is reserved by memcpy on WSE-3 (0, 1); use queue 2 or up"),
    (6, "wse3", "pe.csl", "RULE output-queue", "output queue 1 is reserved by memcpy on WSE-3 (0, 1); use queue 2 or up"),
    (7, "wse3", "pe.csl", "RULE output-queue", "output queue 0 is reserved by memcpy on WSE-3 (0, 1); use queue 2 or up"),
    # task IDs: WSE-2's shared ID space, WSE-3's range, memcpy's IDs, WSE-3 data tasks need a bound queue
    (9, "wse2", "pe.csl", "RULE local-id",
     "on WSE-2 colors and task IDs share one ID space: local task ID 4 is also color 4, which reaches PE (1, 0)'s RAMP"),
    (9, "wse3", "pe.csl", "RULE local-id", "local task ID 4 out of range: WSE-3 has 8-30"),
    (11, "wse2", "pe.csl", "RULE local-id", "local task ID 28 is reserved (memcpy keeps 27, 28, 30; 29, 31)"),
    (11, "wse3", "pe.csl", "RULE local-id", "local task ID 28 is reserved (memcpy keeps 27, 28, 30; 29, 31)"),
    (12, "wse3", "pe.csl", "RULE wse3-data-queue", "on WSE-3 the data task's input queue 4 needs @initialize_queue"),
    (24, "wse2", "pe.csl", "RULE control-id", "control task ID 33 is reserved by memcpy (33-37)"),
    (24, "wse3", "pe.csl", "RULE control-id", "control task ID 33 is reserved by memcpy (33-37)"),
    (25, "wse2", "pe.csl", "RULE data-id", "data task ID 21 (color) is reserved by memcpy"),
    (25, "wse3", "pe.csl", "RULE data-id", "on WSE-3 a data task ID is made from an input queue, not color(21)"),
    (28, "wse2", "pe.csl", "RULE local-args", "a local task takes no arguments"),
    # DSDs and operations: i8 stride, no fabin destination, one fabric input on WSE-3, async needs a queue
    (22, "wse2", "pe.csl", "RULE stride", "mem1d_dsd stride 200 does not fit i8 (-128-127)"),
    (23, "wse3", "pe.csl", "RULE fabin-dest", "@fmovs: a fabin_dsd cannot be a destination"),
    (21, "wse3", "pe.csl", "RULE two-fabin", "@fadds: WSE-3 allows one fabric input per operation"),
    (26, "wse2", "pe.csl", "RULE async-queue", "@fmovs: an asynchronous fabric operand needs `.output_queue`"),
    # the host can pass at most 15 arguments
    (27, "wse2", "pe.csl", "RULE sixteen", "an exported function takes at most 15 parameters"),
    # @comptime_assert with its message
    (15, "wse2", "pe.csl", "RULE assert", "@comptime_assert: variant 15 trips this assert"),
    (15, "wse3", "pe.csl", "RULE assert", "@comptime_assert: variant 15 trips this assert"),
    # colors: routable 0-23, memcpy's 21-23 not routable by the program, one route per color and PE
    (40, "wse2", "layout.csl", "RULE color-24", "color 24 is not a routable color (0-23)"),
    (40, "wse3", "layout.csl", "RULE color-24", "color 24 is not a routable color (0-23)"),
    (42, "wse2", "layout.csl", "RULE memcpy-color", "color 21 is reserved by memcpy (21-23) and cannot be routed"),
    (42, "wse3", "layout.csl", "RULE memcpy-color", "color 21 is reserved by memcpy (21-23) and cannot be routed"),
    # unsupported constructs are refused by name, never guessed at
    (16, "wse2", "pe.csl", "RULE teardown", "teardown is not supported by the executor"),
    (17, "wse2", "pe.csl", "RULE library", "library <kernels/tally> is not supported by the executor"),
    (30, "wse2", "unsupported.csl", "RULE while-else", "unsupported CSL: while ... else"),
]  # fmt: skip


@pytest.mark.parametrize(("variant", "arch", "file", "marker", "message"), REFUSED)
def test_rule_is_refused_at_its_line(variant, arch, file, marker, message):
    assert refusal(variant, arch) == f"{where('rules', file, marker)}: {message}"


def test_the_program_without_broken_rules_runs_on_both_architectures():
    for arch in ("wse2", "wse3"):
        host = Host(accepted(0, arch))
        host.h2d("buf", np.arange(1, 5, dtype=np.float32))
        host.launch("go")
        got = host.d2h("buf", 4, rect=(1, 0, 1, 1)).view(np.float32)
        host.stop()
        np.testing.assert_array_equal(got, [1, 2, 3, 4])


@pytest.mark.parametrize(
    ("variant", "why"),
    [
        (1, "output queue 6 exists on WSE-3"),
        (5, "memcpy keeps only input queue 0 on WSE-2"),
        (6, "WSE-2's memcpy leaves output queue 1 to the program"),
        (7, "WSE-2 lets colors share output queue 0 with memcpy's D2H"),
        (12, "WSE-2 data task IDs are colors; there is no queue to bind"),
        (21, "WSE-2 lets an operation read two fabric inputs"),
    ],
)
def test_what_one_architecture_refuses_the_other_accepts(variant, why):
    arch = "wse3" if variant == 1 else "wse2"
    accepted(variant, arch)


def test_wse2_task_id_collides_only_where_the_color_reaches_the_ramp():
    # variant 10 binds local task 4 on the sender only: color 4 leaves (0, 0) EAST, never down its RAMP
    accepted(10, "wse2")


def test_one_color_per_input_queue_on_wse3():
    # @initialize_queue binds a WSE-3 queue to one color for the whole run
    first, second = (
        where("rules", "pe.csl", "RULE queue-first"),
        where("rules", "pe.csl", "RULE queue-shared"),
    )
    assert refusal(8, "wse3") == (
        f"{first}: input queue 2 serves 2 colors (color 4 at {first}; color 5 at {second}): one color per queue"
    )


def test_wse2_reuses_an_input_queue_for_another_color_only_once_it_is_empty():
    # A WSE-2 operation names its queue and color, so two DSDs may share a queue (WaferLLM's MeshGEMM
    # does); reading color 5 while two wavelets of color 4 are still queued (variant 31) is refused.
    accepted(8, "wse2")
    host = Host(accepted(31, "wse2"))
    with pytest.raises(CslRuntimeError) as info:
        host.launch("go")
        host.d2h("buf", 4, rect=(1, 0, 1, 1))
    assert str(info.value) == (
        f"{where('rules', 'pe.csl', 'RULE queue-reuse')}: input queue 2 on PE (1, 0) still holds 2 wavelet(s) "
        "of color 4; a queue must be empty before an operation reuses it for color 5"
    )


def test_a_color_is_routed_once_per_pe():
    first = where("rules", "layout.csl", "RULE ordinary-route")
    assert refusal(41, "wse2") == (
        f"{where('rules', 'layout.csl', 'RULE twice')}: color 4 at PE (1, 0) is configured twice (first at {first})"
    )


@pytest.mark.parametrize("arch", ["wse2", "wse3"])
def test_48_kb_per_pe(arch):
    # Data alone: `big` and `buf` (4 f32 = 8 words) past the PE's 24576 16-bit words are refused where
    # `big` is declared.
    fits = PE_MEMORY_WORDS - 8
    assert PE_MEMORY_WORDS * 2 == 48 * 1024
    message = refusal(0, arch, big_words=fits + 1)
    assert message == (
        f"{where('rules', 'pe.csl', 'RULE memory')}: out of PE memory: 'big' needs {2 * (fits + 1)} bytes "
        "at byte 16, past the 48 KB of a PE (largest: buf 16 B)"
    )


@pytest.mark.parametrize("arch", ["wse2", "wse3"])
def test_code_and_data_share_the_48_kb(arch):
    # Each role's program has its own code estimate (csl_executor.codesize): the data that exactly fills
    # the 48 KB beside the largest one compiles, one word more is refused, naming both parts.
    small = accepted(0, arch)
    code = {p.params.get("role"): program_code_bytes(p) for p in small.programs}
    role, biggest = max(code.items(), key=lambda kv: kv[1])
    assert all(0 < c < 8 * 1024 for c in code.values()) and biggest % 2 == 0
    fits = PE_MEMORY_WORDS - 8 - biggest // 2
    compiled = accepted(0, arch, big_words=fits)
    assert max(2 * p.memory_words + program_code_bytes(p) for p in compiled.programs) == 48 * 1024
    message = refusal(0, arch, big_words=fits + 1)
    prog = next(p for p in small.programs if p.params.get("role") == role)
    data = 2 * (PE_MEMORY_WORDS - biggest // 2 + 1)
    assert message == (
        f"{DATA / 'rules' / 'pe.csl'}:1: code and data exceed the PE's 48 KB: {data} B of data + about "
        f"{biggest} B of code ({codesize.breakdown(prog)}) = {data + biggest} B > 49152 B "
        f"(largest: big {2 * (fits + 1)} B, buf 16 B)"
    )


@pytest.mark.parametrize(
    ("dims", "offsets", "message"),
    [
        ((9, 3), (4, 1), "--fabric-dims=9,3 is too small: a 3 x 1 kernel at offsets 4,1 needs at least 10,3 "
         "(memcpy takes 2 columns and a halo east of the kernel)"),
        ((10, 2), (4, 1), "--fabric-dims=10,2 is too small: a 3 x 1 kernel at offsets 4,1 needs at least 10,3 "
         "(memcpy takes 2 columns and a halo east of the kernel)"),
        ((12, 3), (3, 1), "--fabric-offsets=3,1: with memcpy the kernel starts at x >= 4 (3 memcpy columns, a "
         "halo and 0 west buffer columns) and y >= 1"),
        ((12, 3), (4, 0), "--fabric-offsets=4,0: with memcpy the kernel starts at x >= 4 (3 memcpy columns, a "
         "halo and 0 west buffer columns) and y >= 1"),
    ],
)  # fmt: skip
def test_fabric_too_small_for_offsets_and_rectangle_is_refused(dims, offsets, message):
    with pytest.raises(CslCompileError) as info:
        compile_program("rules", params={"variant": 0}, dims=dims, offsets=offsets)
    assert str(info.value) == f"{DATA / 'rules' / 'layout.csl'}: {message}"
    compile_program("rules", params={"variant": 0}, dims=(10, 3))  # the smallest that fits


def test_two_rx_directions_receiving_in_one_cycle_is_an_error():
    # (0, 0) and (2, 0) send on color 4 at the same cycle; (1, 0) receives from WEST and EAST. The SDK
    # calls simultaneous arrival undefined; the executor stops rather than pick an order.
    host = Host(accepted(19, "wse2"))
    with pytest.raises(CslRuntimeError) as info:
        host.launch("go")
        host.d2h("buf", 4, rect=(1, 0, 1, 1))
    message = str(info.value)
    assert re.fullmatch(
        r"wavelets on color 4 reach PE \(1, 0\) from WEST and EAST in the same cycle \(\d+\): undefined on the "
        rf"hardware \({re.escape(where('rules', 'layout.csl', 'RULE two-rx'))}\)",
        message,
    ), message


def test_a_wavelet_from_a_direction_outside_rx_is_an_error():
    host = Host(accepted(43, "wse3"))  # (1, 0) receives color 4 from EAST only; it comes from WEST
    with pytest.raises(CslRuntimeError) as info:
        host.launch("go")
        host.d2h("buf", 4, rect=(1, 0, 1, 1))
    assert str(info.value) == (
        "a wavelet on color 4 reaches PE (1, 0) from WEST, but its route receives from {EAST} "
        f"({where('rules', 'layout.csl', 'RULE wrong-rx')})"
    )


def test_a_wavelet_with_no_route_is_an_error_not_a_silent_drop():
    host = Host(accepted(20, "wse2"))  # no route for color 4 at (1, 0)
    with pytest.raises(CslRuntimeError) as info:
        host.launch("go")
        host.d2h("buf", 4, rect=(1, 0, 1, 1))
    assert str(info.value) == (
        "a wavelet on color 4 is sent EAST from PE (0, 0) to PE (1, 0), which has no route for color 4 "
        f"({where('rules', 'layout.csl', 'RULE sender-route')})"
    )


def test_a_host_function_must_be_exported_by_every_pe_it_is_launched_on():
    host = Host(accepted(29, "wse2"))
    with pytest.raises(CslRuntimeError) as info:
        host.launch("go")
    assert str(info.value) == "launch('go'): PE (2, 0) (pe.csl) does not export it"


def test_cslc_command_line_reports_the_rule_and_exits_1(tmp_path, capsys):
    layout = str(DATA / "rules" / "layout.csl")
    base = [
        layout,
        "--arch=wse2",
        "--fabric-dims=10,3",
        "--fabric-offsets=4,1",
        "--memcpy",
        "-o",
        str(tmp_path / "out"),
    ]
    assert cslc_main([*base, "--params=variant:0"]) == 0
    meta = json.loads((tmp_path / "out" / "out.json").read_text())
    assert meta["params"] == {"variant": "0"}
    assert cslc_main([*base, "--params=variant:1"]) == 1
    err = capsys.readouterr().err
    assert (
        err
        == f"cslc: error: {where('rules', 'pe.csl', 'RULE output-queue')}: output queue 6 does not exist on WSE-2 (output queues 0-5)\n"
    )


def test_a_comment_ending_in_task_does_not_turn_the_next_call_into_a_task():
    # Regression: the rewrite of `task name(` into a Zig fn matched across a comment's end of line.
    source = 'comptime {\n  // activate the next task\n  @activate(x);\n}\nconst s = "task f(";\n'
    parse_source(source, "comment.csl")
    with pytest.raises(CslSyntaxError, match=r"^comment\.csl:2:"):
        parse_source("comptime {\n  while (true) {} else {}\n}\n", "comment.csl")
