#!/usr/bin/env cs_python
"""Run the GEMV kernel (wafer_gpt2/kernels/pe/gemv.csl) alone: stream items through it and check y = x @ W + b,
with the reduction the layout's `run` param picks (0: a chain; else runs of that many rows, then
their ends); with `norm`, y = LayerNorm(x) @ W + b, the LayerNorm's gain and beta folded into the
weights: W' = diag(gain) @ W, b' = b + beta @ W (f32, `norm_b`) and the column sums of W' go up,
x goes in raw."""

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from cerebras.sdk.runtime.sdkruntimepybind import MemcpyDataType, MemcpyOrder, SdkRuntime  # pylint: disable=no-name-in-module

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "common"))
from harness import HDR, gelu_tanh, header, item_words, split_items, to_wire16  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--name", help="the compile output folder")
parser.add_argument("--cmaddr", help="IP:port of a CS system (omit for the simulator)")
parser.add_argument("--items", type=int, default=3)
args = parser.parse_args()

params = json.loads((Path(args.name) / "out.json").read_text())["params"]
rows, cols = int(params["rows"]), int(params["cols"])
tile_k, tile_n = int(params["tile_k"]), int(params["tile_n"])
fp16, gelu = int(params["use_fp16"]) == 1, int(params["gelu"]) == 1
norm = int(params["norm"]) == 1
EPS = 1e-5  # the layout's norm_eps
h2d_color, d2h_color = int(params["MEMCPYH2D_DATA_1_ID"]), int(params["MEMCPYD2H_DATA_1_ID"])
k, n = rows * tile_k, cols * tile_n

rng = np.random.default_rng(7)
weights = rng.standard_normal((k, n)).astype(np.float32) / np.float32(np.sqrt(k))
bias = rng.standard_normal(n).astype(np.float32)
xs = rng.standard_normal((args.items, k)).astype(np.float32)
plain_weights, plain_bias = weights.astype(np.float64), bias.astype(np.float64)
if norm:  # a residual stream with an offset, and a LayerNorm's gain and beta, folded in
    xs += np.float32(0.5)
    gain = (1 + 0.5 * rng.standard_normal(k)).astype(np.float32)
    beta = (0.5 * rng.standard_normal(k)).astype(np.float32)
    weights = gain[:, None] * weights
    bias = (plain_bias + beta.astype(np.float64) @ plain_weights).astype(np.float32)
if fp16:  # the weights, and the bias where it is not a LayerNorm's FMAC addend (f32 norm_b)
    weights = weights.astype(np.float16)
    bias = bias if norm else bias.astype(np.float16)

runner = SdkRuntime(args.name, cmaddr=args.cmaddr)
runner.load()
runner.run()

# PE (r, c) at (2 + c, r) holds W[r*tile_k.., c*tile_n..] row-major; the host array is (h, w, elems).
tiles = weights.reshape(rows, tile_k, cols, tile_n).transpose(0, 2, 1, 3).reshape(rows, cols, -1)
wire = to_wire16 if fp16 else (lambda v: np.asarray(v, np.float32).view(np.uint32))
dtype = MemcpyDataType.MEMCPY_16BIT if fp16 else MemcpyDataType.MEMCPY_32BIT
runner.memcpy_h2d(
    runner.get_id("w"),
    wire(tiles).ravel(),
    2,
    0,
    cols,
    rows,
    tile_k * tile_n,
    streaming=False,
    data_type=dtype,
    order=MemcpyOrder.ROW_MAJOR,
    nonblock=False,
)
runner.memcpy_h2d(
    runner.get_id("norm_b" if norm else "b"),
    (bias.view(np.uint32) if norm else wire(bias.reshape(1, cols, tile_n))).ravel(),
    2,
    rows - 1,
    cols,
    1,
    tile_n,
    streaming=False,
    data_type=MemcpyDataType.MEMCPY_32BIT if norm else dtype,
    order=MemcpyOrder.ROW_MAJOR,
    nonblock=False,
)

if norm:  # the column sums of the weights as held, on the roots (the last row)
    colsum = weights.astype(np.float64).sum(axis=0).astype(np.float32)
    runner.memcpy_h2d(
        runner.get_id("norm_g"),
        colsum.view(np.uint32),
        2,
        rows - 1,
        cols,
        1,
        tile_n,
        streaming=False,
        data_type=MemcpyDataType.MEMCPY_32BIT,
        order=MemcpyOrder.ROW_MAJOR,
        nonblock=False,
    )

# Source r streams [header | x chunk r] per item. memcpy runs one command at a time and the sink holds
# a few wavelets, so each item's output is read before the next item goes in.
out = np.zeros((args.items, HDR + n), dtype=np.uint32)
for i in range(args.items):
    lanes = np.stack(
        [item_words(header(i, position=i), xs[i, r * tile_k : (r + 1) * tile_k]) for r in range(rows)]
    )
    runner.memcpy_h2d(
        h2d_color,
        lanes.ravel(),
        0,
        0,
        1,
        rows,
        lanes.shape[1],
        streaming=True,
        data_type=MemcpyDataType.MEMCPY_32BIT,
        order=MemcpyOrder.ROW_MAJOR,
        nonblock=True,
    )
    runner.memcpy_d2h(
        out[i],
        d2h_color,
        cols + 2,
        rows - 1,
        1,
        1,
        HDR + n,
        streaming=True,
        data_type=MemcpyDataType.MEMCPY_32BIT,
        order=MemcpyOrder.ROW_MAJOR,
        nonblock=False,
    )
runner.stop()

heads, ys = split_items(out, n)
x_in = xs.astype(np.float16).astype(np.float32) if fp16 else xs
expected = x_in.astype(np.float64) @ weights.astype(np.float64) + bias.astype(np.float64)
if norm:  # against the LayerNorm itself, unfolded, in float64
    x64 = xs.astype(np.float64)
    normed = (x64 - x64.mean(axis=1, keepdims=True)) / np.sqrt(x64.var(axis=1, keepdims=True) + EPS)
    expected = (normed * gain + beta) @ plain_weights + plain_bias
expected = expected.astype(np.float32)
if gelu:
    expected = gelu_tanh(expected)
np.testing.assert_array_equal(heads[:, 0], np.arange(args.items))
np.testing.assert_array_equal(heads[:, 2], np.arange(args.items))
np.testing.assert_allclose(ys, expected, rtol=1e-4 if fp16 else 1e-5, atol=1e-5)
print(f"max |y - reference| = {np.abs(ys - expected).max():.3g}")
print("SUCCESS!")
