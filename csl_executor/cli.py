"""`csl-executor cslc`, `csl-executor cs_python`, `csl-executor examples` and `csl-executor calibrate`:
the SDK's two commands on the executor (`csl_executor.commands`), a runner for a checkout of
Cerebras' csl-examples, and the executor's cycles against the CS-3 (`csl_executor.calibrate`).

`cslc` takes the SDK compiler's arguments and writes an output folder; `cs_python run.py ...` runs a
host script with the SDK's module names importable (`csl_executor/shim`). Two one-line wrappers named
`cslc` and `cs_python` on PATH (`csl-executor wrappers DIR` writes them) let an example's own
`commands_wse2.sh` run unmodified.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from csl_executor.commands import cs_python_main, cslc_main

# ---------------------------------------------------------------------------------------------------
# Running a checkout of csl-examples

WRAPPER = '#!/bin/sh\nexec "{python}" -m csl_executor.cli {tool} "$@"\n'


def write_wrappers(directory: str | Path) -> Path:
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    for tool in ("cslc", "cs_python"):
        path = d / tool
        path.write_text(WRAPPER.format(python=sys.executable, tool=tool))
        path.chmod(0o755)
    return d


def find_examples(root: Path, arch: str) -> list[Path]:
    """Example folders with a commands script for `arch`: `commands_<arch>.sh`, or, in releases
    before 1.3 (which target WSE-2 only), `commands.sh`."""
    found = {p.parent for p in root.rglob(f"commands_{arch}.sh")}
    if arch == "wse2":
        found |= {p.parent for p in root.rglob("commands.sh") if not (p.parent / "commands_wse2.sh").exists()}
    return sorted(found)


def commands_script(folder: Path, arch: str) -> str:
    return f"commands_{arch}.sh" if (folder / f"commands_{arch}.sh").exists() else "commands.sh"


def run_example(folder: Path, root: Path, arch: str, wrappers: Path, timeout: float) -> dict:
    """Run one example in a fresh copy of the whole tree (examples import files beside them, e.g.
    csl-examples' benchmark-libs), so that the checkout itself is never written to."""
    with tempfile.TemporaryDirectory(prefix="csl-example-") as tmp:
        copy = Path(tmp) / "tree"
        shutil.copytree(root, copy, ignore=shutil.ignore_patterns(".git", "out"))
        work = copy / folder.relative_to(root) if folder != root else copy
        env = dict(os.environ)
        env["PATH"] = f"{wrappers}{os.pathsep}{env.get('PATH', '')}"
        env["WAFER_CSL_STATS"] = str(Path(tmp) / "stats.txt")
        start = time.perf_counter()
        try:
            proc = subprocess.run(
                ["bash", commands_script(work, arch)],
                cwd=work,
                env=env,
                capture_output=True,
                text=True,
                timeout=timeout,
            )
            code, out = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as exc:
            code, out = -1, f"timed out after {timeout:.0f} s\n{exc.stdout or ''!s}{exc.stderr or ''!s}"
        wall = time.perf_counter() - start
        stats_file = Path(env["WAFER_CSL_STATS"])
        runs = (
            [json.loads(line) for line in stats_file.read_text().splitlines()] if stats_file.is_file() else []
        )
    totals = {
        key: sum(r[key] for r in runs) for key in ("cycles", "wavelet_hops", "events", "tasks", "wall_s")
    }
    return {
        "example": str(folder.relative_to(root)) if folder != root else folder.name,
        "arch": arch,
        "ok": code == 0,
        "runs": len(runs),
        "pes": max((r["pes"] for r in runs), default=0),
        **{f"sim_{key}" if key == "wall_s" else key: value for key, value in totals.items()},
        "wall_s": wall,
        "output": out,
    }


def examples_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="csl-executor examples", description="Run a csl-examples checkout on the executor."
    )
    p.add_argument("path", help="a checkout of Cerebras/csl-examples (or one example folder)")
    p.add_argument("--arch", default="wse2", choices=["wse2", "wse3", "both"])
    p.add_argument("--only", action="append", default=[], help="run only examples whose name contains this")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("-v", "--verbose", action="store_true", help="print each failing example's output")
    p.add_argument("--json", metavar="FILE", help="write every run's result and executor statistics here")
    args = p.parse_args(argv)
    root = Path(args.path)
    archs = ["wse2", "wse3"] if args.arch == "both" else [args.arch]
    rows = []
    with tempfile.TemporaryDirectory(prefix="csl-wrappers-") as tmp:
        wrappers = write_wrappers(tmp)
        for arch in archs:
            for folder in find_examples(root, arch):
                if args.only and not any(s in folder.name for s in args.only):
                    continue
                r = run_example(folder, root, arch, wrappers, args.timeout)
                rows.append(r)
                status = "pass" if r["ok"] else "FAIL"
                print(
                    f"{r['example']:<48} {arch:<5} {status:<5} {r['cycles']:>12,} cycles {r['wall_s']:8.1f} s",
                    flush=True,
                )
                if not r["ok"] and args.verbose:
                    print("\n".join("    " + line for line in r["output"].strip().splitlines()[-25:]))
    passed = sum(r["ok"] for r in rows)
    print(f"{passed} of {len(rows)} passed")
    if args.json:
        Path(args.json).write_text(
            json.dumps([{k: v for k, v in r.items() if k != "output"} for r in rows], indent=1)
        )
    return 0 if passed == len(rows) else 1


USAGE = """usage: csl-executor COMMAND [ARGS...]

The CSL executor: compile and run CSL programs without the Cerebras SDK.

commands:
  cslc ARGS...             compile a layout (takes Cerebras cslc's arguments; cslc --help)
  cs_python SCRIPT ARGS... run an SDK host script (run.py) on the executor
  wrappers DIR             write DIR/cslc and DIR/cs_python: put DIR on PATH, run commands_*.sh as is
  examples PATH ...        run a checkout of Cerebras/csl-examples (examples --help)
  calibrate WAFERLLM       WaferLLM's MeshGEMV or MeshGEMM at the published CS-3 points: executor vs hardware cycles
"""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, end="", file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    tool, rest = argv[0], argv[1:]
    if tool == "cslc":
        return cslc_main(rest)
    if tool == "cs_python":
        return cs_python_main(rest)
    if tool == "examples":
        return examples_main(rest)
    if tool == "calibrate":
        from csl_executor.calibrate import main as calibrate_main

        return calibrate_main(rest)
    if tool == "wrappers":
        print(write_wrappers(rest[0] if rest else "."))
        return 0
    print(f"unknown tool {tool!r}\n{USAGE}", end="", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
