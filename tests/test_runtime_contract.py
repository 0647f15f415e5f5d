"""The SdkRuntime-shaped contract as the simulator serves it: conventions and the errors of misuse."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from service_harness import wait_until

from wafer_gpt2.core.runtime import (
    MemcpyDataType,
    MemcpyOrder,
    WaferRuntimeError,
    flat_to_hwl,
    from_wire,
    hwl_to_flat,
    to_wire,
)
from wafer_gpt2.core.steps import StepInputs, StepItem
from wafer_gpt2.core.wire import D2H_COLOR, H2D_COLOR, record_words, step_message
from wafer_gpt2.plan import build_plan
from wafer_gpt2.sim import SimRuntime

F16, F32 = MemcpyDataType.MEMCPY_16BIT, MemcpyDataType.MEMCPY_32BIT


@pytest.fixture(scope="module")
def plan(small_config):
    return build_plan(small_config, "wse2", "fp16", slots=2, context=32)


@pytest.fixture
def runtime(plan):
    rt = SimRuntime(plan)
    rt.load()
    rt.run()
    yield rt
    rt.stop()


def region(plan, name):
    return plan.region(name)


def test_wire_helpers_follow_the_sdk_conventions():
    halves = np.array([1.5, -2.0, 65504.0], dtype=np.float16)
    words = to_wire(halves)
    assert words.dtype == np.uint32 and (words >> 16 == 0).all()  # the value sits in the low half
    assert (from_wire(words | 0xABCD0000, np.float16) == halves).all()  # the high half is ignored
    hwl = np.arange(2 * 3 * 4).reshape(2, 3, 4)
    assert (hwl_to_flat(hwl, MemcpyOrder.ROW_MAJOR) == hwl.reshape(-1)).all()
    col = hwl_to_flat(hwl, MemcpyOrder.COL_MAJOR)
    assert col[1] == hwl[1, 0, 0] and col[2] == hwl[0, 1, 0]  # h fastest, then w, then elems
    assert (flat_to_hwl(col, 2, 3, 4, MemcpyOrder.COL_MAJOR) == hwl).all()


@pytest.mark.parametrize("order", [MemcpyOrder.ROW_MAJOR, MemcpyOrder.COL_MAJOR])
def test_copy_mode_round_trip_lands_per_pe(runtime, plan, order):
    qkv = region(plan, "L0.qkv")
    elems = qkv.symbols["w"].elems
    values = np.random.default_rng(0).standard_normal((qkv.h, qkv.w, elems)).astype(np.float16)
    sym = runtime.get_id("w")
    runtime.memcpy_h2d(
        sym,
        hwl_to_flat(to_wire(values), order),
        qkv.x,
        qkv.y,
        qkv.w,
        qkv.h,
        elems,
        streaming=False,
        data_type=F16,
        order=order,
    )
    # The simulator's PE memory holds exactly what the host sent, PE by PE.
    assert (runtime.memory.regions[plan.regions.index(qkv)].arrays["w"] == values).all()
    out = np.zeros(qkv.w * qkv.h * elems, dtype=np.uint32)
    runtime.memcpy_d2h(
        out, sym, qkv.x, qkv.y, qkv.w, qkv.h, elems, streaming=False, data_type=F16, order=order
    )
    assert (from_wire(flat_to_hwl(out, qkv.h, qkv.w, elems, order), np.float16) == values).all()
    # A sub-rectangle reads the matching part, fewer elements read the first ones.
    part = np.zeros(2 * 3 * 5, dtype=np.uint32)
    runtime.memcpy_d2h(part, sym, qkv.x + 1, qkv.y + 2, 2, 3, 5, data_type=F16)
    assert (from_wire(part, np.float16).reshape(3, 2, 5) == values[2:5, 1:3, :5]).all()


def test_misuse_gets_clear_errors(runtime, plan):
    ln = region(plan, "ln_f")  # the layers' strips hold no gain: their LayerNorms are folded in
    gain = runtime.get_id("gain")
    chunk = ln.symbols["gain"].elems
    ok = np.zeros(ln.w * chunk, dtype=np.float32)
    runtime.memcpy_h2d(gain, ok, ln.x, ln.y, ln.w, 1, chunk)
    with pytest.raises(WaferRuntimeError, match="no symbol named 'weights'"):
        runtime.get_id("weights")
    with pytest.raises(WaferRuntimeError, match="float64.*32-bit"):
        runtime.memcpy_h2d(gain, ok.astype(np.float64), ln.x, ln.y, ln.w, 1, chunk)
    with pytest.raises(WaferRuntimeError, match="float16.*32-bit elements"):
        runtime.memcpy_h2d(gain, ok.astype(np.float16), ln.x, ln.y, ln.w, 1, chunk)
    with pytest.raises(WaferRuntimeError, match=f"has {ok.size - 1} elements.*= {ok.size}"):
        runtime.memcpy_h2d(gain, ok[:-1], ln.x, ln.y, ln.w, 1, chunk)
    with pytest.raises(WaferRuntimeError, match="outside the kernel"):
        runtime.memcpy_h2d(gain, ok, plan.arch.kernel_w - 1, ln.y, ln.w, 1, chunk)
    with pytest.raises(WaferRuntimeError, match="do not fit symbol 'gain'"):
        runtime.memcpy_h2d(gain, np.zeros(ln.w * (chunk + 1), np.float32), ln.x, ln.y, ln.w, 1, chunk + 1)
    with pytest.raises(WaferRuntimeError, match="32-bit elements.*MEMCPY_32BIT"):
        runtime.memcpy_h2d(gain, ok.view(np.uint32), ln.x, ln.y, ln.w, 1, chunk, data_type=F16)
    with pytest.raises(WaferRuntimeError, match="has no symbol 'gain'"):  # the rectangle reaches above ln_f
        runtime.memcpy_h2d(gain, np.zeros(2 * chunk, np.float32), ln.x, ln.y - 1, 1, 2, chunk)
    with pytest.raises(WaferRuntimeError, match="unknown symbol id 999"):
        runtime.memcpy_h2d(999, ok, ln.x, ln.y, ln.w, 1, chunk)
    with pytest.raises(WaferRuntimeError, match="no function 'compute'"):
        runtime.launch("compute")
    with pytest.raises(WaferRuntimeError, match="takes 2 arguments"):
        runtime.launch("clear_slot", np.uint32(0))
    with pytest.raises(WaferRuntimeError, match="no PE program receives"):
        runtime.memcpy_h2d(H2D_COLOR, np.zeros(6, np.uint32), ln.x, ln.y, 1, 1, 6, streaming=True)
    # None of that changed the memory or broke the runtime.
    back = np.ones(ln.w * chunk, dtype=np.float32)
    runtime.memcpy_d2h(back, gain, ln.x, ln.y, ln.w, 1, chunk)
    assert (back == 0).all()


def test_lifecycle(plan):
    rt = SimRuntime(plan)
    sym = rt.get_id("gain")  # ids are known before load(), as in the SDK
    ln = region(plan, "ln_f")
    buf = np.zeros(ln.w * ln.symbols["gain"].elems, dtype=np.float32)
    with pytest.raises(WaferRuntimeError, match="not loaded"):
        rt.memcpy_h2d(sym, buf, ln.x, ln.y, ln.w, 1, ln.symbols["gain"].elems)
    rt.load()
    with pytest.raises(WaferRuntimeError, match="call run\\(\\) first"):
        rt.memcpy_d2h(buf, sym, ln.x, ln.y, ln.w, 1, ln.symbols["gain"].elems)
    rt.run()
    rt.memcpy_d2h(buf, sym, ln.x, ln.y, ln.w, 1, ln.symbols["gain"].elems)
    rt.stop()
    with pytest.raises(WaferRuntimeError, match="after stop"):
        rt.memcpy_d2h(buf, sym, ln.x, ln.y, ln.w, 1, ln.symbols["gain"].elems)
    with pytest.raises(WaferRuntimeError, match="after stop"):
        rt.launch("reset_cycles")


def test_a_command_issued_while_stop_drains_the_queue_gets_the_runtimes_own_error(plan):
    rt = SimRuntime(plan)
    rt.load()
    rt.run()
    release = threading.Event()
    # A command that holds the runtime's command thread (as a long transfer would), so that stop() is
    # still finishing the queue when the next command is issued.
    held = rt._submit("a long command", lambda: release.wait(10), nonblock=True)
    stopper = threading.Thread(target=rt.stop)
    stopper.start()
    wait_until(lambda: not rt.running, timeout=5)  # stopped from the moment stop() is called
    with pytest.raises(WaferRuntimeError, match="the runtime was stopped; no command is accepted after stop"):
        rt.launch("reset_cycles", nonblock=True)
    assert not held.done()  # the queued command still runs to its end before stop() returns
    release.set()
    stopper.join(10)
    assert not stopper.is_alive() and held.done() and held.wait() is True


def test_streams_run_in_issue_order_and_nonblocking_tasks_complete(runtime, plan):
    port_in, port_out = plan.io_ports(0)
    first = step_message(
        StepInputs.of_items([StepItem(0, 0, 464, False), StepItem(0, 1, 3290, target=50256)]), plan.slots
    )
    second = step_message(StepInputs.of_items([StepItem(1, 0, 11)]), plan.slots)
    size = record_words(plan.top_k)
    # A message may arrive in pieces: the program waits for the whole message.
    t1 = runtime.memcpy_h2d(
        H2D_COLOR, first[:4], port_in.x, port_in.y, 1, 1, 4, streaming=True, nonblock=True
    )
    t2 = runtime.memcpy_h2d(
        H2D_COLOR, first[4:], port_in.x, port_in.y, 1, 1, first.size - 4, streaming=True, nonblock=True
    )
    t3 = runtime.memcpy_h2d(
        H2D_COLOR, second, port_in.x, port_in.y, 1, 1, second.size, streaming=True, nonblock=True
    )
    out = np.zeros(2 * size, dtype=np.uint32)
    t4 = runtime.memcpy_d2h(
        out, D2H_COLOR, port_out.x, port_out.y, 1, 1, out.size, streaming=True, nonblock=True
    )
    runtime.task_wait(t4)
    assert all(runtime.is_task_done(t) for t in (t1, t2, t3, t4))
    records = out.reshape(2, size)
    assert records[0, 0] == 1 and records[1, 0] == 0  # item 1 of the first message, item 0 of the second
    assert not np.isnan(records[0, -1:].view(np.float32)[0]) and np.isnan(records[1, -1:].view(np.float32)[0])


def test_reading_more_than_the_program_sent_is_refused(plan):
    rt = SimRuntime(plan)
    rt.load()
    rt.run()
    _, port_out = plan.io_ports(0)
    with pytest.raises(WaferRuntimeError, match="has sent only 0.*wait forever"):
        rt.memcpy_d2h(np.zeros(4, np.uint32), D2H_COLOR, port_out.x, port_out.y, 1, 1, 4, streaming=True)
    with pytest.raises(WaferRuntimeError, match="earlier command failed"):
        rt.launch("reset_cycles")
    rt.stop()


# ----------------------------------------------------------------------------------------------------
# The Protocol: the simulator, the CSL executor and both SDK adapters satisfy `wafer_gpt2.core.runtime.Runtime`.


def _runtime_classes():
    from wafer_gpt2.backends.csl import CslExecutorRuntime
    from wafer_gpt2.backends.sdk_appliance import ApplianceRuntime
    from wafer_gpt2.backends.sdk_container import SdkContainerRuntime

    return [SimRuntime, CslExecutorRuntime, SdkContainerRuntime, ApplianceRuntime]


def _protocol_members() -> list[str]:
    from wafer_gpt2.core.runtime import Runtime

    return sorted(name for name in vars(Runtime) if not name.startswith("_"))


@pytest.mark.parametrize("cls", _runtime_classes(), ids=lambda cls: cls.__name__)
def test_every_runtime_satisfies_the_protocol(cls):
    """isinstance (runtime_checkable) on an instance made without the class's own __init__ (the SDK
    adapters need the SDK to construct), and each method's parameters named and kinded as the
    Protocol's (mypy checks the types: see `make typecheck`)."""
    import inspect

    from wafer_gpt2.core.runtime import CheckedRuntime, Runtime

    instance = cls.__new__(cls)
    if isinstance(instance, CheckedRuntime):
        CheckedRuntime.__init__(instance)  # the state `running` reads
    assert isinstance(instance, Runtime)
    if isinstance(instance, CheckedRuntime):
        instance.stop()
    for name in _protocol_members():
        assert hasattr(cls, name), name
        if name == "running":
            continue
        want = inspect.signature(getattr(Runtime, name)).parameters
        have = inspect.signature(getattr(cls, name)).parameters
        assert [(p.name, p.kind) for p in have.values()] == [(p.name, p.kind) for p in want.values()], name


def test_the_simulator_runtime_is_a_runtime(runtime):
    from wafer_gpt2.core.runtime import Runtime

    assert isinstance(runtime, Runtime) and runtime.running


def test_something_else_is_not_a_runtime():
    from wafer_gpt2.core.runtime import Runtime

    assert not isinstance(object(), Runtime)
