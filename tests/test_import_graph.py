"""The project's modules import one way: no cycles, and the lower layers never import `service`.

The graph is built from the source with `ast` (every `import`/`from ... import` anywhere in a module,
including the ones inside functions, since those still tie the modules together; only the imports under
`if TYPE_CHECKING:`, which never run, are left out). A `from pkg import name` counts as an edge to
`pkg.name` when that is a module, else to `pkg`. Running this file as a script prints the strongly
connected components:

    python tests/test_import_graph.py
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("service", "wafer", "weights", "kernels", "bench")
# Lower layers: they must not import the service.
NO_SERVICE = ("wafer", "weights", "kernels")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            # The vendored Cerebras SDK shim is imported as `cerebras.*`, not as a project module.
            if "shim" in path.relative_to(ROOT).parts:
                continue
            found[_module_name(path)] = path
    return found


def _resolve(current: str, is_pkg: bool, level: int, module: str | None) -> str:
    if level == 0:
        return module or ""
    base = current.split(".")
    if not is_pkg:
        base = base[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def _type_checking_only(tree: ast.Module) -> set[int]:
    """ids of the import nodes under `if TYPE_CHECKING:` (annotations only: they never run)."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = test.id if isinstance(test, ast.Name) else getattr(test, "attr", None)
            if name == "TYPE_CHECKING":
                skip.update(id(inner) for stmt in node.body for inner in ast.walk(stmt))
    return skip


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_pkg = path.name == "__init__.py"
        skip = _type_checking_only(tree)
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(name, is_pkg, node.level, node.module)
                for alias in node.names:
                    sub = f"{base}.{alias.name}" if base else alias.name
                    targets.append(sub if sub in mods else base)
            for target in targets:
                # Importing a.b.c runs a, a.b and a.b.c: the edge is to the deepest project module.
                while target and target not in mods:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    item = stack.pop()
                    on_stack.discard(item)
                    comp.append(item)
                    if item == node:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_no_import_cycles():
    found = cycles(import_graph())
    assert not found, "import cycles among project modules:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_lower_layers_never_import_service():
    graph = import_graph()
    bad = sorted(
        f"{mod} -> {dep}"
        for mod, deps in graph.items()
        if mod.split(".")[0] in NO_SERVICE
        for dep in deps
        if dep.split(".")[0] == "service"
    )
    assert not bad, "lower layers import the service:\n" + "\n".join(bad)


def test_serving_needs_no_tool_and_plotting_says_what_to_install():
    """Issue 15: training, the loopback appliance and plotting are tools. Building the CLI (every
    command registered) and the app imports none of them; with matplotlib absent, drawing fails with
    one line naming the extra."""
    code = """
import sys
sys.modules["matplotlib"] = None  # as if the `report` extra were not installed
from service.cli import build_parser
from service.api import create_app
build_parser()
tools = [m for m in sys.modules if m.startswith(("weights.train_demo", "wafer.appliance_server", "wafer.report.plots", "wafer.wafer_map", "torch"))]
assert not tools, tools
from wafer.errors import MissingExtra
try:
    import wafer.wafer_map
except MissingExtra as exc:
    print(exc)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "pip install 'wafer-gpt2[report]'" in out.stdout


if __name__ == "__main__":
    g = import_graph()
    comps = cycles(g)
    for comp in comps:
        print(f"{len(comp)}: " + " ".join(comp))
        for mod in comp:
            print(f"    {mod} -> {' '.join(sorted(d for d in g[mod] if d in comp))}")
    print(f"{len(g)} modules, {len(comps)} cycles")
    sys.exit(1 if comps else 0)
