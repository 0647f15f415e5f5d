#!/usr/bin/env cs_python
"""Run the attention kernel (wafer_gpt2/kernels/pe/attention.csl) alone: items of two slots fill the KV cache and
attend to it; check every output against NumPy attention, then clear a slot and refill it."""

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
args = parser.parse_args()

params = json.loads((Path(args.name) / "out.json").read_text())["params"]
row_len, fold, ppp, slots = (int(params[k]) for k in ("row_len", "fold", "ppp", "slots"))
hpp, dim = int(params["hpp"]), int(params["head_dim"])
h2d, d2h = int(params["MEMCPYH2D_DATA_1_ID"]), int(params["MEMCPYD2H_DATA_1_ID"])
context, width = row_len * fold * ppp, hpp * dim
rng = np.random.default_rng(5)


def attend(q: np.ndarray, keys: np.ndarray, values: np.ndarray) -> np.ndarray:
    out = np.empty(width)
    for h in range(hpp):
        s = slice(h * dim, (h + 1) * dim)
        scores = keys[:, s].astype(np.float64) @ q[s] / np.sqrt(dim)
        e = np.exp(scores - scores.max())
        out[s] = e @ values[:, s] / e.sum()
    return out


runner = SdkRuntime(args.name, cmaddr=args.cmaddr)
runner.load()
runner.run()

# Slot 0 fills the whole context, slot 1 a few positions, interleaved; then slot 1 is cleared and refilled.
order = [(0, p) for p in range(context)]
order[3:3] = [(1, p) for p in range(min(4, context))]
rounds = [order, [(1, p) for p in range(min(3, context))]]
cache = {}
for n_round, items in enumerate(rounds):
    if n_round:
        runner.launch("clear_slot", np.uint16(0), np.uint16(1), nonblock=False)
        cache.pop(1, None)
    expected, words = [], []
    for index, (slot, position) in enumerate(items):
        q, k, v = (rng.standard_normal(width).astype(np.float32) for _ in range(3))
        keys, values = cache.setdefault(
            slot, (np.zeros((context, width), np.float32), np.zeros((context, width), np.float32))
        )
        keys[position], values[position] = k, v
        expected.append(attend(q, keys[: position + 1], values[: position + 1]))
        words.append(item_words(header(index, slot, position), np.concatenate([k, q, v])))
    # memcpy runs one command at a time, and the sink holds only a few wavelets: stream an item in,
    # read its output, then the next (all inputs first would stall behind the unread outputs).
    sink_x = row_len + 1 if (fold - 1) % 2 == 0 else 0
    out = np.zeros((len(items), HDR + width), np.uint32)
    for index, item in enumerate(words):
        runner.memcpy_h2d(
            h2d,
            item,
            0,
            0,
            1,
            1,
            item.size,
            streaming=True,
            data_type=MemcpyDataType.MEMCPY_32BIT,
            order=MemcpyOrder.ROW_MAJOR,
            nonblock=True,
        )
        runner.memcpy_d2h(
            out[index],
            d2h,
            sink_x,
            fold - 1,
            1,
            1,
            HDR + width,
            streaming=True,
            data_type=MemcpyDataType.MEMCPY_32BIT,
            order=MemcpyOrder.ROW_MAJOR,
            nonblock=False,
        )
    heads, got = split_items(out, width)
    np.testing.assert_array_equal(heads[:, 0], np.arange(len(items)))
    np.testing.assert_allclose(got, np.array(expected), rtol=1e-5, atol=1e-6)
    print(
        f"round {n_round}: {len(items)} items, max |out - reference| = {np.abs(got - np.array(expected)).max():.3g}"
    )
runner.stop()
print("SUCCESS!")
