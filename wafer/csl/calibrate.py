"""The executor's cycles against Cerebras hardware: WaferLLM's MeshGEMV for WSE-3, run unmodified,
at the published CS-3 points (wafer.calibration.MESHGEMV_WSE3, docs/calibration.md).

`python -m wafer.csl.cli calibrate WAFERLLM [--max-p 80]` copies `MeshGEMV/WSE-3` of a checkout of
github.com/MeshInfra/WaferLLM into a temporary folder, compiles it for each published point with the
parameters its `run_sim.sh` computes, runs its own `launch_sim.py` and reads the "Mean cycle count" it
prints (the mean over the PEs of each one's timestamp counter per iteration, as on the hardware), and
prints the table docs/csl-executor.md carries. Points above `--max-p` are left out: a P x P grid
costs the executor about P^2 events per cycle of fabric traffic (P = 80: about a minute).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from wafer.csl.cli import cs_python_main, cslc_main


@dataclass(frozen=True)
class Point:
    p: int
    m: int
    n: int
    groups: int
    hardware: float
    executor: float

    @property
    def ratio(self) -> float:
        return self.executor / self.hardware


def meshgemv_params(p: int, m: int, n: int, groups: int) -> str:
    """`--params` as WaferLLM's run_sim.sh computes them."""
    per_group = p // groups
    root1 = per_group // 2
    root2 = (groups // 2) * per_group + root1
    return f"P:{p},Mt:{m // p},Nt:{n // p},pe_num_group:{per_group},root_1st_phase:{root1},root_2nd_phase:{root2}"


def run_meshgemv(source: Path, p: int, m: int, n: int, groups: int) -> float:
    """Mean cycles per iteration of WaferLLM's MeshGEMV (its WSE-3 folder `source`) on the executor."""
    with tempfile.TemporaryDirectory(prefix="meshgemv-") as tmp:
        work = Path(tmp) / "MeshGEMV"
        shutil.copytree(source, work, ignore=shutil.ignore_patterns("out", "compile_out"))
        cwd = Path.cwd()
        os.chdir(work)
        try:
            err = io.StringIO()
            with contextlib.redirect_stderr(err):
                code = cslc_main(
                    ["--arch=wse3", "./src/layout.csl", f"--fabric-dims={p + 7},{p + 2}", "--fabric-offsets=4,1",
                     f"--params={meshgemv_params(p, m, n, groups)}", "-o", "out", "--memcpy", "--channels", "1"]
                )  # fmt: skip
            if code != 0:
                raise RuntimeError(f"cslc failed on MeshGEMV P={p}: {err.getvalue().strip()}")
            out = io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                code = cs_python_main(["launch_sim.py", "--P", str(p), "--M", str(m), "--N", str(n)])
            found = re.search(r"Mean cycle count: ([\d.]+)", out.getvalue())
            if code != 0 or found is None:
                raise RuntimeError(f"MeshGEMV P={p} did not run: {err.getvalue().strip()[-2000:]}")
            return float(found.group(1))
        finally:
            os.chdir(cwd)


def calibrate(checkout: Path, max_p: int = 80) -> list[Point]:
    from wafer.calibration import MESHGEMV_WSE3

    source = checkout / "MeshGEMV" / "WSE-3"
    if not (source / "src" / "layout.csl").is_file():
        raise FileNotFoundError(f"{checkout}: not a checkout of MeshInfra/WaferLLM (no MeshGEMV/WSE-3/src)")
    points = []
    for run in MESHGEMV_WSE3:
        if run.p <= max_p:
            cycles = run_meshgemv(source, run.p, run.m, run.n, run.groups)
            points.append(Point(run.p, run.m, run.n, run.groups, run.cycles, cycles))
    return points


def table(points: list[Point]) -> str:
    lines = [
        "| program | config | hardware cycles | executor cycles | executor / hardware |",
        "|---|---|---|---|---|",
    ]
    for pt in points:
        config = f"P={pt.p}, {pt.m} x {pt.n}, {pt.groups} groups"
        lines.append(
            f"| WaferLLM MeshGEMV (WSE-3) | {config} | {pt.hardware:,.1f} | {pt.executor:,.1f} | {pt.ratio:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m wafer.csl.cli calibrate",
        description="Run WaferLLM's MeshGEMV at the published CS-3 points and compare cycles.",
    )
    parser.add_argument("checkout", type=Path, help="a checkout of github.com/MeshInfra/WaferLLM")
    parser.add_argument(
        "--max-p", type=int, default=80, help="leave out grids larger than P x P (default 80)"
    )
    args = parser.parse_args(argv)
    points = calibrate(args.checkout, args.max_p)
    print(table(points))
    worst = [pt for pt in points if not 0.8 <= pt.ratio <= 1.25]
    return 1 if worst else 0
