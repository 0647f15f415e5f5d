"""The executor's cycles against Cerebras hardware: WaferLLM's MeshGEMV for WSE-3, run unmodified,
at the published CS-3 points (`HARDWARE`).

`csl-executor calibrate WAFERLLM [--max-p 80]` copies `MeshGEMV/WSE-3` of a checkout of
github.com/MeshInfra/WaferLLM into a temporary folder, compiles it for each published point with the
parameters its `run_sim.sh` computes, runs its own `launch_sim.py` and reads the "Mean cycle count" it
prints (the mean over the PEs of each one's timestamp counter per iteration, as on the hardware), and
prints the table csl_executor/README.md carries. Points above `--max-p` are left out: a P x P grid
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

from csl_executor.commands import cs_python_main, cslc_main

# The published CS-3 runs of WaferLLM's MeshGEMV for WSE-3 (He et al., "WaferLLM: Large Language Model
# Inference at Wafer Scale", OSDI 2025), as one of its authors logged them in the fork
# github.com/FxPiGaAo/WaferLLM (MeshGEMV/WSE-3/wse_result.json at commit 5c67053; every log says
# "Running on simulator: False"): (P, M, N, groups, mean cycles per iteration over the PEs, after 10
# warm-up iterations of a loop of 100). The product's cost model fits its constants on the same runs
# (wafer_gpt2.core.calibration, which the executor may not import); tests/test_cost_model.py holds the
# two copies equal.
HARDWARE: tuple[tuple[int, int, int, int, float], ...] = (
    (16, 16, 16, 2, 246.95),
    (16, 16, 16, 4, 237.96),
    (16, 16, 16, 8, 240.96),
    (16, 128, 128, 2, 274.96),
    (16, 128, 128, 4, 267.95),
    (16, 128, 128, 8, 268.95),
    (80, 80, 80, 2, 596.96),
    (80, 80, 80, 4, 468.95),
    (80, 80, 80, 8, 416.96),
    (80, 640, 640, 8, 447.95),
    (144, 144, 144, 8, 601.95),
    (144, 1152, 1152, 8, 631.95),
    (208, 208, 208, 8, 784.96),
    (208, 1664, 1664, 8, 815.95),
    (272, 272, 272, 8, 970.95),
    (272, 2176, 2176, 8, 998.96),
    (336, 336, 336, 8, 1188.10),
    (336, 2688, 2688, 8, 1219.09),
    (400, 400, 400, 8, 1372.08),
    (400, 3200, 3200, 8, 1403.07),
    (464, 464, 464, 8, 1556.07),
    (464, 3712, 3712, 8, 1587.10),
    (528, 528, 528, 8, 1742.05),
    (528, 4224, 4224, 8, 1770.11),
    (592, 592, 592, 8, 1924.07),
    (592, 4736, 4736, 8, 1955.04),
    (656, 656, 656, 8, 2143.22),
    (656, 5248, 5248, 8, 2174.21),
    (720, 720, 720, 8, 2327.22),
    (720, 5760, 5760, 8, 2358.03),
    (720, 5760, 720, 8, 2350.22),
    (720, 720, 5760, 8, 2339.21),
)


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
    source = checkout / "MeshGEMV" / "WSE-3"
    if not (source / "src" / "layout.csl").is_file():
        raise FileNotFoundError(f"{checkout}: not a checkout of MeshInfra/WaferLLM (no MeshGEMV/WSE-3/src)")
    points = []
    for p, m, n, groups, hardware in HARDWARE:
        if p <= max_p:
            points.append(Point(p, m, n, groups, hardware, run_meshgemv(source, p, m, n, groups)))
    return points


def table(points: list[Point]) -> str:
    lines = [
        "| program | config | CS-3 cycles (measured, published) | executor cycles (modeled) | executor / CS-3 |",
        "|---|---|---|---|---|",
    ]
    for pt in points:
        config = f"P={pt.p}, {pt.m} x {pt.n}, {pt.groups} groups"
        lines.append(
            f"| WaferLLM MeshGEMV (WSE-3) | {config} | {pt.hardware:,.2f} | {pt.executor:,.1f} | {pt.ratio:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="csl-executor calibrate",
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
