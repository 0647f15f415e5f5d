"""`wafer-gpt2 cslc`, `wafer-gpt2 cs_python` and `wafer-gpt2 csl examples`: the SDK's two commands on
the executor, and a runner for a checkout of Cerebras' csl-examples.

`cslc` takes the SDK compiler's arguments and writes an output folder; `cs_python run.py ...` runs a
host script with the SDK's module names importable (`wafer/csl/shim`). Two one-line wrappers named
`cslc` and `cs_python` on PATH (`wafer-gpt2 csl wrappers DIR` writes them) let an example's own
`commands_wse2.sh` run unmodified.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from wafer.csl.errors import CslError
from wafer.csl.layout import Options, compile_layout
from wafer.csl.sdk import write_output

SHIM_DIR = Path(__file__).parent / "shim"


def _pairs(values: list[str], what: str, as_int: bool = True) -> dict[str, int]:
    out: dict[str, int] = {}
    for value in values:
        for item in value.split(","):
            item = item.strip()
            if not item:
                continue
            if ":" not in item:
                raise SystemExit(f"cslc: {what} {item!r}: expected NAME:VALUE")
            name, v = item.split(":", 1)
            try:
                out[name.strip()] = int(v, 0)
            except ValueError:
                raise SystemExit(f"cslc: {what} {item!r}: the value must be an integer") from None
    return out


def _dims(v: str, what: str) -> tuple[int, int]:
    try:
        a, b = v.split(",")
        return int(a), int(b)
    except ValueError:
        raise SystemExit(f"cslc: {what}={v!r}: expected W,H") from None


def cslc_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="cslc",
        description="Compile a CSL layout with the project's executor (not Cerebras cslc): checks the "
        "program like a compiler would and writes an output folder for cs_python / SdkRuntime.",
    )
    p.add_argument("layout", help="the layout file (layout.csl)")
    p.add_argument("--arch", default="wse2", choices=["wse2", "wse3"])
    p.add_argument("--fabric-dims", required=True, help="W,H of the (simulated) fabric")
    p.add_argument("--fabric-offsets", default="4,1", help="X,Y of the kernel's north-west PE")
    p.add_argument("--params", action="append", default=[], help="NAME:VALUE[,NAME:VALUE...] (repeatable)")
    p.add_argument("--colors", action="append", default=[], help="NAME:COLOR[,...] (repeatable)")
    p.add_argument("--memcpy", action="store_true", help="link the memcpy infrastructure")
    p.add_argument("--channels", type=int, default=1, help="memcpy I/O channels (1-16)")
    p.add_argument("--width-west-buf", type=int, default=0)
    p.add_argument("--width-east-buf", type=int, default=0)
    p.add_argument("-o", "--output", default="out", help="output folder")
    p.add_argument("--verbose", action="store_true", help="accepted for compatibility; no effect")
    return p


def cslc_main(argv: list[str] | None = None) -> int:
    args = cslc_parser().parse_args(argv)
    args.output = args.output[1:] if args.output.startswith("=") else args.output  # `-o=out`
    if not 1 <= args.channels <= 16:
        print(f"cslc: --channels={args.channels}: expected 1-16", file=sys.stderr)
        return 2
    options = Options(
        arch=args.arch,
        fabric_dims=_dims(args.fabric_dims, "--fabric-dims"),
        fabric_offsets=_dims(args.fabric_offsets, "--fabric-offsets"),
        params=_pairs(args.params, "--params"),
        colors=_pairs(args.colors, "--colors"),
        memcpy=args.memcpy,
        channels=args.channels,
        width_west_buf=args.width_west_buf,
        width_east_buf=args.width_east_buf,
    )
    try:
        compiled = compile_layout(args.layout, options)
    except CslError as exc:
        print(f"cslc: error: {exc}", file=sys.stderr)
        return 1
    for warning in compiled.warnings:
        print(f"cslc: warning: {warning}", file=sys.stderr)
    write_output(compiled, args.output)
    return 0


def cs_python_main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: cs_python SCRIPT [ARGS...]: run a host script with the SDK's modules on the executor")
        return 0 if argv else 2
    script = Path(argv[0])
    if not script.is_file():
        print(f"cs_python: no script {script}", file=sys.stderr)
        return 2
    sys.path[:0] = [str(SHIM_DIR), str(script.resolve().parent)]
    sys.argv = [str(script)] + argv[1:]
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as exc:
        return int(exc.code or 0) if not isinstance(exc.code, str) else 1
    except CslError as exc:
        print(f"cs_python: error: {exc}", file=sys.stderr)
        return 1
    return 0


# ---------------------------------------------------------------------------------------------------
# Running a checkout of csl-examples

WRAPPER = '#!/bin/sh\nexec "{python}" -m wafer.csl.cli {tool} "$@"\n'


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
        prog="wafer-gpt2 csl examples", description="Run a csl-examples checkout on the executor."
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


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        print(
            "usage: python -m wafer.csl.cli {cslc|cs_python|examples|wrappers|calibrate} ...", file=sys.stderr
        )
        return 2
    tool, rest = argv[0], argv[1:]
    if tool == "cslc":
        return cslc_main(rest)
    if tool == "cs_python":
        return cs_python_main(rest)
    if tool == "examples":
        return examples_main(rest)
    if tool == "calibrate":
        from wafer.csl.calibrate import main as calibrate_main

        return calibrate_main(rest)
    if tool == "wrappers":
        print(write_wrappers(rest[0] if rest else "."))
        return 0
    print(f"unknown tool {tool!r}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
