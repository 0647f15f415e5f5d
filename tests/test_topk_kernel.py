"""kernels/lib/topk.csl alone on the CSL executor (tests/data/topk/: one PE): a column's record by the
histogram and its counting sort, or by the heap where a logit is infinite, and the merge of two
records, against NumPy's exact top-k (wafer.sim.kernels.top_k: best first, ties to the lower id).
The cases are the ones a histogram can get wrong: every logit in one bin, ties across the cut, fewer
logits than k, a range too narrow to divide, sorted input. Running on the executor is not compiling
with Cerebras cslc."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from wafer.csl.layout import Options, compile_layout
from wafer.csl.sdk import MemcpyDataType, MemcpyOrder, SdkRuntime
from wafer.sim.kernels import top_k

LAYOUT = Path(__file__).resolve().parent / "data" / "topk" / "layout.csl"
N, K = 40, 8  # logits per column, entries per record
RECORD = 2 * K + 3
NO_ID = 0x7FFFFFFF
WANT = 1  # the requested token of both records


@pytest.fixture(
    scope="module", params=[("wse2", 4, 1), ("wse3", 64, 4)], ids=["wse2, 4 bins", "wse3, 64 bins, runs of 4"]
)
def compiled(request):
    arch, bins, short_run = request.param
    params = {"n": N, "top_k": K, "bins": bins, "short_run": short_run}
    return compile_layout(
        LAYOUT, Options(arch=arch, fabric_dims=(8, 3), fabric_offsets=(4, 1), params=params)
    )


def run(compiled, a: np.ndarray, b: np.ndarray, len_a: int = N, len_b: int = N) -> list[np.ndarray]:
    rt = SdkRuntime(compiled)
    rt.load()
    rt.run()
    u32, order = MemcpyDataType.MEMCPY_32BIT, MemcpyOrder.ROW_MAJOR
    for name, values in (("logits_a", a), ("logits_b", b)):
        words = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
        rt.memcpy_h2d(rt.get_id(name), words, 0, 0, 1, 1, N, streaming=False, data_type=u32, order=order,
                      nonblock=False)  # fmt: skip
    rt.launch("select", np.uint16(len_a), np.uint16(len_b), nonblock=False)
    rt.launch("merge", nonblock=False)
    out = []
    for name in ("rec_a", "rec_b", "rec_out"):
        words = np.zeros(RECORD, dtype=np.uint32)
        rt.memcpy_d2h(words, rt.get_id(name), 0, 0, 1, 1, RECORD, streaming=False, data_type=u32, order=order,
                      nonblock=False)  # fmt: skip
        out.append(words)
    rt.stop()
    return out


def expected_list(logits: np.ndarray, first_id: int) -> tuple[np.ndarray, np.ndarray]:
    """The k best (ids, values), padded with (NO_ID, -inf) where fewer logits than k exist."""
    ids, vals = top_k(logits[None, :].astype(np.float32), K)
    ids, vals = ids[0] + first_id, vals[0]
    pad = K - ids.size
    return (
        np.concatenate([ids, np.full(pad, NO_ID)]).astype(np.int64),
        np.concatenate([vals, np.full(pad, -np.inf, np.float32)]),
    )


def check_list(record: np.ndarray, ids: np.ndarray, vals: np.ndarray) -> None:
    np.testing.assert_array_equal(record[:K].view(np.int32).astype(np.int64), ids)
    np.testing.assert_array_equal(record[K : 2 * K].view(np.float32), vals)


def check(compiled, a: np.ndarray, b: np.ndarray, len_a: int = N, len_b: int = N, lse: bool = True) -> None:
    rec_a, rec_b, merged = run(compiled, a, b, len_a, len_b)
    a, b = a[:len_a].astype(np.float32), b[:len_b].astype(np.float32)
    check_list(rec_a, *expected_list(a, 0))
    check_list(rec_b, *expected_list(b, N))
    both = np.full(2 * N, -np.inf, np.float32)
    both[:len_a], both[N : N + len_b] = a, b
    ids, vals = expected_list(both, 0)
    ids[vals == -np.inf] = NO_ID  # the merge keeps the records' empty entries
    check_list(merged, ids, vals)
    if lse:
        f32 = [r[2 * K : 2 * K + 3].view(np.float32) for r in (rec_a, rec_b, merged)]
        for (m, s, _), logits in zip(f32[:2], (a, b), strict=True):
            assert m == logits.max() and s == pytest.approx(np.exp(logits - logits.max()).sum(), rel=1e-6)
        assert f32[0][2] == a[WANT] and np.isnan(f32[1][2])  # b's ids start at N: not the requested one
        m, s, target = f32[2]
        assert m == max(a.max(), b.max()) and target == a[WANT]
        assert m + np.log(s) == pytest.approx(np.logaddexp.reduce(np.concatenate([a, b]).astype(np.float64)))


def test_random_logits(compiled):
    rng = np.random.default_rng(5)
    check(compiled, rng.standard_normal(N), rng.standard_normal(N))


def test_every_logit_equal_falls_in_one_bin(compiled):
    check(compiled, np.zeros(N), np.zeros(N))


def test_ties_across_the_cut(compiled):
    rng = np.random.default_rng(6)
    check(compiled, rng.integers(0, 3, N).astype(np.float32), rng.integers(0, 3, N).astype(np.float32))


def test_fewer_logits_than_k(compiled):
    rng = np.random.default_rng(7)
    check(compiled, rng.standard_normal(N), rng.standard_normal(N), len_a=5, len_b=2)


def test_a_range_too_narrow_to_divide(compiled):
    a = np.float32(1.0) + np.arange(N, dtype=np.float32) * np.float32(
        1e-38
    )  # equal in f32 but for the last bits
    check(compiled, a, np.linspace(1, 1 + 1e-6, N, dtype=np.float32))


def test_sorted_logits(compiled):
    up = np.arange(N, dtype=np.float32) / 4
    check(compiled, up, up[::-1].copy())


def test_an_infinite_logit_takes_the_heap(compiled):
    rng = np.random.default_rng(8)
    a, b = rng.standard_normal(N).astype(np.float32), rng.standard_normal(N).astype(np.float32)
    a[3], b[10] = np.inf, -np.inf
    check(compiled, a, b, lse=False)  # exp(inf - inf) is NaN: only the lists are compared
