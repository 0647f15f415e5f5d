"""Library functions and modules implemented natively by the executor: what `csl_executor.libs` and
`csl_executor.collectives` build their libraries from, and what the compiler recognises when a program
calls one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from csl_executor import ast
from csl_executor.errors import CslCompileError
from csl_executor.types import ANYTYPE, VOID_T, CslType, Struct, type_of_value
from csl_executor.values import CExpr, known

if TYPE_CHECKING:
    from csl_executor.compiler import Ctx


class NativeFn:
    """A library function: its signature, how it runs on a PE, and (if pure) how it folds."""

    def __init__(
        self,
        name: str,
        params: list[CslType],
        ret: CslType,
        runtime: str | None = None,
        fold: Any = None,
        comptime: Any = None,
    ) -> None:
        self.name = name
        self.params = params
        self.ret = ret
        self.runtime = runtime  # format string over the argument codes, e.g. "pe.tsc_enable()"
        self.fold = fold
        self.comptime = comptime

    def __repr__(self) -> str:
        return f"<library function {self.name}>"

    def call(self, ctx: Ctx, arg_nodes: list[ast.Node], node: ast.Node) -> CExpr:
        if len(arg_nodes) != len(self.params):
            raise ctx.error(node, f"{self.name} takes {len(self.params)} arguments, found {len(arg_nodes)}")
        args = []
        for pt, a in zip(self.params, arg_nodes, strict=True):
            ce = ctx.cx(a, pt)
            if pt is not ANYTYPE:
                ce = ctx.coerce(ce, pt, a)
            args.append(ce)
        if self.comptime is not None:
            return self.comptime(ctx, args, node)
        ret = self.ret if self.ret is not ANYTYPE else (args[0].type if args else VOID_T)
        if self.fold is not None and all(a.known for a in args):
            return known(self.fold(*[a.value for a in args]), ret)
        if self.runtime is None:
            raise ctx.error(node, f"{self.name} needs comptime-known arguments")
        if not ctx.runtime:
            raise ctx.error(node, f"{self.name} runs on the PE, not at comptime")
        code = self.runtime.format(*[ctx.code(a) for a in args], where=ctx.fb.const(ctx.where(node)))
        return ctx.dyn(ret, code)

    def py(self, *args: Any) -> Any:
        """Called by `@map` with element values (pure functions only)."""
        if self.fold is None:
            raise CslCompileError(f"{self.name} cannot be mapped")
        return self.fold(*args)


class NativeModule:
    spec = ""

    def __init__(self, comp, ctx: Ctx, params: Struct, node: ast.Node) -> None:
        self.comp = comp
        self.params = params
        self.members: dict[str, Any] = {}

    def member(self, ctx: Ctx, name: str, node: ast.Node) -> CExpr:
        if name not in self.members:
            raise ctx.error(node, f"library <{self.spec}> has no member {name!r}")
        m = self.members[name]
        if isinstance(m, CExpr):
            return m
        return CExpr(type_of_value(m), m)
