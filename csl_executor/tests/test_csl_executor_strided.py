"""The executor's two ways of running a DSD operation over memory give the same memory.

Most operations take the fast path (`PE._strided_compute`: NumPy views of the memory for mem1d
operands); the rest, and every error, take the indexed one (`PE._indexed_compute`: the word address
of every element). Random operations over one small memory, with strides of either sign, in-place
and overlapping operands, scalars and scalar pointers, run through both: where the fast path takes
one, the two memories must be equal bit for bit.
"""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from csl_executor import dsd as D
from csl_executor.pe import PE
from csl_executor.types import F16, F32, U16, Dsd

WORDS = 48
# (operation, sources, destination type, source type)
OPS = [
    ("fadds", 2, "f32", "f32"),
    ("fmacs", 3, "f32", "f32"),
    ("fmovs", 1, "f32", "f32"),
    ("fmaxs", 2, "f32", "f32"),
    ("fmachs", 3, "f32", "f16"),
    ("faddh", 2, "f16", "f16"),
    ("fmovh", 1, "f16", "f16"),
    ("add16", 2, "u16", "u16"),
]
ELEM = {"f32": F32, "f16": F16, "u16": U16}


def memory_pe(words: np.ndarray) -> PE:
    """A PE with this memory and nothing else: enough for an operation's arithmetic."""
    pe = PE.__new__(PE)
    pe.x = pe.y = 0
    pe.mem = bytearray(words.tobytes())
    pe.mem16 = np.frombuffer(pe.mem, dtype=np.uint16)
    pe.views = D.typed_views(pe.mem16)
    return pe


@st.composite
def mem1d(draw, etype: str, n: int) -> Dsd:
    words = D.WORDS[etype]
    return Dsd(
        "mem1d",
        ELEM[etype],
        base=draw(st.integers(0, WORDS - 1)) // words * words,
        offset=draw(st.integers(-2, 4)),
        length=n,
        stride=draw(st.integers(-3, 3)),
    )


@st.composite
def operation(draw):
    name, nsrc, dtype, stype = draw(st.sampled_from(OPS))
    stypes = D.src_types(D.OpSpec(name, nsrc, dtype, stype, "test"))
    n = draw(st.integers(1, 8))
    dest = draw(mem1d(dtype, n))
    srcs = []
    for k, etype in enumerate(stypes):
        kind = draw(st.sampled_from(["mem1d", "dest", "scalar", "pointer"]))
        if kind == "dest" and D.WORDS[etype] == D.WORDS[dtype]:
            srcs.append(dest)  # in place
        elif kind == "scalar" and k > 0:
            bits = draw(st.integers(0, 0xFFFF))
            srcs.append(D.Scalar(float(np.uint16(bits).view(np.float16)) if etype != "u16" else bits))
        elif kind == "pointer":
            words = D.WORDS[etype]
            srcs.append(D.ScalarPtr(draw(st.integers(0, WORDS - words)) // words * words, ELEM[etype]))
        else:
            srcs.append(draw(mem1d(etype, n)))
    return D.OpSpec(name, nsrc, dtype, stype, "test"), dest, tuple(srcs), stypes, n


def both_paths(op: tuple, seed: int) -> tuple[bool, PE, PE]:
    """(whether the fast path took the operation, the PE after it, the PE after the indexed path)."""
    spec, dest, srcs, stypes, n = op
    words = np.random.default_rng(seed).integers(0, 1 << 16, WORDS, dtype=np.uint16)
    fast, indexed = memory_pe(words), memory_pe(words)
    with np.errstate(all="ignore"):
        took = fast._strided_compute(spec, dest, srcs, stypes, n)
        if took:
            indexed._indexed_compute(spec, dest, srcs, stypes, n)
    return took, fast, indexed


# Data generation is cheap, but a loaded CI machine can make it look slow.
@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(operation(), st.integers(0, 2**32 - 1))
def test_the_fast_path_leaves_the_memory_the_indexed_path_leaves(op, seed) -> None:
    took, fast, indexed = both_paths(op, seed)
    event("fast path" if took else "indexed path alone")
    assert fast.mem == indexed.mem


def test_the_fast_path_takes_the_gemv_tiles_step_and_declines_an_overlap() -> None:
    """`acc += x_j * W[j, :]` in place (lib/fmac.csl's step) is the fast path's; a source that
    overlaps the destination one element on is not."""
    spec, n = D.OpSpec("fmacs", 3, "f32", "f32", "test"), 4
    acc = Dsd("mem1d", F32, base=0, length=n, stride=1)
    row = Dsd("mem1d", F32, base=16, length=n, stride=1)
    took, fast, indexed = both_paths((spec, acc, (acc, row, D.Scalar(0.5)), ["f32"] * 3, n), 3)
    assert took and fast.mem == indexed.mem
    shifted = Dsd("mem1d", F32, base=2, length=n, stride=1)
    assert not both_paths((spec, acc, (shifted, row, D.Scalar(0.5)), ["f32"] * 3, n), 3)[0]
