"""CSL's types, as the executor knows them, and the values that only exist at comptime.

Numbers are Python `int` / `float` (a `float` of type f32 or f16 always holds a value already rounded
to that format); booleans are `bool`. Everything else a CSL program can name (colors, task IDs, queues,
DSDs, FIFOs, structs, modules, functions, types themselves) is one of the small classes below.
Memory is addressed in 16-bit words, as on the hardware, so a type's size is given in words.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field, replace
from typing import Any


class CslType:
    name: str = "?"
    words: int = 0  # size in 16-bit words when stored in PE memory (0: not storable)

    def __repr__(self) -> str:
        return self.name

    @property
    def is_int(self) -> bool:
        return False

    @property
    def is_float(self) -> bool:
        return False

    @property
    def is_numeric(self) -> bool:
        return self.is_int or self.is_float


@dataclass(frozen=True, eq=True, repr=False)
class IntType(CslType):
    bits: int
    signed: bool

    @property
    def name(self) -> str:  # type: ignore[override]
        return f"{'i' if self.signed else 'u'}{self.bits}"

    @property
    def words(self) -> int:  # type: ignore[override]
        return max(1, self.bits // 16)

    @property
    def is_int(self) -> bool:
        return True

    @property
    def lo(self) -> int:
        return -(1 << (self.bits - 1)) if self.signed else 0

    @property
    def hi(self) -> int:
        return (1 << (self.bits - 1)) - 1 if self.signed else (1 << self.bits) - 1

    def wrap(self, v: int) -> int:
        mask = (1 << self.bits) - 1
        if self.signed:
            half = 1 << (self.bits - 1)
            return ((v + half) & mask) - half
        return v & mask

    def wrap_code(self, code: str) -> str:
        mask = (1 << self.bits) - 1
        if self.signed:
            half = 1 << (self.bits - 1)
            return f"((((({code}) + {half}) & {mask}) - {half}))"
        return f"(({code}) & {mask})"


@dataclass(frozen=True, eq=True, repr=False)
class FloatType(CslType):
    bits: int

    @property
    def name(self) -> str:  # type: ignore[override]
        return f"f{self.bits}"

    @property
    def words(self) -> int:  # type: ignore[override]
        return self.bits // 16

    @property
    def is_float(self) -> bool:
        return True


@dataclass(frozen=True, eq=True, repr=False)
class SimpleType(CslType):
    """A type with no structure of its own: bool, void, color, queues, task IDs, DSD kinds, ..."""

    name: str
    words: int = 0


@dataclass(frozen=True, eq=True, repr=False)
class ArrayType(CslType):
    length: int
    elem: CslType

    @property
    def name(self) -> str:  # type: ignore[override]
        return f"[{self.length}]{self.elem.name}"

    @property
    def words(self) -> int:  # type: ignore[override]
        return self.length * self.elem.words

    @property
    def scalar(self) -> CslType:
        t: CslType = self
        while isinstance(t, ArrayType):
            t = t.elem
        return t

    @property
    def count(self) -> int:
        """Number of scalar elements."""
        return self.words // max(1, self.scalar.words)


@dataclass(frozen=True, eq=True, repr=False)
class PointerType(CslType):
    elem: CslType
    many: bool = False
    const: bool = False

    @property
    def name(self) -> str:  # type: ignore[override]
        return f"{'[*]' if self.many else '*'}{'const ' if self.const else ''}{self.elem.name}"

    words = 1


@dataclass(frozen=True, eq=True, repr=False)
class FnType(CslType):
    params: tuple[CslType, ...]
    ret: CslType

    @property
    def name(self) -> str:  # type: ignore[override]
        return f"fn({', '.join(p.name for p in self.params)}) {self.ret.name}"


@dataclass(frozen=True, eq=False, repr=False)
class EnumType(CslType):
    tag: IntType
    members: tuple[tuple[str, int], ...]
    label: str = "enum"

    @property
    def name(self) -> str:  # type: ignore[override]
        return self.label

    @property
    def words(self) -> int:  # type: ignore[override]
        return self.tag.words

    def value_of(self, member: str) -> int | None:
        return dict(self.members).get(member)


@dataclass(frozen=True, eq=False, repr=False)
class StructType(CslType):
    """A declared `struct { ... }` type (used at comptime; its values are `Struct`)."""

    fields: tuple[tuple[str, CslType, Any], ...]
    label: str = "struct"

    @property
    def name(self) -> str:  # type: ignore[override]
        return self.label


I8, I16, I32, I64 = (IntType(b, True) for b in (8, 16, 32, 64))
U8, U16, U32, U64 = (IntType(b, False) for b in (8, 16, 32, 64))
F16, F32 = FloatType(16), FloatType(32)
BOOL = SimpleType("bool", 1)
VOID_T = SimpleType("void")
NORETURN = SimpleType("noreturn")
TYPE = SimpleType("type")
ANYTYPE = SimpleType("anytype")
COMPTIME_INT = SimpleType("comptime_int")
COMPTIME_FLOAT = SimpleType("comptime_float")
COMPTIME_STRUCT = SimpleType("comptime_struct")
STRING = SimpleType("comptime_string")
COLOR = SimpleType("color", 1)
DIRECTION = SimpleType("direction")
LOCAL_TASK_ID = SimpleType("local_task_id", 1)
DATA_TASK_ID = SimpleType("data_task_id", 1)
CONTROL_TASK_ID = SimpleType("control_task_id", 1)
INPUT_QUEUE = SimpleType("input_queue", 1)
OUTPUT_QUEUE = SimpleType("output_queue", 1)
UT_ID = SimpleType("ut_id", 1)
MEM1D_DSD = SimpleType("mem1d_dsd")
MEM4D_DSD = SimpleType("mem4d_dsd")
FABIN_DSD = SimpleType("fabin_dsd")
FABOUT_DSD = SimpleType("fabout_dsd")
FIFO_T = SimpleType("fifo")
DSR_DEST = SimpleType("dsr_dest")
DSR_SRC0 = SimpleType("dsr_src0")
DSR_SRC1 = SimpleType("dsr_src1")
MODULE = SimpleType("imported_module")
FN_ANY = SimpleType("fn")
TASK_ID_TYPES = (LOCAL_TASK_ID, DATA_TASK_ID, CONTROL_TASK_ID)
DSD_TYPES = (MEM1D_DSD, MEM4D_DSD, FABIN_DSD, FABOUT_DSD)

NAMED_TYPES: dict[str, CslType] = {
    "i8": I8, "i16": I16, "i32": I32, "i64": I64, "u8": U8, "u16": U16, "u32": U32, "u64": U64,
    "f16": F16, "f32": F32, "bool": BOOL, "void": VOID_T, "noreturn": NORETURN, "type": TYPE,
    "anytype": ANYTYPE, "comptime_int": COMPTIME_INT, "comptime_float": COMPTIME_FLOAT,
    "comptime_struct": COMPTIME_STRUCT, "color": COLOR, "direction": DIRECTION,
    "local_task_id": LOCAL_TASK_ID, "data_task_id": DATA_TASK_ID, "control_task_id": CONTROL_TASK_ID,
    "input_queue": INPUT_QUEUE, "output_queue": OUTPUT_QUEUE, "ut_id": UT_ID,
    "mem1d_dsd": MEM1D_DSD, "mem4d_dsd": MEM4D_DSD, "fabin_dsd": FABIN_DSD, "fabout_dsd": FABOUT_DSD,
    "dsr_dest": DSR_DEST, "dsr_src0": DSR_SRC0, "dsr_src1": DSR_SRC1, "imported_module": MODULE,
}  # fmt: skip


# ---------------------------------------------------------------------------------------------------
# Number formats


_F32 = struct.Struct("<f")
_U32 = struct.Struct("<I")
_F16 = struct.Struct("<e")
_U16 = struct.Struct("<H")


def round_f32(v: float) -> float:
    """Round to the nearest binary32 (ties to even); overflow gives +-inf, as the hardware does."""
    try:
        return _F32.unpack(_F32.pack(v))[0]
    except OverflowError:
        return math.copysign(math.inf, v)


def round_f16(v: float) -> float:
    try:
        return _F16.unpack(_F16.pack(v))[0]
    except OverflowError:
        return math.copysign(math.inf, v)


def f32_bits(v: float) -> int:
    return _U32.unpack(_F32.pack(round_f32(v)))[0]


def bits_f32(b: int) -> float:
    return _F32.unpack(_U32.pack(b & 0xFFFFFFFF))[0]


def f16_bits(v: float) -> int:
    return _U16.unpack(_F16.pack(round_f16(v)))[0]


def bits_f16(b: int) -> float:
    return _F16.unpack(_U16.pack(b & 0xFFFF))[0]


# ---------------------------------------------------------------------------------------------------
# Comptime values


class Void:
    _instance: Void | None = None

    def __new__(cls) -> Void:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "{}"


VOID = Void()


@dataclass(frozen=True)
class Color:
    id: int

    def __repr__(self) -> str:
        return f"color({self.id})"


@dataclass(frozen=True)
class Direction:
    name: str

    def __repr__(self) -> str:
        return self.name


NORTH, SOUTH, EAST, WEST, RAMP = (Direction(n) for n in ("NORTH", "SOUTH", "EAST", "WEST", "RAMP"))
DIRECTIONS = {d.name: d for d in (NORTH, SOUTH, EAST, WEST, RAMP)}


@dataclass(frozen=True)
class TaskId:
    kind: str  # "local", "data", "control"
    id: int
    color: Color | None = None  # WSE-2 data task IDs are made from a color
    queue: int | None = None  # WSE-3 data task IDs are made from an input queue

    def __repr__(self) -> str:
        return f"{self.kind}_task_id({self.id})"


@dataclass(frozen=True)
class Queue:
    kind: str  # "input" or "output"
    id: int

    def __repr__(self) -> str:
        return f"{self.kind}_queue({self.id})"


@dataclass(frozen=True)
class UtId:
    id: int


@dataclass(frozen=True)
class Struct:
    """An anonymous struct or tuple value: `.{ .a = 1 }`, `.{ RAMP, EAST }`, a module's params."""

    fields: tuple[tuple[str, Any], ...]
    types: tuple[tuple[str, CslType], ...] = ()
    is_tuple: bool = False
    struct_type: StructType | None = None

    def get(self, name: str, default: Any = None) -> Any:
        for k, v in self.fields:
            if k == name:
                return v
        return default

    def has(self, name: str) -> bool:
        return any(k == name for k, _ in self.fields)

    def type_of(self, name: str) -> CslType | None:
        for k, t in self.types:
            if k == name:
                return t
        return None

    def names(self) -> list[str]:
        return [k for k, _ in self.fields]

    def values(self) -> list[Any]:
        return [v for _, v in self.fields]

    def with_field(self, name: str, value: Any, ftype: CslType | None = None) -> Struct:
        fields = [(k, v) for k, v in self.fields if k != name] + [(name, value)]
        types = [(k, t) for k, t in self.types if k != name] + ([(name, ftype)] if ftype else [])
        return replace(self, fields=tuple(fields), types=tuple(types))

    def __repr__(self) -> str:
        if self.is_tuple:
            return ".{" + ", ".join(repr(v) for v in self.values()) + "}"
        return ".{" + ", ".join(f".{k} = {v!r}" for k, v in self.fields) + "}"


@dataclass
class ArrayValue:
    """A comptime array (a literal, `@zeros`, `@constants`): its type and its flat scalar values."""

    type: ArrayType
    items: list[Any]

    def __repr__(self) -> str:
        return f"{self.type.name}{{{', '.join(map(repr, self.items[:8]))}{', ...' if len(self.items) > 8 else ''}}}"


@dataclass(frozen=True)
class Pointer:
    """An address in a PE's memory (16-bit words) and what it points to."""

    addr: int
    type: PointerType
    symbol: str = ""

    def __repr__(self) -> str:
        return f"&{self.symbol or hex(self.addr)}"


@dataclass(frozen=True)
class EnumValue:
    type: EnumType
    member: str
    value: int

    def __repr__(self) -> str:
        return f"{self.type.name}.{self.member}"


@dataclass(frozen=True)
class Dsr:
    """A data structure register: `@get_dsr(dsr_dest, 1)`. Its contents live on each PE."""

    kind: str  # "dest", "src0", "src1"
    id: int

    def __repr__(self) -> str:
        return f"dsr_{self.kind}({self.id})"


@dataclass(frozen=True)
class Fifo:
    index: int  # per program
    buffer: Pointer
    length: int
    elem: CslType


@dataclass(frozen=True)
class Dsd:
    """A data structure descriptor: how an operation walks memory, the fabric or a FIFO.

    mem1d: base (word address), offset (elements), length, stride (elements), elem type.
    mem4d: base, elem, `dims` ((extent, stride), ...) outermost first.
    fabin/fabout: color, queue, length; fabout may send control wavelets.
    """

    kind: str  # "mem1d", "mem4d", "fabin", "fabout"
    elem: CslType | None = None
    base: int = 0
    offset: int = 0
    length: int = 0
    stride: int = 1
    dims: tuple[tuple[int, int], ...] = ()
    color: Color | None = None
    queue: int | None = None
    control: bool = False
    wavelet_index_offset: bool = False
    simd_mode: str = ""
    symbol: str = ""
    extras: tuple[tuple[str, Any], ...] = field(default=())

    def changed(self, **fields: Any) -> Dsd:
        """A copy with `fields` changed: `dataclasses.replace` without its walk over every field, since
        the running program rebuilds DSDs at every step of a @map."""
        new = object.__new__(Dsd)
        new.__dict__.update(self.__dict__)
        new.__dict__.update(fields)
        return new

    @property
    def fabric_color(self) -> Color:
        """The color of a fabin/fabout DSD, which always has one (mem1d/mem4d have none)."""
        if self.color is None:
            raise RuntimeError(f"internal: a {self.kind} DSD without a color")
        return self.color

    @property
    def type(self) -> CslType:
        return {"mem1d": MEM1D_DSD, "mem4d": MEM4D_DSD, "fabin": FABIN_DSD, "fabout": FABOUT_DSD}[self.kind]


def type_of_value(v: Any) -> CslType:
    """The type a comptime value has when nothing declared one."""
    if isinstance(v, bool):
        return BOOL
    if isinstance(v, int):
        return COMPTIME_INT
    if isinstance(v, float):
        return COMPTIME_FLOAT
    if isinstance(v, str):
        return STRING
    if isinstance(v, Void):
        return VOID_T
    if isinstance(v, Color):
        return COLOR
    if isinstance(v, Direction):
        return DIRECTION
    if isinstance(v, TaskId):
        return {"local": LOCAL_TASK_ID, "data": DATA_TASK_ID, "control": CONTROL_TASK_ID}[v.kind]
    if isinstance(v, Queue):
        return INPUT_QUEUE if v.kind == "input" else OUTPUT_QUEUE
    if isinstance(v, UtId):
        return UT_ID
    if isinstance(v, Struct):
        return v.struct_type or COMPTIME_STRUCT
    if isinstance(v, ArrayValue):
        return v.type
    if isinstance(v, Pointer):
        return v.type
    if isinstance(v, EnumValue):
        return v.type
    if isinstance(v, Fifo):
        return FIFO_T
    if isinstance(v, Dsr):
        return {"dest": DSR_DEST, "src0": DSR_SRC0, "src1": DSR_SRC1}[v.kind]
    if isinstance(v, Dsd):
        return v.type
    if isinstance(v, CslType):
        return TYPE
    return getattr(v, "csl_type", FN_ANY)
