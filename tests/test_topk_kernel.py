"""wafer_gpt2/kernels/lib/topk.csl and lib/topk_merge.csl on the CSL executor (tests/data/topk/: three PEs in a
row): each column's record by the histogram and its counting sort, or by the heap where a logit is
infinite, and the streamed merge along the three (the second PE merging the first's record with its own
on the way to the third, which merges that with its own into memory), against
NumPy's exact top-k (wafer_gpt2.sim.kernels.top_k: best first, ties to the lower id). The cases are the ones
a histogram or a merge can get wrong: every logit in one bin, ties across the cut and between columns,
fewer logits than k, a range too narrow to divide, sorted input. Running on the executor is not
compiling with Cerebras cslc."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from csl_executor.layout import Options, compile_layout
from csl_executor.sdk import MemcpyDataType, MemcpyOrder, SdkRuntime
from wafer_gpt2.sim.kernels import top_k

LAYOUT = Path(__file__).resolve().parent / "data" / "topk" / "layout.csl"
N, K = 40, 8  # logits per column, entries per record
RECORD = 2 * K + 3
NO_ID = 0x7FFFFFFF
WANT = 1  # the requested token of both records


COLUMNS = 3


@pytest.fixture(
    scope="module",
    params=[("wse2", 4, 1), ("wse3", 64, 2), ("wse2", 64, 3)],
    ids=["wse2, 4 bins, blocks of 1", "wse3, 64 bins, blocks of 2", "wse2, 64 bins, blocks of 3"],
)
def compiled(request):
    arch, bins, block = request.param
    params = {"n": N, "top_k": K, "bins": bins, "block": block}
    return compile_layout(
        LAYOUT, Options(arch=arch, fabric_dims=(7 + COLUMNS, 3), fabric_offsets=(4, 1), params=params)
    )


def run(compiled, columns: list[np.ndarray], lens: list[int]) -> tuple[list[np.ndarray], np.ndarray]:
    """Every column's record, and the last PE's merged record."""
    rt = SdkRuntime(compiled)
    rt.load()
    rt.run()
    u32, order = MemcpyDataType.MEMCPY_32BIT, MemcpyOrder.ROW_MAJOR
    words = np.ascontiguousarray(np.concatenate(columns), dtype=np.float32).view(np.uint32)
    rt.memcpy_h2d(rt.get_id("logits"), words, 0, 0, COLUMNS, 1, N, streaming=False, data_type=u32, order=order,
                  nonblock=False)  # fmt: skip
    rt.launch("select", *(np.uint16(n) for n in lens), nonblock=False)
    rt.launch("merge", nonblock=False)
    out = []
    for name in ("rec", "merged"):
        words = np.zeros(COLUMNS * RECORD, dtype=np.uint32)
        rt.memcpy_d2h(words, rt.get_id(name), 0, 0, COLUMNS, 1, RECORD, streaming=False, data_type=u32,
                      order=order, nonblock=False)  # fmt: skip
        out.append(words.reshape(COLUMNS, RECORD))
    rt.stop()
    return list(out[0]), out[1][COLUMNS - 1]


def expected_list(logits: np.ndarray, first_id: int) -> tuple[np.ndarray, np.ndarray]:
    """The k best (ids, values), padded with (NO_ID, -inf) where fewer logits than k exist."""
    if logits.size == 0:  # a column past the vocabulary
        ids, vals = np.zeros(0, np.int64), np.zeros(0, np.float32)
    else:
        ids, vals = top_k(logits[None, :].astype(np.float32), K)
        ids, vals = ids[0] + first_id, vals[0]
    pad = K - ids.size
    return (
        np.concatenate([ids, np.full(pad, NO_ID)]).astype(np.int64),
        np.concatenate([vals, np.full(pad, -np.inf, np.float32)]),
    )


def check_list(record: np.ndarray, ids: np.ndarray, vals: np.ndarray) -> None:
    """A record's entries: (id, logit) word pairs, best first."""
    np.testing.assert_array_equal(record[0 : 2 * K : 2].view(np.int32).astype(np.int64), ids)
    np.testing.assert_array_equal(record[1 : 2 * K : 2].view(np.float32), vals)


def check(compiled, *columns: np.ndarray, lens: tuple[int, ...] = (N, N, N), lse: bool = True) -> None:
    records, merged = run(compiled, list(columns), list(lens))
    used = [c[:n].astype(np.float32) for c, n in zip(columns, lens, strict=True)]
    for i, (record, logits) in enumerate(zip(records, used, strict=True)):
        check_list(record, *expected_list(logits, i * N))
    every = np.full(COLUMNS * N, -np.inf, np.float32)
    for i, logits in enumerate(used):
        every[i * N : i * N + logits.size] = logits
    ids, vals = expected_list(every, 0)
    ids[vals == -np.inf] = NO_ID  # the merge keeps the records' empty entries
    check_list(merged, ids, vals)
    if lse:
        tails = [r[2 * K : 2 * K + 3].view(np.float32) for r in (*records, merged)]
        for (m, s, _), logits in zip(tails[:COLUMNS], used, strict=True):
            if logits.size == 0:
                assert m == -np.inf and s == 0
            else:
                assert m == logits.max() and s == pytest.approx(np.exp(logits - logits.max()).sum(), rel=1e-6)
        assert tails[0][2] == used[0][WANT] and np.isnan(tails[1][2]) and np.isnan(tails[2][2])
        m, s, target = tails[COLUMNS]
        assert m == max(c.max() for c in used if c.size) and target == used[0][WANT]
        assert m + np.log(s) == pytest.approx(np.logaddexp.reduce(np.concatenate(used).astype(np.float64)))


def test_random_logits(compiled):
    rng = np.random.default_rng(5)
    check(compiled, *rng.standard_normal((COLUMNS, N)))


def test_one_column_holds_the_whole_top_k(compiled):
    rng = np.random.default_rng(9)
    columns = rng.standard_normal((COLUMNS, N))
    for i in range(COLUMNS):  # each column in turn: the input's entries or own's taken, or drained
        shifted = columns.copy()
        shifted[i] += 10
        check(compiled, *shifted)


def test_every_logit_equal_falls_in_one_bin(compiled):
    check(compiled, *np.zeros((COLUMNS, N)))


def test_ties_across_the_cut(compiled):
    rng = np.random.default_rng(6)
    check(compiled, *rng.integers(0, 3, (COLUMNS, N)).astype(np.float32))


def test_fewer_logits_than_k(compiled):
    rng = np.random.default_rng(7)
    check(compiled, *rng.standard_normal((COLUMNS, N)), lens=(5, 2, 0))


def test_a_range_too_narrow_to_divide(compiled):
    a = np.float32(1.0) + np.arange(N, dtype=np.float32) * np.float32(
        1e-38
    )  # equal in f32 but for the last bits
    check(compiled, a, np.linspace(1, 1 + 1e-6, N, dtype=np.float32), a[::-1].copy())


def test_sorted_logits(compiled):
    up = np.arange(N, dtype=np.float32) / 4
    check(compiled, up, up[::-1].copy(), up + 0.125)


def test_an_infinite_logit_takes_the_heap(compiled):
    rng = np.random.default_rng(8)
    columns = rng.standard_normal((COLUMNS, N)).astype(np.float32)
    columns[0, 3], columns[1, 10] = np.inf, -np.inf
    check(compiled, *columns, lse=False)  # exp(inf - inf) is NaN: only the lists are compared
