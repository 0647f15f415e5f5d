"""What the executor learned from public CSL it had not seen, on a program of our own.

csl_executor/tests/data/wider/ is three PEs in a row (layout.csl says what each color carries):
SIMD-64 fabric DSDs (two f16 values per wavelet, an odd count), a counter filter, a router switch
that takes a PE's RAMP only after a control wavelet moves it (the PE's words wait for it), a route
changed at run time (`tile_config.color_config.reset_routes`), a false `@assert` in a branch never
taken, the
documented `<math>` library in its generic, f16 and f32 forms (also at comptime in the layout, as
WaferLLM's layouts compute a PE's group), a mem4d DSD given by extents and strides, a
pointer-destination reduction `@fmaxs(&m, m, v)`, a
comptime `@load_to_dsr` with asynchronous options, `<tile_config>`'s task priority, and cslc's
warnings (a module parameter no `param` declares, an `@export_name` no PE exports). Its `variant`
param breaks one rule at a time; each refusal names the `// RULE` line.
"""

from __future__ import annotations

import numpy as np
import pytest
from csl_executor_helpers import DATA, Host, compile_program, f16_bits, where

from csl_executor.errors import CslCompileError, CslRuntimeError
from csl_executor.layout import Options, compile_layout

ARCHS = ["wse2", "wse3"]
X = np.array([-1.5, 0.25, 2.0, -0.0], np.float32)
H = np.array([-1.5, 0.25, 2.5, 3.0], np.float16)


def run(arch: str, schedule: str | None = None, **params) -> dict[str, np.ndarray]:
    host = Host(compile_program("wider", arch=arch, params=params), schedule=schedule)
    host.h2d("vals", np.arange(1, 9).astype(np.float16), bits=16)
    host.h2d("x", X, rect=(2, 0, 1, 1))
    host.h2d("h", H, rect=(2, 0, 1, 1), bits=16)
    host.launch("run")
    out = {
        "got": f16_bits(host.d2h("got", 8, rect=(1, 0, 1, 1), bits=16)),
        "filtered": host.d2h("filtered", 2, rect=(1, 0, 1, 1)),
        "relayed": host.d2h("relayed", 4, rect=(2, 0, 1, 1)),
        "turned": host.d2h("turned", 2, rect=(1, 0, 1, 1)),
        "order": host.d2h("order", 3, rect=(2, 0, 1, 1), bits=16),
        "ints": host.d2h("ints", 8, rect=(2, 0, 1, 1), bits=16).astype(np.uint16).view(np.int16),
        "maxmin": host.d2h("maxmin", 2, rect=(2, 0, 1, 1)).view(np.float32),
        "picked": host.d2h("picked", 6, rect=(2, 0, 1, 1)).view(np.float32),
        "fx": host.d2h("fx", 32, rect=(2, 0, 1, 1)).view(np.float32).reshape(8, 4),
        "fh": f16_bits(host.d2h("fh", 16, rect=(2, 0, 1, 1), bits=16)).reshape(4, 4),
    }
    host.stop()
    out["cycles"] = np.array([host.rt.machine.now])
    return out


@pytest.fixture(scope="module", params=ARCHS)
def result(request) -> tuple[str, dict[str, np.ndarray]]:
    return request.param, run(request.param)


def test_simd_64_carries_two_f16_values_per_wavelet(result):
    _, out = result
    # seven values in four wavelets: the last wavelet carries one value, the eighth stays zero
    np.testing.assert_array_equal(out["got"], [1, 2, 3, 4, 5, 6, 7, 0])


def test_counter_filter_passes_the_counts_it_is_set_to(result):
    _, out = result
    np.testing.assert_array_equal(out["filtered"], [10, 14])  # wavelets 0 and 4 of 8


def test_words_from_the_ramp_wait_for_the_switch_position_that_takes_them(result):
    _, out = result
    np.testing.assert_array_equal(out["relayed"], [100, 101, 102, 103])


def test_a_route_changed_at_run_time(result):
    _, out = result
    # (1, 0) turns color 6 from "pass east" to "to my RAMP" before (0, 0)'s two words arrive
    np.testing.assert_array_equal(out["turned"], [7, 8])


def test_math_library_rounds_to_its_type(result):
    _, out = result
    x64 = X.astype(np.float64)
    f32 = np.float32
    expect = [
        np.floor(X), np.ceil(X), np.exp(x64).astype(f32), np.tanh(x64).astype(f32),
        np.sqrt(np.abs(x64)).astype(f32), np.maximum(X, f32(0.5)), np.sign(X), X * f32(8),
    ]  # fmt: skip
    for row, want in zip(out["fx"], expect, strict=True):
        np.testing.assert_array_equal(row, want)
    h64 = H.astype(np.float64)
    f16 = np.float16
    for row, want in zip(
        out["fh"],
        [np.floor(H), np.ceil(H), np.exp(h64).astype(f16), (np.abs(h64) ** 2).astype(f16)],
        strict=True,
    ):
        np.testing.assert_array_equal(row, want)
    # floor_f16 at comptime in the layout (3), a module function (6), integer abs/max/sign, NaN,
    # signbit of -0.0, floor of PI
    np.testing.assert_array_equal(out["ints"], [3, 6, 5, 7, -1, 1, 1, 3])


def test_mem4d_dsd_given_by_extents_and_strides(result):
    _, out = result
    # extent (2, 3), stride (1, 3): columns 0-1 of each 4-element row of the 3 x 4 grid
    np.testing.assert_array_equal(out["picked"], [0, 1, 4, 5, 8, 9])


def test_pointer_destination_reduces_over_the_vector(result):
    _, out = result
    np.testing.assert_array_equal(out["maxmin"], [2.0, -1.5])  # @fmaxs(&m, m, v); -max(-v)


def test_high_priority_task_runs_first_and_a_comptime_dsr_keeps_its_async_options(result):
    _, out = result
    # 12 is HIGH (tile_config), 10 LOW; 14 is activated by the asynchronous copy loaded at comptime
    np.testing.assert_array_equal(out["order"], [12, 10, 14])


def test_cslc_warns_and_compiles():
    compiled = compile_program("wider", arch="wse2")
    assert compiled.warnings == [
        f"{DATA / 'wider' / 'helper.csl'}:1: parameter 'unused' is given but the file declares no "
        "`param unused`; ignored",
        f"{where('wider', 'layout.csl', 'never_exported')}: @export_name('never_exported'): no PE program exports it",
    ]


@pytest.mark.parametrize(
    ("variant", "arch", "file", "marker", "message"),
    [
        (1, "wse2", "layout.csl", "RULE comptime-exp",
         "math.exp_f32 can only be evaluated at run time (SDK Libraries page)"),
        (2, "wse2", "pe.csl", "RULE star-t",
         "`.base_address`: on SDK 1.4 a single-item pointer *f32 is not a [*]f32: write @ptrcast([*]f32, ...) "
         "(the *T -> *[1]T coercion arrived in SDK 2.10)"),
        (3, "wse2", "pe.csl", "RULE task-21",
         "local task ID 21 is reserved on WSE-2: it is memcpy's color 21 (colors and task IDs share one ID "
         "space; memcpy keeps 21-23)"),
        (5, "wse2", "pe.csl", "RULE simd-32bit",
         "@fmovs: `.simd_mode` packs 16-bit values into wavelets; this operand is f32"),
    ],
)  # fmt: skip
def test_refusals(variant, arch, file, marker, message):
    with pytest.raises(CslCompileError) as info:
        compile_program("wider", arch=arch, params={"variant": variant})
    assert str(info.value) == f"{where('wider', file, marker)}: {message}"


def test_what_the_other_sdk_line_or_architecture_accepts():
    # SDK 2.10 coerces *T to *[1]T; WSE-3's task IDs 21-23 are not memcpy's colors (its data tasks are
    # queues), and WaferLLM's MeshGEMM binds 22 and 23 there
    layout = DATA / "wider" / "layout.csl"
    compile_layout(
        layout, Options(arch="wse2", fabric_dims=(10, 3), params={"variant": 2}, memcpy=True, sdk="2.10")
    )
    compile_program("wider", arch="wse3", params={"variant": 3})


def test_two_asynchronous_operations_on_one_microthread_are_refused():
    with pytest.raises(CslRuntimeError) as info:
        run("wse3", variant=4)
    assert str(info.value).startswith(
        f"{where('wider', 'pe.csl', 'RULE same-ut')}: microthread 3 is busy with @fmovs"
    )


def test_seeded_schedules_are_repeatable_and_legal():
    # Every seed gives the same results (the program does not depend on the order of its tasks
    # beyond what tile_config fixes); one seed gives the same cycles twice; seeds differ in timing.
    base = run("wse2")
    seeded = {seed: run("wse2", schedule=f"seed:{seed}") for seed in (1, 2, 3)}
    for out in seeded.values():
        for key in ("got", "filtered", "relayed", "turned", "ints", "maxmin", "picked", "fx", "fh"):
            np.testing.assert_array_equal(out[key], base[key])
        assert out["order"][0] == 12  # HIGH first under every schedule
    assert run("wse2", schedule="seed:1")["cycles"] == seeded[1]["cycles"]
    assert len({int(o["cycles"][0]) for o in seeded.values()} | {int(base["cycles"][0])}) > 1


def test_schedule_from_the_environment(monkeypatch):
    monkeypatch.setenv("WAFER_CSL_SCHEDULE", "seed:7")
    host = Host(compile_program("tasks", arch="wse2", params={"data_out_queue": 5}))
    assert str(host.rt.machine.schedule) == "seed:7"
    monkeypatch.setenv("WAFER_CSL_SCHEDULE", "sideways")
    with pytest.raises(
        CslRuntimeError, match="schedule 'sideways': expected local-first, highest, lowest, fifo or seed:N"
    ):
        Host(compile_program("tasks", arch="wse2", params={"data_out_queue": 5}))
