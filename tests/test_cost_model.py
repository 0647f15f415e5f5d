"""The cycle model's formulas on small cases computed by hand (constants by name: H per hop, R router to
PE, S per DSD operation started, T per task activation, 20 per exp, fp16 SIMD 4 on WSE-2 and 8 on WSE-3, fp32 1)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from wafer_gpt2.core import calibration, cost
from wafer_gpt2.core.arch import ARCHS
from wafer_gpt2.core.tiling import AttentionTiling, GemvTiling, HeadTiling, NormTiling, gather_lines
from wafer_gpt2.model.config import PRESETS
from wafer_gpt2.plan import build_plan
from wafer_gpt2.plan.stages import RECORD_SORT_PHASE, UNSTREAMED_RES_2_PHASE

H, R, S, T = cost.HOP_CYCLES, cost.ROUTER_TO_PE_CYCLES, cost.DSD_OP_START_CYCLES, cost.TASK_ACTIVATION_CYCLES
M = cost.MAP_STEP_CYCLES  # one step of a GEMV's @map, beyond its FMACs
STEP = H + R + 1  # one chain step: a hop, into the PE, one fp32 add


def test_constants_are_the_published_or_calibrated_ones() -> None:
    assert cost.CLOCK_HZ == 1.1e9 and cost.SDK_CLOCK_HZ == 0.85e9
    assert (cost.WAVELETS_PER_LINK_PER_CYCLE, cost.ROUTER_TO_PE_CYCLES) == (1, 7)
    # the two fitted on WaferLLM's MeshGEMV measured on a CS-3 (wafer_gpt2.core.calibration)
    hop, op_start, map_step = calibration.fit()
    assert (H, S, cost.MAP_STEP_CYCLES) == (round(hop), round(op_start), round(map_step)) == (2, 15, 2)
    assert ARCHS["wse2"].macs_per_cycle("fp16") == 4 and ARCHS["wse3"].macs_per_cycle("fp16") == 8
    assert ARCHS["wse2"].macs_per_cycle("fp32") == ARCHS["wse3"].macs_per_cycle("fp32") == 1
    assert ARCHS["wse2"].usable_colors == 21 and ARCHS["wse2"].pe_sram_bytes == 48 * 1024
    assert cost.cycles_to_us(1100) == pytest.approx(1.0) and cost.cycles_to_us(
        850, cost.SDK_CLOCK_HZ
    ) == pytest.approx(1.0)


def test_streams_and_reductions() -> None:
    assert cost.stream_cycles(5, 3) == 3 * H + R + 5
    assert cost.chain_reduce_cycles(3, 4) == 3 * STEP + 4
    assert cost.chain_reduce_cycles(0, 4) == 0
    # two_level, runs of 3 over 6 PEs: both runs chain (2 steps), the runs' ends, 3 hops apart, chain
    # theirs as they stream out (1 step), and the words pass once (comm/reduce.csl's FIFO)
    assert cost.two_level_reduce_cycles(6, 4, 3) == (2 * STEP) + (3 * H + R + 1) + 4
    two_of_four = STEP + (2 * H + R + 1) + 1
    assert cost.two_level_reduce_cycles(4, 1, 2) == two_of_four
    assert cost.reduce_cycles("two_level", 6, 4, 3) == cost.two_level_reduce_cycles(6, 4, 3)
    # all-reduce over 4 PEs: root 1; the halves (0, 1) and (3, 2) chain at the same time, 2 hands its
    # sum to 1 (a hop into the PE after its half, one add, a task to start the broadcast), then 1
    # broadcasts both ways (2 hops at most)
    join = (STEP + 1) + H + R + 1 + 1 + T
    assert cost.allreduce_cycles("chain", 4, 1) == join + (2 * H + R + 1)
    assert cost.allreduce_cycles("two_level", 4, 1, 2) == join + (2 * H + R + 1)  # runs of 2 = the halves
    # over 8 PEs, runs of 2: each half of 4 is two_of_four; root 3 is 4 hops from PE 7
    assert cost.allreduce_cycles("two_level", 8, 1, 2) == (two_of_four + H + R + 1 + 1 + T) + (4 * H + R + 1)
    assert cost.allreduce_cycles("two_level", 1, 1, 2) == 0
    kind, group = cost.best_reduction(64, 1)
    assert kind == "two_level" and 2 <= group < 64 and cost.best_reduction(3, 64) == ("chain", 0)
    assert cost.reduction_options(4) == [("chain", 0), ("two_level", 2), ("two_level", 3)]
    # three levels over 8 PEs, runs of 2, their ends in runs of 2: a link in each run, a link of 2 hops
    # between the ends of a pair of runs, one of 4 hops between the two pairs' ends
    assert cost.three_level_reduce_cycles(8, 4, 2, 2) == STEP + (2 * H + R + 1) + (4 * H + R + 1) + 4
    assert cost.reduce_cycles("three_level", 8, 4, 2, 2) == cost.three_level_reduce_cycles(8, 4, 2, 2)
    # only whole runs, whole runs of their ends and at least two of those (what comm/reduce.csl takes)
    assert [o for o in cost.gemv_reduction_options(8) if o[0] == "three_level"] == [("three_level", 2, 2)]
    assert cost.gemv_reduction_options(7) == [(kind, g, 0) for kind, g in cost.reduction_options(7)]


def test_gemv_cost_by_hand() -> None:
    g = cost.GELU_CYCLES
    small = GemvTiling(4, 4, 2, 2)  # tile 2x2, chain over 2 rows
    # the accumulator zeroed (an @fmovs of the tile's 2 outputs), then one @map started, over 2
    # inputs, each step ceil(2 / 4) = 1 cycle of FMACs
    zero = S + 2
    fmac = zero + S + 2 * (M + 1)
    # With an epilogue (fc's GELU), gemv.csl's steps on the last PE: a task for the input, one for the
    # sums, the bias's operation and the GELU's @map, the header and outputs sent in one operation.
    send = S + 5
    c = cost.gemv_cost(small, "wse2", "fp16", epilogue_cycles_per_output=g)
    assert c.phases == {
        "input multicast": H + R,
        "task: the input in": T,
        "tile FMAC": fmac,
        "chain reduction": STEP + 2,
        "task: the sums in": T,
        "bias + epilogue": (S + 2) + (S + 2 * g),
        "the output's header (its send's start)": send,
    }
    # Without one (attn_proj, proj) the sums stream into the lane as the reduction makes them: the
    # last PE's bias pass, header and the lane's operation start (3 S + 2 + 5), then its 2 words, are
    # later than the reduction's 2 words here (a line of two PEs), by the rest.
    assert small.bias_at_root and cost.streams_out(small) and not cost.streams_out(small, g)
    c = cost.gemv_cost(small, "wse2", "fp16")
    own = 3 * S + 2 + 5
    assert c.phases == {
        "input multicast": H + R,
        "task: the input in": T,
        "tile FMAC": fmac,
        "chain reduction": STEP + 2,
        "the last PE's bias and header (beyond the reduction)": own + 2 - (STEP + 2),
    }
    assert cost.gemv_cost(small, "wse2", "fp32").cycles == c.cycles + 2  # 2 outputs at 1 per cycle
    # tile 16x64: the last PE's bias pass over 64 words, its header and the lane's start (3 S + 64 + 5)
    # outlast the 3 links of the chain, so its 64 words leave after them
    wide = GemvTiling(64, 64, 4, 1)
    zero, last = S + 64, (3 * S + 64 + 5) + 64
    assert cost.gemv_cost(wide, "wse2", "fp16").cycles == R + T + zero + S + 16 * (M + 16) + last
    assert cost.gemv_cost(wide, "wse3", "fp16").cycles == R + T + zero + S + 16 * (M + 8) + last
    # The LayerNorm folded in (qkv): a task for the sums, the statistics, one FMAC into memory, and the
    # last one (the bias plus the sums times rstd) as the output leaves, its header sent long before
    folded = GemvTiling(64, 64, 4, 1, norm_fold=True)
    phases = cost.gemv_cost(folded, "wse2", "fp16").phases
    assert not folded.bias_at_root and phases["task: the sums in"] == T
    assert phases["LayerNorm (mean, rstd), the bias as the output leaves"] == 10 + (S + 64) + S
    assert "the output's header (its send's start)" not in phases
    # with GELU after it (fc) the epilogue makes the output in memory, and the frame is sent
    phases = cost.gemv_cost(folded, "wse2", "fp16", g).phases
    assert phases["LayerNorm (mean, rstd) + bias"] == 10 + 2 * (S + 64)
    assert phases["the output's header (its send's start)"] == S + 5
    two = GemvTiling(64, 64, 4, 1, reduction="two_level", group=2)
    c = cost.gemv_cost(two, "wse2", "fp16", epilogue_cycles_per_output=g)
    assert c.phases["two_level reduction (runs of 2)"] == STEP + (2 * H + R + 1) + 64
    # the bias's operation, then the GELU's @map
    assert c.phases["bias + epilogue"] == S + 64 + S + 64 * g


def test_a_shared_epilogue_by_hand() -> None:
    """fc's GELU shared by the last PEs of a K-line (wafer_gpt2.core.cost.epilogue_cycles): 16 outputs on 2 PEs.
    The root biases all 16 (an operation, S + 16) and starts the stream of slice 0 back (S), which reaches the other PE
    one link later with its 8 words (STEP + 8); a task activation there, 8 GELUs (the root's own 8
    are done long before). The gather line: the far PE's header (S + 5), a task and a DSD operation,
    its 8 words; the root, its own slice long done, passes the header and those 8 words on in one
    operation (STEP after the far PE's last word), then a task and an operation, its own 8. Less the
    unshared lane's S + 5 + 16 (its header and outputs in one operation from their frame)."""
    g = cost.GELU_CYCLES
    far = S + 16 + S + STEP + 8 + T + 8 * g
    end = far + S + 5 + (T + S) + 8 + STEP + (T + S) + 8
    assert cost.epilogue_cycles(16, 2, g) == end - (S + 5 + 16)
    assert cost.epilogue_cycles(16, 1, g) == (S + 16) + (S + 16 * g)  # the last PE alone: two operations
    shared = GemvTiling(768, 3072, 32, 192, "k_along_x", epilogue_pes=4)
    phases = cost.gemv_cost(shared, "wse2", "fp16", g).phases
    assert (
        phases["bias + epilogue (shared by 4 PEs)"]
        == cost.epilogue_cycles(16, 4, g)
        < cost.epilogue_cycles(16, 1, g) * 2 / 3
    )
    with pytest.raises(ValueError, match="do not split 16 outputs"):  # relayed slices are equal
        cost.epilogue_cycles(16, 3, g)
    # offered only where there is per-output work, on as many PEs as the K-line holds, each an output
    assert cost.epilogue_options(shared, 0) == [1]
    assert cost.epilogue_options(shared, g) == list(range(1, 17))
    assert cost.epilogue_options(GemvTiling(768, 3072, 4, 192, "k_along_x"), g) == [1, 2, 3, 4]


def test_a_multicast_epilogue_by_hand() -> None:
    """The epilogue shared through comm/spread.csl: 16 outputs on 2 PEs. The root biases all 16 (S + 16)
    and starts the multicast of the other PE's 8 sums (S), which are in that PE a link and 8 words
    later; a task, its 8 GELUs, the start of its part of the sum (S). The root's own 8 GELUs and its
    read of the sum (S) are done before the sum comes: one chain step on, 8 words, a task to start
    the lane."""
    g = cost.GELU_CYCLES
    far = S + 16 + S + (H + R + 8) + T + 8 * g + S
    assert cost.epilogue_cycles(16, 2, g, multicast=True) == far + STEP + 8 + T
    # 8 PEs for 32 outputs: the farthest PE's multicast is in 7 links away, the chain of 7 steps
    far = S + (7 * H + R + 28) + T + 4 * g + S
    assert cost.epilogue_cycles(32, 8, g, bias=False, multicast=True) == far + 7 * STEP + 28 + T
    # against the unshared lane's one operation, the gather's steps cost the relayed epilogue more than
    # the multicast's sum at every width (both are offered)
    for pes in (2, 4, 8, 16):
        assert cost.epilogue_cycles(32, pes, g, False, True) < cost.epilogue_cycles(32, pes, g, False)
    # 16 outputs on 3 PEs: the farthest takes 6, the others 5; the multicast carries the 11 before the
    # root's, the farthest is 2 links away and the chain has 2 steps
    assert cost.epilogue_slices(16, 3) == [6, 5, 5]
    far = S + 16 + S + (2 * H + R + 11) + T + 6 * g + S
    assert cost.epilogue_cycles(16, 3, g, multicast=True) == far + 2 * STEP + 11 + T
    # a count that does not divide the outputs is offered multicast only
    four = GemvTiling(768, 3072, 4, 192, "k_along_x")
    assert cost.epilogue_ways(four, g) == [
        (1, False),
        (2, False),
        (2, True),
        (3, True),
        (4, False),
        (4, True),
    ]
    assert cost.epilogue_ways(four, 0) == [(1, False)]
    fc = cost.best_gemv_reduction(
        GemvTiling(768, 3072, 64, 96, "k_along_x", norm_fold=True), "wse2", "fp16", g
    )
    # 11 PEs (slices of 3 and 2) edge out 8 (of 4): a GELU less on the farthest, three chain steps more
    assert (fc.epilogue_pes, fc.epilogue_multicast) == (11, True)
    assert cost.epilogue_cycles(32, 11, g, False, True, True) < cost.epilogue_cycles(
        32, 8, g, False, True, True
    )
    # fc has its LayerNorm folded in: the multicast carries all 32 raw sums and the 2 statistics, and
    # every PE applies the LayerNorm to its 4 (rsqrt and 2 operations per output) before its GELUs
    phases = cost.gemv_cost(replace(fc, epilogue_pes=8), "wse2", "fp16", g).phases
    assert "LayerNorm (mean, rstd) + bias" not in phases
    far = S + (7 * H + R + 34) + T + (cost.RSQRT_CYCLES + 2 * 4) + 4 * g + S
    assert phases["LayerNorm + epilogue (shared by 8 PEs, multicast)"] == far + 7 * STEP + 28 + T
    assert far + 7 * STEP + 28 + T == cost.epilogue_cycles(32, 8, g, False, True, True)


def test_norm_cost_by_hand() -> None:
    # 16 values on 4 PEs: input, a task, the local sums of x and x^2 (one @map of 4 steps, each its
    # overhead and 1 + 2 ops), one all-reduce of the two words towards PE 1 (each step passes 2 words,
    # the broadcast too), a task, rsqrt, normalise (four operations over the chunk), the header's send
    two = cost.norm_cost(NormTiling(16, 4, reduction="two_level", group=2))
    allreduce = ((STEP + 2) + H + R + 1 + 2 + T) + (2 * H + R + 2)
    sums = S + 4 * (M + 3)
    assert two.phases["local sums (x, x^2)"] == sums
    assert two.phases["two_level all-reduce"] == allreduce
    steps = (R + 4) + T + sums + allreduce + T + 10 + 4 * (S + 4) + (S + 5)
    assert two.cycles == steps
    chain = cost.norm_cost(NormTiling(16, 4, reduction="chain"))
    assert chain.cycles == steps


def test_attention_cost_by_hand() -> None:
    t = AttentionTiling(
        n_head=2, head_dim=8, slots=1, context=8, head_groups=2, chain=4, fold=1, reduction="chain"
    )
    # 4 PEs x 2 positions, one head per PE: the scores are one @map of 8 steps (head dimensions) over
    # 2 positions, the weighted V one @map of 2 steps (positions) over 8 dimensions.
    c = cost.attention_cost(t, "wse2", "fp16")
    # every PE reads the header, k and q (5 + 2 x 8 words) before its task starts, v meanwhile
    assert c.phases["k, q multicast"] == 3 * H + R + 5 + 16
    # the scores' accumulator zeroed first (an @fmovs of the 2 positions), as every accumulate does
    assert c.phases["scores q.k"] == (S + 2) + S + 8 * (M + 1) + T
    weights = 2 * 20 + (S + 8) + S + 2 * (M + 2)  # the weighted V's accumulator (8 words) zeroed too
    assert c.phases["exp + weighted V"] == weights
    # The max round: a copy and the start of the round, the word through 3 chain steps; PE 3 (the
    # chain's end) takes its task after its own weights, copies M and sends it (two DSD operations);
    # PE 0, 3 hops away, takes a task when it is in.
    assert max(2 * S + 3 * STEP + 1, weights) == weights
    sent = weights + T + 2 * S
    known = sent + (3 * H + R + 1) + T
    assert c.phases["max merge round + M multicast (beyond the weights)"] == known - weights
    # Each PE: its factor (one exp) and the round's start; one head per PE, so the round's operation
    # multiplies [l | acc] by it as it goes (an FMAC with the arriving stream).
    rescale = 20 + S
    # Two heads per PE: a factor each, l times it, acc times it (an @fmuls of 8 words), then the start.
    two_heads = AttentionTiling(**{**vars(t), "n_head": 4})
    assert cost.attention_cost(two_heads, "wse2", "fp16").phases["rescale"] == 2 * (20 + 1 + S + 8) + S
    assert c.phases["rescale"] == rescale
    # The sum round along the chain, PE i ready when M reached it (PE 3 at once), then the record of
    # 9 words ([l | acc]) and the task of the chain's end.
    ready = [known + rescale - 2 * i for i in range(3)] + [sent + rescale]
    first = ready[0]
    for r in ready[1:]:
        first = max(r, first + H + R) + 1
    assert c.phases["sum merge round (chain)"] == first + 9 + T - known - rescale
    # The new position (7) is PE 3's, which ends the merge: it stores k (one @map of 8 steps, a step
    # its overhead and the rounding) before its scores, and v before its weights in a task of their
    # own (v is read on while it works), so M and all after it come that much later.
    store = S + 8 * (M + 1)
    assert c.phases["the owner's k, v store (not hidden)"] == 2 * store + T
    # 1/l (one head: no second send to chain), the multiply riding the output's stream
    assert (c.phases["1 / sum"], c.phases["to the O rows"]) == (10, 3 * H + R + 8)
    assert c.cycles == sum(c.phases.values())
    # Runs of 2: PEs 0 -> 1 and 2 -> 3 at once, then the ends (PE 1 -> PE 3, 2 hops apart) on the
    # stream of PE 3's run (comm/reduce.csl's FIFO).
    two = AttentionTiling(**{**vars(t), "reduction": "two_level", "group": 2})
    c2 = cost.attention_cost(two, "wse2", "fp16")
    assert cost._run_end_links(two) == (2,)
    end1 = max(ready[1], ready[0] + H + R) + 1
    end3 = max(ready[3], ready[2] + H + R) + 1
    assert (
        c2.phases["sum merge round (two_level)"] == max(end3, end1 + 2 * H + R) + 1 + 9 + T - known - rescale
    )
    # Folded: the runs' ends are linked by direct routes: on a snake of two rows of 5 the runs' last
    # PEs (4 and 9) sit at the two ends of their rows, five hops apart
    folded = AttentionTiling(**{**vars(t), "chain": 10, "context": 10, "fold": 2, "group": 5})
    assert cost._run_end_links(AttentionTiling(**{**vars(folded), "reduction": "two_level"})) == (5,)
    # The first token: only the owner has a position; both rounds still run the whole chain (the
    # empty PEs send (-inf) and then zeros).
    first_token = cost.attention_cost(t, "wse2", "fp16", positions=1)
    # the scores' @map still runs over both positions of the PE; the weighted V over the visible one
    assert first_token.phases["scores q.k"] == (S + 2) + S + 8 * (M + 1) + T
    assert first_token.phases["exp + weighted V"] == 20 + (S + 8) + S + (M + 2)
    # PE 0 owns position 0: its maximum joins the chain `store` late, after the others' weights (a
    # single position: 20 + zeroing + S + M + 2), so M is late for all; its own weights end after both
    # stores.
    w1 = 20 + (S + 8) + S + (M + 2)
    plain_sent = max(2 * S + 3 * STEP + 1, w1) + T + 2 * S
    sent = max(2 * S + store + 3 * STEP + 1, w1) + T + 2 * S
    known0 = max(sent + 3 * H + R + 1, 2 * store + w1) + T
    ready = (
        [known0 + rescale] + [sent + (2 * (3 - i) + R + 1) + T + rescale for i in (1, 2)] + [sent + rescale]
    )
    plain = [plain_sent + (2 * (3 - i) + R + 1) + T + rescale for i in range(3)] + [plain_sent + rescale]
    late = cost.chain_times(ready) - cost.chain_times(plain)
    assert first_token.phases["the owner's k, v store (not hidden)"] == late > 0


@pytest.mark.parametrize(("chain", "fold"), [(5, 1), (12, 2), (24, 4), (40, 4), (104, 8)])
@pytest.mark.parametrize("dtype", ["fp16", "fp32"])
def test_best_attention_is_the_fastest_that_attention_cost_prices(chain: int, fold: int, dtype: str) -> None:
    """`best_attention` ranks the merges by their rounds alone (the other phases are the same for
    every option): the option it picks is one that `attention_cost` prices fastest."""
    t = AttentionTiling(12, 64, 16, 1024, 12, chain, fold)
    options = [
        AttentionTiling(**{**vars(t), "reduction": k, "group": g}) for k, g in cost.reduction_options(chain)
    ]
    if AttentionTiling.comb_fits(chain, fold):
        options.append(t.with_comb())
    fastest = min(cost.attention_cost(o, "wse2", dtype).cycles for o in options)
    best = cost.best_attention(t, "wse2", dtype)
    assert best in options
    assert cost.attention_cost(best, "wse2", dtype).cycles == fastest


@pytest.mark.parametrize(("chain", "fold"), [(1, 1), (5, 1), (12, 2), (24, 4), (40, 4), (104, 8)])
def test_no_merge_is_faster_than_its_floor(chain: int, fold: int) -> None:
    """`merge_rounds_floor` (which lets `best_attention` leave options unpriced) is under the rounds of
    every option, the owner's stores and the PEs' work anywhere."""
    t = AttentionTiling(12, 64, 16, 1024, 12, chain, fold)
    options = [
        AttentionTiling(**{**vars(t), "reduction": k, "group": g}) for k, g in cost.reduction_options(chain)
    ]
    if AttentionTiling.comb_fits(chain, fold):
        options.append(t.with_comb())
    for option in options:
        for weights, owner, k_store, v_store in [(0, None, 0, 0), (500, 0, 40, 90), (3000, chain - 1, 0, 7)]:
            floor = cost.merge_rounds_floor(option, weights)
            assert floor <= cost.merge_rounds(option, weights, owner, k_store, v_store).summed
    # not a floor of nothing: a chain's pays its every link, twice, and a PE's work
    link = cost.link_cycles(1) + cost.FP32_OPS_PER_CYCLE
    assert cost.merge_rounds_floor(options[0], 0) >= 2 * (chain - 1) * link
    assert cost.merge_rounds_floor(options[0], 5000) >= 5000 + (chain - 1) * link


@pytest.mark.parametrize(
    ("rows", "n", "norm_fold", "per_output"),
    [
        (24, 3072, False, cost.GELU_CYCLES),  # fc: GELU shared or not
        (48, 3072, True, cost.GELU_CYCLES),  # fc with ln_2 folded in
        (32, 2304, True, 0),  # qkv with ln_1 folded in
        (36, 768, False, 0),  # proj: its sums stream out
        (60, 768, False, 0),
        (7, 192, True, cost.GELU_CYCLES),
    ],
)
def test_best_gemv_reduction_is_the_fastest_pair(rows, n, norm_fold, per_output) -> None:
    """`best_gemv_reduction` picks the reduction, then the epilogue: the pair is the first of every
    (reduction, epilogue) pair that `gemv_cost` prices fastest."""
    base = GemvTiling(768, n, rows, 12, norm_fold=norm_fold)
    pairs = [
        GemvTiling(
            **{
                **vars(base),
                "reduction": k,
                "group": g,
                "end_group": e,
                "epilogue_pes": p,
                "epilogue_multicast": m,
            }
        )
        for k, g, e in cost.gemv_reduction_options(rows)
        for p, m in cost.epilogue_ways(base, per_output)
    ]
    for dtype in ("fp16", "fp32"):
        price = [cost.gemv_cost(t, "wse2", dtype, per_output).cycles for t in pairs]
        best = cost.best_gemv_reduction(base, ARCHS["wse2"], dtype, per_output)
        assert best == pairs[price.index(min(price))]


def test_the_heads_tree_by_hand() -> None:
    """One round over the roots' tree of 3 columns (comm/tree.csl): the centre (column 1) folds the
    left half's (column 0, alone: its own vector) after a DSD operation and a hop, then the right half's
    (column 2) the same way, each a pass of the words and an add; a longer half chains to its end first
    and its end passes the last stream on to the centre as it comes."""
    head = HeadTiling(vocab=96, dim=4, gemv=GemvTiling(4, 96, 2, 3, "k_along_x"), top_k=2, workers=1)
    assert head.centre == 1 and head.tree_halves() == ([0], [2])
    join = S + H + R
    first = max(0 + S, join) + 1 + 5
    assert cost.head_tree_cycles(head, [0, 0, 0], 5) == max(first + S, join) + 1 + 5
    five = HeadTiling(vocab=160, dim=4, gemv=GemvTiling(4, 160, 2, 5, "k_along_x"), top_k=2, workers=1)
    assert five.centre == 2 and five.tree_halves() == ([0, 1], [4, 3])
    passed = STEP + H + R  # a chain of two, whose end adds the first word and passes it on
    first = max(S, passed) + 1 + 5
    assert cost.head_tree_cycles(five, [0] * 5, 5) == max(first + S, passed) + 1 + 5


def test_head_cost_adds_up_and_the_planner_takes_the_cheapest() -> None:
    head = HeadTiling(
        vocab=50257, dim=768, gemv=GemvTiling(768, 50257, 64, 393, "k_along_x"), top_k=64, workers=8
    )
    c = cost.head_cost(head, "wse2", "fp16")
    assert c.cycles == sum(c.phases.values()) and c.occupancy is None  # the rounds block: occupancy = span
    # the farthest column's input comes last: 392 hops after the first's
    assert c.phases["input to the farthest column"] == 392 * H + H + R
    best = cost.best_head(HeadTiling(vocab=50257, dim=768, gemv=head.gemv, top_k=64), "wse2", "fp16")
    assert best.gemv.reduction == "chain" and best.gemv.tile_n % best.workers == 0
    assert cost.head_cost(best, "wse2", "fp16").cycles <= c.cycles
    assert cost.worker_options(GemvTiling(16, 256, 4, 2, "k_along_x")) == [1, 2]  # fewer than the K-line's 4
    assert cost.worker_options(GemvTiling(16, 256, 1, 2, "k_along_x")) == []


def test_a_head_with_its_rounds_apart_takes_an_item_as_often_as_its_slower_role() -> None:
    """HeadTiling.apart: the workers and the root after the K-line's weighted PEs. The span grows by
    the header's and the sum's way to them (one multicast: the hops to the last worker, a task on the
    header and the sum's read), and loses the root's scatter (each worker's slice is in the sum it
    read); the stage's occupancy is the slower of its two roles, which run different items: a
    weighted PE's window read, FMACs and chain, and the rounds' PEs' everything after the chain."""
    gemv = GemvTiling(768, 50257, 24, 262, "k_along_x")
    head = HeadTiling(vocab=50257, dim=768, gemv=gemv, top_k=64, workers=8, apart=True)
    assert head.line == 24 + 8 + 1 and head.pes == 33 * 262
    c = cost.head_cost(head, "wse2", "fp16")
    assert c.phases["the sum to the rounds' PEs"] == (
        8 * H + R + cost.TASK_ACTIVATION_CYCLES + cost.DSD_OP_START_CYCLES
    )
    # the same head with its slices scattered back from the root (the rounds on weighted PEs) waits
    # for the scatter: apart, a worker's slice is ready a task after its sum
    scattered = cost.head_cost(replace(head, apart=False), "wse2", "fp16")
    round_a = "round A: slice max and min reduced to the centre"
    assert c.phases[round_a] < scattered.phases[round_a]
    assert c.phases["chain reduction"] == cost.chain_reduce_cycles(23, 192) + cost.DSD_OP_START_CYCLES + 5
    weighted, rounds = cost.head_role_cycles(head, c)
    fmac, chain = c.phases["tile FMAC"], c.phases["chain reduction"]
    assert weighted == 5 + 32 + cost.TASK_ACTIVATION_CYCLES + fmac + chain
    # every PE of the rounds reads the sum's 192 words on every item (in the span they overlap the
    # weighted chain's hops)
    assert (
        rounds
        == c.cycles - c.phases["input to the farthest column"] - fmac - chain + 192 + cost.DSD_OP_START_CYCLES
    )
    assert c.occupancy == c.busy == max(weighted, rounds) < c.cycles
    # the same K-line with its last PEs as the workers and root: one item at a time
    together = HeadTiling(vocab=50257, dim=768, gemv=replace(gemv, rows=33), top_k=64, workers=8)
    assert cost.head_cost(together, "wse2", "fp16").busy > c.busy
    # best_head keeps the plan's workers apart (they are PEs the plan gave the rounds)
    assert cost.best_head(head, "wse2", "fp16").workers == 8
    # in two sets taking the items in turn: each set's PEs once every other item, the second set's
    # items across the first set's routers (a hop each, priced on the span)
    two = replace(head, sets=2)
    assert two.line == 24 + 2 * 9 and two.set_start(1) == 33
    c2 = cost.head_cost(two, "wse2", "fp16")
    assert c2.cycles == c.cycles + 9 * cost.HOP_CYCLES
    weighted2, rounds2 = cost.head_role_cycles(two, c2)
    assert weighted2 == weighted and rounds2 == cost.ceil_div(rounds + 9 * cost.HOP_CYCLES, 2)
    assert c2.busy == max(weighted2, rounds2) < c.busy


def test_the_records_sort_is_priced_on_io_out_not_in_the_head() -> None:
    """The head's centre sends its record ordered by bin and io.out sorts inside the bins
    (lib/best_first.csl), so the head's span, every plan's initiation interval, holds no sort: io.out's
    stage does, at a pass per entry and the moves of the bins' inversions."""
    head = HeadTiling(
        vocab=50257, dim=768, gemv=GemvTiling(768, 50257, 64, 393, "k_along_x"), top_k=64, workers=8
    )
    kept, bin_t = cost.threshold_bins(50257, 393, 128, 64)
    moves = (kept - bin_t) * (bin_t / 2 - 1) / 4
    passes = 64 * cost.TOPK_SORT_PASS_CYCLES + int(
        moves * (cost.TOPK_INVERSION_CYCLES + cost.TOPK_SORT_MOVER_CYCLES)
    )
    assert cost.record_sort_cycles(head) == cost.TASK_ACTIVATION_CYCLES + passes + cost.DSD_OP_START_CYCLES
    assert not any("sort" in phase for phase in cost.head_cost(head, "wse2", "fp16").phases)
    plan = build_plan(PRESETS["gpt2"], "wse2")
    stages = {s.name: s for s in plan.stage_costs}
    assert stages["io.out"].phases[RECORD_SORT_PHASE] == cost.record_sort_cycles(plan.region("head").tiling)
    assert plan.occupancy_cycles == stages["head"].busy > stages["io.out"].busy


def test_the_centres_scalar_counts_are_the_executors_count_of_its_csl() -> None:
    """The centre's take of round C's entries (lib/topk.csl `take`) is priced at the CSL executor's rule,
    a cycle per operator, memory access and call of each statement: an entry of a bin before t, one of
    bin t (its insertion's tests and count besides), and a pass of the insertion loop (an inversion)
    are each counted here from the parsed CSL, as the executor charges them."""
    from csl_executor import ast
    from csl_executor.compiler import operations, statement_operations
    from csl_executor.parse import parse_file

    source = parse_file(str(Path(cost.__file__).parents[1] / "kernels" / "lib" / "topk.csl"))
    take = next(d for d in source.decls if getattr(d, "name", None) == "take")
    loop = next(s for s in take.body.stmts if isinstance(s, ast.For))
    *reads, branch = loop.body.stmts  # the entry's loads and its bin, then the branch on it
    entry = 1 + sum(map(statement_operations, reads)) + operations(branch.cond)  # 1: the loop's test
    earlier = entry + sum(map(statement_operations, branch.then.stmts))
    in_bin_t = branch.other  # the test for a place among bin t's places, and the insertion
    start, insertion, *after = in_bin_t.then.stmts
    moves = operations(insertion.cond) + sum(map(statement_operations, insertion.body.stmts))
    inserted = (
        entry
        + operations(in_bin_t.cond)
        + statement_operations(start)
        + operations(insertion.cond)  # its last test, which ends it
        + sum(operations(s.cond) + sum(map(statement_operations, s.then.stmts)) if isinstance(s, ast.If)
              else statement_operations(s) for s in after)
    )  # fmt: skip
    assert earlier == 2 + cost.TOPK_TAKE_CYCLES
    assert inserted - earlier == cost.TOPK_BIN_T_CYCLES
    assert moves == cost.TOPK_INVERSION_CYCLES


def test_threshold_bins() -> None:
    """Round C takes k and half the threshold bin (at least one entry); with fewer columns than k the
    histogram spans every logit; gpt2's 393 columns of 128: about 69 entries, a bin of about 9 (a
    Gaussian-logit model, which a NumPy replay of the selection on random normal logits gives as
    69.0 and 9.5)."""
    kept, bin_t = cost.threshold_bins(50257, 393, 128, 64)
    assert kept == pytest.approx(64 + bin_t / 2) and 60 < kept < 75 and 5 < bin_t < 12
    kept, bin_t = cost.threshold_bins(512, 2, 256, 16)
    assert bin_t >= 1 and kept == pytest.approx(16 + bin_t / 2)


def test_calibration_within_its_bounds() -> None:
    """Every published MeshGEMV run, fitted or checked, within 0.67-1.5x of the model: the bounds the
    calibration was set to meet."""
    rows = calibration.checks()
    assert len(rows) == len(calibration.MESHGEMV_WSE3) and any(not r.fitted_on for r in rows)
    assert all(0.67 <= r.ratio <= 1.5 for r in rows), [(r.run, r.ratio) for r in rows]
    assert all(0.9 <= r.ratio <= 1.1 for r in rows if not r.fitted_on)  # the runs not fitted on: within 10%


def test_the_executor_is_timed_against_the_same_published_runs() -> None:
    """The CSL executor keeps its own copy of the CS-3 MeshGEMV runs (it imports nothing of the
    product): the same runs, in the same order, as the cost model fits on."""
    from csl_executor.calibrate import HARDWARE

    assert HARDWARE == tuple((r.p, r.m, r.n, r.groups, r.cycles) for r in calibration.MESHGEMV_WSE3)


def test_best_choices_are_the_cheapest() -> None:
    t = GemvTiling(768, 3072, 32, 96, "k_along_x")
    best = cost.best_gemv_reduction(t, ARCHS["wse2"], "fp16", cost.GELU_CYCLES)
    chain = GemvTiling(**{**vars(t), "reduction": "chain"})
    two = cost.best_gemv_reduction(GemvTiling(768, 3072, 31, 96, "k_along_x"), ARCHS["wse2"], "fp16")
    assert (
        cost.gemv_cost(best, "wse2", "fp16", cost.GELU_CYCLES).cycles
        <= cost.gemv_cost(chain, "wse2", "fp16", cost.GELU_CYCLES).cycles
    )
    # 32 rows: runs of runs beat runs, which beat one chain; 31 (prime) takes no third level
    assert best.reduction == "three_level" and best.group * best.end_group * 2 <= 32
    assert two.reduction == "two_level" and 2 <= two.group < 31


def test_standalone_gemv() -> None:
    c = cost.standalone_gemv_cost("wse2", 2, 2, 4, 4, "fp16")
    # two rows: only the chain (a two-level reduction needs runs of at least 2 and two runs); injection
    # = 7 + tile_k.
    assert c.name == "chain reduction"
    assert c.phases == {
        "input injection": R + 2,
        "input multicast": H + R,
        "task: the input in": T,
        "tile FMAC": (S + 2) + S + 2 * (M + 1),
        "chain reduction": STEP + 2,
        "the last PE's bias and header (beyond the reduction)": (3 * S + 2 + 5) + 2 - (STEP + 2),
    }
    assert c.cycles == sum(c.phases.values())
    wide = cost.standalone_gemv_cost("wse2", 16, 4, 64, 64, "fp16")
    assert wide.name.startswith("three_level (runs of 2, their ends in runs of 2)")


def test_ready_time_reductions_are_the_closed_forms_at_zero_skew() -> None:
    """The reductions priced from their members' ready times (first word out of the
    member that ends them) are today's closed forms when every member is ready at once."""
    for n in (2, 3, 7, 8, 48, 64, 96, 393):
        zero = [0] * n
        root = cost.allreduce_root(n)
        for words in (1, 2, 65, 128):
            assert cost.chain_times(zero) + words == cost.chain_reduce_cycles(n - 1, words)
            for g in (2, 3, 5, 8, 18, 64):
                if g < n:
                    two = cost.two_level_reduce_cycles(n, words, g)
                    assert cost.level_times(zero, [g]) + words == two, (n, g)
                    assert cost.reduce_times("two_level", zero, g) == cost.level_times(zero, [g])
            for _, g, e in cost.gemv_reduction_options(n):
                if e:
                    three = cost.three_level_reduce_cycles(n, words, g, e)
                    assert cost.level_times(zero, [g, e]) + words == three, (n, g, e)
            # the all-reduce: its reduction to the middle, a task, the broadcast back both ways
            back = T + max(root, n - 1 - root) * H + R + words
            for kind, group in cost.reduction_options(n)[:6]:
                total = cost.mid_times(zero, kind, group, words) + back
                assert total == cost.allreduce_cycles(kind, n, words, group), (n, kind, group)
    assert cost.chain_times([0]) == 0 and cost.mid_times([0], "chain", 0, 5) == 5


def test_ready_times_follow_the_late_members() -> None:
    # a chain over 3 members, the last one late: its own add waits for it, not the link
    assert cost.chain_times([0, 0, 100]) == 100 + 1
    assert cost.chain_times([0, 0, 0]) == 2 * STEP
    # a member ready late in the middle of a chain delays everything after it by what it is late
    assert cost.chain_times([0, 50, 0, 0]) == 50 + 1 + 2 * STEP
    # two levels, runs of 2 over 4 members ready as an input wave two cycles a member apart: the
    # second run's end is ready at 6, the first run's sum leaves its end at 2 + 1 and reaches the
    # second end's CE over 2 hops
    wave = [0, 2, 4, 6]
    first_run = max(2, 0 + H + R) + 1
    second_run = max(6, 4 + H + R) + 1
    assert cost.level_times(wave, [2]) == max(second_run, first_run + 2 * H + R) + 1
    # three levels: runs of 2, pairs of their ends, then the chain of those: spans of 2 and 4 members
    zero = [0] * 8
    assert cost.level_times(zero, [2, 2]) == STEP + (2 * H + R + 1) + (4 * H + R + 1)
    # the links' real hops where given: a shorter last run's end sits closer
    assert cost.level_times([0] * 6, [4], end_hops=[2]) == 3 * STEP + (2 * H + R + 1)
    # a middle root whose far half joins streamed (a FIFO) instead of after its half is in memory
    assert cost.mid_times([0] * 4, "chain", 0, 10, streamed_join=True) == max(STEP, STEP + H + R) + 1 + 10


def test_occupancy_is_the_span_of_a_blocking_stage() -> None:
    blocking = cost.StageCost("x").add("a", 10).add("b", 5)
    assert blocking.busy == blocking.cycles == 15 and blocking.first_word_cycles == 15
    pipelined = cost.StageCost("y", {"a": 100}, first_word=40, occupancy=30)
    assert pipelined.busy == 30 and pipelined.first_word_cycles == 40
    copy = pipelined.renamed("z")
    assert (copy.name, copy.phases, copy.first_word, copy.occupancy) == ("z", {"a": 100}, 40, 30)
    assert copy.phases is not pipelined.phases
    # the residual add (residual.csl): the chunk in, a task and one add, then its header and sum leave
    # in one operation, the sum's first word after the header
    res = cost.residual_cost(16)
    assert res.cycles == (H + R + 16) + (T + S + 16) + (S + 5 + 16)
    assert res.first_word == (H + R + 16) + (T + S + 16) + (S + 5)
    # after a GEMV whose sums stream out, the chunk's words are in that GEMV's reduction
    assert cost.residual_cost(16, streamed_in=True).cycles == res.cycles - 16
    # a lane in, a lane out (res_2 in a band): the header is in long before the streamed sums, so each
    # word passes at a link and an add; after a framed send the words wait for the header's steps
    assert cost.residual_cost(16, streamed_in=True, streams_through=True).cycles == H + R + 1
    steps = T + (S + 5) + S
    assert cost.residual_cost(16, streams_through=True).cycles == (H + R + 5) + steps + 16
    # a lane in and a send after (res_1, which forwards x'): the words added into x's frame as they
    # come, then a task and the frame's send
    send = T + (S + 5 + 16)
    assert cost.residual_cost(16, streamed_in=True, lane_in=True).cycles == (H + R + 1) + send
    assert cost.residual_cost(16, lane_in=True).cycles == (H + R + 5) + (T + S) + 16 + send


def test_a_gathered_hand_off_by_hand() -> None:
    """comm/gather.csl led from its output end: the lead's header and slice (one operation from its
    frame: 5 + 12 words), a task and the relay's operation; then the others' words or their relays
    through every PE, whichever is later; then the hops to the farthest reader and its ramp. A lead
    that sends its slice apart from the header takes a task and an operation more."""
    start = 15 + 5 + (20 + 15) + 12
    # GPT-2's 64 slices of 12 words: the words (63 x 12 = 756) outlast the relays (63 x 10 + 12)
    assert cost.gathered_handoff_cycles(64, 12, 100) == start + 63 * 12 + 100 * 2 + 7
    assert cost.gathered_handoff_cycles(64, 12, 100, framed=False) == start + 35 + 63 * 12 + 100 * 2 + 7
    # slices of 4: the farthest slice's relays through 15 PEs outlast the words
    assert cost.gathered_handoff_cycles(16, 4, 10) == (15 + 5 + 35 + 4) + (15 * 10 + 4) + 10 * 2 + 7


@pytest.mark.parametrize("objective", ["latency", "compact"])
def test_hand_offs_that_are_gather_lines_are_priced_as_one(objective: str) -> None:
    """Where a bundle of lanes would share routers (a strip handing off to columns not its own, with
    no room between the rows for lanes that turn) the generator builds a gather line and a multicast:
    the plan's geometry names exactly those hand-offs (`gathered`), and the critical path prices the
    last layer's as one, or as lanes that turn where its strip and ln_f are rows apart (`staircase`)."""
    from wafer_gpt2.codegen import build_program
    from wafer_gpt2.model.config import GPT2Config
    from wafer_gpt2.plan import build_plan, price_candidates

    config = GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=512, n_positions=64, name="tiny")
    options = dict(arch="wse2", dtype="fp32", slots=2, context=64)
    plan = build_plan(config, objective=objective, **options)
    search = price_candidates(config, compact=objective == "compact", **options)
    geo = next(c for c in search.priced if c.knobs == plan.knobs).geometry
    turns = geo.staircase("L1.res_2", "ln_f")
    assert turns == (objective == "latency")  # the plans of the executor's tests: one of each
    final_line = set() if turns else {"final"}
    gathered = {name for name, src, dst in geo.routes() if geo.gathered(src, dst)}
    assert gathered == {"L0.resid_1", "L0.resid_2", "L1.resid_1", "L1.resid_2"} | final_line
    program = build_program(plan)
    built = {flow.name.split(".", 1)[1].rsplit(".gather", 1)[0].rsplit(".multicast", 1)[0].split(".line")[0]
             for flow in program.flows
             if (".gather" in flow.name or ".multicast" in flow.name) and ".qkv.g" not in flow.name}  # fmt: skip
    # the generator's names: the skips ln_1 -> res_1 -> res_2, ln_f (the embedding's are lanes)
    assert built == {"L0.ln_1.x", "L0.res_1.x", "L1.ln_1.x", "L1.res_1.x"} | final_line
    chunk = 64 // geo.r
    final = next(s for s in plan.stage_costs if s.name == "to ln_f")
    res_2 = next(s for s in plan.stage_costs if s.name == "L1.res_2")
    assert "the words in, added as they pass" in res_2.phases
    if turns:
        # a lane a source PE, all on one color, each as many routers as a straight lane would cross
        lanes = [flow for flow in program.flows if ".final.lane" in flow.name]
        hops, _ = geo.route_legs("L1.res_2", "ln_f")
        assert len(lanes) == geo.r and len({lane.color for lane in lanes}) == 1
        assert {len(lane.routes) for lane in lanes} == {hops}
        assert final.phases == {"route": cost.stream_cycles(chunk, hops)}
        return
    lines = geo.handoff_lines("final", "L1.res_2", "ln_f", 64)  # side by side where the strips split
    assert final.phases["route"] == cost.gathered_handoff_cycles(
        geo.r // lines, chunk, geo.gather_hops("L1.res_2", "ln_f", lines)
    )
    # the last res_2 leads that line: it adds and sends from its frame instead of streaming through
    framed = cost.residual_cost(chunk, streamed_in=True, lane_in=True).cycles
    assert final.phases[UNSTREAMED_RES_2_PHASE] == framed - cost.residual_cost(chunk, "r", True, True).cycles


@pytest.mark.parametrize(("interlock", "band_counts"), [(False, (2, 3, 4)), (True, (2, 3, 4, 6))])
def test_band_turns_a_pair_apart_are_priced_alike(interlock: bool, band_counts: tuple[int, ...]) -> None:
    """The outer stages price one band turn of each parity and give it to the turns a pair of bands
    further down: priced alone, every turn costs the same (plain and interlocked bands)."""
    from wafer_gpt2.core.arch import resolve_arch
    from wafer_gpt2.plan.geometry import Dirs, Geometry, replica_geometry
    from wafer_gpt2.plan.stages import _unstreamed_res_2, from_res_2_stage, outer_stage_costs
    from wafer_gpt2.plan.structure import Knobs
    from wafer_gpt2.plan.tilings import head_tiling, layer_tilings, strip_norm

    config, arch = PRESETS["gpt2"], resolve_arch("wse2")
    knobs = Knobs(stream_pes=12, fold=8, attn_chain=208, fc_cols=96, head_cols=242, interlock=interlock)
    lt = layer_tilings(config, knobs, 16, 1024, arch, "fp16")
    head = head_tiling(config, knobs, 64, arch, "fp16")
    ln_f = strip_norm(config.n_embd, knobs.head_rows, normalise=True)
    unstreamed = _unstreamed_res_2(lt.ln.chunk, cost.streams_out(lt.proj))
    turns_seen = 0
    for bands in band_counts:
        geo = replica_geometry(config, replace(knobs, bands=bands), arch, "fp16", Dirs.of(lt, head))
        assert isinstance(geo, Geometry) and geo.interlocked == interlock
        _, turns, _ = outer_stage_costs(config, geo, lt, head, ln_f, arch, "fp16", 0)
        for name, src, dst in geo.outer_routes():
            if name.startswith("turn."):
                alone = from_res_2_stage(
                    cost.StageCost("alone"), config, geo, head, unstreamed, name, src, dst
                )
                assert turns[name].phases == alone.phases, (bands, name)
                turns_seen += 1
    assert turns_seen == sum(band_counts) - len(band_counts)


def test_a_folded_layernorms_statistics_wait_only_past_the_reduction() -> None:
    """A GEMV with its LayerNorm folded in takes the statistics from the strip before it
    (`folded_stats_cycles`: the strip's sums, its all-reduce, the column to the farthest K-line end),
    and waits for them only where they come after its own reduction: a tall, light GEMV (one output a
    PE, 64 K-lines of 4 PEs) waits exactly the difference; GPT-2's qkv and fc in the plans the search
    returns wait for nothing, and price no sums of their own."""
    light = GemvTiling(16, 64, 4, 64, norm_fold=True)
    plain = cost.gemv_cost(replace(light, norm_fold=False), "wse2", "fp32")
    reduced = sum(plain.phases[p] for p in FIRST_PHASES)
    reduced += next(c for p, c in plain.phases.items() if p.endswith("reduction"))
    late = cost.folded_stats_cycles(light) - reduced
    assert late > 0
    assert cost.gemv_cost(light, "wse2", "fp32").phases[STATS_WAIT] == late
    for slots, objective in ((16, "latency"), (32, "throughput")):
        plan = build_plan(PRESETS["gpt2"], "wse2", slots=slots, objective=objective)
        for stage in plan.layer_stage_costs:
            assert STATS_WAIT not in stage.phases and "LayerNorm sums (x, x^2)" not in stage.phases


FIRST_PHASES = ("input multicast", "task: the input in", "tile FMAC")
STATS_WAIT = "the LayerNorm's statistics from the strip (beyond the reduction)"


def test_a_gathered_handoff_takes_the_most_lines_both_strips_split_into() -> None:
    """`gather_lines`: equal runs of whole source slices and whole reader windows holding the same
    words, at most `most` (GPT-2's three gathered hand-offs of a 32-slot replica take 4: its 32-PE
    strip of 24-word slices into a 12-PE stream of 64, that stream across a band turn, and into ln_f)."""
    assert gather_lines(32, 24, 12, 64) == gather_lines(12, 64, 12, 64) == gather_lines(12, 64, 32, 24) == 4
    assert gather_lines(6, 10, 4, 15) == 2  # 3 slices of 10 words, 2 windows of 15
    assert gather_lines(5, 8, 5, 8) == 1  # 5 lines would be one a PE: more than the most
    assert gather_lines(12, 64, 12, 64, most=3) == 3 and gather_lines(7, 64, 12, 64) == 1
    plan = build_plan(PRESETS["gpt2"], "wse2", slots=32, objective="throughput", replicas="auto")
    split = {rt.name: rt.lines for rt in plan.routes if rt.lines > 1}
    assert split == {"embed.out": 4, "turn.5": 4, "final": 4}
