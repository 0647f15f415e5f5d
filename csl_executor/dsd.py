"""DSDs at run time: building and moving them, reading and writing what they address, and the
element-wise arithmetic of the DSD builtins.

Semantics (the Cerebras SDK documentation's "DSDs" and "Builtins" pages): an operation steps through its operands element by
element, as many elements as its shortest DSD operand (FIFOs, scalars and scalar pointers do not end
it); each step reads one element of every source and writes one of the destination; f32 and f16
operations round to nearest even after every arithmetic step (an fmac rounds its product, then its
sum); 16-bit results leave on the fabric with the upper half of the wavelet zero. Where a destination
in memory is read again by a later step of the same operation (a stride-0 accumulator, `@fmaxs(&m,
m, v)`), the steps run one after another; otherwise they are done as one NumPy operation (over views
of the memory where the operands' addresses step evenly: `mem_span`, `span_view`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from csl_executor.errors import CslRuntimeError
from csl_executor.types import F16, F32, CslType, Dsd, Fifo

I16_LIMIT = (-(1 << 15), (1 << 15) - 1)
I8_LIMIT = (-(1 << 7), (1 << 7) - 1)
MAX_EXTENT = 0xFFFF  # extents are u16 [D]


@dataclass(frozen=True)
class Scalar:
    """A scalar operand: a float for floating-point operations, the raw bits for integer ones."""

    value: Any


@dataclass(frozen=True)
class ScalarPtr:
    """A pointer used as an operand: one element that every step reads and writes (stride 0)."""

    addr: int
    elem: CslType


def scalar_ptr(addr: int, elem: CslType) -> ScalarPtr:
    return ScalarPtr(addr, elem)


# ---------------------------------------------------------------------------------------------------
# Building and mutating DSDs (called by generated code as DSD.<name>)


def check_fields(d: Dsd) -> str | None:
    if d.kind == "mem4d":
        for extent, _stride in d.dims:
            if not 0 <= extent <= MAX_EXTENT:
                return f"mem4d_dsd extent {extent} does not fit u16"
        return None
    if not 0 <= d.length <= MAX_EXTENT:
        return f"DSD extent {d.length} does not fit u16 (0-{MAX_EXTENT})"
    if d.kind == "mem1d" and not I8_LIMIT[0] <= d.stride <= I8_LIMIT[1]:
        return f"mem1d_dsd stride {d.stride} does not fit i8 ({I8_LIMIT[0]}-{I8_LIMIT[1]})"
    if d.kind == "mem1d" and not I16_LIMIT[0] <= d.offset <= I16_LIMIT[1]:
        return f"mem1d_dsd offset {d.offset} does not fit i16"
    return None


def _checked(d: Dsd, where: str) -> Dsd:
    problem = check_fields(d)
    if problem:
        raise CslRuntimeError(f"{where}: {problem}")
    return d


def mem1d(elem: CslType, base: int, length: int, stride: int, offset: int, wio: bool, where: str) -> Dsd:
    return _checked(
        Dsd("mem1d", elem, base=base, offset=offset, length=length, stride=stride, wavelet_index_offset=wio),
        where,
    )


def mem4d(elem: CslType, base: int, dims: tuple, wio: bool, where: str) -> Dsd:
    return _checked(Dsd("mem4d", elem, base=base, dims=dims, wavelet_index_offset=wio), where)


def with_length(d: Dsd, length: int, where: str) -> Dsd:
    return _checked(d.changed(length=length), where)


def increment_dsd_offset(d: Dsd, n: int, words: int, where: str) -> Dsd:
    if not I16_LIMIT[0] <= n <= I16_LIMIT[1]:
        raise CslRuntimeError(f"{where}: @increment_dsd_offset by {n} does not fit its i16 offset")
    if d.kind not in ("mem1d", "mem4d"):
        raise CslRuntimeError(f"{where}: @increment_dsd_offset needs a memory DSD, found {d.kind}")
    return d.changed(base=d.base + n * words)


def set_dsd_base_addr(d: Dsd, addr: int, where: str) -> Dsd:
    if d.kind not in ("mem1d", "mem4d"):
        raise CslRuntimeError(f"{where}: @set_dsd_base_addr needs a memory DSD, found {d.kind}")
    return d.changed(base=addr, offset=0)


def set_dsd_length(d: Dsd, n: int, where: str) -> Dsd:
    if d.kind == "mem4d":
        raise CslRuntimeError(f"{where}: @set_dsd_length does not apply to a mem4d_dsd")
    return _checked(d.changed(length=n), where)


def set_dsd_stride(d: Dsd, s: int, where: str) -> Dsd:
    if d.kind != "mem1d":
        raise CslRuntimeError(f"{where}: @set_dsd_stride applies to a mem1d_dsd only")
    return _checked(d.changed(stride=s), where)


class DsdModule:
    """What generated code sees as `DSD`."""

    Scalar = Scalar
    scalar_ptr = staticmethod(scalar_ptr)
    mem1d = staticmethod(mem1d)
    mem4d = staticmethod(mem4d)
    with_length = staticmethod(with_length)
    increment_dsd_offset = staticmethod(increment_dsd_offset)
    set_dsd_base_addr = staticmethod(set_dsd_base_addr)
    set_dsd_length = staticmethod(set_dsd_length)
    set_dsd_stride = staticmethod(set_dsd_stride)


# ---------------------------------------------------------------------------------------------------
# Operation descriptions


@dataclass
class OpSpec:
    name: str
    nsrc: int
    dtype: str  # element type of the destination
    stype: str  # element type of the sources
    where: str
    opts: dict[str, Any] = field(default_factory=dict)

    @property
    def is_async(self) -> bool:
        return bool(self.opts.get("async"))

    def check_static(self, ctx, operands, node) -> None:
        kinds = [k for _, k in operands]
        dest = kinds[0]
        if dest == "scalar":
            raise ctx.error(node, f"@{self.name}: the destination must be a DSD, a FIFO or a pointer")
        if isinstance(dest, Dsd) and dest.kind == "fabin":
            raise ctx.error(node, f"@{self.name}: a fabin_dsd cannot be a destination")
        for k in kinds[1:]:
            if isinstance(k, Dsd) and k.kind == "fabout":
                raise ctx.error(node, f"@{self.name}: a fabout_dsd cannot be a source")
        fabins = [k for k in kinds[1:] if (isinstance(k, Dsd) and k.kind == "fabin") or k is _FABIN_T(ctx)]
        rules = ctx.comp.arch
        if rules == "wse3" and len(fabins) > 1:
            raise ctx.error(node, f"@{self.name}: WSE-3 allows one fabric input per operation")
        fabric = any(
            (isinstance(k, Dsd) and k.kind in ("fabin", "fabout")) or k in (_FABIN_T(ctx), _FABOUT_T(ctx))
            for k in kinds
        )
        if fabric and self.is_async is False and self.opts.get("activate") is not None:
            raise ctx.error(node, f"@{self.name}: `.activate` needs `.async = true`")
        for k, etype in zip(kinds, [self.dtype, *src_types(self)], strict=False):
            if isinstance(k, Dsd) and k.simd_mode and WORDS[etype] != 1:
                raise ctx.error(
                    node,
                    f"@{self.name}: `.simd_mode` packs 16-bit values into wavelets; this operand is {etype}",
                )
        for k in kinds:
            if isinstance(k, Dsd) and k.kind in ("fabin", "fabout") and k.queue is None and self.is_async:
                q = "input_queue" if k.kind == "fabin" else "output_queue"
                raise ctx.error(node, f"@{self.name}: an asynchronous fabric operand needs `.{q}`")

    def runtime_opts_code(self, ctx) -> str:
        """`.index = v` is a run-time value: it moves every operand DSD made with
        `.wavelet_index_offset = true` by v 16-bit words (sdklayout-05 passes `2 * idx` for f32)."""
        index = self.opts.get("index")
        if index is None:
            return ""
        self.opts = {k: v for k, v in self.opts.items() if k != "index"}
        return f", {ctx.code(index)}"


def _FABIN_T(ctx):
    from csl_executor.types import FABIN_DSD

    return FABIN_DSD


def _FABOUT_T(ctx):
    from csl_executor.types import FABOUT_DSD

    return FABOUT_DSD


@dataclass
class MapSpec:
    fn: Any  # FnSym or NativeFn
    params: tuple[CslType, ...]
    ret: CslType
    kinds: tuple[str, ...]  # "dsd" | "ptr" | "value" per operand (inputs then output)
    where: str


# ---------------------------------------------------------------------------------------------------
# Addressing


def mem_indices(d: Dsd | ScalarPtr, n: int, op_words: int, where: str) -> np.ndarray:
    """Word addresses of the first n elements an operand addresses."""
    if isinstance(d, ScalarPtr):
        return np.full(n, d.addr, dtype=np.int64)
    # Offsets and strides count elements of the operation (residual's gemv moves f32 data through a
    # DSD declared over an i16 array: "the type here doesn't matter").
    words = op_words
    if d.kind == "mem1d":
        start = d.base + d.offset * words
        return start + np.arange(n, dtype=np.int64) * (d.stride * words)
    # mem4d: the last index variable varies fastest
    idx = np.zeros(1, dtype=np.int64)
    for extent, stride in d.dims:
        idx = (idx[:, None] + np.arange(extent, dtype=np.int64)[None, :] * (stride * words)).reshape(-1)
    return d.base + idx[:n]


def mem_span(d: Dsd | ScalarPtr, op_words: int) -> tuple[int, int] | None:
    """(first word, words from one element to the next) of an operand whose addresses step evenly: a
    mem1d DSD, or a scalar pointer (step 0); None for a mem4d DSD."""
    if isinstance(d, ScalarPtr):
        return d.addr, 0
    if d.kind == "mem1d":
        return d.base + d.offset * op_words, d.stride * op_words
    return None


def typed_views(mem16: np.ndarray) -> dict[str, np.ndarray]:
    """A PE's memory as an array of each element type (32-bit types at even word addresses)."""
    return {t: mem16.view(NP[t]) for t in NP}


def span_view(views: dict[str, np.ndarray], etype: str, start: int, step: int, n: int) -> np.ndarray | None:
    """The n elements at words start, start + step, ... as a view of the memory (a step of 0 repeats
    one element, read-only); None where a 32-bit element is not word-pair aligned (the indexed path
    reports that). The caller has checked that every element lies in the memory."""
    words = WORDS[etype]
    if words == 2 and (start | step) & 1:
        return None
    first, every = start // words, step // words
    view = views[etype]
    if every == 0:
        return np.broadcast_to(view[first : first + 1], (n,))
    return view[first::every][:n]


def span_in_memory(start: int, step: int, n: int, etype: str, size: int) -> bool:
    """Do the n elements of a span lie in a memory of `size` words?"""
    last = start + (n - 1) * step
    return min(start, last) >= 0 and max(start, last) + WORDS[etype] - 1 < size


def spans_apart(a: tuple[int, int, str], b: tuple[int, int, str], n: int) -> bool:
    """Do two spans of n elements ((start, step, element type)) touch no word in common?"""
    lo_a, hi_a = _word_range(*a, n)
    lo_b, hi_b = _word_range(*b, n)
    return hi_a < lo_b or hi_b < lo_a


def _word_range(start: int, step: int, etype: str, n: int) -> tuple[int, int]:
    last = start + (n - 1) * step
    return min(start, last), max(start, last) + WORDS[etype] - 1


def op_length(operands: tuple) -> int:
    """Steps of an operation: its shortest memory DSD operand, or, when it has none, its shortest
    fabric DSD. A fabric extent does not cut short an operation over memory: topic-12 and topic-13
    send a 5-element buffer through a fabout_dsd of extent 1 and expect all 5 wavelets."""
    mem = [_extent(o) for o in operands if isinstance(o, Dsd) and o.kind in ("mem1d", "mem4d")]
    if mem:
        return min(mem)
    fab = [_extent(o) for o in operands if isinstance(o, Dsd)]
    return min(fab) if fab else 1


def _extent(d: Dsd) -> int:
    """Elements a DSD can supply or take."""
    if d.kind == "mem4d":
        n = 1
        for extent, _ in d.dims:
            n *= extent
        return n
    return d.length


def dsd_length(d: Any) -> int | None:
    """Elements an operand can supply or take (None: unbounded)."""
    if isinstance(d, Dsd):
        return _extent(d)
    return None


NP = {
    "f32": np.float32,
    "f16": np.float16,
    "u16": np.uint16,
    "i16": np.int16,
    "u32": np.uint32,
    "i32": np.int32,
}
WORDS = {"f32": 2, "u32": 2, "i32": 2, "f16": 1, "u16": 1, "i16": 1}


def read_mem(mem16: np.ndarray, idx: np.ndarray, etype: str, where: str) -> np.ndarray:
    if WORDS[etype] == 2:
        if (idx & 1).any():
            raise CslRuntimeError(f"{where}: a 32-bit operand at an odd word address")
        lo = mem16[idx].astype(np.uint32)
        hi = mem16[idx + 1].astype(np.uint32)
        bits = lo | (hi << 16)
        return bits.view(NP[etype]) if etype != "u32" else bits
    words = mem16[idx]
    return words.view(NP[etype]) if etype != "u16" else words


def write_mem(mem16: np.ndarray, idx: np.ndarray, values: np.ndarray, etype: str, where: str) -> None:
    if WORDS[etype] == 2:
        if (idx & 1).any():
            raise CslRuntimeError(f"{where}: a 32-bit operand at an odd word address")
        bits = np.ascontiguousarray(values, dtype=NP[etype]).view(np.uint32)
        mem16[idx] = (bits & 0xFFFF).astype(np.uint16)
        mem16[idx + 1] = (bits >> 16).astype(np.uint16)
    else:
        mem16[idx] = np.ascontiguousarray(values, dtype=NP[etype]).view(np.uint16)


def from_wavelets(payloads: list[int], etype: str, per_wavelet: int = 1) -> np.ndarray:
    """Element values from wavelet payloads; with two per wavelet (a SIMD mode) the low half comes
    first, then the high half."""
    arr = np.fromiter(payloads, dtype=np.uint32, count=len(payloads))
    if etype == "f32":
        return arr.view(np.float32)
    if etype == "u32":
        return arr
    if per_wavelet == 2:
        halves = np.empty(2 * len(arr), dtype=np.uint16)
        halves[0::2] = arr & 0xFFFF
        halves[1::2] = arr >> 16
        low = halves
    else:
        low = (arr & 0xFFFF).astype(np.uint16)
    return low.view(NP[etype]) if etype != "u16" else low


def to_wavelets(values: np.ndarray, etype: str, per_wavelet: int = 1) -> list[int]:
    """Wavelet payloads of element values: 32-bit values one per wavelet; 16-bit values one per
    wavelet with the upper half zero, or two per wavelet (low half first) in a SIMD mode, the last
    wavelet of an odd count carrying one value."""
    if etype in ("f32", "u32"):
        return np.ascontiguousarray(values, dtype=NP[etype]).view(np.uint32).tolist()
    words = np.ascontiguousarray(values, dtype=NP[etype]).view(np.uint16).astype(np.uint32)
    if per_wavelet == 2:
        if len(words) % 2:
            words = np.append(words, np.uint32(0))
        return (words[0::2] | (words[1::2] << 16)).tolist()
    return words.tolist()


def scalar_array(s: Scalar, n: int, etype: str) -> np.ndarray:
    v = s.value
    if etype in ("f32", "f16"):
        return np.full(n, v, dtype=NP[etype])
    mask = 0xFFFFFFFF if etype == "u32" else 0xFFFF
    bits = int(v) & mask
    arr = np.full(n, bits, dtype=np.uint32 if etype == "u32" else np.uint16)
    return arr.view(NP[etype]) if etype == "i16" else arr


# ---------------------------------------------------------------------------------------------------
# Arithmetic


def compute(name: str, srcs: list[np.ndarray], dtype: str, stype: str) -> np.ndarray:
    """The results of `name` for whole arrays of source elements (each step independent)."""
    with np.errstate(all="ignore"):
        if name in ("fmovs", "fmovh", "mov16", "mov32"):
            return srcs[0]
        if name in ("fnegs", "fnegh"):
            return np.negative(srcs[0])
        if name in ("fabss", "fabsh"):
            return np.abs(srcs[0])
        a, b = srcs[0], srcs[1]
        if name in ("fadds", "faddh"):
            return np.add(a, b)
        if name in ("fsubs", "fsubh"):
            return np.subtract(a, b)
        if name in ("fmuls", "fmulh"):
            return np.multiply(a, b)
        if name in ("fmaxs", "fmaxh"):
            return np.maximum(a, b)
        if name in ("fmins", "fminh"):
            return np.minimum(a, b)
        if name in ("fmacs", "fmach"):
            return np.add(a, np.multiply(b, srcs[2]))
        if name == "fmachs":
            prod = np.multiply(b.astype(np.float32), srcs[2].astype(np.float32))  # exact in f32
            return np.add(a.astype(np.float32), prod)
        ua, ub = a.view(np.uint16), b.view(np.uint16)
        if name == "add16":
            return (ua + ub).astype(np.uint16)
        if name == "sub16":
            return (ua - ub).astype(np.uint16)
        if name == "and16":
            return ua & ub
        if name == "or16":
            return ua | ub
        if name == "xor16":
            return ua ^ ub
    raise CslRuntimeError(f"internal: no arithmetic for @{name}")


def src_types(spec: OpSpec) -> list[str]:
    if spec.name == "fmachs":
        return ["f32", "f16", "f16"]
    return [spec.stype] * spec.nsrc


def round_type(etype: str) -> CslType:
    return F32 if etype == "f32" else F16


def fifo_elem(f: Fifo) -> str:
    return "u32" if f.elem.words == 2 else "u16"
