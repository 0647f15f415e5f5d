"""wafer_gpt2/kernels/lib/topk.csl on the CSL executor (tests/data/topk/: one PE as one worker, as the
centre of the head's threshold selection and as io.out, which puts the record best first with
lib/best_first.csl): the histogram of a slice over [min, max], the threshold
bin, the entries of the bins up to it, the centre's k best of them read a chunk at a time, against
NumPy's exact top-k (wafer_gpt2.sim.kernels.top_k: best first, ties to the lower id), the log-sum-exp and
the target's logit. The cases are the ones a threshold can get wrong: every logit in one bin (the
bins' width 0), ties across the cut, fewer logits than k, a range too narrow to divide, sorted
input, more entries than a chunk. Running on the executor is not compiling with Cerebras cslc."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from csl_executor.layout import Options, compile_layout
from csl_executor.sdk import MemcpyDataType, MemcpyOrder, SdkRuntime
from wafer_gpt2.sim.kernels import top_k

LAYOUT = Path(__file__).resolve().parent / "data" / "topk" / "layout.csl"
N, K = 40, 8  # logits of the slice, entries of the record
RECORD = 2 * K + 3
NO_ID = 0x7FFFFFFF
WANT = 1  # the requested token


@pytest.fixture(
    scope="module",
    params=[("wse2", 4, 3), ("wse3", 64, 8), ("wse2", 64, 32)],
    ids=["wse2, 4 bins, chunks of 3", "wse3, 64 bins, chunks of 8", "wse2, 64 bins, chunks of 32"],
)
def compiled(request):
    arch, bins, chunk = request.param
    params = {"n": N, "top_k": K, "bins": bins, "chunk": chunk}
    return compile_layout(
        LAYOUT, Options(arch=arch, fabric_dims=(8, 3), fabric_offsets=(4, 1), params=params)
    )


def run(compiled, logits: np.ndarray, length: int, want: int) -> np.ndarray:
    rt = SdkRuntime(compiled)
    rt.load()
    rt.run()
    u32, order = MemcpyDataType.MEMCPY_32BIT, MemcpyOrder.ROW_MAJOR
    words = np.ascontiguousarray(logits, dtype=np.float32).view(np.uint32)
    rt.memcpy_h2d(rt.get_id("logits"), words, 0, 0, 1, 1, N, streaming=False, data_type=u32, order=order,
                  nonblock=False)  # fmt: skip
    rt.launch("run", np.uint16(length), np.uint16(want), nonblock=False)
    record = np.zeros(RECORD, dtype=np.uint32)
    rt.memcpy_d2h(record, rt.get_id("wire"), 0, 0, 1, 1, RECORD, streaming=False, data_type=u32, order=order,
                  nonblock=False)  # fmt: skip
    rt.stop()
    return record


def check(compiled, logits: np.ndarray, length: int = N) -> None:
    logits = logits.astype(np.float32)
    want = WANT if WANT < length else length
    record = run(compiled, logits, length, want)
    used = logits[:length]
    ids, vals = top_k(used[None, :], K)
    pad = K - ids.shape[1]
    ids = np.concatenate([ids[0], np.full(pad, NO_ID)])
    vals = np.concatenate([vals[0], np.full(pad, -np.inf, np.float32)])
    assert record[0] == 7
    np.testing.assert_array_equal(record[1 : 1 + K].astype(np.int64), ids)
    np.testing.assert_array_equal(record[1 + K : 1 + 2 * K].view(np.float32), vals)
    lse, target = record[1 + 2 * K :].view(np.float32)
    assert lse == pytest.approx(np.logaddexp.reduce(used.astype(np.float64)), abs=1e-5)
    assert target == used[WANT] if want < length else np.isnan(target)


def test_random_logits(compiled):
    check(compiled, np.random.default_rng(5).standard_normal(N))


def test_every_logit_equal_falls_in_one_bin(compiled):
    check(compiled, np.zeros(N))


def test_ties_across_the_cut(compiled):
    check(compiled, np.random.default_rng(6).integers(0, 3, N))


def test_fewer_logits_than_k(compiled):
    check(compiled, np.random.default_rng(7).standard_normal(N), length=5)
    check(compiled, np.random.default_rng(7).standard_normal(N), length=1)


def test_a_range_too_narrow_to_divide(compiled):
    a = np.float32(1.0) + np.arange(N, dtype=np.float32) * np.float32(
        1e-38
    )  # equal in f32 but for the last bits
    check(compiled, a)
    check(compiled, np.float32(1.0) + np.arange(N, dtype=np.float32) * np.float32(1e-7))


def test_sorted_input(compiled):
    check(compiled, np.arange(N, dtype=np.float32))
    check(compiled, -np.arange(N, dtype=np.float32))
