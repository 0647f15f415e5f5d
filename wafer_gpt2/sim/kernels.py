"""What each kind of region computes, vectorised over its PEs: the numerics the CSL kernels follow.

Every function takes the tiling (`wafer_gpt2.core.tiling`) that says what each PE holds and combines partial
results in the order the tiling fixes. They work on a batch of B token items at once; the
per-PE work is done for all PEs by one NumPy call (no Python loop over PEs).

Precision (`fp16=True` is the hardware default, `fp16=False` the all-fp32 mode):
- Stored values (weights, biases, LayerNorm gains, the KV cache) carry the dtype of the PE symbol
  that holds them; a float16 symbol rounds once, when the value is written.
- A GEMV input vector is rounded to fp16 where it enters the GEMV region (the multicast carries fp16
  wavelets) and each PE accumulates its tile's products in fp32 (`@fmachs`). fp16 x fp16 products are
  exact in fp32, so an fp32 BLAS matmul over fp16-valued operands is that same arithmetic.
- Partial sums, biases, residuals, LayerNorm, GELU, softmax and the log-sum-exp are fp32.
- Attention scores: q is rounded to fp16 in fp16 mode and dotted with the fp16 K cache with fp32
  accumulation; the softmax weights are summed in fp32 and, rounded to fp16 in fp16 mode, multiply
  the (fp16) V cache with fp32 accumulation (`@fmachs`, as the GEMV's input).
"""

from __future__ import annotations

import math

import numpy as np

from wafer_gpt2.core.memory_layout import tiled_positions
from wafer_gpt2.core.tiling import (
    AttentionTiling,
    GemvTiling,
    HeadTiling,
    NormTiling,
    allreduce_halves,
    ceil_div,
    reduction_end_runs,
    reduction_runs,
)
from wafer_gpt2.sim import parallel

F32 = np.float32


def round_fp16(x: np.ndarray) -> np.ndarray:
    """The value an fp32 vector has after the CSL converts it to fp16 (round to nearest even)."""
    return x.astype(np.float16).astype(F32)


def chain_sum(partials: np.ndarray) -> np.ndarray:
    """Sum over axis 0 in chain order: ((p0 + p1) + p2) + ... (NumPy reduces a leading axis in order)."""
    return np.add.reduce(partials, axis=0)


def combine(partials: np.ndarray, reduction: str, group: int = 0, end_group: int = 0) -> np.ndarray:
    """Sum over axis 0 in the order of `wafer_gpt2.core.tiling.reduction_runs`: each run chained, then the runs'
    sums chained (three_level: in runs of `end_group` first, `ends_sum`). May overwrite `partials`."""
    runs = reduction_runs(partials.shape[0], reduction, group)
    if len(runs) == 1:
        return chain_sum(partials)
    return ends_sum(
        np.stack([chain_sum(partials[run.start : run.stop]) for run in runs]), reduction, end_group
    )


def ends_sum(run_sums: np.ndarray, reduction: str, end_group: int = 0) -> np.ndarray:
    """The runs' sums (axis 0, in run order) combined as the second level of a reduction does
    (`wafer_gpt2.core.tiling.reduction_end_runs`): one chain, or chains of `end_group` whose sums
    then chain (three_level)."""
    ends = reduction_end_runs(run_sums.shape[0], reduction, end_group)
    if len(ends) == 1:
        return chain_sum(run_sums)
    return chain_sum(np.stack([chain_sum(run_sums[e.start : e.stop]) for e in ends]))


def allreduce_sum(partials: np.ndarray, reduction: str, group: int = 0) -> np.ndarray:
    """Sum over axis 0 in the order of comm/allreduce.csl: the left half (0 .. root) and the right half
    (n-1 down to root + 1) each combined in the tiling's order, then left + right on the root."""
    left, right = allreduce_halves(partials.shape[0])
    total = combine(np.ascontiguousarray(partials[left]), reduction, group)
    if right:
        total = total + combine(np.ascontiguousarray(partials[right]), reduction, group)
    return total


# ----------------------------------------------------------------------------------------------------
# GEMV: y[N] = x[K] @ W[K, N]; PE (r, c) holds W tile (r, c) as a row-major [tile_k, tile_n] block.
# The tiling-indexed arrays come from `wafer_gpt2.core.memory_layout.gather` of the region's memory image.


def gemv_weight_cache(tiles: np.ndarray, tiling: GemvTiling) -> np.ndarray:
    """[rows, cols, tile_k * tile_n] tiles -> [rows, tile_k, N] float32 with the outputs in N order: the
    layout one batched matmul needs. A compute cache, rebuilt whenever the host writes the symbol;
    moving output columns around changes no arithmetic (each output sums its own column of tiles)."""
    tk, tn = tiling.tile_k, tiling.tile_n
    tiled = tiles.reshape(tiling.rows, tiling.cols, tk, tn).transpose(0, 2, 1, 3).reshape(tiling.rows, tk, -1)
    return np.ascontiguousarray(tiled[:, :, tiled_positions(tiling)], dtype=F32)


def gemv_bias_cache(tiles: np.ndarray, tiling: GemvTiling) -> np.ndarray:
    """[rows, cols, tile_n] bias slices -> [N] float32, as held by the PEs that end the reduction
    (reduction index rows - 1) and add it."""
    return np.ascontiguousarray(tiles[-1].reshape(-1)[tiled_positions(tiling)], dtype=F32)


# The partial sums are formed `group` reduction indices at a time over blocks of output columns, so a
# group's [group, B, block] partials stay in cache while they are combined (few NumPy calls when B is
# small, cache-sized pieces when it is large). For a two-level reduction a group is one of its runs,
# whose sum is one term of the second level. The sizes below were tuned by measurement (docs/simulator.md,
# "Speed": the thresholds and what they were measured at).
GEMV_CACHE_ELEMS = 1 << 20
GEMV_GROUP_BLOCK = 2048  # grow the group while its blocks stay at least this wide
GEMV_MIN_BLOCK = 128
GEMV_ALIGN = 16  # block widths are a multiple of this many columns (whole SIMD vectors)
# Below this many multiply-adds a GEMV runs on one thread: handing blocks to the pool costs more than
# it saves (docs/simulator.md, "Speed").
GEMV_PARALLEL_MACS = 1 << 24


def gemv_region(
    x: np.ndarray,
    weight_cache: np.ndarray,
    tiling: GemvTiling,
    fp16: bool,
    root_bias: np.ndarray | None = None,
) -> np.ndarray:
    """x [B, K] -> y [B, N]: every PE's fp32 partial sum of its tile, combined over the reduction
    index in the tiling's order (chain, or two_level runs). `root_bias` [N] (fp32) is added to the
    partial of the PE that ends the reduction before it is combined (`GemvTiling.bias_at_root`);
    without it the sums carry no bias."""
    batch, tk = x.shape[0], tiling.tile_k
    xp = np.zeros((batch, tiling.rows * tk), dtype=F32)
    xp[:, : tiling.k] = round_fp16(x) if fp16 else x  # the multicast into the region carries fp16
    chunks = np.ascontiguousarray(xp.reshape(batch, tiling.rows, tk).transpose(1, 0, 2))  # chunk r to row r
    if tiling.reduction in ("two_level", "three_level") and 0 < tiling.group < tiling.rows:
        group = tiling.group
    else:
        group = 8
        while group < tiling.rows and 2 * group * batch * GEMV_GROUP_BLOCK <= GEMV_CACHE_ELEMS:
            group *= 2
    n = weight_cache.shape[2]
    out = np.empty((batch, n), dtype=F32)

    def reduce_block(span: tuple[int, int]) -> None:
        start, stop = span
        columns = weight_cache[:, :, start:stop]
        bias = None if root_bias is None else root_bias[start:stop]
        out[:, start:stop] = _reduce_columns(chunks, columns, tiling.reduction, group, bias, tiling.end_group)

    # Blocks of output columns are independent (as the PE columns are), so they run side by side on
    # the pool, as many per thread; the arithmetic of each block is unchanged.
    widest = max(GEMV_MIN_BLOCK, GEMV_CACHE_ELEMS // (group * batch))
    threads = parallel.threads() if batch * tiling.k * n >= GEMV_PARALLEL_MACS else 1
    parallel.map_all(reduce_block, _column_blocks(n, widest, threads), in_place=threads == 1)
    return out


def _column_blocks(n: int, widest: int, threads: int) -> list[tuple[int, int]]:
    """[start, stop) spans covering 0..n, at most `widest` wide, a multiple of `threads` in number
    (when the columns allow it) and of near-equal width, so every thread gets the same work."""
    count = ceil_div(n, widest)
    if threads > 1:
        count = min(ceil_div(count, threads) * threads, ceil_div(n, GEMV_ALIGN))
    width = ceil_div(ceil_div(n, count), GEMV_ALIGN) * GEMV_ALIGN
    return [(start, min(start + width, n)) for start in range(0, n, width)]


def _reduce_columns(
    chunks: np.ndarray,
    weights: np.ndarray,
    reduction: str,
    group: int,
    root_bias: np.ndarray | None = None,
    end_group: int = 0,
) -> np.ndarray:
    """sum over r of chunks[r] @ weights[r], `group` rows per matmul: a chain carries its running sum
    from group to group; a two- or three-level reduction (whose runs are the groups) combines the
    groups' sums as its second level does (`ends_sum`). `root_bias` joins the last row's partial first."""
    rows, batch = chunks.shape[:2]
    starts = range(0, rows, group)
    # One buffer for every group's partials, reused group after group, and one for the groups' sums.
    partials = np.empty((min(group, rows), batch, weights.shape[2]), dtype=F32)
    nodes = np.empty((len(starts), batch, weights.shape[2]), dtype=F32)
    for i, g in enumerate(starts):
        size = min(group, rows - g)
        block = np.matmul(chunks[g : g + size], weights[g : g + size], out=partials[:size])  # [G, B, block]
        if root_bias is not None and g + size == rows:
            block[size - 1] += root_bias  # before the running sum reaches it: the PE's own vector
        if reduction == "chain" and i:
            block[0] += nodes[i - 1]  # the running sum arriving from PE g - 1 (a + b == b + a)
        nodes[i] = chain_sum(block)
    if reduction == "chain":
        return nodes[-1]
    return ends_sum(nodes, reduction, end_group)


def folded_norm(
    sums: np.ndarray, x: np.ndarray, colsum: np.ndarray, strip: NormTiling, eps: float
) -> np.ndarray:
    """The LayerNorm folded into a GEMV (wafer_gpt2/kernels/pe/gemv.csl norm_dim): `sums` = x @ diag(gain) @ W
    [B, N] from the raw x [B, K]. The strip before the GEMV makes the statistics as it makes a
    LayerNorm's (pe/layernorm.csl `folded_stats`, `layernorm_region`'s sums: each PE's chunk in index
    order, fp32 before any fp16 rounding, all-reduced in `allreduce_sum`'s order), and the PE that ends
    the GEMV's reduction makes (sums - mean * colsum) * rstd (`norm_statistics`). Overwrites and
    returns `sums`."""
    mean, rstd = norm_statistics(strip_sums(x, strip), strip.dim, eps)
    sums += colsum * -mean[:, None]
    sums *= rstd[:, None]
    return sums


# ----------------------------------------------------------------------------------------------------
# LayerNorm over C values: PE p holds x[p*chunk:(p+1)*chunk] and the same chunk of gain and bias.
# The strip lies along x ((h, w) = (1, pes)) or along y ((pes, 1)); either way PE p is element p.


def norm_cache(tiles: np.ndarray, tiling: NormTiling) -> np.ndarray:
    """[pes, chunk] gain or bias -> [C] float32."""
    return np.ascontiguousarray(tiles.reshape(-1)[: tiling.dim], dtype=F32)


def layernorm_region(
    x: np.ndarray, gain: np.ndarray, bias: np.ndarray, tiling: NormTiling, eps: float
) -> np.ndarray:
    """One-pass statistics, as wafer_gpt2/kernels/pe/layernorm.csl: each PE sums its chunk's x and x^2 in index
    order, the two sums are combined over the PEs in the all-reduce's order (`allreduce_sum`: each
    half of the strip in the tiling's order, then the halves) -> mean = sum / C and
    variance = sum_sq / C - mean^2 (clamped at 0: rounding can leave it just below); every PE then
    writes ((x - mean) * rstd) * g + b for its chunk. All fp32.

    E[x^2] - mean^2 in fp32 loses about log2(1 + mean^2 / variance) bits of the variance to
    cancellation: a few ulps for GPT-2's residual stream, whose mean is small beside its spread."""
    mean, rstd = norm_statistics(strip_sums(x, tiling), tiling.dim, eps)
    return ((x - mean[:, None]) * rstd[:, None]) * gain + bias


def strip_sums(x: np.ndarray, tiling: NormTiling) -> np.ndarray:
    """[sum of x, sum of x^2] [2, B] over a LayerNorm strip as pe/layernorm.csl makes them: each PE
    sums its chunk in index order (fp32), and the strip all-reduces the two (`allreduce_sum`)."""
    batch = x.shape[0]
    xp = np.zeros((batch, tiling.pes * tiling.chunk), dtype=F32)
    xp[:, : tiling.dim] = x  # padding stays 0, so it adds nothing to either sum
    by_index = xp.reshape(batch, tiling.pes, tiling.chunk).transpose(2, 0, 1)  # [chunk, B, pes]
    sums = np.stack([chain_sum(by_index), chain_sum(np.square(by_index))])  # [2, B, pes]
    return allreduce_sum(np.moveaxis(sums, 2, 0), tiling.reduction, tiling.group)


def norm_statistics(total: np.ndarray, dim: int, eps: float) -> tuple[np.ndarray, np.ndarray]:
    """(mean, rstd) [B] from the reduced [sum of x, sum of x^2] [2, B] of `dim` values, as
    pe/layernorm.csl and pe/gemv.csl take them: variance = E[x^2] - mean^2, clamped at 0, fp32."""
    mean = total[0] / F32(dim)
    var = np.maximum(total[1] / F32(dim) - mean * mean, F32(0))
    return mean, F32(1) / np.sqrt(var + F32(eps))


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """GPT-2's GELU, tanh form, fp32, in the operation order of kernels/gelu.csl: the CSL math library
    has exp but no tanh, so tanh(u) = 1 - 2 / (exp(2u) + 1) (saturates correctly at +-inf)."""
    inner = F32(math.sqrt(2.0 / math.pi)) * (x + F32(0.044715) * (x * x * x))
    with np.errstate(over="ignore"):
        tanh = F32(1) - F32(2) / (np.exp(F32(2) * inner) + F32(1))
    return F32(0.5) * x * (F32(1) + tanh)


def residual_add(y: np.ndarray, residual: np.ndarray) -> np.ndarray:
    """The out port of attn_proj / proj adds the residual stream element by element (fp32)."""
    return y + residual


# ----------------------------------------------------------------------------------------------------
# Attention. PE (g, p) of the layer's attention region holds, for every slot, the K and V of heads
# [g*hpp, (g+1)*hpp) at positions [p*ppp, (p+1)*ppp): its `k_cache` symbol is laid out
# [slot][head in PE][head_dim][position in PE] (K^T per head), its `v_cache`
# [slot][head in PE][position in PE][head_dim], so that wafer_gpt2/kernels/pe/attention.csl computes both products
# as one @map each. Where PE (g, p) sits in the region's rectangle is the plan's business (a chain may
# be folded into several rows); the kernels get it as two [G, P] index arrays (`pe_y`, `pe_x`) into the
# (h, w, elems) memory image.


ATTENTION_SPLIT_SLOTS = 8  # a group of this many slots or more runs as two halves, one per thread


def _kv_view(memory_hwl: np.ndarray, tiling: AttentionTiling, symbol: str) -> np.ndarray:
    """(h, w, elems) of `k_cache` or `v_cache` -> a view (h, w, slots, ppp, hpp, head_dim) of the same
    memory, whatever the symbol's own order of axes."""
    h, w, _ = memory_hwl.shape
    t = tiling
    if symbol == "k_cache":
        held = memory_hwl.reshape(h, w, t.slots, t.heads_per_pe, t.head_dim, t.positions_per_pe)
        return held.transpose(0, 1, 2, 5, 3, 4)
    if symbol == "v_cache":
        held = memory_hwl.reshape(h, w, t.slots, t.heads_per_pe, t.positions_per_pe, t.head_dim)
        return held.transpose(0, 1, 2, 4, 3, 5)
    raise ValueError(f"not a KV cache symbol: {symbol!r}")


def write_kv(
    memory_hwl: np.ndarray,
    values: np.ndarray,
    slots: np.ndarray,
    positions: np.ndarray,
    tiling: AttentionTiling,
    pe_y: np.ndarray,
    pe_x: np.ndarray,
    symbol: str,
) -> None:
    """values [B, C] (one token's K or V per item, `symbol` says which) -> the PE that owns each item's
    position, for every head group. The memory's dtype rounds (an fp16 cache in fp16 mode)."""
    batch = values.shape[0]
    heads = np.zeros((batch, tiling.head_groups * tiling.heads_per_pe, tiling.head_dim), dtype=F32)
    heads[:, : tiling.n_head] = values.reshape(batch, tiling.n_head, tiling.head_dim)
    per_group = heads.reshape(batch, tiling.head_groups, tiling.heads_per_pe, tiling.head_dim).transpose(
        1, 0, 2, 3
    )
    owner = positions // tiling.positions_per_pe
    view = _kv_view(memory_hwl, tiling, symbol)
    view[pe_y[:, owner], pe_x[:, owner], slots[None, :], (positions % tiling.positions_per_pe)[None, :]] = (
        per_group
    )


def kv_logical(
    memory_hwl: np.ndarray, tiling: AttentionTiling, pe_y: np.ndarray, pe_x: np.ndarray, symbol: str
) -> np.ndarray:
    """A K or V store's (h, w, elems) memory (`symbol` says which) -> float32 [slot, head, position,
    head_dim]: the values the PEs hold, in the order attention reads them (positions past the context
    are padding)."""
    held = _kv_view(memory_hwl, tiling, symbol)[pe_y, pe_x]  # [G, P, slots, ppp, hpp, D]
    logical = held.transpose(2, 0, 4, 1, 3, 5).reshape(
        tiling.slots, -1, tiling.chain * tiling.positions_per_pe, tiling.head_dim
    )
    return np.ascontiguousarray(logical[:, : tiling.n_head], dtype=F32)


def attention_region(
    q: np.ndarray,
    keys: np.ndarray,
    values: np.ndarray,
    slots: np.ndarray,
    positions: np.ndarray,
    tiling: AttentionTiling,
    fp16: bool,
) -> np.ndarray:
    """q [B, C] -> attention output [B, C] for items whose K/V are already in the stores, given as
    `kv_logical` arrays [slot, head, position, head_dim].

    Item b attends to positions 0..positions[b] of its slot. Each PE of the chain computes a partial
    (max, sum of exp, exp-weighted V) over its own positions; the partials are merged along the chain
    with the log-sum-exp rule. Items are processed in groups of slots (see `_segments`)."""
    out = np.empty((q.shape[0], tiling.n_head * tiling.head_dim), dtype=F32)
    q = round_fp16(q) if fp16 else q

    def attend(group: tuple[np.ndarray, np.ndarray]) -> None:  # groups of slots are independent
        group_slots, rows = group
        out[rows] = _attend_group(q, keys, values, group_slots, rows, positions, tiling, fp16)

    parallel.map_all(attend, _segments(slots))
    return out


def _segments(slots: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """Group the batch for vectorised attention: the runs of one slot's items that have the same
    length go together (the single-item slots of a decode step, the equal prompts of a prefill), in
    two halves, one per thread, when there are ATTENTION_SPLIT_SLOTS or more.

    Returns (slots [S], rows [S, n]) pairs; rows index into the batch."""
    by_length: dict[int, list[tuple[int, list[int]]]] = {}
    start = 0
    for end in [*np.flatnonzero(np.diff(slots)) + 1, len(slots)]:
        by_length.setdefault(end - start, []).append((int(slots[start]), list(range(start, end))))
        start = end
    groups = []
    for runs in by_length.values():
        half = ceil_div(len(runs), 2)
        for part in (runs[:half], runs[half:]) if len(runs) >= ATTENTION_SPLIT_SLOTS else (runs,):
            if part:
                groups.append((np.array([slot for slot, _ in part]), np.array([rows for _, rows in part])))
    return groups


def _attend_group(
    q: np.ndarray,
    keys: np.ndarray,
    values: np.ndarray,
    group_slots: np.ndarray,
    rows: np.ndarray,
    positions: np.ndarray,
    tiling: AttentionTiling,
    fp16: bool,
) -> np.ndarray:
    n_slots, n_items = rows.shape
    heads, dim, ppp = tiling.n_head, tiling.head_dim, tiling.positions_per_pe
    item_pos = positions[rows]  # [S, n]
    used = int(item_pos.max()) // ppp + 1  # chain PEs holding any visible position (the rest add nothing)
    span = used * ppp
    first = int(group_slots[0])
    if np.array_equal(group_slots, np.arange(first, first + n_slots)):  # consecutive slots: views
        k, v = keys[first : first + n_slots, :, :span], values[first : first + n_slots, :, :span]
    else:
        k, v = keys[group_slots, :, :span], values[group_slots, :, :span]  # [S, H, span, D]
    qh = q[rows].reshape(n_slots, n_items, heads, dim).transpose(0, 2, 1, 3)  # [S, H, n, D]
    scores = np.matmul(qh, k.transpose(0, 1, 3, 2)) * F32(1.0 / math.sqrt(dim))  # [S, H, n, span]
    visible = np.arange(span)[None, None, :] <= item_pos[:, :, None]  # [S, n, span]
    scores = np.where(visible[:, None], scores, F32(-np.inf))

    # Per chain PE p: local max m_p and sum s_p of exp(score - m_p) over its ppp positions.
    per_pe = scores.reshape(n_slots, heads, n_items, used, ppp)
    local_max = per_pe.max(axis=4)  # [S, H, n, used]; -inf where the PE holds nothing visible
    finite_max = np.where(np.isfinite(local_max), local_max, F32(0))
    weights = np.exp(per_pe - finite_max[..., None])  # 0 at masked positions
    local_sum = weights.sum(axis=4)
    # The merge's two rounds (wafer_gpt2/kernels/pe/attention.csl): the max over the chain (a max in any
    # order), then every PE's (l, acc) times exp(m_p - M), summed in the tiling's order.
    global_max = local_max.max(axis=3)  # position 0 is always visible, so this is finite
    rescale = np.exp(local_max - global_max[..., None])  # [S, H, n, used]; 0 for empty PEs
    total = combine(
        np.ascontiguousarray(np.moveaxis(local_sum * rescale, 3, 0)), tiling.reduction, tiling.group
    )  # [S, H, n]
    # Each PE's exp-weighted V sum, rescaled and summed along the chain, folded into one matmul
    # (the same terms; only the fp32 rounding order of that sum differs from a PE-by-PE chain). In fp16
    # mode the weights multiply V as fp16 (the kernel's @fmachs takes an fp16 scalar); the sum above
    # keeps them fp32.
    weights = round_fp16(weights) if fp16 else weights
    scaled = (weights * rescale[..., None]).reshape(n_slots, heads, n_items, span)
    # The PE that ends the merge multiplies by 1 / l as the output leaves (wafer_gpt2/kernels/comm/gather.csl).
    out = np.matmul(scaled, v) * (F32(1) / total)[..., None]  # [S, H, n, D]
    return out.transpose(0, 2, 1, 3).reshape(n_slots, n_items, heads * dim)


# ----------------------------------------------------------------------------------------------------
# Head: logits = h @ wte^T on the head's GEMV tiling; each column of PEs keeps its local top-k and
# (max, sum of exp), which are merged along the columns. The embedding reads rows of the same tiles.


def embed(token: np.ndarray, head_cache: np.ndarray, head: HeadTiling) -> np.ndarray:
    """wte rows [B, C] from the head's tiles (in fp16 mode the fp16-stored rows)."""
    weights = head_cache.reshape(head.gemv.rows * head.gemv.tile_k, -1)  # [C padded, V padded]
    return np.ascontiguousarray(weights[: head.dim, token].T)


def head_scores(
    hidden: np.ndarray, head_cache: np.ndarray, head: HeadTiling, targets: np.ndarray, fp16: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """hidden [B, C] (after ln_f) -> (top-k ids [B, k], top-k logits [B, k], lse [B], target logit [B]).

    Target logit is NaN where targets[b] < 0. Ties in the top-k go to the lower token id."""
    tiling = head.gemv
    logits = gemv_region(hidden, head_cache, tiling, fp16)  # [B, V]
    batch = logits.shape[0]
    ids = np.empty((batch, min(head.top_k, tiling.n)), dtype=np.int64)
    best = np.empty(ids.shape, dtype=F32)
    lse = np.empty(batch, dtype=F32)

    def select(rows: slice) -> None:  # items are independent: halves of the batch run side by side
        ids[rows], best[rows] = top_k(logits[rows], head.top_k)
        lse[rows] = _logsumexp(logits[rows], head)

    halves = [slice(start, start + ceil_div(batch, 2)) for start in range(0, batch, ceil_div(batch, 2))]
    parallel.map_all(select, halves if batch >= 2 else [slice(0, batch)])
    target_logit = np.where(targets >= 0, logits[np.arange(batch), np.maximum(targets, 0)], F32(np.nan))
    return ids, best, lse, target_logit.astype(F32)


def _logsumexp(logits: np.ndarray, head: HeadTiling) -> np.ndarray:
    """[B, V] -> [B], summed in the order of wafer_gpt2/kernels/pe/head.csl's rounds A and B: every worker's slice
    sums exp(l - its max) in index order and rescales the sum to the global max M by one exp; a column's
    slices are added along its K-line's chain links (worker 0 first); the columns' sums are combined
    over the tree of the roots (`HeadTiling.tree_halves`: each half in its order, then the centre's own
    plus the left half's, plus the right half's); LSE = M + log(sum)."""
    tiling = head.gemv
    batch = logits.shape[0]
    workers, part = head.workers, head.slice
    tiled = np.full((batch, tiling.cols * tiling.tile_n), -np.inf, dtype=F32)
    tiled[:, : tiling.n] = logits
    # [slice index, batch, column, slot]: every worker's logits in index order along axis 0
    by_slice = np.ascontiguousarray(np.moveaxis(tiled.reshape(batch, tiling.cols, workers, part), 3, 0))
    slice_max = np.maximum.reduce(by_slice, axis=0)  # -inf for an empty slice
    finite_max = np.where(np.isfinite(slice_max), slice_max, F32(0))
    peak = np.max(logits, axis=1).astype(F32)
    with np.errstate(invalid="ignore", over="ignore"):
        sums = chain_sum(np.exp(by_slice - finite_max))  # each slice in index order
        sums = np.where(np.isfinite(slice_max), sums * np.exp(finite_max - peak[:, None, None]), F32(0))
    columns = chain_sum(np.ascontiguousarray(np.moveaxis(sums.astype(F32), 2, 0)))  # [B, cols]
    left, right = head.tree_halves()
    per_column = np.ascontiguousarray(columns.T)  # [cols, B]
    total = per_column[head.centre]
    if left:
        total = total + combine(np.ascontiguousarray(per_column[left]), head.tree, head.tree_group)
    if right:
        total = total + combine(np.ascontiguousarray(per_column[right]), head.tree, head.tree_group)
    return (peak + np.log(total)).astype(F32)


def top_k(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k largest logits per row, best first; equal logits are ordered by lower id.

    The same set and order as per-column top-k lists merged along the columns with that rule."""
    batch, vocab = logits.shape
    k = min(k, vocab)
    candidates = np.argpartition(-logits, k - 1, axis=1)[:, :k]
    threshold = np.take_along_axis(logits, candidates, axis=1).min(axis=1, keepdims=True)
    above = (logits > threshold).sum(axis=1)
    tied = (logits == threshold).sum(axis=1)
    for b in np.flatnonzero(above + tied != k):
        # A tie straddles the cut: keep every id above it and the lowest ids at it.
        row = logits[b]
        at = np.flatnonzero(row == threshold[b])[: k - above[b]]
        candidates[b] = np.concatenate([np.flatnonzero(row > threshold[b]), at])
    values = np.take_along_axis(logits, candidates, axis=1)
    order = np.lexsort((candidates, -values), axis=1)
    return np.take_along_axis(candidates, order, axis=1), np.take_along_axis(values, order, axis=1)
