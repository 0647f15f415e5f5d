"""The executor's cycles, composed from csl_executor/timing.py, and held to Cerebras hardware.

csl_executor/tests/data/meshchain/ is a column of P PEs that runs a GEMV the way WaferLLM's
MeshGEMV does (a @map over DSD registers per PE, a chain of adds up the column, a multicast back
down), timed per PE with <time>. Every PE added to the column adds one hop and one stop to the chain
(a hop, the router-to-CE latency, one step of the add, the output queue to the router) and one hop
to the multicast: the test checks the executor's loop period grows by exactly that.

csl_executor/tests/data/stream/ is a pair of PEs, one streaming to the other's input queue: the
test checks how fast a long stream runs under each `timing.STREAM_PACING` rule.

The hardware check runs WaferLLM's own MeshGEMV for WSE-3, unmodified, at published CS-3 points
(csl_executor/README.md, "Timed like hardware"): set WAFER_CSL_WAFERLLM to a checkout of
github.com/MeshInfra/WaferLLM; without it that test is skipped.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from csl_executor_helpers import Host, compile_program, f16_bits

from csl_executor import timing
from csl_executor.arch import RULES

MT, NT, ROUNDS = 4, 2, 5


def loop_period(arch: str, p: int) -> float:
    host = Host(compile_program("meshchain", arch=arch, params={"P": p, "Mt": MT, "Nt": NT}))
    rng = np.random.default_rng(p)
    x = rng.random((p, MT)).astype(np.float16)
    w = rng.random((p, MT, NT)).astype(np.float16)
    host.h2d("x", x.reshape(-1), rect=(0, 0, 1, p), bits=16)
    host.h2d("w", w.reshape(-1), rect=(0, 0, 1, p), bits=16)
    host.launch("gemv", np.int16(ROUNDS))
    res = f16_bits(host.d2h("res", NT, rect=(0, 0, 1, p), bits=16)).reshape(p, NT)
    words = host.d2h("stamps", 6, rect=(0, 0, 1, p), bits=16).reshape(p, 6).astype(np.int64)
    host.stop()
    want = np.einsum("pm,pmn->n", x.astype(np.float32), w.astype(np.float32))
    np.testing.assert_allclose(res, np.broadcast_to(want, res.shape), rtol=2e-2)  # every PE has the sum
    start = words[:, 0] + (words[:, 1] << 16) + (words[:, 2] << 32)
    end = words[:, 3] + (words[:, 4] << 16) + (words[:, 5] << 32)
    periods = (end - start) / ROUNDS
    assert len(set(periods.tolist())) == 1  # a steady loop: every PE sees the same period
    return float(periods[0])


@pytest.mark.parametrize("arch", ["wse2", "wse3"])
def test_each_pe_of_the_chain_adds_its_hops_and_its_stop(arch):
    per_pe = 2 * timing.HOP + timing.ROUTER_TO_CE + 1 + timing.CE_TO_ROUTER
    assert loop_period(arch, 8) - loop_period(arch, 4) == 4 * per_pe


def stream_cycles(arch: str, e: int, queue: int) -> int:
    """Cycles the receiver of csl_executor/tests/data/stream/ spends reading e wavelets."""
    host = Host(compile_program("stream", arch=arch, params={"E": e, "queue": queue}))
    data = np.arange(1, e + 1, dtype=np.uint32)
    host.h2d("buf", data)
    host.launch("run")
    got = host.d2h("buf", e, rect=(1, 0, 1, 1))
    words = host.d2h("stamps", 6, rect=(1, 0, 1, 1), bits=16).astype(np.int64)
    host.stop()
    np.testing.assert_array_equal(got, data)
    return int((words[3:] - words[:3]) @ np.array([1, 1 << 16, 1 << 32]))


@pytest.mark.parametrize(("arch", "queue"), [("wse3", 2), ("wse2", 4)])
@pytest.mark.parametrize("pacing", ["queue-depth", "link-rate"])
def test_a_long_stream_into_an_input_queue_runs_at_the_pacing_rules_rate(monkeypatch, arch, queue, pacing):
    monkeypatch.setattr(timing, "STREAM_PACING", pacing)
    per_wavelet = (stream_cycles(arch, 64, queue) - stream_cycles(arch, 32, queue)) / 32
    depth = RULES[arch].input_queues[queue]
    # queue-depth: a wavelet holds its place in the queue from the router until the CE takes it
    # (ROUTER_TO_CE cycles later), so `depth` of them are under way at a time; link-rate: one a cycle.
    assert per_wavelet == (timing.ROUTER_TO_CE / depth if pacing == "queue-depth" else 1)


WAFERLLM = os.environ.get("WAFER_CSL_WAFERLLM", "")


@pytest.mark.skipif(
    not (WAFERLLM and (Path(WAFERLLM) / "MeshGEMV" / "WSE-3").is_dir()),
    reason="set WAFER_CSL_WAFERLLM to a checkout of MeshInfra/WaferLLM",
)
@pytest.mark.parametrize(("m", "n"), [(16, 16), (128, 128)])
def test_waferllm_meshgemv_within_the_band_of_the_cs3_runs(m, n):
    from csl_executor.calibrate import HARDWARE, run_meshgemv

    hardware = next(cycles for p, mm, nn, groups, cycles in HARDWARE if (p, mm, nn, groups) == (16, m, n, 4))
    cycles = run_meshgemv(Path(WAFERLLM) / "MeshGEMV" / "WSE-3", 16, m, n, 4)
    assert 0.8 <= cycles / hardware <= 1.25
