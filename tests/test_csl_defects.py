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
import shutil
from pathlib import Path

import numpy as np
import pytest

from csl_executor.errors import CslCompileError
from csl_executor.layout import Options, compile_layout
from wafer_gpt2.codegen import build_program
from wafer_gpt2.codegen.build import Tile, _assign_tasks
from wafer_gpt2.codegen.routes import make_flow
from wafer_gpt2.core.arch import ARCHS
from wafer_gpt2.errors import ProgramError
from wafer_gpt2.model.config import GPT2Config
from wafer_gpt2.plan import build_plan

PROGRAM = Path(__file__).resolve().parent / "data" / "csl_defects" / "layout.csl"
KERNELS = Path(__file__).resolve().parent.parent / "wafer_gpt2" / "kernels"


def kernel_sources() -> list[Path]:
    """Every CSL file of the kernels (a scan over none would pass whatever they hold)."""
    paths = sorted(KERNELS.rglob("*.csl"))
    assert len(paths) > 10, KERNELS
    return paths


DEFECTS = [
    # (variant, arch, what the executor says) -- what the old kernels did
    (1, "wse2", r"pe\.csl:\d+: output queue 6 does not exist on WSE-2"),  # layernorm/embed_head: oq 6, 7
    (2, "wse3", r"pe\.csl:\d+: input queue 1 is reserved by memcpy on WSE-3"),  # io_in/io_out: queue 1
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


def test_two_colors_read_through_one_queue_at_once_are_refused_on_wse2():
    # reduce.csl's defect: WSE-2 lets a queue serve colors one after another (an operation names its
    # queue and color), so the program compiles; reading both at once is refused when it happens
    from csl_executor.errors import CslRuntimeError
    from csl_executor.sdk import SdkRuntime

    runtime = SdkRuntime(compile_variant(3, "wse2"))
    runtime.load()
    runtime.run()
    with pytest.raises(CslRuntimeError, match=r"pe\.csl:\d+: input queue 2 on PE \(0, 0\) is still used by"):
        runtime._loaded().run_idle()


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
    """A LayerNorm PE (10 task IDs) reached by colors 0-12: with 24-26 and 13-20 (less memcpy's streaming
    colors 14 and 15) there are 9 IDs left on WSE-2 (and fewer on WSE-3, whose local IDs start at 8);
    the old pool made up the difference with memcpy's 21-23."""
    tile = Tile("pe/layernorm.csl", "ln_f")
    flows = [make_flow(f"f{c}", (1, 0), [(0, 0)]) for c in range(13)]
    for color, flow in enumerate(flows):
        flow.color = color
    with pytest.raises(ProgramError, match=r"region ln_f \(pe/layernorm\.csl\), PE \(0, 0\): 10 local task IDs needed, \d left "
                       r"on WSE-\d: memcpy keeps task IDs 21, 22, 23, 27, 28, 29, 30, 31"):  # fmt: skip
        _assign_tasks({(0, 0): tile}, flows, arch)


@pytest.mark.parametrize("arch", ["wse2", "wse3"])
def test_a_region_whose_pes_see_few_colors_each_gets_task_ids_per_pe(arch):
    """A region's links may use many colors while each PE sees few of them (the full vocabulary's LM
    head: 13 colors over its 99 columns): where the region's colors together leave too few task IDs,
    each PE gets IDs that only the colors reaching it are kept clear of."""
    tiles = {(0, 0): Tile("pe/layernorm.csl", "ln_f"), (1, 0): Tile("pe/layernorm.csl", "ln_f")}
    flows = [make_flow(f"f{c}", (2, 0), [(c % 2, 0)]) for c in range(13)]
    for color, flow in enumerate(flows):
        flow.color = color
    _assign_tasks(tiles, flows, arch)
    for (x, _), tile in tiles.items():
        own = {c for c in range(13) if c % 2 == x}
        assert len(tile.params["tasks"]) == 10 and not set(tile.params["tasks"]) & own
        assert not set(tile.params["tasks"]) & set(ARCHS[arch].memcpy_task_ids)
    assert tiles[(0, 0)].params["tasks"] != tiles[(1, 0)].params["tasks"]


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
        for path in kernel_sources()
        if (hits := stride0_accumulations(path.read_text()))
    }
    assert not found, found


# -- the programs' own asynchronous operations ---------------------------------------------------------

# Three PEs all-reduce `words` f32 with wafer_gpt2/kernels/comm/allreduce.csl: the left half (PEs 0, 1) chains
# towards the root (1), PE 2 is the right half alone and hands its vector to the root (the join), and
# the root broadcasts the sums both ways. `go` starts it; the done task ends the launch.
ALLREDUCE_PE = """
param memcpy_params: comptime_struct;
param words: u16;
param run_role: u16;
param join_role: u16;
const run_color: color = @get_color(1);
const sys_mod = @import_module("<memcpy/memcpy>", memcpy_params);
const stats = @import_module("comm/allreduce.csl", .{
  .run_role = run_role, .run_rx = run_color, .run_tx = run_color, .end_role = 4, .end_rx = run_color,
  .end_tx = run_color, .join_role = join_role, .join_color = @get_color(2), .bcast_color = @get_color(3),
  .words = words, .run_queue = 3, .end_queue = 5, .tx_queue = 3, .end_tx_queue = 5, .bcast_queue = 4,
  .step_task = 10, .join_task = 11, .done_task = 12 });
var v = @zeros([words]f32);
var v_ptr: [*]f32 = &v;
fn go() void {
  stats.start(&v);
}
task done() void {
  sys_mod.unblock_cmd_stream();
}
comptime {
  @bind_local_task(done, @get_local_task_id(12));
  @export_symbol(v_ptr, "v");
  @export_symbol(go);
}
"""
ALLREDUCE_LAYOUT = """
param words: u16;
const memcpy = @import_module("<memcpy/get_params>", .{ .width = 3, .height = 1 });
layout {
  @set_rectangle(3, 1);
  @set_tile_code(0, 0, "pe.csl", .{ .memcpy_params = memcpy.get_params(0), .words = words, .run_role = 0, .join_role = 0 });
  @set_tile_code(1, 0, "pe.csl", .{ .memcpy_params = memcpy.get_params(1), .words = words, .run_role = 2, .join_role = 2 });
  @set_tile_code(2, 0, "pe.csl", .{ .memcpy_params = memcpy.get_params(2), .words = words, .run_role = 3, .join_role = 1 });
  @set_color_config(0, 0, @get_color(1), .{ .routes = .{ .rx = .{RAMP}, .tx = .{EAST} } });
  @set_color_config(1, 0, @get_color(1), .{ .routes = .{ .rx = .{WEST}, .tx = .{RAMP} } });
  @set_color_config(2, 0, @get_color(2), .{ .routes = .{ .rx = .{RAMP}, .tx = .{WEST} } });
  @set_color_config(1, 0, @get_color(2), .{ .routes = .{ .rx = .{EAST}, .tx = .{RAMP} } });
  @set_color_config(1, 0, @get_color(3), .{ .routes = .{ .rx = .{RAMP}, .tx = .{WEST, EAST} } });
  @set_color_config(0, 0, @get_color(3), .{ .routes = .{ .rx = .{EAST}, .tx = .{RAMP} } });
  @set_color_config(2, 0, @get_color(3), .{ .routes = .{ .rx = .{WEST}, .tx = .{RAMP} } });
  @export_name("v", [*]f32, true);
  @export_name("go", fn()void);
}
"""


@pytest.mark.parametrize("arch", ["wse2", "wse3"])
def test_the_all_reduce_join_keeps_one_operation_per_microthread(arch, tmp_path):
    """The PE after the root sends its half's sums to the root (the join) and receives the broadcast
    with the same queue number, so on one microthread. It used to start both at once: a join longer
    than its queues hold (32 words here; LayerNorm's 2 always fit) was still sending when the receive
    started. It now starts the receive when the join has left."""
    from csl_executor.sdk import MemcpyDataType, MemcpyOrder, SdkRuntime

    words = 32
    shutil.copytree(KERNELS / "comm", tmp_path / "comm")
    (tmp_path / "pe.csl").write_text(ALLREDUCE_PE)
    (tmp_path / "layout.csl").write_text(ALLREDUCE_LAYOUT)
    compiled = compile_layout(
        str(tmp_path / "layout.csl"),
        Options(arch=arch, fabric_dims=(10, 3), params={"words": words}, memcpy=True),
    )
    values = np.arange(3 * words, dtype=np.float32).reshape(3, words) / 8
    runtime = SdkRuntime(compiled)
    runtime.load()
    runtime.run()
    kw = dict(
        streaming=False, data_type=MemcpyDataType.MEMCPY_32BIT, order=MemcpyOrder.ROW_MAJOR, nonblock=False
    )
    runtime.memcpy_h2d(runtime.get_id("v"), values.reshape(-1).view(np.uint32), 0, 0, 3, 1, words, **kw)
    runtime.launch("go", nonblock=False)
    out = np.zeros(3 * words, dtype=np.uint32)
    runtime.memcpy_d2h(out, runtime.get_id("v"), 0, 0, 3, 1, words, **kw)
    runtime.stop()
    want = (values[0] + values[1]) + values[2]  # the left half's chain, then the join
    assert np.array_equal(out.view(np.float32).reshape(3, words), np.stack([want] * 3))


def unsignalled_async_operations(text: str) -> list[str]:
    """Asynchronous DSD operations that neither activate nor unblock a task when they end. A FIFO's
    filling operation needs none (pipeline-02-fifo's, topic-09-fifos'): its last word is taken by the
    operation that drains the FIFO, which ends after it and signals."""
    code = "\n".join(line.split("//", 1)[0] for line in text.splitlines())
    fifos = set(re.findall(r"(?:var|const)\s+(\w+)\s*=\s*@allocate_fifo\(", code))
    found = []
    for call in re.finditer(r"@(f\w+|mov16|mov32|add16|sub16)\(", code):
        args = _arguments(code, call.end() - 1)
        options = args[-1] if args[-1].startswith(".{") else ""
        if not re.search(r"\.async\s*=\s*true", options) or re.search(r"\.(activate|unblock)\s*=", options):
            continue
        if _operand(args[0]) in fifos:
            continue
        found.append(f"@{call[1]}({', '.join(args)})")
    return found


def test_every_asynchronous_operation_says_when_it_ends():
    """A buffer or microthread that an asynchronous operation still holds must not be reused: the next
    user waits for the operation's end, which only an .activate or .unblock reports (or, for a short
    send, a synchronous operation). comm/scatter.csl's send, head.csl's (max, sum) pair and the
    all-reduce's join had none."""
    found = {
        str(path.relative_to(KERNELS)): hits
        for path in kernel_sources()
        if (hits := unsignalled_async_operations(path.read_text()))
    }
    assert not found, found


# PE 0 scatters 2 x `n` words to PEs 1 and 2 (wafer_gpt2/kernels/comm/scatter.csl) and at once activates its
# `next` task, which overwrites the buffer the send reads, as a next item would; PE 1 is slow to take
# its part (a scalar loop first), so the send is held back by the fabric.
SCATTER_PE = """
param memcpy_params: comptime_struct;
param n: u16;
param role: u16;
param slot: u16;
param rx: color;
param tx: color;
const sys_mod = @import_module("<memcpy/memcpy>", memcpy_params);
const scatter = @import_module("comm/scatter.csl", .{
  .role = role, .rx_color = rx, .tx_color = tx, .rx_queue = 2, .tx_queue = 3, .step_task = 10,
  .done_task = 11, .sent_task = 12 });
var v = @zeros([2 * n]f32);
var v_ptr: [*]f32 = &v;
var busy: u32 = 0;
fn go() void {
  if (role == scatter.ROLE_FIRST) {
    scatter.send(&v, 2 * n);
    @activate(@get_local_task_id(12));
  } else {
    for (@range(u16, 200)) |i| {
      busy += @as(u32, i);
    }
    scatter.receive(&v, 0, slot * n, n);
  }
}
task kept() void {
  sys_mod.unblock_cmd_stream();
}
task next() void {
  for (@range(u16, 2 * n)) |i| {
    v[i] = -1.0;
  }
  sys_mod.unblock_cmd_stream();
}
comptime {
  @bind_local_task(kept, @get_local_task_id(11));
  @bind_local_task(next, @get_local_task_id(12));
  @export_symbol(v_ptr, "v");
  @export_symbol(go);
}
"""
SCATTER_LAYOUT = """
param n: u16;
const memcpy = @import_module("<memcpy/get_params>", .{ .width = 3, .height = 1 });
layout {
  @set_rectangle(3, 1);
  @set_tile_code(0, 0, "pe.csl", .{ .memcpy_params = memcpy.get_params(0), .n = n, .role = 0, .slot = 2,
                                    .rx = @get_color(2), .tx = @get_color(1) });
  @set_tile_code(1, 0, "pe.csl", .{ .memcpy_params = memcpy.get_params(1), .n = n, .role = 1, .slot = 1,
                                    .rx = @get_color(1), .tx = @get_color(2) });
  @set_tile_code(2, 0, "pe.csl", .{ .memcpy_params = memcpy.get_params(2), .n = n, .role = 2, .slot = 0,
                                    .rx = @get_color(2), .tx = @get_color(1) });
  @set_color_config(0, 0, @get_color(1), .{ .routes = .{ .rx = .{RAMP}, .tx = .{EAST} } });
  @set_color_config(1, 0, @get_color(1), .{ .routes = .{ .rx = .{WEST}, .tx = .{RAMP} } });
  @set_color_config(1, 0, @get_color(2), .{ .routes = .{ .rx = .{RAMP}, .tx = .{EAST} } });
  @set_color_config(2, 0, @get_color(2), .{ .routes = .{ .rx = .{WEST}, .tx = .{RAMP} } });
  @export_name("v", [*]f32, true);
  @export_name("go", fn()void);
}
"""


@pytest.mark.parametrize("arch", ["wse2", "wse3"])
def test_a_scatter_holds_its_buffer_until_the_send_has_left(arch, tmp_path):
    """The first PE of a scatter line goes on to its next item while its send may still be reading the
    buffer (and holding its output queue's microthread). The send now blocks the caller's next task
    until it has left: the slices arrive as they were when sent."""
    from csl_executor.sdk import MemcpyDataType, MemcpyOrder, SdkRuntime

    n = 32
    shutil.copytree(KERNELS / "comm", tmp_path / "comm")
    (tmp_path / "pe.csl").write_text(SCATTER_PE)
    (tmp_path / "layout.csl").write_text(SCATTER_LAYOUT)
    options = Options(arch=arch, fabric_dims=(10, 3), params={"n": n}, memcpy=True)
    runtime = SdkRuntime(compile_layout(str(tmp_path / "layout.csl"), options))
    runtime.load()
    runtime.run()
    kw = dict(
        streaming=False, data_type=MemcpyDataType.MEMCPY_32BIT, order=MemcpyOrder.ROW_MAJOR, nonblock=False
    )
    values = np.zeros((3, 2 * n), dtype=np.float32)
    values[0] = np.arange(2 * n)
    runtime.memcpy_h2d(runtime.get_id("v"), values.reshape(-1).view(np.uint32), 0, 0, 3, 1, 2 * n, **kw)
    runtime.launch("go", nonblock=False)
    out = np.zeros(3 * 2 * n, dtype=np.uint32)
    runtime.memcpy_d2h(out, runtime.get_id("v"), 0, 0, 3, 1, 2 * n, **kw)
    runtime.stop()
    got = out.view(np.float32).reshape(3, 2 * n)
    assert np.array_equal(got[2, :n], values[0, :n]), got[2, :n]  # the farthest PE's slice went first
    assert np.array_equal(got[1, :n], values[0, n:]), got[1, :n]
    assert (got[0] == -1).all()  # the next item's write, after the send


@pytest.mark.parametrize(
    "model, arch, objective",
    [("tiny", "wse2", "latency"), ("tiny", "wse3", "compact"), ("gpt2", "wse2", "latency")],
)
def test_every_multicast_reader_has_room_for_the_whole_payload(model, arch, objective):
    """A PE fed by a multicast reads its whole payload into its input array (pe/gemv.csl, layernorm.csl,
    residual.csl: one operation, no skips that would stop the stream at every reader's window): the
    plan's memory map must size that array so, for exactly the hand-offs the generator makes gather
    lines (plan/geometry.py `gathered`, codegen/build.py `connect`)."""
    from wafer_gpt2.model.config import PRESETS

    config = (
        PRESETS["gpt2"]
        if model == "gpt2"
        else GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=512, n_positions=64, name="tiny")
    )
    small = {} if model == "gpt2" else dict(dtype="fp32", slots=2, context=64)
    plan = build_plan(config, arch=arch, objective=objective, **small)
    program = build_program(plan)
    # (payload param, its per-stream param in each kernel, the array the plan sizes for it)
    inputs = [
        ("in_payload", ("in_per_stream", "in_rows_per_stream"), "x"),
        ("resid_payload", ("resid_per_stream",), "resid"),
    ]
    checked = 0
    for tile in program.tiles.values():
        if not tile.file.endswith(("gemv.csl", "layernorm.csl", "residual.csl")):
            continue
        name, _, replica = tile.region.partition("@")
        symbols = plan.region(name, int(replica or 0)).symbols
        for payload_key, per_stream_keys, symbol in inputs:
            per_stream = next((tile.params[k] for k in per_stream_keys if k in tile.params), 1)
            if per_stream > 1:
                checked += 1
                assert symbols[symbol].elems >= tile.params[payload_key], (tile.region, symbol)
    assert checked, "no multicast reader in this plan: the check ran over nothing"
