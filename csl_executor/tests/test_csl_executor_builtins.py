"""The executor's DSD builtins, each checked against NumPy in the precision the SDK gives it.

csl_executor/tests/data/builtins/pe.csl runs every builtin once on one PE (one compile and one run
per architecture, shared by the tests below); each writes its own slot of an exported result array.
The semantics come from the Cerebras SDK documentation's "Builtins" and "DSDs" pages: f32 operations are IEEE binary32 rounded to nearest even after every operation
(no fused multiply-add), the `h` forms the same in binary16, `@fmachs` multiplies f16 values exactly
and accumulates in f32, `@mov16`/`@mov32` copy raw words. Inputs include the cases where rounding
shows: ties to even, a product that a fused FMA would keep, fp16 overflow to infinity.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from csl_executor_helpers import Host, compile_program, f16_bits

N = 8
F32, F16 = np.float32, np.float16

# Slots of `res` (f32), in pe.csl's order.
FMACS, FADDS, FSUBS, FMULS, FMAXS, FMOVS, FMACHS, MAP2 = range(8)
STRIDED, FIELDS, SET_LENGTH, INCREMENT, REDUCE, MEM4D, MAP_SQRT, FMAXS_SCALAR, FIFO, MAP_DSR = range(8, 18)
# Slots of `res16` (f16).
FMACH, FADDH, FMOVH = range(3)


def inputs() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """x = a | b | c (f32), h = a | b | c (f16), raw u32 and u16 words; the scalar operand of
    @fmacs is c[0], that of @fmach/@fmachs is hc[0]."""
    rng = np.random.default_rng(12)
    a = rng.standard_normal(N).astype(F32)
    b = rng.standard_normal(N).astype(F32)
    c = rng.standard_normal(N).astype(F32)
    # Rounding cases: 1 + 2^-24 is a tie and stays 1 (even); 1 + 3 * 2^-24 rounds up to 1 + 2^-22;
    # -1 + (1 + 2^-12)^2 is 2^-11 when the product is rounded first and 2^-11 + 2^-24 when fused.
    a[:3] = [1.0, 1.0, -1.0]
    b[:3] = [2.0**-24, 3 * 2.0**-24, 1 + 2.0**-12]
    c[0] = 1 + 2.0**-12
    ha = rng.standard_normal(N).astype(F16)
    hb = rng.standard_normal(N).astype(F16)
    hc = rng.standard_normal(N).astype(F16)
    # f16: a tie (1 + 2^-11 -> 1), a product that rounds before the sum, and overflow to infinity.
    ha[:4] = [1.0, 1.0, -1.0, 65504.0]
    hb[:4] = [2.0**-11, 3 * 2.0**-11, 1 + 2.0**-6, 16.0]
    hc[0] = 1 + 2.0**-6
    w = rng.integers(0, 2**32, N, dtype=np.uint64).astype(np.uint32)
    u = rng.integers(0, 2**16, N).astype(np.uint16)
    return np.concatenate([a, b, c]), np.concatenate([ha, hb, hc]), w, u


@dataclass
class Results:
    x: np.ndarray
    h: np.ndarray
    w: np.ndarray
    u: np.ndarray
    res: np.ndarray  # [18, N] f32
    res16: np.ndarray  # [4, N] f16
    resw: np.ndarray
    resu: np.ndarray

    @property
    def a(self) -> np.ndarray:
        return self.x[:N]

    @property
    def b(self) -> np.ndarray:
        return self.x[N : 2 * N]

    @property
    def s(self) -> np.float32:
        return self.x[2 * N]

    @property
    def ha(self) -> np.ndarray:
        return self.h[:N]

    @property
    def hb(self) -> np.ndarray:
        return self.h[N : 2 * N]

    @property
    def hs(self) -> np.float16:
        return self.h[2 * N]


@pytest.fixture(scope="module", params=["wse2", "wse3"])
def run(request) -> Results:
    x, h, w, u = inputs()
    host = Host(compile_program("builtins", arch=request.param))
    host.h2d("x", x)
    host.h2d("h", h, bits=16)
    host.h2d("w", w)
    host.h2d("u", u, bits=16)
    host.launch("compute")
    res = host.d2h("res", 18 * N).view(F32).reshape(18, N)
    res16 = f16_bits(host.d2h("res16", 4 * N, bits=16)).reshape(4, N)
    resw = host.d2h("resw", N)
    resu = (host.d2h("resu", N, bits=16) & 0xFFFF).astype(np.uint16)
    host.stop()
    return Results(x, h, w, u, res, res16, resw, resu)


def same_bits(got: np.ndarray, want: np.ndarray) -> None:
    """Bit-exact equality (so that 0.0 vs -0.0 and one ulp both count)."""
    want = np.asarray(want, dtype=got.dtype)
    np.testing.assert_array_equal(got.view(np.uint32 if got.itemsize == 4 else np.uint16), want.view(
        np.uint32 if got.itemsize == 4 else np.uint16))  # fmt: skip


def test_fmacs_rounds_the_product_then_the_sum(run):
    same_bits(run.res[FMACS], run.a + run.b * run.s)
    # the case a fused multiply-add would get differently
    assert run.res[FMACS][2] == F32(2.0**-11)
    assert float(run.res[FMACS][2]) != float(run.a[2]) + float(run.b[2]) * float(run.s)


def test_fadds_rounds_to_nearest_even(run):
    same_bits(run.res[FADDS], run.a + run.b)
    assert run.res[FADDS][0] == F32(1.0)  # a tie goes to the even neighbour
    assert run.res[FADDS][1] == F32(1 + 2.0**-22)


def test_fsubs(run):
    same_bits(run.res[FSUBS], run.a - run.b)


def test_fmuls(run):
    same_bits(run.res[FMULS], run.a * run.b)


def test_fmaxs_with_dsd_and_scalar_operands(run):
    same_bits(run.res[FMAXS], np.maximum(run.a, run.b))
    same_bits(run.res[FMAXS_SCALAR], np.maximum(run.a, F32(0)))


def test_fmovs(run):
    same_bits(run.res[FMOVS], run.a)


def test_fmachs_multiplies_f16_exactly_and_accumulates_in_f32(run):
    want = run.a + run.hb.astype(F32) * F32(run.hs)
    same_bits(run.res[FMACHS], want)


def test_fmach_rounds_in_f16(run):
    with np.errstate(over="ignore"):  # 65504 + 16 * hs overflows, as it does on the PE
        want = run.ha + run.hb * run.hs
    same_bits(run.res16[FMACH], want)
    assert run.res16[FMACH][2] == F16(2.0**-5)  # the f16 product rounded before the sum


def test_faddh_rounds_to_nearest_even_and_overflows(run):
    with np.errstate(over="ignore"):
        want = run.ha + run.hb
    same_bits(run.res16[FADDH], want)
    assert run.res16[FADDH][0] == F16(1.0)  # tie to even
    assert run.res16[FADDH][1] == F16(1 + 2.0**-9)
    assert np.isposinf(run.res16[FADDH][3])  # 65504 + 16 rounds up past the largest f16


def test_fmovh(run):
    same_bits(run.res16[FMOVH], run.ha)


def test_mov32_copies_raw_words(run):
    np.testing.assert_array_equal(run.resw, run.w)


def test_mov16_copies_raw_words(run):
    np.testing.assert_array_equal(run.resu, run.u)


def test_map_calls_a_csl_function_per_element(run):
    same_bits(run.res[MAP2], run.a * run.b + F32(1))


def test_map_with_a_math_library_function(run):
    same_bits(run.res[MAP_SQRT], np.sqrt(run.a * run.a + F32(1)))


def test_tensor_access_stride_and_increment_dsd_offset(run):
    # |i|{N/2} -> x[2i+1], then the same destination moved by N/2 elements gets x[2i]
    same_bits(run.res[STRIDED], np.concatenate([run.a[1::2], run.a[0::2]]))


def test_base_address_extent_stride_fields_and_set_dsd_base_addr(run):
    same_bits(run.res[FIELDS], np.concatenate([run.b[0::2], run.b[1::2]]))


def test_set_dsd_stride_and_set_dsd_length(run):
    same_bits(run.res[SET_LENGTH], run.b + run.a)


def test_increment_dsd_offset_at_run_time(run):
    same_bits(run.res[INCREMENT], np.concatenate([run.a[3:], np.zeros(3, F32)]))


def test_zero_stride_accumulator_reduces_in_order(run):
    acc = F32(0)
    for v in run.a:  # element by element, each sum rounded to f32
        acc = F32(acc + v)
    assert run.res[REDUCE][0].view(np.uint32) == acc.view(np.uint32)
    assert not run.res[REDUCE][1:].any()


def test_mem4d_tensor_access_transposes(run):
    grid = run.a.reshape(2, 4)
    same_bits(run.res[MEM4D], grid.T.reshape(-1))


def test_fifo_passes_elements_in_order_and_fnegs_negates(run):
    same_bits(run.res[FIFO], -run.a)


def test_map_over_dsrs_steps_a_saved_f16_register_by_its_own_width(run):
    """A GEMV as WaferLLM writes it: @fmachs on DSD registers inside a @map, the f16 row register
    loaded with .save_address. After each step it must move by the row's length in 16-bit words, not
    in the f32 destination's words (an executor defect that read garbage rows)."""
    h = run.h.astype(F16)
    rows = [F32(F16(run.x[j])) * h[4 * j : 4 * j + 4].astype(F32) for j in range(2)]
    same_bits(run.res[MAP_DSR, :4], (F32(0) + rows[0]) + rows[1])
