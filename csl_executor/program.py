"""One PE program as the compiler builds it: its modules, memory map, tasks, exports and routes.

A `Program` is what `cslc` calls a tile code: a root file compiled with one set of parameters. Every
PE that `@set_tile_code` gives the same file and parameters shares one `Program` (its generated code,
its memory map, its task table); each PE then has its own memory and state (`csl_executor.pe`).

`ModuleInstance` is one `@import_module` of one file with one parameter struct: its top-level names
are evaluated lazily, so declarations may refer to each other in any order, as in Zig.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from csl_executor import ast
from csl_executor.errors import CslCompileError
from csl_executor.types import (
    ArrayType,
    Color,
    CslType,
    Dsd,
    Fifo,
    Struct,
)

PE_MEMORY_WORDS = 24 * 1024  # 48 KB of 16-bit words (SDK documentation, "Computing with Cerebras")


# ---------------------------------------------------------------------------------------------------
# Symbols: what a name refers to once its declaration has been evaluated


@dataclass
class Const:
    value: Any
    type: CslType


@dataclass
class MemVar:
    """A variable in PE memory: its word address and type (an array or a scalar)."""

    name: str
    type: CslType
    addr: int
    mutable: bool
    line: int = 0
    file: str = ""


@dataclass
class SlotVar:
    """A global `var` of a kind that does not live in data memory (a DSD, a pointer): one Python slot
    per PE, starting at `initial`."""

    name: str
    type: CslType
    index: int
    initial: Any


@dataclass(eq=False)
class FnSym:
    decl: ast.FnDecl
    module: ModuleInstance
    comptime_args: tuple = ()  # a specialisation of a function with `comptime` parameters
    py: Any = None  # the generated Python function, once compiled
    compiling: bool = False
    code_instructions: int = 0  # its estimated instruction count (csl_executor.codesize)
    csl_type: Any = None

    @property
    def name(self) -> str:
        return self.decl.name

    @property
    def where(self) -> str:
        return f"{self.module.path}:{self.decl.line}"


@dataclass
class TaskBinding:
    kind: str  # "local", "data", "control"
    id: int
    fn: FnSym
    where: str


@dataclass
class Export:
    name: str
    kind: str  # "data" or "fn"
    addr: int = 0
    elem: CslType | None = None
    length: int = 0  # elements reachable from addr within the symbol
    fn: FnSym | None = None
    where: str = ""


@dataclass
class ColorConfig:
    """A router setting for one color: routes, optional switches and filter, color swap."""

    rx: tuple[str, ...]
    tx: tuple[str, ...]
    switches: Struct | None = None
    filter: Struct | None = None
    color_swap_x: bool = False
    color_swap_y: bool = False
    teardown: bool = False
    where: str = ""


@dataclass
class Program:
    """A compiled tile code (root file + parameters) for one architecture."""

    arch: str
    path: str
    params: Struct
    memory_words: int = 0
    memory_image: bytearray = field(default_factory=bytearray)
    symbols: list[MemVar] = field(default_factory=list)
    slots: list[SlotVar] = field(default_factory=list)
    tasks: dict[int, TaskBinding] = field(default_factory=dict)
    # (activate|block|unblock, task ID, where); ("load_dsr", (dsr, dsd, opts), where); before
    # finishing, a task ID may still be ("fn", FnSym), resolved by the layout.
    startup: list[tuple[str, Any, str]] = field(default_factory=list)
    exports: dict[str, Export] = field(default_factory=dict)
    local_colors: dict[int, ColorConfig] = field(default_factory=dict)
    queue_colors: dict[tuple[str, int], tuple[int, str]] = field(default_factory=dict)
    queue_uses: dict[tuple[str, int], dict[int, str]] = field(default_factory=dict)
    fifos: list[Fifo] = field(default_factory=list)
    modules: dict[Any, ModuleInstance] = field(default_factory=dict)
    memcpy: Struct | None = None
    native_state: dict[str, Any] = field(default_factory=dict)
    functions: list[FnSym] = field(default_factory=list)
    teardown_handler: FnSym | None = None
    control_task_table: bool = False
    compiled_fns: list[FnSym] = field(default_factory=list)  # every function generated for this program

    def __post_init__(self) -> None:
        if not self.memory_image:
            self.memory_image = bytearray(2 * PE_MEMORY_WORDS)

    # -- memory --------------------------------------------------------------------------------------
    def allocate(self, name: str, ctype: CslType, mutable: bool, where: tuple[str, int]) -> MemVar:
        words = ctype.words
        if words <= 0:
            raise CslCompileError(f"{where[0]}:{where[1]}: cannot place {name!r} of type {ctype} in memory")
        # 32-bit values, and every array, start at an even word: programs move 16-bit arrays with
        # 32-bit operations (fft-1d-2d copies f16 pairs with @fmovs), which needs the alignment.
        align = 2 if _scalar(ctype).words >= 2 or isinstance(ctype, ArrayType) else 1
        addr = (self.memory_words + align - 1) // align * align
        if addr + words > PE_MEMORY_WORDS:
            raise CslCompileError(
                f"{where[0]}:{where[1]}: out of PE memory: {name!r} needs {2 * words} bytes at byte "
                f"{2 * addr}, past the 48 KB of a PE ({self.memory_report()})"
            )
        self.memory_words = addr + words
        var = MemVar(name, ctype, addr, mutable, where[1], where[0])
        self.symbols.append(var)
        return var

    def memory_report(self, top: int = 4) -> str:
        biggest = sorted(self.symbols, key=lambda s: -s.type.words)[:top]
        return "largest: " + ", ".join(f"{s.name} {2 * s.type.words} B" for s in biggest)

    def add_slot(self, name: str, ctype: CslType, initial: Any) -> SlotVar:
        slot = SlotVar(name, ctype, len(self.slots), initial)
        self.slots.append(slot)
        return slot

    def bind_task(self, kind: str, task_id: int, fn: FnSym, where: str) -> None:
        other = self.tasks.get(task_id)
        if other is not None:
            raise CslCompileError(
                f"{where}: task ID {task_id} is already bound to {other.kind} task {other.fn.name!r} "
                f"({other.where}); on this PE one ID names one task"
            )
        self.tasks[task_id] = TaskBinding(kind, task_id, fn, where)

    def export(self, exp: Export) -> None:
        if exp.name in self.exports and self.exports[exp.name] != exp:
            raise CslCompileError(f"{exp.where}: symbol {exp.name!r} is exported twice")
        self.exports[exp.name] = exp

    def note_queue(self, kind: str, qid: int, color: Color, where: str) -> None:
        """Record that a DSD reads/writes queue `qid` for `color` (checked for one color per queue)."""
        self.queue_uses.setdefault((kind, qid), {}).setdefault(color.id, where)

    def task_fn(self, fn: FnSym) -> int | None:
        for tid, b in self.tasks.items():
            if b.fn is fn:
                return tid
        return None


def _scalar(t: CslType) -> CslType:
    while isinstance(t, ArrayType):
        t = t.elem
    return t


@dataclass(eq=False)
class ModuleInstance:
    """One `@import_module` (or the root file) with its parameter values."""

    program: Any  # Program, or the layout's LayoutProgram
    path: str
    file: ast.SourceFile | None
    params: Struct
    native: Any = None  # a native library module (csl_executor.libs), or None for a CSL file
    # names, and ("__spec__", fn name) -> that function's specialisations
    symbols: dict[str | tuple[str, str], Any] = field(default_factory=dict)
    decls: dict[str, ast.Node] = field(default_factory=dict)
    evaluating: set[str] = field(default_factory=set)
    csl_type: Any = None

    def __post_init__(self) -> None:
        if self.file is not None:
            for decl in self.file.decls:
                if isinstance(decl, (ast.VarDecl, ast.FnDecl)):
                    if decl.name in self.decls:
                        raise CslCompileError(f"{self.path}:{decl.line}: {decl.name!r} is declared twice")
                    self.decls[decl.name] = decl

    def __repr__(self) -> str:
        return f"module({self.path})"


DsdValue = Dsd
