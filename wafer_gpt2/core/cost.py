"""Cycle model of the wafer program: every figure it produces is *modeled*, never measured.

A stage's cost is the cycles from the first wavelet of its input reaching the stage to the last
wavelet of its output leaving it, for one token item, built from named constants with public sources
(the Cerebras SDK documentation and architecture talks), two of them calibrated on published hardware
measurements (`wafer_gpt2.core.calibration`, docs/calibration.md). Where no public figure exists the constant
says "assumption" and why that value.

Conventions: one wavelet carries one 32-bit word (an fp16 value travels alone in the low half, as
memcpy does); a stream of n wavelets over a path of h hops delivers its last wavelet at
h * HOP_CYCLES + ROUTER_TO_PE_CYCLES + n cycles after the first left (one wavelet per link per cycle,
pipelined through the routers). Reductions built from asynchronous DSD operations (fabric in ->
add -> fabric out) need no task per element; steps that need scalar control (log-sum-exp rescale,
top-k merge) pay a task activation.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from itertools import pairwise
from statistics import NormalDist

import numpy as np

from wafer_gpt2.core.arch import Arch, resolve_arch
from wafer_gpt2.core.tiling import (
    AttentionTiling,
    GemvTiling,
    HeadTiling,
    NormTiling,
    Reduction,
    allreduce_root,
    ceil_div,
    reduction_runs,
    three_level_fits,
)

# --- Named constants --------------------------------------------------------------------------------
# Clock: 1.1 GHz is the figure of the architecture talks (Hot Chips 34) and WaferLLM's conversion; the
# SDK examples convert cycles at 0.85 GHz.
CLOCK_HZ = 1.1e9
SDK_CLOCK_HZ = 0.85e9
# "32-bit messages, called wavelets, can be sent to or received by neighboring PEs in a single clock
# cycle" (Cerebras SDK documentation, "A Conceptual View"): the bandwidth of a link.
WAVELETS_PER_LINK_PER_CYCLE = 1
# Latency of a router hop. Calibrated (wafer_gpt2.core.calibration, docs/calibration.md): WaferLLM's MeshGEMV
# on a CS-3 fits 2.03 cycles per hop; the public notes' "one cycle per router hop" is the bandwidth.
HOP_CYCLES = 2
# "Router to processor about 7 cycles" (Cerebras SDK notes): paid once by every wavelet that stops at
# a PE. Kept at its public value; the calibration's stops fit it.
ROUTER_TO_PE_CYCLES = 7
# Starting a DSD operation one after another, with the scalar control between them. Calibrated
# (wafer_gpt2.core.calibration): the MeshGEMV loop starts about ten in series per iteration, 15.4 cycles each.
DSD_OP_START_CYCLES = 15
# One step of a @map over DSD registers loaded once (WaferLLM's GEMV loop), beyond the step's own
# compute. Calibrated with the two above: 2.0 cycles.
MAP_STEP_CYCLES = 2
# Task activation: no public figure. Assumption: 20 cycles from a wavelet or @activate to the first
# instruction of the task (hardware task pick plus a short prologue). Paid where a step needs control.
TASK_ACTIVATION_CYCLES = 20
# fp32 add / multiply / FMAC: one element per cycle (Cerebras SDK notes: "fp32 FMAC about one element per cycle").
FP32_OPS_PER_CYCLE = 1
# exp in software (the CSL math library has exp, no tanh). Assumption: 20 cycles per fp32 element (a
# range reduction and a short polynomial, each step one fp32 op per cycle).
EXP_CYCLES = 20
# GELU tanh form = exp + reciprocal + 8 fp32 mul/add (kernels/gelu.csl). Assumption: 20 + 10 + 8.
GELU_CYCLES = EXP_CYCLES + 18
# reciprocal square root / division in software. Assumption: 10 cycles (Newton steps on fp32).
RSQRT_CYCLES = 10
# The head's threshold selection (wafer_gpt2/kernels/lib/topk.csl, pe/head.csl) is scalar code per logit and per
# entry; no public figure prices a CE's scalar instructions, so these count the scalar operations of
# the CSL as written at one cycle each (assumption, the CSL executor's own rule: csl_executor/README.md).
# A worker's slice: its max and min (a load, two compares); in the histogram pass and again in the
# selection pass a logit's bin (a compare with L, subtract, multiply, clamp, convert) and its count;
# a kept entry's two stores and its count. The centre per entry of round C: its loads, its bin, the
# place it takes; an entry of bin t more: the test for a place among bin t's, the insertion's start,
# its last test and the count of bin t's places; per inversion (logits out of order inside a bin,
# sorted on io.out) one pass of the insertion loop: its test (the index, its decrement, a load, two
# compares and their `and`) and the move (two loads, two stores, the index twice, the decrement); per
# entry of that sort its look at the one before (the loop's test and count, two loads, the index, a
# compare), and per entry that moves its load, its two stores and the loop's first test again.
# The output record's ids and logits are copied by a DSD operation each.
TOPK_SCAN_CYCLES = 4
TOPK_BIN_CYCLES = 6
TOPK_ENTRY_CYCLES = 5
TOPK_TAKE_CYCLES = 12
TOPK_BIN_T_CYCLES = 13
TOPK_INVERSION_CYCLES = 12
TOPK_SORT_PASS_CYCLES = 6
TOPK_SORT_MOVER_CYCLES = 9
# The histogram of round B: bins over [L, M]. More bins leave fewer entries for round C and the centre
# but cost a word each in round B's vector and a statement each in a worker's histogram.
TOPK_BINS = 64
# The centre reads round C's entries this many at a time (one DSD operation each).
HEAD_CHUNK = 32


# Words of the header every item carries ahead of its payload on the streams between regions
# (wafer_gpt2/kernels/comm/recv.csl HDR).
ITEM_HEADER_WORDS = 5


def cycles_to_us(cycles: float, clock_hz: float = CLOCK_HZ) -> float:
    return cycles / clock_hz * 1e6


def stream_cycles(wavelets: int, hops: int) -> int:
    """Last wavelet of a stream of `wavelets` words arriving at a PE `hops` routers away."""
    return hops * HOP_CYCLES + ROUTER_TO_PE_CYCLES + ceil_div(wavelets, WAVELETS_PER_LINK_PER_CYCLE)


def chain_reduce_cycles(steps: int, words: int) -> int:
    """A pipelined add chain over `steps` + 1 PEs of `words`-long fp32 vectors: every step adds one
    hop, one router-to-PE crossing and one fp32 add of latency; the vector streams through once."""
    if steps <= 0:
        return 0
    return steps * (HOP_CYCLES + ROUTER_TO_PE_CYCLES + FP32_OPS_PER_CYCLE) + ceil_div(
        words, FP32_OPS_PER_CYCLE
    )


def two_level_reduce_cycles(n: int, words: int, group: int) -> int:
    """Runs of `group` PEs chain at the same time, and the runs' last PEs, `group` PEs apart, chain
    their sums as those stream out (wafer_gpt2/kernels/comm/reduce.csl: a run's end adds its run's stream and the
    ends' stream at once, through a FIFO): every link adds its latency, the vector streams through
    once."""
    if n <= 1:
        return 0
    group = max(1, min(group, n))
    runs = ceil_div(n, group)
    cross = (runs - 1) * (group * HOP_CYCLES + ROUTER_TO_PE_CYCLES + FP32_OPS_PER_CYCLE)
    return chain_reduce_cycles(group - 1, words) + cross


def three_level_reduce_cycles(n: int, words: int, group: int, end_group: int) -> int:
    """Runs of `group` PEs chain at once; the runs' ends chain in runs of `end_group` (their links
    `group` PEs long) as their sums stream out, and those runs' ends (`group` x `end_group` PEs apart)
    chain theirs (comm/reduce.csl's third level: two FIFOs on such an end, every level streaming at
    once): every link adds its latency, the vector streams through once. For the shapes
    `three_level_fits` allows."""
    span = group * end_group
    second = (end_group - 1) * (group * HOP_CYCLES + ROUTER_TO_PE_CYCLES + FP32_OPS_PER_CYCLE)
    third = (n // span - 1) * (span * HOP_CYCLES + ROUTER_TO_PE_CYCLES + FP32_OPS_PER_CYCLE)
    return chain_reduce_cycles(group - 1, words) + second + third


def reduce_cycles(kind: str, n: int, words: int, group: int = 0, end_group: int = 0) -> int:
    if kind == "chain":
        return chain_reduce_cycles(n - 1, words)
    if kind == "two_level":
        return two_level_reduce_cycles(n, words, group)
    if kind == "three_level":
        return three_level_reduce_cycles(n, words, group, end_group)
    raise ValueError(f"unknown reduction {kind!r}")


def allreduce_cycles(kind: str, n: int, words: int, group: int = 0) -> int:
    """Every one of n PEs ends with the sum (wafer_gpt2/kernels/comm/allreduce.csl): the two halves of the line
    reduce towards the middle at the same time (`wafer_gpt2.core.tiling.allreduce_halves`, each a chain or
    two-level), the right half's end hands its sum to the root (one more chain step, after the root's
    own half is done, and a task activation to start the broadcast once the join is in), and the root
    multicasts the result both ways (one route, so every PE holds the same bits): about n/2 hops each
    way instead of n."""
    if n <= 1:
        return 0
    root = allreduce_root(n)
    left, right = root + 1, n - 1 - root  # the lengths of `wafer_gpt2.core.tiling.allreduce_halves(n)`
    join_ready = reduce_cycles(kind, right, words, group) + HOP_CYCLES + ROUTER_TO_PE_CYCLES
    reduced = max(reduce_cycles(kind, left, words, group), join_ready) + FP32_OPS_PER_CYCLE + words
    reduced += TASK_ACTIVATION_CYCLES
    farthest = max(root, right)
    return reduced + farthest * HOP_CYCLES + ROUTER_TO_PE_CYCLES + words


# --- Ready-time reductions ---------------------------------------------------------------------------
# The closed forms above price a reduction whose members all hold their vectors at once. The functions
# below take each member's ready time instead (a reduction that follows an input wave, members that
# finish their own work at different times) and give the time the result's FIRST word is out of the
# member that ends the reduction; the last word follows `words` cycles later, as the vector streams
# through once. With every member ready at 0 they are the closed forms exactly
# (tests/test_cost_model.py checks the identities):
#   chain_times([0] * n) + words                 == chain_reduce_cycles(n - 1, words)
#   level_times([0] * n, [g]) + words            == two_level_reduce_cycles(n, words, g)
#   mid_times([0] * n, kind, g, words)           == the reduction part of allreduce_cycles


def link_cycles(hops: int) -> int:
    """A word's way over a link of `hops` routers into the next member's CE."""
    return hops * HOP_CYCLES + ROUTER_TO_PE_CYCLES


def chain_times(ready: list[int], hops: list[int] | int = 1) -> int:
    """First word of the sum out of the last member of a streamed chain (comm/chain.csl) whose member i
    holds its vector at ready[i] and whose link i (member i to i + 1) is hops[i] routers long (an int:
    every link). Member 0 sends from ready[0]; member i adds the arriving stream to its own as it comes:
    its first word is out at max(ready[i], the previous member's first word + the link) + one add."""
    if not ready:
        return 0
    first = ready[0]
    # The planner's inner loop: `link_cycles` and max inlined (the same integers).
    if isinstance(hops, int):
        link = hops * HOP_CYCLES + ROUTER_TO_PE_CYCLES
        for r in ready[1:]:
            first += link
            first = (r if r > first else first) + FP32_OPS_PER_CYCLE
        return first
    for r, h in zip(ready[1:], hops, strict=True):
        first += h * HOP_CYCLES + ROUTER_TO_PE_CYCLES
        first = (r if r > first else first) + FP32_OPS_PER_CYCLE
    return first


def _chain_prefixes(ready: list[int]) -> list[int]:
    """chain_times(ready[: j + 1]) for every j: when each member of a streamed chain sends its first word."""
    out = [ready[0]]
    link = link_cycles(1)
    for r in ready[1:]:
        out.append(max(r, out[-1] + link) + FP32_OPS_PER_CYCLE)
    return out


def level_times(ready: list[int], groups: list[int], end_hops: Sequence[int] | None = None) -> int:
    """First word of the sum at the end of a streamed reduction in len(groups) + 1 levels over members
    ready at `ready` in line order: runs of groups[0] chain at once (`wafer_gpt2.core.tiling.reduction_runs`),
    then runs of groups[1] of their ends, ..., then one chain of the last level's ends. A level's ends
    stream into the next level as they go (comm/reduce.csl's FIFO on a run's end: no task). A link
    between two ends of level l is priced at the members a run of that level spans (groups[0] *
    groups[1] * ...: as two_level_reduce_cycles prices it, also for a shorter last run) unless
    end_hops gives the hops of every level's links in order. [] is a chain; [g] comm/reduce.csl's two
    levels (the only ones the program implements today)."""
    if not groups:
        return chain_times(ready)
    spans, span = [], 1
    for g in groups:
        span *= max(1, g)
        spans.append(span)
    hops_left = list(end_hops) if end_hops is not None else None
    level = (
        [chain_times(ready[s : s + groups[0]]) for s in range(0, len(ready), groups[0])]
        if groups[0] > 1
        else list(ready)
    )
    for depth in range(1, len(groups) + 1):
        g = groups[depth] if depth < len(groups) else len(level)
        g = max(1, g)
        nxt = []
        for s in range(0, len(level), g):
            part = level[s : s + g]
            if hops_left is None:
                hops: list[int] | int = spans[depth - 1]
            else:
                hops, hops_left = hops_left[: len(part) - 1], hops_left[len(part) - 1 :]
            nxt.append(chain_times(part, hops))
        level = nxt
    return level[0]


def reduce_times(kind: str, ready: list[int], group: int = 0) -> int:
    """`reduce_cycles` with ready times: the first word of the sum on the line's last member."""
    if kind == "chain" or not 1 < group < len(ready):
        return chain_times(ready)
    if kind == "two_level":
        return level_times(ready, [group])
    raise ValueError(f"unknown reduction {kind!r}")


def mid_times(ready: list[int], kind: str, group: int, words: int, streamed_join: bool = False) -> int:
    """A line reduced towards a root in its middle (comm/allreduce.csl's reduction half: members 0 ..
    root and n-1 .. root + 1 at once, `wafer_gpt2.core.tiling.allreduce_halves`), ready times in line order:
    the time the root holds the whole sum. The far half's end hands its sum to the root once it holds
    it (comm/allreduce.csl's join: the root adds it after its own half, one more pass of the words);
    streamed_join: the far half's stream joins the root's as a two-level run end's does (a FIFO, no
    second pass)."""
    n = len(ready)
    if n <= 1:
        return words if n else 0
    root = allreduce_root(n)
    left = ready[: root + 1]
    right = ready[root + 1 :][::-1]
    left_first = reduce_times(kind, left, group) if len(left) > 1 else left[0]
    right_first = reduce_times(kind, right, group) if len(right) > 1 else right[0]
    if streamed_join:
        return max(left_first, right_first + link_cycles(1)) + FP32_OPS_PER_CYCLE + words
    left_end = left_first + (words if len(left) > 1 else 0)
    right_end = right_first + (words if len(right) > 1 else 0)
    return max(left_end, right_end + link_cycles(1)) + FP32_OPS_PER_CYCLE + words


def reduction_options(n: int) -> list[tuple[Reduction, int]]:
    """(kind, group) of every reduction the program implements over n PEs: the chain, and the
    two-level reduction with each run length that leaves at least two runs."""
    chain: list[tuple[Reduction, int]] = [("chain", 0)]
    return chain + [("two_level", g) for g in range(2, n) if n > 2]


@lru_cache(maxsize=1024)  # the planner asks again for every candidate of the same width
def gemv_reduction_options(n: int) -> list[tuple[Reduction, int, int]]:
    """(kind, group, end_group) of every reduction a GEMV's K-lines of n PEs can take: those of
    `reduction_options`, and the three-level ones `three_level_fits` allows (wafer_gpt2/kernels/pe/gemv.csl
    gives the third level an input queue of its own; the other users of comm/reduce.csl have none left):
    the run lengths g and e with g * e a divisor of n, in order of g then e."""
    three: list[tuple[Reduction, int, int]] = [
        ("three_level", g, e)
        for g in range(2, n)
        if n % g == 0
        for e in range(2, n // g)
        if three_level_fits(n, g, e)
    ]
    return [(kind, g, 0) for kind, g in reduction_options(n)] + three


@lru_cache(maxsize=4096)  # the planner asks again for every candidate of the same strip
def best_reduction(n: int, words: int) -> tuple[str, int]:
    """The (kind, group) the model finds fastest for n PEs and `words` per partial."""
    return min(reduction_options(n), key=lambda kg: reduce_cycles(kg[0], n, words, kg[1]))


def embed_reduction(arch: Arch | str, members: int, words: int, head: bool) -> tuple[str, int]:
    """How an embedding line of `members` PEs reduces (`head`: it runs through every head column of a
    K-line before the wpe rows, wafer_gpt2/kernels/pe/head.csl; else only through the embedding's rows,
    pe/embed.csl): the fastest reduction, except that a head PE has an input queue for a chain of run
    ends only on WSE-2 (queue 1; WSE-3's memcpy keeps 0 and 1, and head.csl uses the other six), so
    through the head a WSE-3 line is a chain."""
    if head and resolve_arch(arch).name != "wse2":
        return "chain", 0
    return best_reduction(members, words)


@dataclass
class StageCost:
    """Modeled cycles of one stage, phase by phase (phases run one after the other).

    `first_word`: cycles from the stage's start to its output's first word leaving (None: not priced
    apart; a consumer that works on the stream can start then). `occupancy`: the stage's initiation
    interval, the cycles its busiest PE is taken per item, for a program that takes its next item
    while the previous one is still in the stage (the LM head with its rounds apart); None for a
    program that blocks (a PE takes its next item only when its last operation for this one is
    over), whose occupancy is its whole span (`busy`)."""

    name: str
    phases: dict[str, int] = field(default_factory=dict)
    first_word: int | None = None
    occupancy: int | None = None

    @property
    def cycles(self) -> int:
        return sum(self.phases.values())

    @property
    def busy(self) -> int:
        """Modeled initiation interval: the occupancy where the stage has one, else its span."""
        return self.cycles if self.occupancy is None else self.occupancy

    @property
    def first_word_cycles(self) -> int:
        """Modeled cycles to the output's first word: `first_word` where priced, else the whole span."""
        return self.cycles if self.first_word is None else self.first_word

    def renamed(self, name: str) -> StageCost:
        """A copy under another name (its phases copied, its first word and occupancy kept)."""
        return StageCost(name, dict(self.phases), self.first_word, self.occupancy)

    def add(self, phase: str, cycles: int) -> StageCost:
        self.phases[phase] = self.phases.get(phase, 0) + int(cycles)
        return self


# --- GEMV ------------------------------------------------------------------------------------------

# LayerNorm's statistics travel as one vector: (sum of x, sum of x^2), all-reduced together by a
# LayerNorm strip (and, where the LayerNorm is folded into the GEMV after it, sent on to that GEMV's
# roots).
NORM_STAT_WORDS = 2


# The scalar work of one value of LayerNorm's sums: an add into the sum of x, a multiply and an add
# into the sum of x^2 (wafer_gpt2/kernels/lib/norm_stats.csl, in a @map's step).
NORM_SUM_OPS = 3


@lru_cache(maxsize=1024)  # the search asks again for every candidate with the same strip
def stats_reduction(pes: int) -> tuple[Reduction, int]:
    """How a LayerNorm strip of `pes` PEs all-reduces its statistics: the (kind, group) the model
    prices fastest (`allreduce_cycles`). The strips' tilings take it, and the GEMVs whose LayerNorm
    a strip of theirs computes price its statistics' arrival with it."""
    return min(reduction_options(pes), key=lambda kg: allreduce_cycles(kg[0], pes, NORM_STAT_WORDS, kg[1]))


def folded_stats_cycles(tiling: GemvTiling) -> int:
    """When the statistics of a GEMV's folded LayerNorm are in its farthest root's memory, from the
    moment its input reaches its nearest PEs, as `gemv_cost` counts (wafer_gpt2/kernels/pe/layernorm.csl
    `folded_stats`): the strip's PE i takes chunk i from the stream that passes its router into the
    K-lines a hop earlier, sums it, the strip all-reduces the two sums (`stats_reduction`), and the PE
    in the roots' column (index rows - 1) sends them along that column to every root (pe/gemv.csl
    `stats_in`), `cols` hops to the farthest. The GEMV's own PEs sum nothing."""
    kind, group = stats_reduction(tiling.rows)
    at_strip = (
        ROUTER_TO_PE_CYCLES
        + TASK_ACTIVATION_CYCLES
        + norm_sums_cycles(tiling.tile_k)
        + allreduce_cycles(kind, tiling.rows, NORM_STAT_WORDS, group)
        + TASK_ACTIVATION_CYCLES
        + DSD_OP_START_CYCLES
        + NORM_STAT_WORDS
    )
    return at_strip - HOP_CYCLES + tiling.cols * HOP_CYCLES + ROUTER_TO_PE_CYCLES


def norm_sums_cycles(values: int) -> int:
    """A LayerNorm PE's sums of x and x^2 over its `values` (wafer_gpt2/kernels/lib/norm_stats.csl `sums`): one
    @map into two scalars, each step the step overhead (MAP_STEP_CYCLES) and its scalar work, and one
    DSD operation start."""
    if values <= 0:
        return 0
    return DSD_OP_START_CYCLES + values * (MAP_STEP_CYCLES + NORM_SUM_OPS)


def map_fmac_cycles(steps: int, width: int, macs_per_cycle: int) -> int:
    """wafer_gpt2/kernels/lib/fmac.csl `accumulate`: one @map of `steps` steps with the accumulator and the matrix
    row in DSD registers, each step `width` FMACs at the SIMD width (fp32 accumulate) plus the step's
    overhead (calibrated, MAP_STEP_CYCLES); one DSD operation start for the whole @map, after the
    accumulator's zeroing (an @fmovs of `width` fp32 words)."""
    zero = DSD_OP_START_CYCLES + width * FP32_OPS_PER_CYCLE
    return zero + DSD_OP_START_CYCLES + steps * (MAP_STEP_CYCLES + ceil_div(width, macs_per_cycle))


def gemv_compute_cycles(tiling: GemvTiling, arch: Arch, dtype: str) -> int:
    """One PE's tile as wafer_gpt2/kernels/pe/gemv.csl computes it: one @map over its tile_k inputs, each step a
    row of tile_n FMACs (`map_fmac_cycles`)."""
    return map_fmac_cycles(tiling.tile_k, tiling.tile_n, arch.macs_per_cycle(dtype))


def gemv_cost(
    tiling: GemvTiling,
    arch: Arch | str,
    dtype: str,
    epilogue_cycles_per_output: int = 0,
    name: str = "gemv",
) -> StageCost:
    """y = x @ W on the tiling's grid, from the input chunks at the region's edge to the output
    chunks leaving the far edge.

    1. multicast: chunk r (tile_k words) streams along the `cols` PEs of reduction index r; each PE
       starts its FMACs on the first word and, since every word needs ceil(tile_n / SIMD) >= 1 cycles,
       finishes tile_k * ceil(tile_n / SIMD) cycles later (the farthest PE starts cols - 1 hops late).
    2. reduction of the fp32 partials (tile_n words) over the `rows` PEs: chain or two_level.
    3. bias (+ epilogue, e.g. GELU) on the last PE of each output column, one output after another.
    With the LayerNorm folded in (`norm_fold`), the strip before the GEMV makes its statistics while
    the K-lines multiply (`folded_stats_cycles`: the GEMV waits only where they come after its
    reduction), and the last PE turns them into mean and rstd and applies them with the bias (two
    FMACs per output).
    The PE program's steps on the last PE's path (wafer_gpt2/kernels/pe/gemv.csl): a task when the
    input is in (`got_input`), another when the sums are (`reduced`), an operation's start per
    vector operation of the epilogue, and the output's send, the header and the outputs in one
    operation from their frame (comm/gather.csl `send_framed`; the outputs' words are priced where
    the next stage reads them).
    Where nothing follows the sum (`GemvTiling.bias_at_root` and no epilogue: attn_proj and proj,
    whose outputs are lanes into the residual strip under their columns), the last PE adds the bias
    to its own partial and sends the header while the partials are in the fabric, and the
    reduction's last add writes the lane (gemv.csl `streams_out`): the sums leave as they are made,
    their words priced in the reduction (`residual_cost(streamed_in=True)` takes them at a link).
    An unshared LayerNorm without GELU (qkv) makes its last FMAC as its output's send, its header sent
    while the reduction was in the fabric (gemv.csl `norm_sends`, comm/gather.csl `send_fmac`).
    """
    arch = resolve_arch(arch)
    cost = StageCost(name)
    cost.add("input multicast", (tiling.cols - 1) * HOP_CYCLES + ROUTER_TO_PE_CYCLES)
    cost.add("task: the input in", TASK_ACTIVATION_CYCLES)
    cost.add("tile FMAC", max(tiling.tile_k, gemv_compute_cycles(tiling, arch, dtype)))
    label = f"{tiling.reduction} reduction" + reduction_shape(tiling)
    reduced = reduce_cycles(tiling.reduction, tiling.rows, tiling.tile_n, tiling.group, tiling.end_group)
    cost.add(label, reduced)
    if tiling.norm_fold:
        # the root's `reduced` task waits for the strip's statistics too (gemv.csl `stats_in`)
        late = folded_stats_cycles(tiling) - cost.cycles
        if late > 0:
            cost.add("the LayerNorm's statistics from the strip (beyond the reduction)", late)
    if streams_out(tiling, epilogue_cycles_per_output):
        # the last PE's bias pass, the header's send and the lane's operation start after its FMACs;
        # its own vector joins the stream when those are done (beyond the reduction where the line
        # is short; a line of one PE sends it)
        own = 3 * DSD_OP_START_CYCLES + tiling.tile_n * FP32_OPS_PER_CYCLE + ITEM_HEADER_WORDS
        late = own + tiling.tile_n * FP32_OPS_PER_CYCLE - reduced
        if late > 0:
            cost.add("the last PE's bias and header (beyond the reduction)", late)
        return cost
    cost.add("task: the sums in", TASK_ACTIVATION_CYCLES)
    # shared through comm/spread.csl, every PE applies the LayerNorm to its own slice (in the epilogue)
    spread_norm = tiling.norm_fold and tiling.epilogue_multicast and tiling.epilogue_pes > 1
    # qkv's LayerNorm: the second FMAC (the bias plus the sums times rstd) is the send's own operation
    norm_sends = tiling.norm_fold and tiling.epilogue_pes == 1 and not epilogue_cycles_per_output
    if norm_sends:
        last = RSQRT_CYCLES + DSD_OP_START_CYCLES + tiling.tile_n + DSD_OP_START_CYCLES
        return cost.add("LayerNorm (mean, rstd), the bias as the output leaves", last)
    if tiling.norm_fold and not spread_norm:  # the bias rides the multiply by rstd: not a pass of its own
        cost.add("LayerNorm (mean, rstd) + bias", RSQRT_CYCLES + 2 * (DSD_OP_START_CYCLES + tiling.tile_n))
    cycles = epilogue_cycles(
        tiling.tile_n,
        tiling.epilogue_pes,
        epilogue_cycles_per_output,
        not tiling.norm_fold,
        tiling.epilogue_multicast,
        spread_norm,
    )
    if cycles or not tiling.norm_fold:
        how = ", multicast" if tiling.epilogue_multicast else ""
        shared = f" (shared by {tiling.epilogue_pes} PEs{how})" if tiling.epilogue_pes > 1 else ""
        what = (
            "LayerNorm + epilogue" if spread_norm else "epilogue" if tiling.norm_fold else "bias + epilogue"
        )
        cost.add(what + shared, cycles)
    cost.add("the output's header (its send's start)", DSD_OP_START_CYCLES + ITEM_HEADER_WORDS)
    return cost


def reduction_shape(tiling: GemvTiling) -> str:
    """How a GEMV's reduction runs, for a stage's label: " (runs of g)", " (runs of g, their ends in
    runs of e)", or nothing for a chain."""
    if tiling.reduction == "two_level":
        return f" (runs of {tiling.group})"
    if tiling.reduction == "three_level":
        return f" (runs of {tiling.group}, their ends in runs of {tiling.end_group})"
    return ""


def streams_out(tiling: GemvTiling, epilogue_cycles_per_output: int = 0) -> bool:
    """Whether the GEMV's sums leave as its reduction makes them (wafer_gpt2/kernels/pe/gemv.csl
    `streams_out`): the bias at the root, and no epilogue after the sum."""
    return tiling.bias_at_root and not epilogue_cycles_per_output


@lru_cache(maxsize=4096)  # pure, and priced for every candidate of the search
def epilogue_cycles(
    tile_n: int, pes: int, per_output: int, bias: bool = True, multicast: bool = False, norm: bool = False
) -> int:
    """The bias (unless it was added already: `bias` False) and the epilogue of one output column,
    from its sum being complete on the K-line's last PE to the output's lane starting (its header and
    tile_n words then stream as before). `multicast`: shared as `multicast_epilogue_cycles` prices
    (`norm`: with the folded LayerNorm on every PE's slice).

    One PE: the bias and the epilogue, output after output. Shared by the last `pes` PEs of the line
    (wafer_gpt2/kernels/pe/gemv.csl, comm/scatter.csl, comm/gather.csl), priced step by step as the CSL takes
    them:
    - the last PE adds the bias to all outputs, starts one stream of slices 0 .. pes-2 back along the
      line and applies the epilogue to its own slice (pes - 1) meanwhile;
    - PE j (0 the farthest) has set up its receive long before: it passes on the j slices for the PEs
      beyond it as they come, then (a task and a DSD operation later) reads its own; its epilogue starts
      a task activation after the slice is in;
    - a gather line from PE 0 carries [header | slice 0 | ... | slice pes-1] out through the last PE:
      every PE passes the header and the words before its slice on in one operation, then appends its
      own, a task activation and a DSD operation later (comm/gather.csl's steps).
    Priced as the time the gathered stream has left, less what the unshared lane takes for the same
    stream (its header and tile_n words, one DSD operation: comm/gather.csl `send_framed`), which the
    model leaves to the hand-off."""
    added = tile_n * FP32_OPS_PER_CYCLE + DSD_OP_START_CYCLES if bias else 0
    if pes <= 1:  # the bias one operation, the epilogue one more (lib/gelu.csl's @map)
        return added + (DSD_OP_START_CYCLES + tile_n * per_output if per_output else 0)
    if pes > tile_n:
        raise ValueError(f"{pes} epilogue PEs for {tile_n} outputs leave a PE without one")
    if multicast:
        return multicast_epilogue_cycles(tile_n, pes, per_output, 0 if norm else added, norm)
    if tile_n % pes:
        raise ValueError(
            f"{pes} epilogue PEs do not split {tile_n} outputs evenly, as a relayed sharing needs"
        )
    part = tile_n // pes
    work = part * per_output
    sent = added + DSD_OP_START_CYCLES  # the slices' stream leaves the last PE
    # ready[j]: PE j's slice done (the last PE's own meanwhile)
    ready = [kept + TASK_ACTIVATION_CYCLES + work for kept in _scattered(pes, part, sent)]
    ready.append(sent + work)
    end = ready[0] + DSD_OP_START_CYCLES + ITEM_HEADER_WORDS + _TASK_STEP + part  # PE 0's slice has left
    for j in range(1, pes):
        # PE j passes the header and the j slices before its own on in one operation, then its own
        passed = max(ready[j] + DSD_OP_START_CYCLES + ITEM_HEADER_WORDS + j * part, end + _RELAY)
        end = passed + _TASK_STEP + part
    lane = DSD_OP_START_CYCLES + ITEM_HEADER_WORDS + tile_n
    return end - lane


def epilogue_slices(tile_n: int, pes: int) -> list[int]:
    """The outputs of each of `pes` PEs sharing an epilogue through comm/spread.csl (the farthest
    first, the root last), as wafer_gpt2/kernels/pe/gemv.csl cuts them: tile_n // pes each, and one more
    for each of the farthest tile_n % pes, so that the root, which also sends the multicast, has the
    fewest."""
    base, extra = divmod(tile_n, pes)
    return [base + (1 if j < extra else 0) for j in range(pes)]


def multicast_epilogue_cycles(tile_n: int, pes: int, per_output: int, added: int, norm: bool = False) -> int:
    """The epilogue shared by the last `pes` PEs as wafer_gpt2/kernels/comm/spread.csl takes it, after
    `added` cycles of bias on the root, the outputs cut as `epilogue_slices` cuts them:
    - the root starts one multicast of the others' sums (all but its own slice, the last) back along
      the line (`norm`: all tile_n raw sums and the LayerNorm's two statistics) and applies the
      epilogue to its own slice meanwhile, then starts its read of the sum;
    - PE j (0 the farthest) reads every word of the multicast (one operation set up long before), a
      task activation later (`norm`: applies the LayerNorm to its slice, priced as the root's phase
      prices it for all outputs) applies the epilogue to its slice, writing it into a vector of the same
      length that is zero elsewhere, and starts its part of a streamed chain sum of those vectors
      towards the root (comm/chain.csl's links: the windows side by side, every word one nonzero
      term), which the root reads into its sums' place;
    - a task activation on the root when the sum is in, which starts the lane as an unshared root does."""
    parts = epilogue_slices(tile_n, pes)
    words = tile_n - parts[-1]
    sent_words = tile_n + NORM_STAT_WORDS if norm else words

    def work(part: int) -> int:
        return part * per_output + (RSQRT_CYCLES + 2 * part if norm else 0)

    sent = added + DSD_OP_START_CYCLES  # the multicast leaves the root
    ready = [
        sent
        + stream_cycles(sent_words, pes - 1 - j)
        + TASK_ACTIVATION_CYCLES
        + work(parts[j])
        + DSD_OP_START_CYCLES
        for j in range(pes - 1)
    ]
    ready.append(sent + work(parts[-1]) + DSD_OP_START_CYCLES)  # the root's read of the sum
    return chain_times(ready) + words + TASK_ACTIVATION_CYCLES


# A word passed on through a PE (a hop, the ramp, the CE's move), and the next DSD operation of a PE
# started by a task: the steps of comm/scatter.csl and comm/gather.csl.
_RELAY = HOP_CYCLES + ROUTER_TO_PE_CYCLES + FP32_OPS_PER_CYCLE
_TASK_STEP = TASK_ACTIVATION_CYCLES + DSD_OP_START_CYCLES


def gathered_handoff_cycles(sources: int, chunk: int, hops: int, framed: bool = True) -> int:
    """A vector held in `chunk`-word slices by a line of `sources` PEs, handed to a region through a
    gather line led from its output end and one multicast (comm/gather.csl's near-led roles, which
    wafer_gpt2/codegen/build.py `connect` builds where a bundle of lanes would share routers): the
    lead sends the header and its slice, then (a task later) relays in one operation what the others
    sent at once; the last word reaches it after the line's words or after the farthest slice's
    relays through every PE, whichever is later, and then crosses `hops` routers to the farthest
    reader, which takes the whole payload in one operation. `framed`: the lead's slice follows the
    header in its frame (`send_framed`, the residual adds), so both leave in one DSD operation;
    otherwise the header is one and the slice, a task later, the next (the embedding)."""
    relay_start = DSD_OP_START_CYCLES + ITEM_HEADER_WORDS + _TASK_STEP + chunk
    if not framed:
        relay_start += _TASK_STEP
    relayed = max((sources - 1) * chunk, (sources - 1) * _RELAY + chunk)
    return relay_start + relayed + hops * HOP_CYCLES + ROUTER_TO_PE_CYCLES


def _scattered(pes: int, part: int, sent: int) -> list[int]:
    """When PE j (0 the farthest of the pes - 1 others) of a scatter line (comm/scatter.csl) has its
    slice of `part` words in memory, the last PE having started the stream at `sent`: its slice's last
    word is at its queue after the links and the slices before it; a PE that passed words on reads its
    own a task and a DSD operation later."""
    return [
        sent + (pes - 1 - j) * _RELAY + (j + 1) * part + (_TASK_STEP if j > 0 else 0) for j in range(pes - 1)
    ]


def epilogue_options(tiling: GemvTiling, per_output: int) -> list[int]:
    """The epilogue_pes the program implements for a tiling: 1, and where there is per-output work,
    every count up to the K-line's length that leaves every PE at least one output (a count that does
    not divide tile_n only multicast: `epilogue_ways`)."""
    if per_output <= 0:
        return [1]
    return list(range(1, min(tiling.tile_n, tiling.rows) + 1))


def epilogue_ways(tiling: GemvTiling, per_output: int) -> list[tuple[int, bool]]:
    """(epilogue_pes, epilogue_multicast) of every way the program shares an epilogue: alone, and
    each sharing relayed (comm/scatter.csl, comm/gather.csl: equal slices, so a divisor of tile_n) or
    multicast (comm/spread.csl: any count, the slices cut by `epilogue_slices`)."""
    ways = []
    for p in epilogue_options(tiling, per_output):
        if p == 1:
            ways.append((1, False))
            continue
        if tiling.tile_n % p == 0:
            ways.append((p, False))
        ways.append((p, True))
    return ways


@lru_cache(maxsize=8192)
def best_gemv_reduction(
    tiling: GemvTiling, arch: Arch | str, dtype: str, epilogue_cycles_per_output: int = 0
) -> GemvTiling:
    """The tiling with the reduction (`gemv_reduction_options`: chain, two or three levels with their
    best run lengths) and the epilogue sharing (`epilogue_options`) the model finds fastest. Only what
    wafer_gpt2/kernels/comm implements is offered: a faster plan the CSL cannot run is worth nothing."""

    def variant(reduction: tuple[Reduction, int, int], way: tuple[int, bool]) -> GemvTiling:
        (kind, group, end_group), (pes, multicast) = reduction, way
        return GemvTiling(
            **{
                **vars(tiling),
                "reduction": kind,
                "group": group,
                "end_group": end_group,
                "epilogue_pes": pes,
                "epilogue_multicast": multicast,
            }
        )

    def cycles(option: GemvTiling) -> int:
        return gemv_cost(option, arch, dtype, epilogue_cycles_per_output).cycles

    # `gemv_cost` is the reduction's phase plus the epilogue's, neither depending on the other: the
    # fastest reduction under any one epilogue, then the fastest epilogue after it, is the fastest pair
    # (and of pairs that tie, the first in the order the options are listed)
    ways = epilogue_ways(tiling, epilogue_cycles_per_output)
    reduction = min(gemv_reduction_options(tiling.rows), key=lambda r: cycles(variant(r, ways[0])))
    return min((variant(reduction, way) for way in ways), key=cycles)


# --- LayerNorm -------------------------------------------------------------------------------------


def norm_cost(tiling: NormTiling, name: str = "layernorm") -> StageCost:
    """One-pass LayerNorm over a strip (wafer_gpt2/kernels/pe/layernorm.csl): every PE sums its chunk's x and x^2
    (`norm_sums_cycles`: one @map into two scalars), the two words are all-reduced over the strip
    at once (`allreduce_cycles`: they stream back to back through every DSD step, towards the middle
    of the strip and back); then mean and
    variance = E[x^2] - mean^2, rstd, and every PE writes ((x - mean) * rstd) * g + b (4 fp32 ops per
    value).

    The exact alternative, a pairwise (count, mean, M2) merge, needs scalar control at every step (a
    task activation and the merge arithmetic on 3 words): priced with these constants at 504 cycles
    for GPT-2's 32-PE strip (rooted at the strip's end) against 217 for the 2-word DSD all-reduce
    rooted there (and 428 for the two 1-word all-reduces of a two-pass LayerNorm), so the CSL does not
    implement it."""
    cost = StageCost(name)
    if not tiling.normalise:
        # The GEMV after it has the LayerNorm folded in and takes the stream through the strip's
        # routers (wafer_gpt2/codegen/build.py): one hop, which the hand-off counts.
        return cost.add("through its routers", 0)
    # layernorm.csl's steps: a task when the chunk is in (got_input), one when the statistics are
    # (got_sum), an operation's start per vector operation, the output's header and its send's start
    cost.add("input", ROUTER_TO_PE_CYCLES + tiling.chunk)
    cost.add("task: the input in", TASK_ACTIVATION_CYCLES)
    cost.add("local sums (x, x^2)", norm_sums_cycles(tiling.chunk))
    cost.add(
        f"{tiling.reduction} all-reduce",
        allreduce_cycles(tiling.reduction, tiling.pes, NORM_STAT_WORDS, tiling.group),
    )
    cost.add("task: the sums in", TASK_ACTIVATION_CYCLES)
    cost.add("rsqrt", RSQRT_CYCLES)
    cost.add("normalise", 4 * (DSD_OP_START_CYCLES + tiling.chunk))
    cost.add("the output's header (its send's start)", DSD_OP_START_CYCLES + ITEM_HEADER_WORDS)
    return cost


def residual_cost(
    chunk: int,
    name: str = "residual",
    streamed_in: bool = False,
    streams_through: bool = False,
    lane_in: bool = False,
) -> StageCost:
    """Add the residual stream's chunk to the arriving one and pass the sum on, as
    wafer_gpt2/kernels/pe/residual.csl does. `streamed_in`: the GEMV before it sends its sums as its
    reduction makes them, its header long before, and its cost holds their words.
    - `lane_in` (the GEMV output comes on a lane: res_1, res_2): the header is read alone, and a task
      then starts one add that takes the words as they come into x's frame; where the GEMV streamed,
      each word is added a link after it left. Then a task, the header and the sum in one operation.
    - `streams_through` (a lane in, a lane out, nothing forwarded: res_2 inside a band): that add
      writes the lane out, the header sent on before it; each word passes at a link and an add.
    - else the chunk in (a hop, the ramp, its words), a task, one fp32 add over the chunk, then the
      header and the sum in one operation from the input's frame."""
    link = HOP_CYCLES + ROUTER_TO_PE_CYCLES
    cost = StageCost(name)
    if streams_through or lane_in:
        if streamed_in:
            cost.add("the words in, added as they pass", link + FP32_OPS_PER_CYCLE)
        else:
            # the header's send (streams_through) and the add's start, while the words wait
            send = DSD_OP_START_CYCLES + ITEM_HEADER_WORDS if streams_through else 0
            steps = TASK_ACTIVATION_CYCLES + send + DSD_OP_START_CYCLES
            cost.add("the header in, a task, the add's start", link + ITEM_HEADER_WORDS + steps)
            cost.add("the words, added as they pass", chunk * FP32_OPS_PER_CYCLE)
        if streams_through:
            return cost
        cost.add("task: the sum in", TASK_ACTIVATION_CYCLES)
    else:
        cost.add("the chunk in", link + (0 if streamed_in else chunk))
        cost.add("task: add", TASK_ACTIVATION_CYCLES + DSD_OP_START_CYCLES + chunk * FP32_OPS_PER_CYCLE)
    send = DSD_OP_START_CYCLES + ITEM_HEADER_WORDS
    cost.first_word = cost.cycles + send
    return cost.add("the sum's send", send + chunk)


# --- Attention -------------------------------------------------------------------------------------


def attention_cost(
    tiling: AttentionTiling,
    arch: Arch | str,
    dtype: str,
    positions: int | None = None,
    name: str = "attention",
) -> StageCost:
    """One decode item attending to `positions` cached positions (default: the whole context).

    1. the group's stream of [k | q | v] (a run of qkv columns holds them, each contiguous) enters
       the group's rows and is multicast over its block: every PE reads k and q (comm/recv.csl)
       before its task starts, v meanwhile; the PE that owns the new position moves its k into the
       cache (`_store_cycles`); the scores read q where it arrived.
    2. each PE, per head (wafer_gpt2/kernels/pe/attention.csl `scores_and_max`): the scores of all its
       positions as one @map over the head dimension (K stored transposed: step d adds q_d * K^T[d, :],
       ppp FMACs) and their max.
    3. the max round (`merge_rounds`): the maxima (hpp words) reduced over the group's chain in the
       tiling's order with @fmaxs, in the fabric while every PE makes its exps and the exp-weighted V
       as one @map over the visible positions (step j adds e_j * V[j, :], head_dim FMACs); the owner
       stores its v first. The PE that ends it multicasts M back once its own work is done.
    4. the sum round: when M is in, each PE's [l | acc] times exp(m - M) (an exp and an @fmuls per
       head; with one head per PE the round's FMAC multiplies) is summed over the same links, a plain streamed add (comm/reduce.csl), every PE ready at
       its own time (M reaches the far ones later, the owner is later by what its stores cost beyond
       its wait for M: "the owner's k, v store (not hidden)").
    5. 1/sum on the PE that ends the merge and the hand-off to its rows of the O GEMV: the output,
       multiplied by it as it leaves (wafer_gpt2/kernels/comm/gather.csl send_scaled_parts), its
       header sent as the item came in.
    """
    arch = resolve_arch(arch)
    positions = tiling.context if positions is None else max(1, min(positions, tiling.context))
    macs = arch.macs_per_cycle(dtype)
    width, _ = tiling.grid_wh
    hpp, dim = tiling.heads_per_pe, tiling.head_dim
    local = min(tiling.positions_per_pe, positions)
    weights, owner, k_cycles, v_cycles = _merge_inputs(tiling, arch, dtype, positions)
    cost = StageCost(name)
    # Every PE reads the header, k and q before its task starts (v is read meanwhile).
    stream = ITEM_HEADER_WORDS + 2 * hpp * dim
    cost.add("k, q multicast", stream_cycles(stream, (width - 1) + (tiling.fold - 1)))
    # The scores' @map runs over all positions_per_pe (its K^T register steps a whole row per step);
    # the later steps see only the visible ones.
    cost.add("scores q.k", hpp * map_fmac_cycles(dim, tiling.positions_per_pe, macs) + TASK_ACTIVATION_CYCLES)
    # per head, the visible scores times 1 / sqrt(head_dim) (@fmuls) and their max (@fmaxs)
    cost.add("scale + max", hpp * 2 * (DSD_OP_START_CYCLES + local * FP32_OPS_PER_CYCLE))
    rounds = merge_rounds(tiling, weights)
    stored = merge_rounds(tiling, weights, owner, k_cycles, v_cycles)
    cost.add("exp + weighted V", weights)
    cost.add("max merge round + M multicast (beyond the weights)", rounds.m_known - weights)
    cost.add("rescale", rounds.rescale)
    cost.add(f"sum merge round ({tiling.reduction})", rounds.summed - rounds.m_known - rounds.rescale)
    cost.add("the owner's k, v store (not hidden)", stored.summed - rounds.summed)
    # 1/l per head; acc * (1/l) is made as the output leaves (one @fmuls into the fabric per head, each
    # after the previous one's task).
    cost.add("1 / sum", hpp * RSQRT_CYCLES + (hpp - 1) * (TASK_ACTIVATION_CYCLES + DSD_OP_START_CYCLES))
    # comm/gather.csl's lane: its header left as the item came in (attention.csl), so the first
    # head's product leaves in an operation started by the task that ends the merge.
    cost.add("the output's first operation", DSD_OP_START_CYCLES)
    # The PE that ends the merge sends the group's output to its O rows (a multicast over them).
    cost.first_word = cost.cycles
    cost.add("to the O rows", stream_cycles(hpp * dim, width - 1 + tiling.fold - 1))
    return cost


def _merge_inputs(
    tiling: AttentionTiling, arch: Arch, dtype: str, positions: int
) -> tuple[int, int, int, int]:
    """(each PE's exps and weighted V, the owner of the new position, its k store, its v store and
    the task that makes its weights when v is in) in cycles: what `merge_rounds` takes."""
    hpp, local = tiling.heads_per_pe, min(tiling.positions_per_pe, positions)
    macs = arch.macs_per_cycle(dtype)
    weights = local * hpp * EXP_CYCLES + hpp * map_fmac_cycles(local, tiling.head_dim, macs)
    k_cycles, v_cycles = _store_cycles(tiling, dtype)
    owner = (positions - 1) // tiling.positions_per_pe
    return weights, owner, k_cycles, v_cycles + TASK_ACTIVATION_CYCLES


def _store_cycles(tiling: AttentionTiling, dtype: str) -> tuple[int, int]:
    """wafer_gpt2/kernels/pe/attention.csl `store_k` and `store_v`, (k, v) cycles on the owner: k one
    DSD operation (K^T's rows follow each other across heads), v one per head (V's rows are per head).
    They are DSD moves in fp32, @maps that round each value to the fp16 cache in fp16 (a step: its
    overhead and the conversion)."""
    width = tiling.heads_per_pe * tiling.head_dim
    per_value = MAP_STEP_CYCLES + FP32_OPS_PER_CYCLE if dtype == "fp16" else FP32_OPS_PER_CYCLE
    k = DSD_OP_START_CYCLES + width * per_value
    v = tiling.heads_per_pe * DSD_OP_START_CYCLES + width * per_value
    return k, v


@dataclass(frozen=True)
class MergeRounds:
    """attention.csl's two rounds, in cycles from the start of the max round (every PE's scores and
    maxima done): `m_known` when the last PE holds M, `rescale` each PE's work between M and its
    send, `summed` when the PE that ends the merge holds the sums (its task started)."""

    m_known: int
    rescale: int
    summed: int


def merge_rounds(
    tiling: AttentionTiling, weights: int, owner: int | None = None, k_store: int = 0, v_store: int = 0
) -> MergeRounds:
    """The max round and the sum round over a head group's chain (wafer_gpt2/kernels/pe/attention.csl,
    comm/reduce.csl), `weights` the cycles each PE spends on its exps and weighted V meanwhile; PE
    `owner` (the new position's) stores k (`k_store` cycles) before its scores and v (`v_store`)
    after it has started the max round, before its weights.

    Max round: each PE copies its maxima and starts the round (two DSD operations); the hpp words
    stream through the chain (or its runs, then the runs' ends, linked by direct routes:
    `_run_end_links`). The PE that ends it takes its task once its own weights are done, and sends M
    (a copy and a send) over one multicast; each other PE takes a task when M is in and its own
    weights are done.
    Sum round: a PE's factor (one exp per head), the l it scales and its acc (an @fmuls per head) and
    the start of the round's operation (one head per PE: the exp and the start, the operation an FMAC
    that scales as it sends); then the record [l | acc] streams through the same links, each
    PE ready at its own time; the last add ends its task. A group of one PE goes straight on to 1/l."""
    hpp = tiling.heads_per_pe
    record = hpp * (tiling.head_dim + 1)
    n = tiling.chain
    if n == 1:  # a group of one PE has no rounds: its own max is M
        late = k_store + v_store if owner is not None else 0
        return MergeRounds(weights + late, 0, weights + late)
    begins = [0] * n  # when a PE's scores are done
    done = [weights] * n  # when its weights are
    if owner is not None:
        begins[owner] = k_store
        done[owner] = k_store + v_store + weights
    far = _hops_to_end(tiling)
    start = 2 * DSD_OP_START_CYCLES
    m_done = start + _merge_first(begins, tiling) + hpp
    sent = max(m_done, done[-1]) + TASK_ACTIVATION_CYCLES + 2 * DSD_OP_START_CYCLES
    # M's multicast reaches PE i at sent + stream_cycles(hpp, far[i]) (the planner's inner loop:
    # the arithmetic inlined)
    arrives = sent + stream_cycles(hpp, 0)
    known = [
        (m if (m := arrives + h * HOP_CYCLES) > d else d) + TASK_ACTIVATION_CYCLES
        for h, d in zip(far[:-1], done, strict=False)
    ]
    known.append(sent)  # the PE that ends the round holds M at once
    rescale = _rescale_cycles(tiling)
    ready = [k + rescale for k in known]
    summed = _merge_first(ready, tiling) + record + TASK_ACTIVATION_CYCLES
    return MergeRounds(max(known), rescale, summed)


def _rescale_cycles(tiling: AttentionTiling) -> int:
    """The sum round's start on a PE once it holds M: its factor, its l and acc scaled, the round's
    operation started."""
    hpp = tiling.heads_per_pe
    if hpp == 1:  # the round's own operation multiplies by the factor as the record leaves (an FMAC)
        return EXP_CYCLES + DSD_OP_START_CYCLES
    return (
        hpp * (EXP_CYCLES + FP32_OPS_PER_CYCLE + DSD_OP_START_CYCLES + tiling.head_dim) + DSD_OP_START_CYCLES
    )


def merge_rounds_floor(tiling: AttentionTiling, weights: int) -> int:
    """Cycles `merge_rounds(tiling, weights, ...).summed` is never under, wherever the new position's
    stores are: each round passes the first run's members and then every run's end, a link and an
    add each (a link at least a hop); M goes out when the max round is over and the PE that ends it
    has its weights; the sum round starts on a PE once it holds M."""
    if tiling.chain == 1:  # no rounds: the PE's work
        return weights
    runs = tiling.runs()
    passes = (len(runs[0]) - 1 + len(runs) - 1) * (link_cycles(1) + FP32_OPS_PER_CYCLE)
    hpp = tiling.heads_per_pe
    max_round = 2 * DSD_OP_START_CYCLES + passes + hpp
    sent = max(max_round, weights) + TASK_ACTIVATION_CYCLES + 2 * DSD_OP_START_CYCLES
    record = hpp * (tiling.head_dim + 1)
    return sent + _rescale_cycles(tiling) + passes + record + TASK_ACTIVATION_CYCLES


@lru_cache(maxsize=4096)
def _hops_to_end(tiling: AttentionTiling) -> tuple[int, ...]:
    """Hops from each PE of a head group's snake to its last, which ends the merge."""
    along, row = tiling.snake(np.arange(tiling.chain))  # every PE at once: the search prices thousands
    return tuple((np.abs(along - along[-1]) + np.abs(row - row[-1])).tolist())


def _merge_first(ready: list[int], tiling: AttentionTiling) -> int:
    """First word of a round's result on the PE that ends the merge, members ready at `ready`: a
    chain along the snake (neighbours a hop apart), or its runs and then their ends."""
    runs = tiling.runs()
    if len(runs) == 1:
        return chain_times(ready)
    return level_times(ready, [len(runs[0])], _run_end_links(tiling))


@lru_cache(maxsize=4096)
def _run_end_links(tiling: AttentionTiling) -> tuple[int, ...]:
    """Hops between consecutive runs' ends of an attention chain, which wafer_gpt2/codegen/build.py
    links by direct routes: the snake runs along rows of ceil(chain / fold) PEs, every other row
    backwards, so ends a row apart can sit one hop apart; on the comb the runs are the rows' halves,
    whose ends sit side by side in the rows' middle."""
    spots = [tiling.snake(run[-1]) for run in tiling.runs()]
    return tuple(abs(a[0] - b[0]) + abs(a[1] - b[1]) for a, b in pairwise(spots))


@lru_cache(maxsize=4096)
def best_attention(tiling: AttentionTiling, arch: Arch | str, dtype: str) -> AttentionTiling:
    """The attention tiling the model finds fastest: chain or two_level (attention.csl's merge rounds
    run on comm/reduce.csl), each with its best run length on the snake, or two levels on the comb
    where it fits (`AttentionTiling.with_comb`). The options differ in their merge alone
    (`attention_cost`'s other phases depend on the chain's length and fold): the fastest is the one
    whose rounds, with the new position's stores, end first."""
    arch = resolve_arch(arch)
    options = [
        AttentionTiling(**{**vars(tiling), "reduction": kind, "group": group, "comb": False})
        for kind, group in reduction_options(tiling.chain)
    ]
    if AttentionTiling.comb_fits(tiling.chain, tiling.fold):
        options.append(tiling.with_comb())
    merge = _merge_inputs(tiling, arch, dtype, tiling.context)
    # Priced from the lowest floor up, until the floors pass the fastest priced: the options far from
    # the best run length (most of them on a long chain) are never priced. Ties go to the first listed.
    floors = [merge_rounds_floor(t, merge[0]) for t in options]
    best, fastest = 0, None
    for i in sorted(range(len(options)), key=floors.__getitem__):
        if fastest is not None and floors[i] > fastest:
            break
        summed = merge_rounds(options[i], *merge).summed
        if fastest is None or (summed, i) < (fastest, best):
            best, fastest = i, summed
    return options[best]


# --- Head: final LayerNorm is priced by norm_cost; here the LM head GEMV and its threshold selection ---


def threshold_bins(vocab: int, cols: int, tile_n: int, k: int) -> tuple[float, float]:
    """(entries of round C, entries of the threshold bin) of wafer_gpt2/kernels/pe/head.csl's selection: the
    logits of the bins up to the first one whose count reaches k, the bins splitting [L, M] in
    TOPK_BINS. Priced for logits spread like Gaussians (a data assumption): M near the 1 / (2 vocab)
    upper quantile; L the least column max (at least k columns: near the column max's 1 / cols quantile,
    Phi(L) = (ln 2 / cols) ** (1 / tile_n)) or the least logit; the threshold bin sits at the k-th
    best logit, where the density is vocab * pdf(x_k), so it holds about that times a bin's width, and
    round C takes k and half of it."""
    top, low, x_k, inside = _threshold_range(vocab, cols, tile_n, k)
    width = (top - low) / TOPK_BINS
    bin_t = max(1.0, vocab * NormalDist().pdf(x_k) * width)
    return min(inside, k + bin_t / 2), min(inside, bin_t)


def threshold_index(vocab: int, cols: int, tile_n: int, k: int) -> int:
    """The threshold bin's index (0 the bin at M) for the logits `threshold_bins` assumes: where the
    k-th best logit falls among the bins splitting [L, M]; lib/topk.csl `threshold` counts up to it."""
    top, low, x_k, _ = _threshold_range(vocab, cols, tile_n, k)
    return min(TOPK_BINS - 1, max(0, int((top - x_k) / (top - low) * TOPK_BINS)))


def _threshold_range(vocab: int, cols: int, tile_n: int, k: int) -> tuple[float, float, float, float]:
    """(M, L, the k-th best logit, the logits in [L, M]) in units of the logits' spread."""
    normal = NormalDist()
    top = normal.inv_cdf(1 - 0.5 / vocab)
    if cols >= k:
        below = (math.log(2.0) / cols) ** (1.0 / tile_n)
        low, inside = normal.inv_cdf(below), max(float(cols), vocab * (1.0 - below))
    else:
        low, inside = -top, float(vocab)
    return top, low, normal.inv_cdf(1 - min(k, vocab - 1) / vocab), inside


def _run_ends(ready: np.ndarray, group: int, link: int, step: int, first_step: int) -> np.ndarray:
    """The chain recurrence of `chain_times` over each run of `group` consecutive members (the last
    run may be shorter), for all runs at once: a run's end is
    max(ready[0] + first_step, max(ready[i], end_(i-1) + link) + step ...), whose closed form is the
    largest of ready[i] + (first_step if i == 0 else step) + (m - 1 - i) * (link + step) over the run's
    m members. Integers throughout: the same figures as the loop."""
    n = len(ready)
    runs = -(-n // group)
    short = runs * group - n
    per = link + step
    place = np.arange(group, dtype=np.int64)
    offsets = (group - 1 - place) * per + np.where(place > 0, step, first_step)
    padded = np.full(runs * group, _FAR_PAST, dtype=np.int64)
    padded[:n] = ready
    ends = (padded.reshape(runs, group) + offsets).max(axis=1)
    if short:
        ends[-1] -= short * per
    return ends


_FAR_PAST = -(2**40)  # a member that is not there (a short last run's padding)


def _half_sends(ready: np.ndarray, kind: str, group: int, words: int) -> int:
    """A half of the head's tree (comm/tree.csl), its members ready at `ready` in line order: when its
    end's stream to the centre starts. Every operation is synchronous: a run's end folds its run's
    stream into memory before it passes the ends' stream on (one pass of the words more than a FIFO
    would), unless the run's is the last stream it takes: then it passes that one straight on (the
    first of the runs' ends, and the end of a half of one run). The half's end passes the last
    stream on to the centre; a half of one root sends its own (an operation's start)."""
    n = len(ready)
    if n == 1:
        return int(ready[0]) + DSD_OP_START_CYCLES
    if len(reduction_runs(n, kind, group)) == 1:
        return int(_run_ends(ready, n, link_cycles(1), FP32_OPS_PER_CYCLE, 0)[0])
    if group == 1:  # runs of one member fold nothing: each is ready as it is
        ends = ready.copy()
    else:
        streamed = _run_ends(ready, group, link_cycles(1), FP32_OPS_PER_CYCLE, 0)
        ends = streamed + words + DSD_OP_START_CYCLES
        ends[0] = streamed[0]  # the first end passes its run's stream on
        if n % group == 1:  # a last run of one folds nothing
            ends[-1] = ready[-1] + DSD_OP_START_CYCLES
    return int(_run_ends(ends, len(ends), link_cycles(group), FP32_OPS_PER_CYCLE, 0)[0])


def head_tree_cycles(tiling: HeadTiling, ready: np.ndarray | list[int], words: int) -> int:
    """One round over the tree of the head's roots (comm/tree.csl): column c's root ready to send at
    ready[c]; when the centre holds the round's result. Each half's end streams it on (a hop), the
    centre folds the left half's into its own, then the right half's."""
    at = np.asarray(ready, dtype=np.int64)
    t = int(at[tiling.centre])
    for half in _tree_halves(at, tiling.centre):
        if not len(half):
            continue
        arrives = _half_sends(half, tiling.tree, tiling.tree_group, words) + link_cycles(1)
        t = max(t + DSD_OP_START_CYCLES, arrives) + FP32_OPS_PER_CYCLE + words
    return t


def head_relay_cycles(tiling: HeadTiling, ready: np.ndarray | list[int]) -> int:
    """Round C's counts over the tree of the roots (comm/tree.csl `relay`): column c's root reads the
    count of each of its inputs (its row's there at ready[c]; every read started before its count
    comes), sends their sum and relays the entries behind it; when the centre has read its three
    counts. A count passes a root in a link and one send (a DSD operation and its word)."""
    step = DSD_OP_START_CYCLES + 1

    def half_counts(members: np.ndarray) -> int:
        group = tiling.half_runs(len(members))[0].stop  # every run's length but a shorter last one
        ends = _run_ends(members, group, link_cycles(1), step, step)
        return int(_run_ends(ends, len(ends), link_cycles(group), step, 0)[0])

    at = np.asarray(ready, dtype=np.int64)
    t = int(at[tiling.centre]) + DSD_OP_START_CYCLES
    for half in _tree_halves(at, tiling.centre):
        if len(half):
            t = max(t, half_counts(half) + link_cycles(1)) + DSD_OP_START_CYCLES
    return t


def _tree_halves(ready: np.ndarray, centre: int) -> tuple[np.ndarray, np.ndarray]:
    """`HeadTiling.tree_halves` applied to the columns' times: 0 .. centre - 1, and the last column
    down to centre + 1."""
    return ready[:centre], ready[centre + 1 :][::-1]


def head_cost(tiling: HeadTiling, arch: Arch | str, dtype: str, name: str = "head") -> StageCost:
    """logits = h @ wte^T, then the top-k and the log-sum-exp by threshold selection (wafer_gpt2/kernels/pe/
    head.csl), from ln_f's output leaving ln_f to the output record leaving the centre. Every column's
    input arrives a hop after the column before it (ln_f sits under the head), so the columns, their
    workers and the roots of the tree are priced each at its own time (the ready-time reductions);
    the phases below are the increments of the critical path.

    1. every K-line: its window, the tile's FMACs, the chain of partial logits to its root;
    2. the root's logits to its `workers` (comm/scatter.csl), each a slice of tile_n / workers;
    3. round A: a worker's max and min, the K chain's links to the root ([max, -min], folded by
       maxima), the root's [m, -m, -min], the tree; the centre's M, L and scale, broadcast; the
       workers' sums of exps meanwhile;
    4. round B: a worker's rescaled sum and its histogram, [counts | S | target] summed the same way;
       the centre's log-sum-exp and threshold bin, broadcast;
    5. round C: a worker's entries of the bins up to t, the counts and the lists relayed in id order
       to the centre, which keeps the k best as they come (a chunk at a time) and sends the record."""
    arch = resolve_arch(arch)
    g = tiling.gemv
    cols, e, part, k = g.cols, tiling.workers, tiling.slice, tiling.top_k
    m = tiling.centre
    cost = StageCost(name)
    # 1. the K-lines
    window = max(g.tile_k, gemv_compute_cycles(g, arch, dtype))
    chain = chain_reduce_cycles(g.rows - 1, g.tile_n)
    through = 0
    if tiling.apart:
        # the last weighted PE sends the item's header ahead of its sum, multicast to every PE of the
        # rounds: the last worker takes the header in a task and reads the sum whole (the vector
        # streams behind, over the links to it)
        chain += DSD_OP_START_CYCLES + ITEM_HEADER_WORDS
        through = e * HOP_CYCLES + ROUTER_TO_PE_CYCLES + TASK_ACTIVATION_CYCLES + DSD_OP_START_CYCLES
        through += g.tile_n if g.rows == 1 else 0
        # the last set's items cross the routers of the sets before it (no task there): priced for it
        through += (tiling.sets - 1) * tiling.rounds_pes * HOP_CYCLES
    # The columns' times are arrays (one element per column): the rounds' per-column arithmetic is the
    # planner's inner loop, priced for every candidate head.
    logits_at = np.arange(cols, dtype=np.int64) * HOP_CYCLES + (link_cycles(1) + window + chain + through)
    cost.add("input to the farthest column", (cols - 1) * HOP_CYCLES + link_cycles(1))
    cost.add("tile FMAC", window)
    cost.add("chain reduction", chain)
    if tiling.apart:
        cost.add("the sum to the rounds' PEs", through)
    # 2. the slices: the root's scatter (its first DSD operation; a task on the worker), or apart each
    # worker's in the sum it read (a task)
    if tiling.apart:
        slices = [TASK_ACTIVATION_CYCLES] * e
    else:
        slices = [t + TASK_ACTIVATION_CYCLES for t in _scattered(e + 1, part, DSD_OP_START_CYCLES)]
    # 3. round A: a worker's scan, then its part of the K chain's links (a synchronous operation)
    scan = part * TOPK_SCAN_CYCLES + 4 + DSD_OP_START_CYCLES
    worker_a = [s + scan for s in slices]
    row_a = chain_times(worker_a) + link_cycles(1) + 2  # the root has the column's [max, -min]
    root_a_at = logits_at + (row_a + 4 + DSD_OP_START_CYCLES)
    # A worker's exps start when its round-A operation is over: the worker before it has sent.
    sent_a = [int(t) + 2 for t in _chain_prefixes(worker_a)]
    exps = [t + part * (EXP_CYCLES + 2) for t in sent_a]
    centre_a = head_tree_cycles(tiling, root_a_at, 3)
    answer = 6 + RSQRT_CYCLES + DSD_OP_START_CYCLES + 3  # M, L, the scale (a division); the broadcast
    cost.add("round A: slice max and min reduced to the centre", centre_a - int(logits_at[-1]))
    cost.add("the centre's M, L, scale, broadcast", answer)
    a_out = centre_a + answer

    # Every worker of every column at once (rows: worker j, columns: the head's columns): the hops
    # from the centre to worker j of a column, the answer's way back along the roots and the K-line.
    worker = np.arange(e, dtype=np.int64)
    hops = np.abs(np.arange(cols, dtype=np.int64) - m)[None, :] + (e - worker)[:, None]

    def heard(t: int, words: int) -> np.ndarray:  # every worker's task with the answer
        return t + link_cycles(0) + hops * HOP_CYCLES + words + TASK_ACTIVATION_CYCLES

    def chained(ready: np.ndarray, step: int) -> np.ndarray:
        """`chain_times` down each column's workers: the closed form of its recurrence, the latest of
        each worker's time plus the links and adds after it (as `_run_ends`)."""
        after = (e - 1 - worker) * (link_cycles(1) + step) + np.where(worker > 0, step, 0)
        return (ready + after[:, None]).max(axis=0)

    # 4. round B: the rescale (one exp), the counts zeroed, the histogram, the row's operation
    hist = EXP_CYCLES + 2 * TOPK_BINS + part * (TOPK_BIN_CYCLES + 2) + DSD_OP_START_CYCLES
    words_b = TOPK_BINS + 2
    ready_b = (
        np.maximum(heard(a_out, 3), logits_at[None, :] + np.asarray(exps, dtype=np.int64)[:, None]) + hist
    )
    row = chained(ready_b, FP32_OPS_PER_CYCLE) + link_cycles(1) + words_b
    root_b = np.maximum(row, root_a_at + DSD_OP_START_CYCLES) + DSD_OP_START_CYCLES
    centre_b = head_tree_cycles(tiling, root_b, words_b)
    cost.add("round B: histogram and sum of exps reduced to the centre", centre_b - a_out)
    # the running count up to bin t, t's broadcast; then (off the path unless the columns' counts come
    # sooner) log S and the selection's setup: every bin's first place, every place emptied
    t_index = threshold_index(tiling.vocab, cols, g.tile_n, k)
    verdict = 4 * (t_index + 1) + 8 + DSD_OP_START_CYCLES + 1
    cost.add("the centre's threshold bin, broadcast", verdict)
    b_out = centre_b + verdict
    centre_set = b_out + EXP_CYCLES + 2 * TOPK_BINS + 2 * k
    # 5. round C: a worker's selection pass, its count (after the worker before it: its read of that
    # count was started before it comes, so a count passes a worker or a root in one send) and its
    # entries after those it relays
    kept, bin_t = threshold_bins(tiling.vocab, cols, g.tile_n, k)
    select = part * TOPK_BIN_CYCLES + int(kept / (cols * e) * TOPK_ENTRY_CYCLES)
    step = DSD_OP_START_CYCLES + 1
    ready_c = heard(b_out, 1) + (select + DSD_OP_START_CYCLES)
    ready_c[0] += step  # the first worker starts the row with a send of its own count
    root_c = chained(ready_c, step) + link_cycles(1)
    root_c[m] = max(int(root_c[m]), centre_set)
    counts = head_relay_cycles(tiling, root_c)
    cost.add("round C: the lists merged to the centre (their counts)", counts - b_out)
    # The centre takes the entries as they come (slower than their words), a chunk at a time from
    # each of its three inputs, the right half's first chunk read while it takes the others and then
    # taken by a task of its own; bin t's are inserted among its remaining places (about a move each,
    # beyond the tests and the count an insertion takes).
    # The record leaves ordered by bin: io.out sorts inside the bins (`record_sort_cycles`).
    chunks = 3 + int(kept // HEAD_CHUNK)
    take = (
        kept * (2 + TOPK_TAKE_CYCLES)
        + chunks * DSD_OP_START_CYCLES
        + TASK_ACTIVATION_CYCLES
        + bin_t * (TOPK_BIN_T_CYCLES + TOPK_INVERSION_CYCLES)
    )
    cost.add("round C: the entries taken by the centre", int(take))
    record = 2 * (DSD_OP_START_CYCLES + k)  # the ids and the logits into the record
    cost.add("the output record", record + DSD_OP_START_CYCLES)
    if tiling.apart:  # items overlap in the stage: it takes one as often as the slower role allows
        cost.occupancy = max(head_role_cycles(tiling, cost))
    return cost


def head_role_cycles(tiling: HeadTiling, cost: StageCost) -> tuple[int, int]:
    """(a weighted PE, the rounds' PEs): the cycles each role of a head with its rounds apart is
    taken per item, from its `head_cost`. A weighted PE from its window's read to its sum's send
    (which waits until every PE of the rounds reads the sum); the rounds' PEs from the sum's way to
    them to the record, all columns at once (the next item's sums wait at every column, so the
    columns' skew of the input is gone), their read of the sum's words included (the span has them
    in the weighted chain's phase, where they overlap its hops). With `sets` of the
    rounds taking the items in turn, each set's PEs are taken once every `sets` items."""
    g = tiling.gemv
    window, chain = cost.phases["tile FMAC"], cost.phases["chain reduction"]
    weighted = ITEM_HEADER_WORDS + g.tile_k + TASK_ACTIVATION_CYCLES + window + chain
    stream = (ceil_div(g.tile_n, FP32_OPS_PER_CYCLE) + DSD_OP_START_CYCLES) if g.rows > 1 else 0
    rounds = cost.cycles - cost.phases["input to the farthest column"] - window - chain + stream
    return weighted, ceil_div(rounds, tiling.sets)


def record_sort_cycles(tiling: HeadTiling) -> int:
    """io.out putting the head's record best first (wafer_gpt2/kernels/lib/best_first.csl), once the
    record is in: a task, an insertion pass over its k entries and a move per pair out of order inside
    a bin (the bins before the threshold one hold their entries in id order: about a quarter of a bin's
    count of moves each, those bins half as full as the threshold bin; in bins of a few entries about
    as many entries move as there are moves), then the record's send."""
    kept, bin_t = threshold_bins(tiling.vocab, tiling.gemv.cols, tiling.gemv.tile_n, tiling.top_k)
    inversions = max(0.0, kept - bin_t) * max(0.0, bin_t / 2 - 1) / 4
    passes = tiling.top_k * TOPK_SORT_PASS_CYCLES
    moves = inversions * (TOPK_INVERSION_CYCLES + TOPK_SORT_MOVER_CYCLES)
    return TASK_ACTIVATION_CYCLES + passes + int(moves) + DSD_OP_START_CYCLES


@lru_cache(maxsize=4096)
def best_head(tiling: HeadTiling, arch: Arch | str, dtype: str) -> HeadTiling:
    """The head tiling the model finds fastest: its K-lines reduced in a chain (the rounds ride its
    links), the workers (a divisor of tile_n, fewer than the K-line's PEs; apart, the tiling's own)
    and each half of the roots' tree (a chain, or two levels) the model prices fastest; the workers
    with a chained tree first, then the tree with those workers."""
    g = GemvTiling(**{**vars(tiling.gemv), "reduction": "chain", "group": 0})
    base = HeadTiling(**{**vars(tiling), "gemv": g, "tree": "chain", "tree_group": 0})
    if not tiling.apart:  # apart, the workers are the plan's (the PEs it gives the rounds)
        options = worker_options(g)
        if not options:
            raise ValueError(f"a head K-line of {g.rows} PE(s) leaves no PE to hold its logits")
        workers = min(
            options, key=lambda w: head_cost(HeadTiling(**{**vars(base), "workers": w}), arch, dtype).cycles
        )
        base = HeadTiling(**{**vars(base), "workers": workers})
    half = max(len(h) for h in base.tree_halves())
    trees = [base] + [
        HeadTiling(**{**vars(base), "tree": "two_level", "tree_group": group})
        for group in TREE_GROUPS
        if group < half
    ]
    return min(trees, key=lambda t: head_cost(t, arch, dtype).cycles)


# The run lengths offered for the halves of the head's tree (the halves span up to a few thousand
# columns; a handful keeps the search fast).
TREE_GROUPS = (2, 3, 4, 6, 8, 11, 16, 23, 32, 45, 64)


def worker_options(gemv: GemvTiling) -> list[int]:
    """The workers a head K-line can have: divisors of tile_n up to the K-line's PEs less its root."""
    return [w for w in range(1, min(gemv.tile_n, gemv.rows - 1, 64) + 1) if gemv.tile_n % w == 0]


def route_cost(words: int, hops: int, name: str) -> StageCost:
    """A hand-off of `words` words over `hops` routers (a bus on one color)."""
    return StageCost(name).add("route", stream_cycles(words, hops))


def standalone_gemv_cost(arch: Arch | str, rows: int, cols: int, k: int, n: int, dtype: str) -> StageCost:
    """The `cost gemv` command: one GEMV on a rows x cols grid (rows PEs along K), the input chunks
    injected at the grid's edge, the outputs leaving the far edge; the reduction (chain, or two_level
    with its best run length) is the one the model finds fastest. The stage name says which."""
    tiling = best_gemv_reduction(GemvTiling(k, n, rows, cols), resolve_arch(arch), dtype)
    cost = gemv_cost(tiling, arch, dtype, name=f"{tiling.reduction}{reduction_shape(tiling)} reduction")
    cost.phases = {"input injection": ROUTER_TO_PE_CYCLES + tiling.tile_k, **cost.phases}
    return cost
