"""What the import linter does not check: names, and what serving loads.

The layers, the CSL executor's independence and the absence of cycles (function-level imports
included) are pyproject's `[tool.importlinter]` contracts, checked by `lint-imports` in `make test`.
Here: no module imports another module's private name (`from x import _y`): a name that starts with
`_` is the business of its own module, so a second user makes it public (renamed) or moves it. And
serving loads no tool, while drawing without matplotlib says what to install.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("wafer_gpt2", "csl_executor", "tools")
# (importer, module, name) allowed to break the rule; none today.
ALLOWED: set[tuple[str, str, str]] = set()


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def private_imports() -> list[tuple[str, str, str]]:
    """(importer, imported module, name) for every `from module import _name` in the shipped packages
    and the tools (their tests and the vendored SDK shim left out)."""
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).parts
            if "tests" in parts or "shim" in parts or "kernels" in parts:
                continue
            name = _module_name(path)
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if not isinstance(node, ast.ImportFrom):
                    continue
                base = node.module or ""
                if node.level:
                    anchor = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                for alias in node.names:
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        found.append((name, base, alias.name))
    return found


def test_no_module_imports_another_modules_private_names():
    bad = [
        f"{importer}: from {module} import {name}"
        for importer, module, name in private_imports()
        if (importer, module, name) not in ALLOWED
    ]
    assert not bad, "private names imported across modules:\n" + "\n".join(bad)


def test_the_allowed_exceptions_still_exist():
    """An exception that is gone (renamed at last) leaves the list."""
    assert ALLOWED <= set(private_imports())


def test_serving_needs_no_tool_and_plotting_says_what_to_install():
    """Training, the loopback appliance, the report and plotting are tools. Building the CLI (every
    command registered) and the app imports none of them; with matplotlib absent, drawing fails with
    one line naming the extra."""
    code = """
import sys
sys.modules["matplotlib"] = None  # as if the `plot` extra were not installed
from wafer_gpt2.cli.main import build_parser
from wafer_gpt2.service.api import create_app
build_parser()
tools = [m for m in sys.modules if m.split(".")[0] in ("tools", "torch") or m == "wafer_gpt2.plan.drawing"]
assert not tools, tools
from wafer_gpt2.errors import MissingExtra
try:
    import wafer_gpt2.plan.drawing
except MissingExtra as exc:
    print(exc)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "pip install 'wafer-gpt2[plot]'" in out.stdout
