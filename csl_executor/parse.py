"""CSL source -> `csl_executor.ast`, through tree-sitter's Zig grammar.

CSL is Zig's syntax plus a few forms. `rewrite` turns those forms into Zig, keeping every token on
its line so that tree-sitter's positions are the CSL file's lines:

    param NAME: T;            ->  const NAME: T = @__param();
    param NAME: T = V;        ->  const NAME: T = @__param(V);
    var NAME: T;              ->  var NAME: T = undefined;
    task NAME(...)            ->  fn __task__NAME(...)
    layout {                  ->  comptime {            (the line is remembered as a layout block)
    |i, j|{M, N} -> E         ->  @__tensor_access(.{M, N}, .{i, j}) ++ E
    A[i, j]   [M, N]T         ->  A[i][j]   [M][N]T

The tree (PyPI `tree-sitter`, `tree-sitter-zig`) is then converted node by node into `ast` nodes. One
quirk of the grammar is undone here: it reads a prefix `!x` as an error-union type that binds tighter
than calls, fields and indexing, so `!f()` arrives as `(!f)()`; the converter moves the `!` back out.
A construct the converter does not know is refused with its line, never guessed.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import NoReturn, cast

from csl_executor import ast
from csl_executor.errors import CslSyntaxError

_PARAM = re.compile(r"^(\s*)param(\s+)([A-Za-z_]\w*)(\s*:\s*[^=;]+?)?(?:\s*=\s*([^;]+))?\s*;", re.MULTILINE)
_BARE_VAR = re.compile(r"^(\s*(?:export\s+)?var\s+[A-Za-z_]\w*\s*:\s*[^=;]+?)\s*;", re.MULTILINE)
# Comments and strings are matched first and kept as they are: a comment ending in "task" followed by
# a line `name(...)` must not become `fn __task__name(`.
_TASK = re.compile(r'//[^\n]*|"(?:\\.|[^"\\\n])*"|\btask(\s+)([A-Za-z_]\w*)(\s*\()|\btask(\s*\()')
_LAYOUT = re.compile(r"^([ \t]*)layout(\s*\{)", re.MULTILINE)
_TENSOR_ACCESS = re.compile(r"\|\s*([A-Za-z_]\w*(?:\s*,\s*[A-Za-z_]\w*)*)\s*\|\s*\{([^{}]*)\}\s*->\s*")
TASK_PREFIX = "__task__"


def rewrite(source: str) -> tuple[str, set[int]]:
    """The Zig text tree-sitter parses, and the 1-based lines that open a `layout` block."""
    text = _PARAM.sub(_param_to_const, source)
    text = _BARE_VAR.sub(r"\1 = undefined;", text)
    text = _TASK.sub(_task_to_fn, text)
    layout_lines = {text.count("\n", 0, m.start()) + 1 for m in _LAYOUT.finditer(text)}
    text = _LAYOUT.sub(r"\1comptime\2", text)
    text = _TENSOR_ACCESS.sub(lambda m: f"@__tensor_access(.{{{m.group(2)}}}, .{{{m.group(1)}}}) ++ ", text)
    return _split_multi_index(text), layout_lines


def _param_to_const(m: re.Match[str]) -> str:
    indent, gap, name, type_part, default = m.groups()
    return f"{indent}const{gap}{name}{type_part or ''} = @__param({default or ''});"


def _task_to_fn(m: re.Match[str]) -> str:
    if m.group(2) is not None:
        return f"fn{m.group(1)}{TASK_PREFIX}{m.group(2)}{m.group(3)}"
    if m.group(4) is not None:
        return f"fn{m.group(4)}"
    return m.group(0)  # a comment or a string literal


def _split_multi_index(text: str) -> str:
    """A comma at the top level of [...] is CSL's multi-dimensional index or array type."""
    chars = list(text)
    stack: list[str] = []
    in_string = in_comment = False
    for i, ch in enumerate(chars):
        if in_comment:
            in_comment = ch != "\n"
            continue
        if in_string:
            in_string = not (ch == '"' and chars[i - 1] != "\\")
            continue
        if ch == '"':
            in_string = True
        elif ch == "/" and i + 1 < len(chars) and chars[i + 1] == "/":
            in_comment = True
        elif ch in "([{":
            stack.append(ch)
        elif ch in ")]}":
            if stack:
                stack.pop()
        elif ch == "," and stack and stack[-1] == "[":
            chars[i] = "]["
    return "".join(chars)


@functools.cache
def _parser():
    import tree_sitter_zig
    from tree_sitter import Language, Parser

    return Parser(Language(tree_sitter_zig.language()))


@functools.cache
def parse_file(path: str) -> ast.SourceFile:
    """Parse one CSL file (cached by path: the executor parses each file once per process)."""
    p = Path(path)
    try:
        source = p.read_text()
    except OSError as exc:
        raise CslSyntaxError(f"{path}: cannot read CSL source: {exc.strerror}") from exc
    return parse_source(source, str(p))


def parse_source(source: str, path: str = "<csl>") -> ast.SourceFile:
    text, layout_lines = rewrite(source)
    tree = _parser().parse(text.encode())
    _raise_on_syntax_errors(tree.root_node, path)
    return _Converter(path, layout_lines).source_file(tree.root_node)


def _raise_on_syntax_errors(root, path: str) -> None:
    stack = [root]
    while stack:
        node = stack.pop()
        if node.is_error or node.is_missing:
            line, col = node.start_point
            text = node.text.decode(errors="replace").strip().splitlines()
            what = (
                f"missing {node.type!r}"
                if node.is_missing
                else f"cannot parse {text[0][:60] if text else ''!r}"
            )
            raise CslSyntaxError(f"{path}:{line + 1}:{col + 1}: syntax error: {what}")
        if node.has_error:
            stack.extend(reversed(node.children))


_BINARY_OPS = {
    "+", "-", "*", "/", "%", "<<", ">>", "&", "|", "^", "==", "!=", "<", "<=", ">", ">=", "and", "or", "++",
}  # fmt: skip
_ASSIGN_OPS = {"=", "+=", "-=", "*=", "/=", "%=", "<<=", ">>=", "&=", "|=", "^="}


class _Not(ast.Unary):
    """A `!` that tree-sitter bound too tightly (see the module docstring)."""


class _Converter:
    def __init__(self, path: str, layout_lines: set[int]) -> None:
        self.path = path
        self.layout_lines = layout_lines

    # -- helpers -------------------------------------------------------------------------------------
    def fail(self, node, what: str) -> NoReturn:
        raise CslSyntaxError(f"{self.path}:{node.start_point[0] + 1}: unsupported CSL: {what}")

    @staticmethod
    def line(node) -> int:
        return node.start_point[0] + 1

    @staticmethod
    def named(node) -> list:
        return [c for c in node.children if c.is_named and c.type != "comment"]

    @staticmethod
    def tokens(node) -> list[str]:
        return [c.type for c in node.children if not c.is_named]

    @staticmethod
    def text(node) -> str:
        return node.text.decode()

    # -- file and declarations -------------------------------------------------------------------------
    def source_file(self, root) -> ast.SourceFile:
        out = ast.SourceFile(self.path)
        for child in self.named(root):
            out.decls.append(self.top_decl(child))
        return out

    def top_decl(self, node) -> ast.Node:
        if node.type == "variable_declaration":
            return self.var_decl(node)
        if node.type == "function_declaration":
            return self.fn_decl(node)
        if node.type == "comptime_declaration":
            block = self.named(node)[0]
            return ast.ComptimeBlock(
                self.line(node), self.block(block), is_layout=self.line(node) in self.layout_lines
            )
        self.fail(node, f"top-level {node.type}")

    def fn_decl(self, node) -> ast.FnDecl:
        name = self.text(node.child_by_field_name("name"))
        is_task = name.startswith(TASK_PREFIX)
        if is_task:
            name = name[len(TASK_PREFIX) :]
        params = []
        for p in self.named(node.child_by_field_name("parameters") or self._child(node, "parameters")):
            if p.type != "parameter":
                self.fail(p, p.type)
            ptype = p.child_by_field_name("type")
            params.append(
                ast.Param(
                    self.line(p),
                    self.text(p.child_by_field_name("name")),
                    self.expr(ptype),
                    comptime="comptime" in self.tokens(p),
                )
            )
        ret = node.child_by_field_name("type")
        body = node.child_by_field_name("body")
        exported = "export" in self.tokens(node)
        return ast.FnDecl(
            self.line(node),
            name,
            params,
            self.expr(ret),
            self.block(body),
            is_task=is_task,
            exported=exported,
        )

    @staticmethod
    def _child(node, kind: str):
        for c in node.children:
            if c.type == kind:
                return c
        return None

    def var_decl(self, node) -> ast.Node:
        """`variable_declaration` is tree-sitter's node for declarations and assignments alike."""
        toks = self.tokens(node)
        # `align(N)` only places the variable; the executor's allocator aligns every array anyway.
        kids = [k for k in self.named(node) if k.type not in ("byte_alignment", "link_section")]
        op = next((t for t in toks if t in _ASSIGN_OPS), None)
        kind = next((t for t in toks if t in ("const", "var")), None)
        if kind is None:
            if op is None or len(kids) != 2:
                self.fail(node, "statement")
            return ast.Assign(self.line(node), op, self.expr(kids[0]), self.expr(kids[1]))
        name_node = kids[0]
        if name_node.type != "identifier":
            self.fail(node, "declaration pattern")
        type_node = node.child_by_field_name("type")
        init_nodes = [k for k in kids[1:] if k is not type_node and k != type_node]
        init = self.expr(init_nodes[0]) if init_nodes else None
        type_expr = self.expr(type_node) if type_node is not None else None
        decl_kind = kind
        if isinstance(init, ast.BuiltinCall) and init.name == "__param":
            decl_kind = "param"
            init = init.args[0] if init.args else None
        elif isinstance(init, ast.UndefinedLit):
            init = None
        return ast.VarDecl(
            self.line(node),
            decl_kind,
            self.text(name_node),
            type_expr,
            init,
            exported="export" in toks,
            comptime="comptime" in toks,
        )

    # -- statements ----------------------------------------------------------------------------------
    def block(self, node) -> ast.Block:
        if node.type == "block_expression":
            node = self.named(node)[0]
        label = None
        if node.type == "labeled_statement":
            kids = self.named(node)
            if kids[0].type == "block_label":
                label = self.text(self.named(kids[0])[0])
                node = kids[1]
            else:
                node = kids[0]
        if node.type != "block":
            return ast.Block(self.line(node), [self.stmt(node)])
        return ast.Block(self.line(node), [self.stmt(c) for c in self.named(node)], label)

    def stmt(self, node) -> ast.Node:
        t = node.type
        if t == "variable_declaration":
            return self.var_decl(node)
        if t == "expression_statement":
            inner = self.named(node)[0]
            return self.stmt_from_expr(inner)
        if t in ("block", "block_expression"):
            return self.block(node)
        if t == "labeled_statement":
            kids = self.named(node)
            if kids[0].type == "block_label":
                return self.block(node)
            return self.stmt(kids[0])
        if t == "if_statement":
            return self.if_stmt(node)
        if t == "while_statement":
            return self.while_stmt(node)
        if t == "for_statement":
            return self.for_stmt(node)
        if t == "comptime_statement":
            return ast.ComptimeBlock(self.line(node), self.block(self.named(node)[0]))
        return self.stmt_from_expr(node)

    def stmt_from_expr(self, node) -> ast.Node:
        t = node.type
        if t == "return_expression":
            kids = self.named(node)
            if kids:
                return ast.Return(self.line(node), self.expr(kids[0]))
            if "undefined" in self.tokens(node):
                return ast.Return(self.line(node), ast.UndefinedLit(self.line(node)))
            return ast.Return(self.line(node), None)
        if t == "break_expression":
            kids = self.named(node)
            label = None
            for k in kids:
                if k.type == "break_label":
                    label = self.text(self.named(k)[0])
                else:
                    self.fail(node, "break with a value")
            return ast.Break(self.line(node), label)
        if t == "continue_expression":
            return ast.Continue(self.line(node))
        if t == "if_statement":
            return self.if_stmt(node)
        if t in ("block", "block_expression", "labeled_statement"):
            return self.stmt(node)
        if t == "switch_expression":
            return self.x_switch_expression(node)
        if t == "assignment_expression":
            kids = self.named(node)
            op = next(tok for tok in self.tokens(node) if tok in _ASSIGN_OPS)
            return ast.Assign(self.line(node), op, self.expr(kids[0]), self.expr(kids[1]))
        return ast.ExprStmt(self.line(node), self.expr(node))

    def if_stmt(self, node) -> ast.If:
        cond = self.expr(node.child_by_field_name("condition"))
        body = node.child_by_field_name("body")
        other = None
        for c in self.named(node):
            if c.type == "payload":
                self.fail(node, "if with a payload capture")
            if c.type == "else_clause":
                alt = c.child_by_field_name("alternative") or self.named(c)[0]
                other = self.block(alt) if alt.type != "if_statement" else self.if_stmt(alt)
        return ast.If(self.line(node), cond, self.block(body), other)

    def while_stmt(self, node) -> ast.While:
        cond = self.expr(node.child_by_field_name("condition"))
        body = node.child_by_field_name("body")
        cont = None
        for c in self.named(node):
            if c is body or c == body or c == node.child_by_field_name("condition"):
                continue
            if c.type in ("assignment_expression", "variable_declaration"):
                cont = self.stmt(c) if c.type == "variable_declaration" else self.stmt_from_expr(c)
            elif c.type == "else_clause":
                self.fail(c, "while ... else")
            elif c.type == "payload":
                self.fail(c, "while with a payload capture")
            else:
                cont = self.stmt_from_expr(c)
        return ast.While(self.line(node), cond, cont, self.block(body))

    def for_stmt(self, node) -> ast.For:
        kids = self.named(node)
        body = node.child_by_field_name("body")
        payload = next(c for c in kids if c.type == "payload")
        iterable = next(c for c in kids if c.type not in ("payload",) and c != body)
        captures = [self.text(c) for c in self.named(payload)]
        return ast.For(
            self.line(node),
            self.expr(iterable),
            captures,
            self.block(body),
            inline="inline" in self.tokens(node),
        )

    # -- expressions ---------------------------------------------------------------------------------
    def expr(self, node) -> ast.Node:
        method = getattr(self, "x_" + node.type, None)
        if method is None:
            self.fail(node, f"expression {node.type} ({self.text(node)[:40]!r})")
        return method(node)

    def x_identifier(self, node):
        return ast.Ident(self.line(node), self.text(node))

    def x_builtin_type(self, node):
        return ast.Ident(self.line(node), self.text(node))

    def x_integer(self, node):
        text = self.text(node).replace("_", "")
        return ast.IntLit(self.line(node), int(text, 0))

    def x_float(self, node):
        text = self.text(node).replace("_", "")
        value = float.fromhex(text) if text.lower().startswith("0x") else float(text)
        return ast.FloatLit(self.line(node), value)

    def x_boolean(self, node):
        return ast.BoolLit(self.line(node), self.text(node) == "true")

    def x_character(self, node):
        content = bytes(self.text(node)[1:-1], "utf-8").decode("unicode_escape")
        return ast.IntLit(self.line(node), ord(content))

    def x_string(self, node):
        raw = self.text(node)[1:-1]
        return ast.StrLit(self.line(node), bytes(raw, "utf-8").decode("unicode_escape"))

    def x_comptime_expression(self, node):
        """`comptime e`: e, which must be known at comptime (checked by the builtin it becomes)."""
        inner = self.expr(self.named(node)[0])
        return ast.BuiltinCall(self.line(node), "__comptime", [inner])

    def x_parenthesized_expression(self, node):
        inner = self.expr(self.named(node)[0])
        return ast.Unary(inner.line, "()", inner) if isinstance(inner, _Not) else inner

    def x_block(self, node):
        if not self.named(node):
            return ast.VoidLit(self.line(node))
        self.fail(node, "block expression with statements")

    def x_unary_expression(self, node):
        op = self.text(node.child_by_field_name("operator"))
        operand = self.expr(node.child_by_field_name("argument"))
        if op == "-" and isinstance(operand, (ast.IntLit, ast.FloatLit)):
            return type(operand)(operand.line, -operand.value)
        if op not in ("-", "!", "~", "&"):
            self.fail(node, f"unary operator {op!r}")
        return ast.Unary(self.line(node), op, operand)

    def x_error_union_type(self, node):
        if node.child_by_field_name("error") is not None:
            self.fail(node, "error union types")
        return _Not(self.line(node), "!", self.expr(node.child_by_field_name("ok")))

    def x_binary_expression(self, node):
        op = self.text(node.child_by_field_name("operator"))
        if op not in _BINARY_OPS:
            self.fail(node, f"binary operator {op!r}")
        left = self.expr(node.child_by_field_name("left"))
        right = self.expr(node.child_by_field_name("right"))
        if op == "++" and isinstance(left, ast.BuiltinCall) and left.name == "__tensor_access":
            return self.tensor_access(left, right)
        return ast.Binary(self.line(node), op, left, right)

    def tensor_access(self, marker: ast.BuiltinCall, expr: ast.Node) -> ast.TensorAccess:
        extents, names = marker.args
        if not isinstance(extents, (ast.ListLit, ast.StructLit)) or not isinstance(names, ast.ListLit):
            raise CslSyntaxError(f"{self.path}:{marker.line}: malformed tensor access")
        ext = extents.items if isinstance(extents, ast.ListLit) else []
        # The marker's names list holds the tensor's index identifiers, by the grammar.
        idents = [cast(ast.Ident, n).name for n in names.items]
        return ast.TensorAccess(marker.line, idents, list(ext), expr)

    def _rotate_not(self, built: ast.Node, inner_attr: str) -> ast.Node:
        """`(!f)(x)` from the grammar -> `!(f(x))`."""
        inner = getattr(built, inner_attr)
        if isinstance(inner, _Not):
            setattr(built, inner_attr, inner.operand)
            return _Not(built.line, "!", built)
        return built

    def x_call_expression(self, node):
        func = self.expr(node.child_by_field_name("function"))
        args = [self.expr(c) for c in self.named(node) if c != node.child_by_field_name("function")]
        return self._rotate_not(ast.Call(self.line(node), func, args), "func")

    def x_builtin_function(self, node):
        kids = self.named(node)
        name = self.text(kids[0])[1:]
        args = [self.expr(c) for c in self.named(kids[1])] if len(kids) > 1 else []
        return ast.BuiltinCall(self.line(node), name, args)

    def x_field_expression(self, node):
        obj = node.child_by_field_name("object")
        member = self.text(node.child_by_field_name("member"))
        if obj is None:
            return ast.EnumLit(self.line(node), member)
        return self._rotate_not(ast.Field(self.line(node), self.expr(obj), member), "obj")

    def x_index_expression(self, node):
        obj = self.expr(node.child_by_field_name("object"))
        idx = node.child_by_field_name("index")
        if idx is None or idx.type == "range_expression":
            self.fail(node, "slices")
        return self._rotate_not(ast.Index(self.line(node), obj, self.expr(idx)), "obj")

    def x_dereference_expression(self, node):
        return self._rotate_not(ast.Deref(self.line(node), self.expr(self.named(node)[0])), "obj")

    def x_anonymous_struct_initializer(self, node):
        return self.initializer(node, None)

    def x_struct_initializer(self, node):
        kids = self.named(node)
        return self.initializer(node, self.expr(kids[0]))

    def initializer(self, node, type_expr):
        init_list = next(c for c in self.named(node) if c.type == "initializer_list")
        items = self.named(init_list)
        if items and all(i.type in ("assignment_expression", "field_initializer") for i in items):
            fields = []
            for item in items:
                if item.type == "assignment_expression":
                    left = item.child_by_field_name("left")
                    member = left.child_by_field_name("member") if left.type == "field_expression" else None
                    if member is None or left.child_by_field_name("object") is not None:
                        self.fail(item, "struct field initializer")
                    fields.append((self.text(member), self.expr(item.child_by_field_name("right"))))
                else:
                    kids = self.named(item)
                    fields.append((self.text(kids[0]), self.expr(kids[1])))
            return ast.StructLit(self.line(node), type_expr, fields)
        if not items and type_expr is None:
            return ast.StructLit(self.line(node), None, [])
        return ast.ListLit(self.line(node), type_expr, [self.expr(i) for i in items])

    def x_if_expression(self, node):
        cond = self.expr(node.child_by_field_name("condition"))
        kids = [c for c in self.named(node) if c != node.child_by_field_name("condition")]
        if any(k.type == "payload" for k in kids):
            self.fail(node, "if with a payload capture")
        then = self.expr(kids[0])
        other = self.expr(kids[1]) if len(kids) > 1 else None
        if len(kids) > 1 and kids[1].type == "else_clause":
            other = self.expr(self.named(kids[1])[0])
        return ast.IfExpr(self.line(node), cond, then, other)

    def x_else_clause(self, node):
        return self.expr(self.named(node)[0])

    def x_switch_expression(self, node):
        kids = self.named(node)
        subject = self.expr(kids[0])
        cases = []
        for case in kids[1:]:
            if case.type != "switch_case":
                self.fail(case, case.type)
            parts = self.named(case)
            is_else = "else" in self.tokens(case)
            values = [] if is_else else [self.expr(p) for p in parts[:-1]]
            if any(p.type == "payload" for p in parts):
                self.fail(case, "switch case payload")
            body_node = parts[-1]
            body = self.stmt(body_node) if body_node.type in ("block", "block_expression") else None
            if body is None:
                body = self.stmt_from_expr(body_node)
            cases.append(ast.SwitchCase(self.line(case), values, body))
        return ast.SwitchExpr(self.line(node), subject, cases)

    def x_array_type(self, node):
        kids = self.named(node)
        if len(kids) == 1:
            return ast.ArrayTypeExpr(self.line(node), None, self.expr(kids[0]))
        length = kids[0]
        if length.type == "identifier" and self.text(length) == "_":
            return ast.ArrayTypeExpr(self.line(node), None, self.expr(kids[1]))
        return ast.ArrayTypeExpr(self.line(node), self.expr(length), self.expr(kids[1]))

    def x_pointer_type(self, node):
        toks = self.tokens(node)
        many = "[" in toks
        elem = self.named(node)[-1]
        return ast.PointerTypeExpr(self.line(node), many, "const" in toks, self.expr(elem))

    def x_function_signature(self, node):
        params_node = self._child(node, "parameters")
        params = [self.expr(p.child_by_field_name("type")) for p in self.named(params_node)]
        return ast.FnTypeExpr(self.line(node), params, self.expr(node.child_by_field_name("type")))

    def x_enum_declaration(self, node):
        kids = self.named(node)
        tag = None
        members = []
        for k in kids:
            if k.type == "container_field":
                name = self.text(k.child_by_field_name("name"))
                vals = [c for c in self.named(k) if c != k.child_by_field_name("name")]
                members.append((name, self.expr(vals[0]) if vals else None))
            elif tag is None:
                tag = self.expr(k)
            else:
                self.fail(k, "enum member")
        return ast.EnumDecl(self.line(node), tag, members)

    def x_struct_declaration(self, node):
        fields = []
        for k in self.named(node):
            if k.type != "container_field":
                self.fail(k, "struct declarations with methods")
            name = self.text(k.child_by_field_name("name"))
            ftype = k.child_by_field_name("type")
            rest = [c for c in self.named(k) if c not in (k.child_by_field_name("name"), ftype)]
            fields.append((name, self.expr(ftype), self.expr(rest[0]) if rest else None))
        return ast.StructDecl(self.line(node), fields)

    def x_return_expression(self, node):
        self.fail(node, "return inside an expression")
