"""The executor at run time: the task model, the fabric, memcpy through the SDK stand-in, the
deadlock report, the trace of one PE and the `<time>` counter, on three programs of our own
(csl_executor/tests/data/{tasks,fabric,memcpy}), on WSE-2 and WSE-3.

What they check comes from the Cerebras SDK documentation (its task, builtin, fabric, host runtime
and library pages) and the csl-examples programs: a task runs when its ID is activated and unblocked, activation is a flag, tasks run
to completion (by default the executor's picker takes local tasks before wavelet-triggered ones, the lowest ID
first; `WAFER_CSL_SCHEDULE` changes it); a
data task runs once per wavelet with the payload split into 16-bit halves for two arguments; a
control wavelet runs the control task its entrypoint names; an async operation's `.activate` and
`.unblock` fire when it completes. Wavelets move one hop per `timing.HOP` cycles (csl_executor/README.md,
`csl_executor/timing.py`), queues and router buffers are finite, so a sender stalls once they are full
and a program that waits for what never comes stops with a report instead of hanging. memcpy commands
are serialized, so a streaming H2D larger than what the kernel can hold before the D2H starts
deadlocks.
"""

from __future__ import annotations

import numpy as np
import pytest
from csl_executor_helpers import COL, ROW, Host, compile_program, where

from csl_executor import timing
from csl_executor.arch import RULES
from csl_executor.errors import CslDeadlock, CslRuntimeError
from csl_executor.sdk import MemcpyDataType, SdkRuntime

ARCHS = ["wse2", "wse3"]
W = 5  # PEs in the fabric program's row
M = 40  # wavelets of the flood


def tsc(words: np.ndarray) -> np.ndarray:
    """<time>'s three little-endian u16 words per timestamp -> cycles."""
    w = (np.asarray(words, dtype=np.uint64) & 0xFFFF).reshape(-1, 3)
    return (w[:, 0] + (w[:, 1] << 16) + (w[:, 2] << 32)).astype(np.int64)


# ---------------------------------------------------------------------------------------------------
# The task model (csl_executor/tests/data/tasks: one PE)


def run_tasks(arch: str) -> dict[str, np.ndarray]:
    host = Host(compile_program("tasks", arch=arch, params={"data_out_queue": 5}))
    out: dict[str, np.ndarray] = {}
    host.launch("order_test")
    out["order"] = host.d2h("log", 32)
    # Three wavelets on the H2D stream (color 3): data task on_h2d(lo, hi) runs once per wavelet.
    stream = np.array([0x0002_0001, 0x0004_0003, 0x0006_0005], dtype=np.uint32)
    host.rt.memcpy_h2d(3, stream, 0, 0, 1, 1, 3, streaming=True, data_type=MemcpyDataType.MEMCPY_32BIT,
                       order=ROW, nonblock=False)  # fmt: skip
    out["got"] = host.d2h("got", 8, bits=16)
    host.launch("control_test")
    out["control"] = host.d2h("log", 32)
    host.h2d("vals", np.arange(1, 9, dtype=np.float32))
    host.launch("async_test")
    out["async"] = host.d2h("log", 32)
    out["vals"] = host.d2h("vals", 8).view(np.float32)
    host.launch("time_test")
    out["stamps"] = tsc(host.d2h("stamps", 15, bits=16))
    host.stop()
    return out


@pytest.fixture(scope="module", params=ARCHS)
def tasks(request) -> tuple[str, dict[str, np.ndarray]]:
    return request.param, run_tasks(request.param)


def logged(words: np.ndarray) -> list[int]:
    return [int(v) for v in words if v]


def test_local_tasks_run_to_completion_lowest_id_first(tasks):
    _, out = tasks
    # order_test (1) activates 10 and 12; 12 activates 15 and 11 while it runs. Under the default
    # schedule (local tasks before wavelet-triggered ones, the lowest ID first) 10 runs first and
    # unblocks 13, which was activated but blocked since start-up; every task ends before the next.
    assert logged(out["order"]) == [1, 10, 12, 120, 11, 13, 15]


def test_activation_is_a_flag_not_a_counter(tasks):
    _, out = tasks
    assert logged(out["order"]).count(10) == 1  # activated twice before it ran, ran once


def test_the_picker_order_is_an_option(monkeypatch):
    monkeypatch.setenv("WAFER_CSL_SCHEDULE", "highest")
    host = Host(compile_program("tasks", arch="wse2", params={"data_out_queue": 5}))
    host.launch("order_test")
    log = logged(host.d2h("log", 32))
    host.stop()
    # 12 ends (120) before 15 and 11 start; 10 unblocks 13
    assert log == [1, 12, 120, 15, 11, 10, 13]


def test_data_task_runs_once_per_wavelet_with_its_halves(tasks):
    _, out = tasks
    np.testing.assert_array_equal(out["got"], [1, 2, 3, 4, 5, 6, 0, 0])


def test_control_wavelet_runs_the_control_task_it_names(tasks):
    _, out = tasks
    assert logged(out["control"])[7:] == [2, 40]


def test_async_operations_activate_and_unblock_tasks_when_they_complete(tasks):
    _, out = tasks
    # async_test goes on (3) while its send and receive run; the send's .activate runs task 20, the
    # receive's .unblock releases task 24 (activated, blocked), which unblocks the command stream.
    assert logged(out["async"])[9:] == [3, 20, 24]
    np.testing.assert_array_equal(out["vals"], [1, 2, 3, 4, 1, 2, 3, 4])


@pytest.mark.parametrize("arch", ARCHS)
def test_concurrent_operations_must_not_share_a_microthread(arch):
    """async_test's send and receive run at once. With the send on output queue 4 and the receive on
    input queue 4 both take microthread 4 (no ut_id: WSE-2 takes the fabout's output queue, else the
    first fabin's input queue; WSE-3 the highest-ranked fabric operand's queue), which the SDK forbids."""
    host = Host(compile_program("tasks", arch=arch, params={"data_out_queue": 4}))
    with pytest.raises(CslRuntimeError, match=r"pe\.csl:\d+: microthread 4 is busy with @fmovs"):
        host.launch("async_test")
        host.d2h("log", 32)  # the launch runs when the host next waits on the wafer


def test_time_counts_the_cycles_of_dsd_operations(tasks):
    arch, out = tasks
    f32_64, f32_32, f16_64, f16_32 = np.diff(out["stamps"])
    # the same statements around 64 or 32 elements: the difference is the elements' cycles alone
    per32 = timing.ELEMENTS_PER_CYCLE[(arch, 32)]
    per16 = timing.ELEMENTS_PER_CYCLE[(arch, 16)]
    assert f32_64 - f32_32 == 32 // per32 == 32
    assert f16_64 - f16_32 == 64 // per16 - 32 // per16 == {"wse2": 8, "wse3": 4}[arch]
    assert out["stamps"][0] > 0 and (np.diff(out["stamps"]) > 0).all()


# ---------------------------------------------------------------------------------------------------
# The fabric (csl_executor/tests/data/fabric: a row of W PEs)


@pytest.mark.parametrize("arch", ARCHS)
def test_multicast_arrives_one_hop_at_a_time_and_stalls_on_full_queues(arch):
    host = Host(compile_program("fabric", arch=arch, params={"width": W}))
    host.launch("multicast")
    stamps = tsc(host.d2h("stamp", 3, rect=(0, 0, W, 1), bits=16))
    sums = host.d2h("sum", 1, rect=(0, 0, W, 1))
    # Every PE enabled its counter at the same cycle: the first wavelet reaches PE x timing.HOP cycles
    # after PE x - 1, and every receiver got all of it (10 + 20 + 30 + 40).
    assert list(stamps[1:] - stamps[1]) == [0, timing.HOP, 2 * timing.HOP, 3 * timing.HOP]
    assert list(sums) == [0, 100, 100, 100, 100]

    flood = np.arange(100, 100 + M, dtype=np.uint32)
    host.h2d("flood_in", flood)
    host.launch("flood")  # (0, 0) sends M wavelets to (4, 0), which does not read them yet
    assert host.d2h("status", 1)[0] == 0  # the send has not completed
    (sender,) = host.rt.machine.pes[(0, 0)].micro
    rules = RULES[arch]
    # What fits: the output queue, one buffer per router on the way, the receiver's input queue.
    room = rules.output_queues[3] + timing.ROUTER_DEPTH * W + rules.input_queues[3]
    assert sender.pos == room == {"wse2": 20, "wse3": 22}[arch]
    report = host.rt.machine.report()
    assert f"output queue 3 holds {rules.output_queues[3]} wavelet(s) for color 2" in report
    assert f"PE (4, 0) [pe.csl]: {rules.input_queues[3]} wavelet(s) wait at the CE on color 2" in report
    assert "router (3, 0) color 2: 2 wavelet(s) held (EAST neighbour full)" in report

    host.launch("drain")
    np.testing.assert_array_equal(host.d2h("flood_out", M, rect=(W - 1, 0, 1, 1)), flood)
    assert host.d2h("status", 1)[0] == 1
    host.stop()


def test_distance_costs_cycles():
    """The same two launches on a longer row take exactly the extra hops longer to arrive."""
    arrivals = []
    for width in (3, 6):
        host = Host(compile_program("fabric", params={"width": width}))
        host.launch("multicast")
        arrivals.append(tsc(host.d2h("stamp", 3, rect=(width - 1, 0, 1, 1), bits=16))[0])
        host.stop()
    assert arrivals[1] - arrivals[0] == 3 * timing.HOP


# ---------------------------------------------------------------------------------------------------
# Deadlocks: a report naming PEs, colors, queues and tasks, never a hang


def deadlock_of(arch: str, variant: int) -> CslDeadlock:
    host = Host(compile_program("fabric", arch=arch, params={"width": W, "deadlock": variant}))
    with pytest.raises(CslDeadlock) as info:
        host.launch("multicast")
        host.d2h("sum", 1)
        host.h2d("flood_in", np.arange(M, dtype=np.uint32))
        host.launch("flood")
        host.launch("drain")
        host.d2h("status", 1)
    return info.value


@pytest.mark.timeout(60)
@pytest.mark.parametrize("arch", ARCHS)
def test_deadlock_on_backpressure_names_the_queues_and_routers(arch):
    err = deadlock_of(arch, 1)  # the sender waits for room before it unblocks the command stream
    oq, iq = RULES[arch].output_queues[3], RULES[arch].input_queues[3]
    taken = oq + timing.ROUTER_DEPTH * W + iq
    assert err.summary.startswith("deadlock at cycle ")
    assert err.summary.endswith(" while waiting for launch('drain')")
    lines = err.report.splitlines()
    assert lines[:2] == [
        "  host: launch('drain') waits behind it",
        "  host: memcpy is blocked until every PE calls unblock_cmd_stream(); 1 PE(s) have not since the last "
        "launch: (0, 0)",
    ]
    sender = where("fabric", "pe.csl", "@mov32(uc_out")
    assert (
        f"  PE (0, 0) [pe.csl]: microthread @mov32 ({sender}) at element {taken} of {M}: no room in PE (0, 0) "
        f"output queue 3; output queue 3 holds {oq} wavelet(s) for color 2"
    ) in lines
    assert f"  PE (4, 0) [pe.csl]: {iq} wavelet(s) wait at the CE on color 2 (head: data)" in lines
    assert "  router (4, 0) color 2: 2 wavelet(s) held (its CE input is full)" in lines


@pytest.mark.timeout(60)
def test_deadlock_on_a_missing_wavelet_names_the_task_and_its_input_queue():
    err = deadlock_of("wse2", 2)  # the receiver reads M + 1 wavelets, M are sent
    assert err.summary.endswith("while waiting for memcpy_d2h('status', 1 x 1 PEs at (0, 0), 1 per PE)")
    drain = where("fabric", "pe.csl", "RULE drain")
    assert (
        f"  PE (4, 0) [pe.csl]: launched drain waits: @mov32 ({drain}) at element {M} of {M + 1}: no data in "
        "PE (4, 0) input queue 3 (color 2)"
    ) in err.report.splitlines()


@pytest.mark.timeout(60)
def test_deadlock_on_a_blocked_task_names_it():
    err = deadlock_of("wse3", 3)  # PE (2, 0) activates a blocked task instead of unblocking the stream
    assert err.report.splitlines() == [
        "  host: memcpy_d2h('sum', 1 x 1 PEs at (0, 0), 1 per PE) waits behind it",
        "  host: memcpy is blocked until every PE calls unblock_cmd_stream(); 1 PE(s) have not since the last "
        "launch: (2, 0)",
        "  PE (2, 0) [pe.csl]: task 11 is activated but blocked",
    ]


# ---------------------------------------------------------------------------------------------------
# The trace of one PE


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_trace_logs_one_pe_only(how, capsys, monkeypatch):
    compiled = compile_program("fabric", params={"width": W})
    if how == "environment":
        monkeypatch.setenv("WAFER_CSL_TRACE", "2,0")
        host = Host(compiled)
    else:
        host = Host(compiled, trace_pe=(2, 0))
    host.launch("multicast")
    host.d2h("sum", 1)
    host.stop()
    lines = capsys.readouterr().out.splitlines()
    assert lines and all(line.startswith("[") and "] PE (2, 0): " in line for line in lines)
    events = [line.split("] PE (2, 0): ", 1)[1] for line in lines]
    # the launch, then one data task per wavelet of color 1 (WSE-2: task ID = color), each to its end
    assert events == ["start launched multicast", "task done"] + [
        e for v in (10, 20, 30, 40) for e in (f"start task 1 (on_mc, ({v},))", "task done")
    ]


# ---------------------------------------------------------------------------------------------------
# memcpy through the SDK stand-in (csl_executor/tests/data/memcpy: 2 x 2 PEs)


@pytest.mark.parametrize("arch", ARCHS)
def test_memcpy_copy_and_streaming(arch):
    e = 3
    host = Host(compile_program("memcpy", arch=arch, params={"E": e}))
    rect = (0, 0, 2, 2)
    host.h2d(
        "a32", np.arange(12, dtype=np.float32), rect=rect
    )  # ROW_MAJOR: PE (x, y) gets [(2y + x) * e ...]
    host.h2d("a16", np.arange(12, dtype=np.uint16), rect=rect, order=COL, bits=16)
    host.launch("scale", np.float32(2.0), np.uint16(7))
    row = host.d2h("a32", e, rect=rect).view(np.float32)
    col = host.d2h("a32", e, rect=rect, order=COL).view(np.float32)
    a16 = host.d2h("a16", e, rect=rect, bits=16)
    per_pe = 2 * np.arange(12, dtype=np.float32).reshape(2, 2, e)  # [y, x, element]
    np.testing.assert_array_equal(row, per_pe.reshape(-1))
    np.testing.assert_array_equal(col, per_pe.reshape(-1, order="F"))  # index y + 2 (x + 2 e)
    # COL_MAJOR in, ROW_MAJOR out: PE (x, y) element k held host[y + 2 (x + 2 k)], plus 7
    want16 = np.arange(12).reshape(2, 2, e, order="F") + 7
    np.testing.assert_array_equal(a16, want16.reshape(-1))

    # streaming: each PE's data task sends back every wavelet plus 1000 x + 100 y
    words = np.arange(12, dtype=np.uint32)
    host.rt.memcpy_h2d(3, words, 0, 0, 2, 2, e, streaming=True, data_type=MemcpyDataType.MEMCPY_32BIT,
                       order=ROW, nonblock=False)  # fmt: skip
    out = np.zeros(12, dtype=np.uint32)
    host.rt.memcpy_d2h(out, 4, 0, 0, 2, 2, e, streaming=True, data_type=MemcpyDataType.MEMCPY_32BIT,
                       order=ROW, nonblock=False)  # fmt: skip
    bias = np.array([[0, 1000], [100, 1100]], dtype=np.uint32)[:, :, None]
    np.testing.assert_array_equal(out, (words.reshape(2, 2, e) + bias).reshape(-1))
    host.stop()


def stream_through(arch: str, e: int) -> None:
    """H2D of e wavelets per PE, then the D2H that reads them back (memcpy serializes the two)."""
    host = Host(compile_program("memcpy", arch=arch, params={"E": e}))
    rt: SdkRuntime = host.rt
    rt.memcpy_h2d(3, np.arange(4 * e, dtype=np.uint32), 0, 0, 2, 2, e, streaming=True,
                  data_type=MemcpyDataType.MEMCPY_32BIT, order=ROW, nonblock=True)  # fmt: skip
    out = np.zeros(4 * e, dtype=np.uint32)
    rt.memcpy_d2h(out, 4, 0, 0, 2, 2, e, streaming=True, data_type=MemcpyDataType.MEMCPY_32BIT,
                  order=ROW, nonblock=False)  # fmt: skip
    rt.stop()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("arch", ARCHS)
def test_a_stream_larger_than_the_kernel_holds_deadlocks_at_the_exact_size(arch):
    rules = RULES[arch]
    # per PE: memcpy's H2D path, the input queue, the wavelet the stalled task holds, the output
    # queue, memcpy's D2H path
    room = 2 * timing.MEMCPY_PATH_DEPTH + rules.input_queues[2] + 1 + rules.output_queues[2]
    assert room == {"wse2": 15, "wse3": 17}[arch]
    stream_through(arch, room)
    with pytest.raises(CslDeadlock) as info:
        stream_through(arch, room + 1)
    err = info.value
    n = room + 1
    d2h = f"streaming memcpy_d2h(color 4, 2 x 2 PEs at (0, 0), {n} per PE, 0 of {4 * n} received)"
    assert err.summary.endswith(f"while waiting for {d2h}")
    # the non-blocking H2D is still in progress: one wavelet per PE found no room anywhere
    assert err.report.splitlines()[:2] == [
        f"  host: streaming memcpy_h2d(color 3, 2 x 2 PEs at (0, 0), {n} per PE, 4 not yet taken) is in progress",
        f"  host: {d2h} waits behind it",
    ]
    assert (
        "  memcpy D2H path of PE (1, 1) color 4 holds 2 wavelet(s), no D2H reads it"
        in err.report.splitlines()
    )
    assert f"output queue 2 holds {rules.output_queues[2]} wavelet(s) for color 4" in err.report


def test_the_program_just_written_is_loaded_once_without_compiling_it_again(tmp_path):
    """`cslc -o OUT` then `SdkRuntime(OUT)` in one process: the load takes the layout the compile wrote
    (once: a second runtime gets its own, compiled from the sources)."""
    from csl_executor.sdk import load_output, write_output

    compiled = compile_program("tasks", params={"data_out_queue": 5})
    write_output(compiled, tmp_path)
    assert load_output(tmp_path) is compiled
    again = load_output(tmp_path)
    assert again is not compiled and again.rectangle == compiled.rectangle
