"""The simulator's pieces: reduction orders, top-k, the PE memory layout and the per-PE memory limit."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from wafer_gpt2.core import memory_layout
from wafer_gpt2.core.steps import StepInputs
from wafer_gpt2.core.tiling import QKV_ORDER, AttentionTiling, GemvTiling, HeadTiling, NormTiling
from wafer_gpt2.plan import Symbol, build_plan
from wafer_gpt2.sim import SimRuntime, kernels
from wafer_gpt2.sim.memory import PlanMemoryError


@pytest.mark.parametrize("n", [1, 2, 5, 8, 13, 48])
def test_reductions_follow_the_tiling_order_bit_for_bit(n):
    rng = np.random.default_rng(n)
    partials = (rng.standard_normal((n, 3, 7)) * 10.0 ** rng.integers(-3, 4, (n, 1, 1))).astype(np.float32)
    chain = partials[0].copy()
    for r in range(1, n):
        chain = chain + partials[r]
    assert np.array_equal(kernels.combine(partials.copy(), "chain"), chain)
    # two_level, runs of 3: each run chained, then the runs' sums chained in run order
    sums = []
    for start in range(0, n, 3):
        run = partials[start].copy()
        for r in range(start + 1, min(start + 3, n)):
            run = run + partials[r]
        sums.append(run)
    total = sums[0]
    for run in sums[1:]:
        total = total + run
    assert np.array_equal(kernels.combine(partials.copy(), "two_level", 3), total)


@pytest.mark.parametrize(("n", "group", "end_group"), [(8, 2, 2), (12, 2, 3), (48, 3, 4), (96, 4, 4)])
def test_three_level_reductions_follow_the_tiling_order_bit_for_bit(n, group, end_group):
    """Runs of `group` chained, their sums chained in runs of `end_group`, those sums chained in order
    (comm/reduce.csl's third level), in the simulator's combine and in its GEMV's blocked reduction."""
    rng = np.random.default_rng(n)
    partials = (rng.standard_normal((n, 3, 7)) * 10.0 ** rng.integers(-3, 4, (n, 1, 1))).astype(np.float32)

    def chained(vectors):
        total = vectors[0].copy()
        for v in vectors[1:]:
            total = total + v
        return total

    runs = [chained(partials[s : s + group]) for s in range(0, n, group)]
    tops = [chained(runs[s : s + end_group]) for s in range(0, len(runs), end_group)]
    expected = chained(tops)
    assert np.array_equal(kernels.combine(partials.copy(), "three_level", group, end_group), expected)
    assert not np.array_equal(expected, kernels.combine(partials.copy(), "two_level", group))
    # the GEMV's blocked form: one input of 1.0 per row, so row r's partial is its weight row
    weights = np.ascontiguousarray(partials.transpose(1, 0, 2)[:1].transpose(1, 0, 2))  # [n, 1, 7]
    chunks = np.ones((n, 1, 1), dtype=np.float32)
    got = kernels._reduce_columns(chunks, weights, "three_level", group, None, end_group)
    assert np.array_equal(got, kernels.combine(weights.copy(), "three_level", group, end_group))


def test_gemv_matches_a_plain_matmul_for_every_orientation_and_split():
    rng = np.random.default_rng(0)
    k, n = 40, 48
    weight = rng.standard_normal((k, n)).astype(np.float32)
    x = rng.standard_normal((3, k)).astype(np.float32)
    for tiling in (
        GemvTiling(k, n, 3, 5),
        GemvTiling(k, n, 6, 4, "k_along_x", "two_level", group=4),
        GemvTiling(k, n, 8, 4, "k_along_x", "three_level", group=2, end_group=2),
        GemvTiling(k, n, 4, 4, "k_along_x", "chain", n_split=3),
        GemvTiling(k, n, 4, 4, "k_along_x", "chain", n_split=3, split_cols=2),
    ):
        cache = kernels.gemv_weight_cache(memory_layout.gemv_weight_tiles(weight, tiling), tiling)
        np.testing.assert_allclose(
            kernels.gemv_region(x, cache, tiling, fp16=False), x @ weight, rtol=1e-5, atol=1e-5
        )
        bias = rng.standard_normal(n).astype(np.float32)
        assert np.array_equal(
            kernels.gemv_bias_cache(memory_layout.gemv_bias_tiles(bias, tiling), tiling), bias
        )


@pytest.mark.parametrize("reduction", ["chain", "two_level", "three_level"])
def test_a_bias_at_the_root_joins_the_last_partial_once(reduction):
    """`root_bias`: the bias added to the partial of the PE that ends the reduction, before the
    reduction (gemv.csl `bias_first`). Small integers make every fp32 sum exact whatever its order, so
    the result is x @ W + b exactly: the bias lands once, on its own output."""
    rng = np.random.default_rng(2)
    k, n = 40, 48
    weight = rng.integers(-3, 4, (k, n)).astype(np.float32)
    x = rng.integers(-3, 4, (2, k)).astype(np.float32)
    bias = rng.integers(-50, 50, n).astype(np.float32)
    rows = 8 if reduction == "three_level" else 5
    lines = GemvTiling(k, n, rows, 4, reduction=reduction, group=2, end_group=2)
    for tiling in (lines, GemvTiling(k, n, 1, 6)):
        cache = kernels.gemv_weight_cache(memory_layout.gemv_weight_tiles(weight, tiling), tiling)
        got = kernels.gemv_region(x, cache, tiling, False, bias)
        assert np.array_equal(got, x @ weight + bias)


def test_a_run_of_split_columns_holds_each_segment_contiguous():
    """c_attn's q | k | v over runs of columns: a run's outputs in column order are its slice of q,
    then of k, then of v (a head group's stream, read by attention.csl without reordering)."""
    tiling = GemvTiling(8, 24, 2, 4, "k_along_x", n_split=3, split_cols=2)  # segments of 8, 2 per column
    order = tiling.column_order()
    assert tiling.tile_n == 6
    assert order[:12] == [0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19]  # columns 0 and 1: q, k, v of 0..3
    assert order[12:] == [4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23]
    one = GemvTiling(8, 24, 2, 4, "k_along_x", n_split=3).column_order()
    assert one[:6] == [0, 1, 8, 9, 16, 17]  # a run of one column: its two of each
    with pytest.raises(ValueError, match="runs of 3 columns"):
        GemvTiling(8, 24, 2, 4, "k_along_x", n_split=3, split_cols=3).column_order()
    # qkv's runs carry k first (QKV_ORDER): the same slices, k's before q's
    kqv = GemvTiling(8, 24, 2, 4, "k_along_x", n_split=3, split_cols=2, segment_order=QKV_ORDER)
    assert kqv.column_order()[:12] == [8, 9, 10, 11, 0, 1, 2, 3, 16, 17, 18, 19]
    with pytest.raises(ValueError, match="not an order of 3 segments"):
        GemvTiling(8, 24, 2, 4, "k_along_x", n_split=3, split_cols=2, segment_order=(0, 0, 2)).column_order()


@pytest.mark.parametrize("stored", [np.float32, np.float16])
def test_a_folded_layernorm_is_the_layernorm_then_the_gemv(stored):
    """LayerNorm(x) @ W + b from the raw x: the gain and beta folded into the weights the PEs hold
    (`memory_layout.fold_layernorm`), the statistics made by the strip before the GEMV
    (`kernels.folded_norm`), against the unfolded float64 LayerNorm (fp16: the weights rounded)."""
    rng = np.random.default_rng(1)
    k, n, eps = 40, 48, 1e-5
    weight = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
    bias, gain, beta = (rng.standard_normal(size).astype(np.float32) for size in (n, k, k))
    x = (rng.standard_normal((3, k)) + 0.5).astype(np.float32)  # a stream with an offset
    folded, shifted, colsum = memory_layout.fold_layernorm(weight, bias, gain, beta, np.dtype(stored))
    x64 = x.astype(np.float64)
    normed = (x64 - x64.mean(1, keepdims=True)) / np.sqrt(x64.var(1, keepdims=True) + eps)
    unfolded = normed @ (gain[:, None].astype(np.float64) * weight).astype(stored).astype(np.float64)
    want = unfolded + beta.astype(np.float64) @ weight + bias
    for tiling, strip in (
        (GemvTiling(k, n, 3, 5, norm_fold=True), NormTiling(k, 3, normalise=False)),
        (
            GemvTiling(k, n, 6, 4, "k_along_x", "two_level", group=4, norm_fold=True),
            NormTiling(k, 6, "two_level", group=2, normalise=False),
        ),
    ):
        cache = kernels.gemv_weight_cache(memory_layout.gemv_weight_tiles(folded, tiling), tiling)
        sums = kernels.gemv_region(x, cache, tiling, fp16=False)
        got = kernels.folded_norm(sums, x, colsum, strip, eps) + shifted
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-5)


def test_top_k_breaks_ties_by_lower_id():
    logits = np.array([[1.0, 3.0, 2.0, 3.0, 2.0, 2.0, 0.5]], dtype=np.float32)
    ids, values = kernels.top_k(logits, 4)
    assert ids.tolist() == [[1, 3, 2, 4]] and values.tolist() == [[3.0, 3.0, 2.0, 2.0]]


@pytest.mark.parametrize(
    ("workers", "tree", "group"),
    [(1, "chain", 0), (2, "chain", 0), (4, "two_level", 2), (16, "two_level", 3)],
)
def test_the_heads_log_sum_exp_in_its_rounds_order(workers, tree, group):
    """The head's log-sum-exp as pe/head.csl sums it (every worker's slice against its own max,
    rescaled to the global max; the slices of a column added along its K-line; the columns over the
    roots' tree, both halves towards the centre) is the float64 log-sum-exp, also where 1000 tokens
    on 9 columns of 112 leave the last column 104 (with 16 workers its last slice is empty), and on
    logits far apart (slices whose max is far below another's)."""
    rng = np.random.default_rng(0)
    head = HeadTiling(1000, 16, GemvTiling(16, 1000, 32, 9, "k_along_x"), top_k=8)
    logits = (rng.standard_normal((3, 1000)) * 5).astype(np.float32)
    logits[1, ::7] -= 200.0
    exact = np.log(np.exp(logits.astype(np.float64) - 50.0).sum(axis=1)) + 50.0
    ours = kernels._logsumexp(logits, replace(head, workers=workers, tree=tree, tree_group=group))
    np.testing.assert_allclose(ours, exact, rtol=0, atol=2e-5)


def test_layout_round_trips_through_mirrored_axes_and_the_attention_snake(small_config):
    plan = build_plan(small_config, "wse2", "fp32", slots=2, context=64)
    for reg in plan.regions:
        if reg.tiling is None and reg.kind != "embed":
            continue
        ys, xs = memory_layout.pe_coords(reg)
        assert ys.size == len(set(zip(ys.ravel().tolist(), xs.ravel().tolist(), strict=True)))  # one PE each
    attn = replace(plan.region("L0.attn"), axes={"position": "+x", "head_group": "+y"})
    tiling: AttentionTiling = attn.tiling
    ys, xs = memory_layout.pe_coords(attn)
    row = tiling.chain // tiling.fold
    assert (ys[0, :row] == 0).all() and xs[0, 0] == 0 and xs[0, row - 1] == row - 1
    if tiling.fold > 1:  # the chain turns back on the next row
        assert ys[0, row] == 1 and xs[0, row] == row - 1
    mirrored = replace(attn, axes={"position": "-x", "head_group": "+y"})
    assert memory_layout.pe_coords(mirrored)[1][0, 0] == attn.w - 1
    proj = replace(plan.region("L0.proj"), axes={"k": "-y", "n": "+x"})
    ys, xs = memory_layout.pe_coords(proj)
    assert ys[0, 0] == proj.h - 1 and xs[0, 1] == 1  # reduction index 0 sits on the south edge


def test_a_plan_over_the_pe_memory_is_refused_naming_pe_and_symbol(small_config):
    plan = build_plan(small_config, "wse2", "fp32", slots=2, context=32)
    qkv = plan.region("L0.qkv")
    budget = plan.arch.data_bytes("gemv")
    qkv.symbols = {**qkv.symbols, "w": Symbol("f32", budget // 4 + 1)}
    with pytest.raises(PlanMemoryError, match=rf"PE \({qkv.x}, {qkv.y}\) of region 'L0.qkv'.*at symbol 'w'"):
        SimRuntime(plan)


def test_the_cycle_counter_counts_against_the_pe_budget(small_config):
    """The plan lists `cycles` among a region's symbols; the simulator checks it like any other array."""
    plan = build_plan(small_config, "wse2", "fp32", slots=2, context=32)
    qkv = plan.region("L0.qkv")
    assert list(qkv.symbols)[-1] == "cycles"
    others = sum(s.nbytes for name, s in qkv.symbols.items() if name != "w")
    room = plan.arch.data_bytes("gemv") - others  # bytes left for w next to every other array
    qkv.symbols = {**qkv.symbols, "w": Symbol("f32", room // 4 + 1)}  # would fit without the counter
    with pytest.raises(PlanMemoryError, match=r"region 'L0.qkv'.*at symbol 'cycles'"):
        SimRuntime(plan)


def test_clear_slot_zeroes_only_that_slot(small_params):
    from wafer_gpt2.backends.registry import BackendOptions, build_backend
    from wafer_gpt2.core.steps import StepItem

    sim = build_backend("sim", small_params, BackendOptions(slots=2, dtype="fp32", context=16))
    try:
        sim.step(
            StepInputs.of_items(
                [StepItem(0, i, 10 + i) for i in range(3)] + [StepItem(1, i, 20 + i) for i in range(3)]
            )
        )
        attn = next(m for m in sim.runtime.memory.regions if m.region.name == "L0.attn")
        cache = attn.arrays["k_cache"].reshape(attn.region.h, attn.region.w, 2, -1)
        assert np.abs(cache[:, :, 0]).max() > 0 and np.abs(cache[:, :, 1]).max() > 0
        sim.free_slot(0)
        assert np.abs(cache[:, :, 0]).max() == 0 and np.abs(cache[:, :, 1]).max() > 0
        cycles = sim.last_step_cycles()
        assert (
            cycles["L0.attn"] > 0 and cycles["head"] > 0 and set(cycles) == {r.name for r in sim.plan.regions}
        )
    finally:
        sim.close()


@pytest.mark.parametrize(
    "n, widest, threads, count",
    [(50257, 2048, 2, 26), (768, 4096, 2, 2), (2304, 512, 2, 6), (100, 16, 1, 7), (7, 128, 2, 1)],
)
def test_column_blocks_cover_every_column_once_in_even_shares(n, widest, threads, count):
    blocks = kernels._column_blocks(n, widest, threads)
    assert len(blocks) == count
    assert blocks[0][0] == 0 and blocks[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(blocks, blocks[1:], strict=False))
    widths = {stop - start for start, stop in blocks[:-1]}
    assert len(widths) <= 1 and all(w % kernels.GEMV_ALIGN == 0 and w <= widest for w in widths)


def test_slot_parts_keep_slots_whole_ordered_and_balanced():
    from wafer_gpt2.sim.wafer_program import slot_parts

    # slot 3 has 16 items (a prefill run), slots 0, 1, 2, 5 one each, slot 4 has 8
    slots = np.array([0] + [3] * 16 + [1, 2] + [4] * 8 + [5])
    parts = slot_parts(slots, 2)
    assert len(parts) == 2
    assert sorted(np.concatenate(parts).tolist()) == list(range(len(slots)))
    for rows in parts:
        assert np.all(np.diff(rows) > 0)  # the items keep their order
    owners = [{int(s) for s in slots[rows]} for rows in parts]
    assert not owners[0] & owners[1]  # a slot never straddles two parts
    sizes = sorted(len(rows) for rows in parts)
    assert sizes == [12, 16]  # slot 3 alone; slot 4 and the single-item slots together
    assert [r.tolist() for r in slot_parts(slots, 1)] == [list(range(len(slots)))]
    assert [r.tolist() for r in slot_parts(np.array([2, 2, 2]), 2)] == [[0, 1, 2]]


@pytest.mark.parametrize("symbol", ["k_cache", "v_cache"])
def test_kv_logical_reads_back_what_write_kv_stored(small_config, symbol):
    """The float32 [slot, head, position, head_dim] view attention reads is the PE memory's content."""
    plan = build_plan(small_config, "wse2", "fp16", slots=3, context=40)
    region = next(r for r in plan.regions if r.kind == "attention" and r.replica == 0)
    t = region.tiling
    pe_y, pe_x = memory_layout.pe_coords(region)
    memory = np.zeros((region.h, region.w, region.symbols["k_cache"].elems), np.float16)
    slots, positions = np.array([0, 2, 2, 1]), np.array([5, 0, 1, 39])
    values = np.random.default_rng(3).standard_normal((4, t.n_head * t.head_dim)).astype(np.float32)
    kernels.write_kv(memory, values, slots, positions, t, pe_y, pe_x, symbol)

    logical = kernels.kv_logical(memory, t, pe_y, pe_x, symbol)
    assert logical.shape == (t.slots, t.n_head, t.chain * t.positions_per_pe, t.head_dim)
    stored = values.astype(np.float16).astype(np.float32).reshape(4, t.n_head, t.head_dim)
    np.testing.assert_array_equal(logical[slots, :, positions], stored)
    untouched = np.ones(logical.shape[:3], dtype=bool)
    untouched[slots, :, positions] = False
    assert not logical[untouched].any()
    # the PE's own order (wafer_gpt2/kernels/pe/attention.csl): K^T per head, V row by row
    hpp, ppp, dim = t.heads_per_pe, t.positions_per_pe, t.head_dim
    owner, j = divmod(int(positions[0]), ppp)
    held = memory[pe_y[0, owner], pe_x[0, owner]].astype(np.float32)
    if symbol == "k_cache":
        rows = held.reshape(t.slots, hpp, dim, ppp)[slots[0], :, :, j]
    else:
        rows = held.reshape(t.slots, hpp, ppp, dim)[slots[0], :, j, :]
    np.testing.assert_array_equal(rows, stored[0, :hpp])
