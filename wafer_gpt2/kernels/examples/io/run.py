#!/usr/bin/env cs_python
"""Run the io kernels alone: a host message of items becomes numbered requests (io_in.csl), and
output-stream records reach the host with their k entries put best first, equal logits in the order
they came (io_out.csl). Formats: wafer_gpt2/core/wire.py."""

import argparse
import json
from pathlib import Path

import numpy as np
from cerebras.sdk.runtime.sdkruntimepybind import MemcpyDataType, MemcpyOrder, SdkRuntime  # pylint: disable=no-name-in-module

parser = argparse.ArgumentParser()
parser.add_argument("--name", help="the compile output folder")
parser.add_argument("--cmaddr", help="IP:port of a CS system (omit for the simulator)")
args = parser.parse_args()

params = json.loads((Path(args.name) / "out.json").read_text())["params"]
k = int(params["top_k"])
h2d, d2h = int(params["MEMCPYH2D_DATA_1_ID"]), int(params["MEMCPYD2H_DATA_1_ID"])
u32, order = MemcpyDataType.MEMCPY_32BIT, MemcpyOrder.ROW_MAJOR

runner = SdkRuntime(args.name, cmaddr=args.cmaddr)
runner.load()
runner.run()
rng = np.random.default_rng(2)
for message in range(3):
    n = message + 1
    items = rng.integers(0, 1000, (n, 5)).astype(np.uint32)  # slot, position, token, flags, target
    words = np.concatenate([[n], items.ravel()]).astype(np.uint32)
    runner.memcpy_h2d(
        h2d, words, 0, 0, 1, 1, words.size, streaming=True, data_type=u32, order=order, nonblock=True
    )
    got = np.zeros(6 * n, np.uint32)
    runner.memcpy_d2h(
        got, d2h, 1, 0, 1, 1, got.size, streaming=True, data_type=u32, order=order, nonblock=False
    )
    expected = np.column_stack(
        [np.arange(n), items[:, 0], items[:, 1], items[:, 3], items[:, 4], items[:, 2]]
    )
    np.testing.assert_array_equal(got.reshape(n, 6), expected)

    # All n records in before any is read: io_out's ring holds 3, and memcpy runs one command at a
    # time (wafer_gpt2/host/program.py sends a replica at most the records its io.out holds).
    records = rng.integers(0, 2**32, (n, 2 * k + 3), dtype=np.uint64).astype(np.uint32)
    logits = rng.integers(-4, 4, (n, k)).astype(np.float32)  # few values: many ties
    records[:, 1 + k : 1 + 2 * k] = logits.view(np.uint32)
    expected = records.copy()
    for i in range(n):
        best = np.argsort(-logits[i], kind="stable")
        expected[i, 1 : 1 + k] = records[i, 1 : 1 + k][best]
        expected[i, 1 + k : 1 + 2 * k] = records[i, 1 + k : 1 + 2 * k][best]
    words = records.ravel()
    runner.memcpy_h2d(
        h2d, words, 0, 1, 1, 1, words.size, streaming=True, data_type=u32, order=order, nonblock=True
    )
    back = np.zeros(records.size, np.uint32)
    runner.memcpy_d2h(
        back, d2h, 1, 1, 1, 1, back.size, streaming=True, data_type=u32, order=order, nonblock=False
    )
    np.testing.assert_array_equal(back.reshape(n, -1), expected)
    print(f"message {message}: {n} requests numbered, {n} records returned")
runner.stop()
print("SUCCESS!")
