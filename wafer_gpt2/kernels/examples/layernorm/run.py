#!/usr/bin/env cs_python
"""Run the LayerNorm kernel (wafer_gpt2/kernels/pe/layernorm.csl) alone and check y and the forwarded x."""

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from cerebras.sdk.runtime.sdkruntimepybind import MemcpyDataType, MemcpyOrder, SdkRuntime  # pylint: disable=no-name-in-module

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "common"))
from harness import HDR, header, item_words, split_items  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--name", help="the compile output folder")
parser.add_argument("--cmaddr", help="IP:port of a CS system (omit for the simulator)")
parser.add_argument("--items", type=int, default=3)
args = parser.parse_args()

params = json.loads((Path(args.name) / "out.json").read_text())["params"]
pes, chunk, dim = int(params["pes"]), int(params["chunk"]), int(params["dim"])
h2d, d2h_y, d2h_x = (
    int(params[k]) for k in ("MEMCPYH2D_DATA_1_ID", "MEMCPYD2H_DATA_1_ID", "MEMCPYD2H_DATA_2_ID")
)
padded = pes * chunk
eps = np.float32(1e-5)

rng = np.random.default_rng(3)
gain = np.zeros(padded, np.float32)
bias = np.zeros(padded, np.float32)
gain[:dim] = 1 + 0.1 * rng.standard_normal(dim)
bias[:dim] = 0.1 * rng.standard_normal(dim)
xs = np.zeros((args.items, padded), np.float32)
xs[:, :dim] = 3 + 2 * rng.standard_normal((args.items, dim))

runner = SdkRuntime(args.name, cmaddr=args.cmaddr)
runner.load()
runner.run()
for name, values in (("gain", gain), ("bias", bias)):
    runner.memcpy_h2d(
        runner.get_id(name),
        values.view(np.uint32),
        0,
        1,
        pes,
        1,
        chunk,
        streaming=False,
        data_type=MemcpyDataType.MEMCPY_32BIT,
        order=MemcpyOrder.ROW_MAJOR,
        nonblock=False,
    )
# memcpy runs one command at a time and the sinks hold a few wavelets: each item goes in, then its two
# outputs (y, then x, in the order the strip sends them) are read before the next item.
ys = np.zeros((args.items, HDR + padded), np.uint32)
xs_back = np.zeros_like(ys)
u32, row_major = MemcpyDataType.MEMCPY_32BIT, MemcpyOrder.ROW_MAJOR
for i in range(args.items):
    lanes = np.stack(
        [item_words(header(i, position=i), xs[i, p * chunk : (p + 1) * chunk]) for p in range(pes)]
    )
    runner.memcpy_h2d(
        h2d,
        lanes.ravel(),
        0,
        0,
        pes,
        1,
        lanes.shape[1],
        streaming=True,
        data_type=u32,
        order=row_major,
        nonblock=True,
    )
    for color, x_pos, y_pos, out in ((d2h_y, pes, 1, ys), (d2h_x, pes, 2, xs_back)):
        runner.memcpy_d2h(
            out[i], color, x_pos, y_pos, 1, 1, HDR + padded, streaming=True, data_type=u32, order=row_major,
            nonblock=False,
        )  # fmt: skip
runner.stop()

heads, y = split_items(ys, padded)
_, x_back = split_items(xs_back, padded)
x = xs[:, :dim].astype(np.float64)
expected = (x - x.mean(1, keepdims=True)) / np.sqrt(x.var(1, keepdims=True) + 1e-5) * gain[:dim] + bias[:dim]
np.testing.assert_array_equal(heads[:, 0], np.arange(args.items))
np.testing.assert_allclose(y[:, :dim], expected, rtol=1e-5, atol=1e-5)
np.testing.assert_array_equal(x_back, xs)
print(f"max |y - reference| = {np.abs(y[:, :dim] - expected).max():.3g}")
print("SUCCESS!")
