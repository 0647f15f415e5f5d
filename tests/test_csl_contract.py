"""The contract lint: the CSL program a real plan compiles to, checked without a compiler.

- params: every PE program param is supplied by the layout and every module param by its importer;
  kernels/program/layout_mirror.py `pe_params` (the Python mirror of layout.csl) gives exactly those params;
- exports: the layout exports what the PE programs export, which covers every host-visible symbol;
- indices: the layout's index formulas put every tiling index where wafer.memory_layout says;
- routes: colors in range (memcpy's 14, 15, 21-23 never used), one setting per router and color,
  every route connected, at most the usable colors on any router, the emitted rectangles equal the
  routes, and every PE's params agree with the routes through its router (it sends on exactly the
  colors whose route starts at its ramp, and listens on exactly those ending there);
- memory: every array named like a plan symbol has the plan's size and type on every PE;
- orders: the reduction roles follow wafer.tiling's chain and tree_rounds.
Real plans: GPT-2 124M on WSE-2 (fp16) and a tiny custom config (fp16 and fp32).
"""

from __future__ import annotations

import numpy as np
import pytest

from kernels import csl_contract as csl
from kernels import program as prog
from kernels.program import (
    K_ATTN,
    K_EMBED,
    K_GEMV,
    K_HEAD,
    K_NORM,
    K_RES,
    KINDS,
    MEMCPY_RESERVED,
    PROGRAM_FILE,
    ROUTABLE,
    ProgramError,
    build_program,
    decode_role,
    pe_params,
    pe_routes,
    reduction_roles,
    snake_index,
)
from wafer.compile import layout_params
from wafer.memory_layout import pe_coords
from wafer.plan import build_plan
from wafer.tiling import tree_rounds
from weights.config import PRESETS, GPT2Config

TINY = GPT2Config(n_layer=2, n_head=2, n_embd=16, vocab_size=100, n_positions=32, name="tiny")
PE_FILES = [PROGRAM_FILE[k] for k in KINDS]
HOST_VISIBLE = {"w", "b", "gain", "bias", "wpe", "k_cache", "v_cache", "cycles"}


@pytest.fixture(scope="module", params=["tiny-fp16", "tiny-fp32", "gpt2"])
def built(request):
    if request.param == "gpt2":
        plan = build_plan(PRESETS["gpt2"])
    else:
        plan = build_plan(TINY, slots=2, context=32, top_k=8, dtype=request.param.split("-")[1])
    return plan, build_program(plan)


def sample_pes(row, everything: bool):
    """Every PE of small regions; corners, edges and a few inside of big ones."""
    if everything or row.w * row.h <= 64:
        return [(lx, ly) for ly in range(row.h) for lx in range(row.w)]
    xs = sorted({0, 1, row.w // 2, row.w - 2, row.w - 1} & set(range(row.w)))
    ys = sorted({0, 1, row.h // 2, row.h - 2, row.h - 1} & set(range(row.h)))
    return [(lx, ly) for ly in range(row.h) for lx in xs] + [(lx, ly) for ly in ys for lx in range(row.w)]


# -- params and exports (the sources) -------------------------------------------------------------


def test_every_pe_program_gets_exactly_its_params_from_the_layout():
    supplied = csl.tile_code_structs("layout.csl")
    assert set(supplied) == set(PE_FILES)
    for program, fields in supplied.items():
        declared = csl.params(program)
        missing = {p for p, has_default in declared.items() if not has_default} - fields - {"memcpy_params"}
        assert not missing, f"{program}: params the layout does not supply: {sorted(missing)}"
        assert fields <= set(declared), (
            f"layout gives {program} params it does not declare: {sorted(fields - set(declared))}"
        )
    assert set(csl.params("idle.csl")) == {"memcpy_params"}


@pytest.mark.parametrize("importer", sorted([*PE_FILES, "layout.csl", "idle.csl"]))
def test_every_module_param_is_supplied_by_its_import(importer):
    for module, fields in csl.import_sites(importer):
        declared = csl.params(module)
        missing = {p for p, has_default in declared.items() if not has_default} - fields
        assert not missing, f"{importer} imports {module} without {sorted(missing)}"
        assert fields <= set(declared), (
            f"{importer} passes {module} unknown params {sorted(fields - set(declared))}"
        )


def test_layout_params_are_exactly_what_the_compile_command_passes(built):
    plan, program = built
    assert set(layout_params(program, plan.dtype)) == set(csl.params("layout.csl"))


def test_exports_cover_every_host_visible_symbol(built):
    plan, _ = built
    exported = set()
    for program in [*PE_FILES, "idle.csl"]:
        exported |= csl.exported_symbols(program)
        assert {"clear_slot", "reset_cycles"} <= csl.exported_symbols(program), (
            program
        )  # launched on every PE
    assert csl.exported_names("layout.csl") == exported
    for region in plan.regions:
        assert HOST_VISIBLE & set(region.symbols) <= exported, region.name


def test_host_functions_have_one_signature_everywhere():
    """The layout's exported fn types, every PE program's definition, and what out_rpc.json lists for
    the SDK clients' launch() checks (wafer.compile.HOST_FUNCTIONS) agree."""
    import re

    from wafer.compile import HOST_FUNCTIONS, rpc_symbols

    layout = csl.source("layout.csl")
    for name, args in HOST_FUNCTIONS.items():
        types = ", ".join(t for _, t in args)
        assert f'@export_name("{name}", fn({types}) void)' in layout, name
        for program in [*PE_FILES, "idle.csl"]:
            text = csl.source(program)
            signature = re.search(rf"fn {name}\(([^)]*)\) void", text)
            assert signature, f"{program} defines no {name}"
            assert [a.split(":")[1].strip() for a in signature.group(1).split(",") if a] == [
                t for _, t in args
            ], program
    listed = {s["name"]: s for s in rpc_symbols()}
    assert {n for n, s in listed.items() if s["kind"] == "Func"} == set(HOST_FUNCTIONS)
    assert [(i["name"], i["type"]) for i in listed["clear_slot"]["inputs"]] == list(
        HOST_FUNCTIONS["clear_slot"]
    )


def test_python_mirror_gives_exactly_the_declared_params(built):
    _, program = built
    for row in program.regions:
        got = set(pe_params(program, row, 0, 0))
        assert got == set(csl.params(PROGRAM_FILE[KINDS[row.kind]])) - {"memcpy_params"}, row.name


# -- indices ----------------------------------------------------------------------------------------


def layout_indices(row, p: dict, lx: int, ly: int) -> tuple[int, ...]:
    """The tiling indices the layout gives the PE at (lx, ly), in pe_coords' index order."""
    if row.kind in (K_GEMV, K_HEAD):
        return (p["r"], p["c"])
    if row.kind in (K_NORM, K_RES):
        return (p["i"],)
    if row.kind == K_ATTN:
        return snake_index(row, lx, ly)
    return (p["e"], prog.along(row.axes[0], lx, ly, row.w, row.h))


def test_layout_index_formulas_match_the_memory_layout(built):
    _, program = built
    for row in program.regions:
        if row.kind not in (K_GEMV, K_HEAD, K_NORM, K_RES, K_ATTN, K_EMBED):
            continue
        ys, xs = pe_coords(row.region)
        for index in np.ndindex(ys.shape):
            lx, ly = int(xs[index]), int(ys[index])
            p = pe_params(program, row, lx, ly)
            got = layout_indices(row, p, lx, ly)
            assert got == tuple(index), (
                f"{row.name}: PE ({lx}, {ly}) computes {got}, the layout map says {index}"
            )
            if row.w * row.h > 4096 and index[-1] > 3:
                break  # big regions: the first columns of every line are enough


# -- routes -----------------------------------------------------------------------------------------


def test_colors_are_in_range_and_within_the_router_budget(built):
    _, program = built
    colors = {ch.color for ch in program.channels}
    assert colors <= set(ROUTABLE)
    assert not colors & set(MEMCPY_RESERVED) and not colors & {prog.MEMCPY_H2D, prog.MEMCPY_D2H}
    assert program.colors_per_pe().max() <= len(ROUTABLE)


def test_rectangles_reproduce_every_route_and_no_router_is_double_booked(built):
    _, program = built
    count = np.zeros((24, program.kernel_h, program.kernel_w), dtype=np.int32)
    for ch in program.channels:
        xs, ys, _, _ = ch.arrays()
        np.add.at(count, (ch.color, ys, xs), 1)
    assert count.max() == 1, "a router carries two routes on one color"
    rx, tx = program.router_maps()
    rebuilt_rx, rebuilt_tx = np.zeros_like(rx), np.zeros_like(tx)
    for r in program.rects():
        assert 0 <= r.x and r.x + r.w <= program.kernel_w and 0 <= r.y and r.y + r.h <= program.kernel_h
        assert not rebuilt_rx[r.color, r.y : r.y + r.h, r.x : r.x + r.w].any(), "two rectangles overlap"
        rebuilt_rx[r.color, r.y : r.y + r.h, r.x : r.x + r.w] = r.rx
        rebuilt_tx[r.color, r.y : r.y + r.h, r.x : r.x + r.w] = r.tx
    assert np.array_equal(rebuilt_rx, rx) and np.array_equal(rebuilt_tx, tx)


def test_every_route_is_connected(built):
    """A router sending a color towards a neighbour finds it taking that color from this side, and a
    router taking a color from a neighbour finds it sending that way; rx is one direction."""
    _, program = built
    rx, tx = program.router_maps()
    assert set(np.unique(rx).tolist()) <= {0, 1, 2, 4, 8, 16}
    for d, (dx, dy) in prog.STEP.items():
        opposite = prog.OPPOSITE[d]
        sends = (tx & d) != 0
        colors, ys, xs = np.nonzero(sends)
        nx, ny = xs + dx, ys + dy
        inside = (nx >= 0) & (nx < program.kernel_w) & (ny >= 0) & (ny < program.kernel_h)
        assert inside.all(), f"a route leaves the kernel heading {d} at ({xs[~inside][0]}, {ys[~inside][0]})"
        bad = rx[colors, ny, nx] != opposite
        assert not bad.any(), (
            f"color {colors[bad][0]} sent from ({xs[bad][0]}, {ys[bad][0]}) is not taken next door"
        )
        takes = rx == d
        colors, ys, xs = np.nonzero(takes)
        bad = (tx[colors, ys + dy, xs + dx] & opposite) == 0
        assert not bad.any(), (
            f"color {colors[bad][0]} at ({xs[bad][0]}, {ys[bad][0]}) waits for a sender that never sends"
        )
    assert not ((rx != 0) & (tx == 0)).any(), "a route ends nowhere"


def test_every_pe_sends_and_listens_exactly_where_its_routes_start_and_end(built):
    plan, program = built
    rx, tx = program.router_maps()
    everything = plan.config.n_layer <= 2
    for row in program.regions:
        for lx, ly in sample_pes(row, everything):
            x, y = row.x + lx, row.y + ly
            listens, sends = pe_routes(pe_params(program, row, lx, ly), row.kind)
            ends = set(np.flatnonzero(tx[:, y, x] & prog.RAMP).tolist())
            starts = set(np.flatnonzero(rx[:, y, x] == prog.RAMP).tolist())
            assert listens == ends, (
                f"{row.name} PE ({x}, {y}): listens on {sorted(listens)}, routes end on {sorted(ends)}"
            )
            assert sends == starts, (
                f"{row.name} PE ({x}, {y}): sends on {sorted(sends)}, routes start on {sorted(starts)}"
            )
    for x, y, w, h in program.idle:  # PEs without a region carry only routes passing through
        assert (
            not (tx[:, y : y + h, x : x + w] & prog.RAMP).any()
            and not (rx[:, y : y + h, x : x + w] == prog.RAMP).any()
        )


def values_sent(program, row, slot: str) -> int:
    """Values (after the header) one message of `row` carries on its `slot` hand-off."""
    prefix = {"out": "og", "rb": "rg"}.get(slot)
    for index, pre, off, _, group in program.gathers:
        if index == row.index and pre == prefix:
            return sum(program.g_own[off : off + group])
    if row.kind == K_ATTN:
        return row.tv("hpp") * row.tv("head_dim")
    if row.kind == K_HEAD:
        return 2 * row.tv("top_k") + 2  # the record after its item word: ids, logits, lse, target
    return row.tv("tile_n") if row.kind == K_GEMV else row.tv("chunk")


def values_expected(program, row, slot: str) -> int:
    """Values (after the header) one message arriving on `slot` walks through on every PE."""
    p = pe_params(program, row, 0, 0)
    if row.kind in (K_GEMV, K_NORM):
        return p["in_len"]
    if row.kind == K_RES:
        return row.tv("dim") if slot == "rin" else row.tv("chunk")
    if row.kind == K_ATTN:
        return 3 * row.tv("fold") * row.tv("st")
    if row.kind == K_HEAD:
        return row.tv("tile_k")
    if row.kind == prog.K_IO_OUT:
        return row.tv("rec_words") - 1
    raise AssertionError(f"no input {slot!r} on {row.name}")


def test_message_lengths_agree_between_producer_and_consumer(built):
    _, program = built
    rows = program.regions
    checked = 0
    for ch in program.channels:
        senders = [(rows[i], s) for i, s in ch.users if s in ("out", "rb")]
        receivers = [(rows[i], s) for i, s in ch.users if s in ("in", "rin")]
        for (src, out_slot), (dst, in_slot) in zip(senders, receivers, strict=False):
            sent, expected = values_sent(program, src, out_slot), values_expected(program, dst, in_slot)
            assert sent == expected, (
                f"{ch.name}: {src.name} sends {sent} values, {dst.name} expects {expected}"
            )
            checked += 1
    assert checked >= 6


# -- memory map ---------------------------------------------------------------------------------------

CSL_TYPE = {"f16": "f16", "f32": "f32", "i32": "i32", "u32": "u32"}


def test_array_sizes_match_the_plan_memory_map(built):
    plan, program = built
    for row in program.regions:
        file = PROGRAM_FILE[KINDS[row.kind]]
        declared = csl.arrays(file)
        for lx, ly in sample_pes(row, False)[:12]:
            values = pe_params(program, row, lx, ly)
            for name, symbol in row.region.symbols.items():
                assert name in declared, f"{file} declares no array {name!r} (region {row.name})"
                expr, type_name = declared[name]
                elems = csl.evaluate(expr, file, values)
                assert elems == symbol.elems, f"{row.name}.{name}: CSL {elems} elements, plan {symbol.elems}"
                assert csl.element_type(file, type_name, values) == CSL_TYPE[symbol.dtype], (
                    f"{row.name}.{name}"
                )


# -- reduction orders ---------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 13, 64, 96, 197])
def test_tree_roles_follow_tree_rounds(n):
    """Replaying the roles round by round adds exactly the pairs of wafer.tiling.tree_rounds."""
    roles = [decode_role(w) for w in reduction_roles("tree", n)]
    expr = [f"p{i}" for i in range(n)]
    for j, pairs in enumerate(tree_rounds(n)):
        for dst, src in pairs:
            assert j in roles[dst][0] and roles[src][1] == j
            expr[dst] = f"({expr[dst]}+{expr[src]})"
    assert all(tx is None for rx_, tx, _ in roles[:1])  # index 0 is the root
    receives = sum(len(r[0]) for r in roles)
    assert receives == n - 1 == sum(r[1] is not None for r in roles)


@pytest.mark.parametrize("n", [1, 2, 3, 7])
def test_chain_roles_add_in_index_order(n):
    roles = [decode_role(w) for w in reduction_roles("chain", n)]
    for i, (rx_, tx, stream) in enumerate(roles):
        assert len(rx_) == (i > 0) and (tx is None) == (i == n - 1) and stream == (0 < i < n - 1)


# -- refusals -------------------------------------------------------------------------------------------


def test_overlapping_regions_are_refused():
    plan = build_plan(TINY, slots=2, context=32)
    a, b = plan.region("L0.ln_1"), plan.region("L0.qkv")
    b.y = a.y
    with pytest.raises(ProgramError, match="overlap"):
        build_program(plan)


# -- WSE-3 input queues ---------------------------------------------------------------------------------


def test_wse3_every_pe_program_fits_the_input_queues():
    assert csl.wse3_queue_problems() == []
    head = csl.input_queues("embed_head.csl")  # the busiest PE program: memcpy's 2 + 6
    assert len({q for _, q in head} | csl.MEMCPY_INPUT_QUEUES) == csl.WSE3_INPUT_QUEUES


def test_wse3_queue_check_fails_on_an_over_subscribed_pe():
    text = csl.source("embed_head.csl")
    extra = text + '\nconst spare = @import_module("stream.csl", .{ .rx_queue = 8, .tx_queue = 6 });\n'
    problems = csl.wse3_queue_problems({"embed_head.csl": extra})
    assert any("embed_head.csl: a PE binds 9 input queues at once" in p for p in problems), problems
    assert any("binds input queue 8; WSE-3 has ids 0-7" in p for p in problems), problems


def test_wse3_queue_check_fails_on_a_shared_or_reserved_queue():
    gemv = csl.source("gemv.csl")
    shared = gemv.replace(".in_queue = 4", ".in_queue = 2")
    assert shared != gemv
    assert any(
        "input queue 2 is bound by 2 instances at once" in p
        for p in csl.wse3_queue_problems({"gemv.csl": shared})
    )
    reserved = gemv.replace(".in_queue = 4", ".in_queue = 1")
    assert any("which memcpy keeps" in p for p in csl.wse3_queue_problems({"gemv.csl": reserved}))


def test_wse3_queue_check_fails_when_a_reduction_takes_a_queue_per_receive():
    """The old WSE-3 scheme (receive k on queue in_queue + k) ran out of queues at a tree root."""
    per_receive = csl.source("reduce.csl").replace(
        "@get_input_queue(in_queue)", "@get_input_queue(in_queue + k)"
    )
    assert any("reduce.csl must bind exactly one input queue" in p
               for p in csl.wse3_queue_problems({"reduce.csl": per_receive}))  # fmt: skip
