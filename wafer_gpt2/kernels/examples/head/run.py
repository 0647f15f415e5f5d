#!/usr/bin/env cs_python
"""Run the head kernel (wafer_gpt2/kernels/pe/head.csl) alone: embedding lookups of wte rows, then scoring
(logits = h @ wte^T, top-k with ties to the lower id, log-sum-exp, target logit: threshold selection
over the roots' tree, the record from the centre column) against NumPy."""

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from cerebras.sdk.runtime.sdkruntimepybind import MemcpyDataType, MemcpyOrder, SdkRuntime  # pylint: disable=no-name-in-module

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "common"))
from harness import header, item_words  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--name", help="the compile output folder")
parser.add_argument("--cmaddr", help="IP:port of a CS system (omit for the simulator)")
args = parser.parse_args()

params = json.loads((Path(args.name) / "out.json").read_text())["params"]
rows, cols, tile_k, tile_n, vocab, k = (
    int(params[n]) for n in ("rows", "cols", "tile_k", "tile_n", "vocab", "top_k")
)
h2d, d2h = int(params["MEMCPYH2D_DATA_1_ID"]), int(params["MEMCPYD2H_DATA_1_ID"])
dim = rows * tile_k
u32 = MemcpyDataType.MEMCPY_32BIT
order = MemcpyOrder.ROW_MAJOR

rng = np.random.default_rng(11)
wte = rng.standard_normal((vocab, dim)).astype(np.float32)
wte[5] = wte[9]  # two tokens with equal logits: the tie goes to the lower id
wt = np.zeros((dim, cols * tile_n), np.float32)
wt[:, :vocab] = wte.T
tiles = wt.reshape(rows, tile_k, cols, tile_n).transpose(2, 0, 1, 3).reshape(cols, rows, -1)  # (h=c, w=r)

runner = SdkRuntime(args.name, cmaddr=args.cmaddr)
runner.load()
runner.run()
runner.memcpy_h2d(
    runner.get_id("w"),
    tiles.ravel().view(np.uint32),
    1,
    1,
    rows,
    cols,
    tile_k * tile_n,
    streaming=False,
    data_type=u32,
    order=order,
    nonblock=False,
)

# Embedding: every request returns the token's wte row, chunk r from sink r.
for index, token in enumerate([0, vocab - 1, 7, tile_n, vocab // 2]):
    request = np.concatenate([header(index, position=index), [token]]).astype(np.uint32)
    runner.memcpy_h2d(
        h2d, request, 0, 0, 1, 1, request.size, streaming=True, data_type=u32, order=order, nonblock=True
    )
    got = np.zeros(rows * tile_k, np.uint32)
    runner.memcpy_d2h(
        got, d2h, 1, 0, rows, 1, tile_k, streaming=True, data_type=u32, order=order, nonblock=False
    )
    np.testing.assert_array_equal(got.view(np.float32), wte[token])

# Scoring: h -> logits; the record is [item | ids | logits | lse | target].
for index, target in enumerate([None, 3, vocab - 1]):
    h = rng.standard_normal(dim).astype(np.float32)
    flags = 1 | (2 if target is not None else 0)
    lanes = np.stack(
        [
            item_words(header(index, flags=flags, target=target or 0), h[r * tile_k : (r + 1) * tile_k])
            for r in range(rows)
        ]
    )
    runner.memcpy_h2d(
        h2d,
        lanes.ravel(),
        1,
        cols + 1,
        rows,
        1,
        lanes.shape[1],
        streaming=True,
        data_type=u32,
        order=order,
        nonblock=True,
    )
    record = np.zeros(2 * k + 3, np.uint32)
    runner.memcpy_d2h(
        record,
        d2h,
        rows + 1,
        2,  # the centre column (1)'s row, east of its root
        1,
        1,
        record.size,
        streaming=True,
        data_type=u32,
        order=order,
        nonblock=False,
    )
    logits = h.astype(np.float64) @ wte.T.astype(np.float64)
    best = np.lexsort((np.arange(vocab), -logits))[:k]
    ids, values = record[1 : 1 + k].view(np.int32), record[1 + k : 1 + 2 * k].view(np.float32)
    assert record[0] == index
    np.testing.assert_array_equal(ids, best)
    np.testing.assert_allclose(values, logits[best], rtol=1e-5, atol=1e-5)
    lse = record[1 + 2 * k : 2 + 2 * k].view(np.float32)[0]
    peak = logits.max()
    np.testing.assert_allclose(lse, peak + np.log(np.exp(logits - peak).sum()), rtol=1e-5)
    got_target = record[2 + 2 * k :].view(np.float32)[0]
    assert np.isnan(got_target) if target is None else abs(got_target - logits[target]) < 1e-4
    print(f"item {index}: top-1 {ids[0]} ({values[0]:.4f}), lse {lse:.4f}")
runner.stop()
print("SUCCESS!")
