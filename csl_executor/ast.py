"""The CSL syntax tree the executor works on: one small node class per construct.

`csl_executor.parse` builds it from tree-sitter's Zig parse of the (rewritten) source; the comptime
evaluator (`csl_executor.comptime`) walks it, and the code generator (`csl_executor.codegen`) turns function
bodies into Python. Every node keeps the 1-based source line it came from, so that an error can name
`file:line`.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(eq=False)
class Node:
    line: int


# ---------------------------------------------------------------------------------------------------
# Expressions


@dataclass(eq=False)
class Ident(Node):
    name: str


@dataclass(eq=False)
class IntLit(Node):
    value: int


@dataclass(eq=False)
class FloatLit(Node):
    value: float


@dataclass(eq=False)
class BoolLit(Node):
    value: bool


@dataclass(eq=False)
class StrLit(Node):
    value: str


@dataclass(eq=False)
class UndefinedLit(Node):
    pass


@dataclass(eq=False)
class VoidLit(Node):
    """`{}`: the void value (e.g. `param X = {};`)."""


@dataclass(eq=False)
class EnumLit(Node):
    """`.name`: an enum literal, resolved against the expected type."""

    name: str


@dataclass(eq=False)
class Unary(Node):
    op: str  # "-", "!", "~", "&"
    operand: Node


@dataclass(eq=False)
class Binary(Node):
    op: str
    left: Node
    right: Node


@dataclass(eq=False)
class Call(Node):
    func: Node
    args: list[Node]


@dataclass(eq=False)
class BuiltinCall(Node):
    name: str  # without the "@"
    args: list[Node]


@dataclass(eq=False)
class Field(Node):
    obj: Node
    name: str


@dataclass(eq=False)
class Index(Node):
    obj: Node
    index: Node


@dataclass(eq=False)
class Deref(Node):
    obj: Node


@dataclass(eq=False)
class StructLit(Node):
    """`.{ .a = x, .b = y }` (type None) or `T{ .a = x }`."""

    type: Node | None
    fields: list[tuple[str, Node]]


@dataclass(eq=False)
class ListLit(Node):
    """`.{ a, b }` (an anonymous tuple, type None) or `[3]i16{ 1, 2, 3 }` (an array)."""

    type: Node | None
    items: list[Node]


@dataclass(eq=False)
class IfExpr(Node):
    cond: Node
    then: Node
    other: Node | None


@dataclass(eq=False)
class TensorAccess(Node):
    """`|i, j|{M, N} -> A[i, j]`: the comptime shorthand of a DSD's address pattern."""

    vars: list[str]
    extents: list[Node]
    expr: Node


@dataclass(eq=False)
class ArrayTypeExpr(Node):
    length: Node | None  # None: `[_]T`
    elem: Node


@dataclass(eq=False)
class PointerTypeExpr(Node):
    many: bool  # `[*]T` vs `*T`
    const: bool
    elem: Node


@dataclass(eq=False)
class FnTypeExpr(Node):
    params: list[Node]
    ret: Node


@dataclass(eq=False)
class EnumDecl(Node):
    tag: Node | None
    members: list[tuple[str, Node | None]]


@dataclass(eq=False)
class StructDecl(Node):
    fields: list[tuple[str, Node, Node | None]]  # name, type, default


@dataclass(eq=False)
class SwitchExpr(Node):
    subject: Node
    cases: list[SwitchCase]


@dataclass(eq=False)
class SwitchCase(Node):
    values: list[Node]  # empty: `else`
    body: Node


# ---------------------------------------------------------------------------------------------------
# Statements


@dataclass(eq=False)
class VarDecl(Node):
    kind: str  # "const", "var", "param"
    name: str
    type: Node | None
    init: Node | None  # None: no initializer (`var x: T;`, `param p: T;`)
    exported: bool = False
    comptime: bool = False


@dataclass(eq=False)
class Assign(Node):
    op: str  # "=", "+=", ...
    target: Node
    value: Node


@dataclass(eq=False)
class ExprStmt(Node):
    expr: Node


@dataclass(eq=False)
class Block(Node):
    stmts: list[Node]
    label: str | None = None


@dataclass(eq=False)
class If(Node):
    cond: Node
    then: Node
    other: Node | None


@dataclass(eq=False)
class While(Node):
    cond: Node
    cont: Node | None  # the `: (i += 1)` clause
    body: Node


@dataclass(eq=False)
class For(Node):
    iterable: Node
    captures: list[str]
    body: Node
    inline: bool = False


@dataclass(eq=False)
class Return(Node):
    value: Node | None


@dataclass(eq=False)
class Break(Node):
    label: str | None = None


@dataclass(eq=False)
class Continue(Node):
    pass


@dataclass(eq=False)
class ComptimeBlock(Node):
    body: Block
    is_layout: bool = False


# ---------------------------------------------------------------------------------------------------
# Declarations


@dataclass(eq=False)
class Param(Node):
    name: str
    type: Node
    comptime: bool = False


@dataclass(eq=False)
class FnDecl(Node):
    name: str
    params: list[Param]
    ret: Node
    body: Block
    is_task: bool = False
    exported: bool = False


@dataclass(eq=False)
class SourceFile:
    path: str
    decls: list[Node] = field(default_factory=list)
