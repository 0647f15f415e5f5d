"""A syntax gate for CSL without a CSL compiler: rewrite the CSL-only syntax to Zig, parse with Zig's grammar.

CSL is Zig's syntax plus a handful of forms (no public CSL parser exists). `to_zig` rewrites exactly
those forms, keeping every line in place so that errors point at the CSL line:

    param NAME: TYPE;              ->  const NAME: TYPE = undefined;
    param NAME: TYPE = VALUE;      ->  const NAME: TYPE = VALUE;
    param NAME;  param NAME = V;   ->  const NAME = undefined;  const NAME = V;   (untyped params)
    var NAME: TYPE;                ->  var NAME: TYPE = undefined;   (CSL allows no initializer)
    task NAME(ARGS) RET {          ->  fn NAME(ARGS) RET {
    task () void  (a type)         ->  fn () void
    layout {                       ->  comptime {
    |i, j|{M, N} -> A[i, j]        ->  __tensor_access(.{ M, N }) ++ A[i][j]   (DSD tensor access)
    A[i, j]  [M, N]f32             ->  A[i][j]  [M][N]f32   (multi-dimensional index and array type)

The result is parsed with tree-sitter's Zig grammar (PyPI `tree-sitter`, `tree-sitter-zig`), and any
ERROR or MISSING node is reported with its CSL line and column. This checks syntax only: names,
types and builtins are the compiler's business (`cslc`, see the SDK tests).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

_PARAM = re.compile(r"^(\s*)param(\s+)([A-Za-z_]\w*)(\s*:\s*[^=;]+?)?(\s*=\s*[^;]+)?;", re.MULTILINE)
_BARE_VAR = re.compile(r"^(\s*var\s+[A-Za-z_]\w*\s*:\s*[^=;]+?)\s*;", re.MULTILINE)
_TASK = re.compile(r"\btask(\s+[A-Za-z_]\w*\s*\(|\s*\()")
_LAYOUT = re.compile(r"^(\s*)layout(\s*\{)", re.MULTILINE)
# |i|{N} -> or |i, j|{M, N} ->  (the index variables and the extents of a DSD tensor access)
_TENSOR_ACCESS = re.compile(r"\|\s*([A-Za-z_]\w*(?:\s*,\s*[A-Za-z_]\w*)*)\s*\|\s*\{([^{}]*)\}\s*->\s*")


@dataclass(frozen=True)
class SyntaxProblem:
    path: str
    line: int  # 1-based, in the CSL file
    column: int  # 1-based
    message: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}:{self.column}: {self.message}"


def to_zig(source: str) -> str:
    """Rewrite the CSL-only forms to Zig, line for line."""
    text = _PARAM.sub(lambda m: _param_to_const(m), source)
    text = _BARE_VAR.sub(r"\1 = undefined;", text)
    text = _TASK.sub(r"fn\1", text)
    text = _LAYOUT.sub(r"\1comptime\2", text)
    return _split_multi_index(_rewrite_tensor_access(text))


def _param_to_const(m: re.Match[str]) -> str:
    indent, gap, name, type_part, default = m.groups()
    value = default if default else " = undefined"
    return f"{indent}const{gap}{name}{type_part or ''}{value};"


def _rewrite_tensor_access(text: str) -> str:
    out, pos = [], 0
    for m in _TENSOR_ACCESS.finditer(text):
        out.append(text[pos : m.start()])
        out.append(f"__tensor_access(.{{ {m.group(2).strip()} }}) ++ ")
        pos = m.end()
    out.append(text[pos:])
    return "".join(out)


def _split_multi_index(text: str) -> str:
    """A comma at the top level of [...] is CSL's multi-dimensional index or array type: A[i, j] ->
    A[i][j]. Zig never has one there (its array literals put commas inside braces)."""
    chars = list(text)
    stack: list[str] = []  # open brackets, innermost last
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


def _parser():
    try:
        import tree_sitter_zig
        from tree_sitter import Language, Parser
    except ImportError as exc:  # pragma: no cover - the test extra installs both
        raise RuntimeError(
            "the CSL syntax gate needs the PyPI packages tree-sitter and tree-sitter-zig "
            "(pip install tree-sitter tree-sitter-zig)"
        ) from exc
    return Parser(Language(tree_sitter_zig.language()))


def check_source(source: str, path: str = "<csl>") -> list[SyntaxProblem]:
    """Every syntax problem in one CSL source (empty when it parses)."""
    tree = _parser().parse(to_zig(source).encode())
    problems: list[SyntaxProblem] = []
    stack = [tree.root_node]
    while stack:
        node = stack.pop()
        if node.is_error or node.is_missing:
            line, col = node.start_point
            what = f"missing {node.type!r}" if node.is_missing else f"cannot parse {_snippet(node)!r}"
            problems.append(SyntaxProblem(path, line + 1, col + 1, what))
            continue  # one report per broken subtree
        if node.has_error:
            stack.extend(reversed(node.children))
    return sorted(problems, key=lambda p: (p.line, p.column))


def _snippet(node) -> str:
    text = node.text.decode(errors="replace").strip().splitlines()
    return text[0][:60] if text else node.type


def check_file(path: str | Path) -> list[SyntaxProblem]:
    path = Path(path)
    return check_source(path.read_text(), str(path))


def kernel_files() -> list[Path]:
    """Every .csl file of the kernel library."""
    return sorted(Path(__file__).parent.rglob("*.csl"))


def main(argv: list[str] | None = None) -> int:
    import sys

    paths = [Path(a) for a in (argv if argv is not None else sys.argv[1:])] or kernel_files()
    problems = [p for path in paths for p in check_file(path)]
    for problem in problems:
        print(problem)
    print(f"{len(paths)} CSL files, {len(problems)} syntax problems")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
