"""The executor's cycles against Cerebras hardware: WaferLLM's MeshGEMV and MeshGEMM for WSE-3, run
unmodified, at the published CS-3 points (`HARDWARE`, `MESHGEMM_HARDWARE`).

`csl-executor calibrate WAFERLLM [--max-p 80] [--program meshgemv|meshgemm|all]` copies the program's
`WSE-3` folder of a checkout of github.com/MeshInfra/WaferLLM into a temporary folder, compiles it for
each published point with the parameters its `run_sim.sh` computes, runs its own `launch_sim.py` and
reads the "Mean cycle count" it prints (the mean over the PEs of each one's timestamp counter per
iteration, as on the hardware), and prints the table csl_executor/README.md carries. Points above
`--max-p` are left out: a P x P grid costs the executor about P^2 events per cycle of fabric traffic
(MeshGEMV at P = 80: minutes a point; MeshGEMM at P = 16: from 15 seconds at 1 x 1 x 1 tiles to 4
minutes at 8 x 8 x 8, and P = 80 costs about 25 times as much). The exit status is 1 when a point
falls outside 0.8-1.25x of the hardware.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import shutil
import tempfile
from collections.abc import Callable
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

# The published CS-3 runs of WaferLLM's MeshGEMM for WSE-3 ([M, N] = [M, K] @ [K, N] on P x P PEs, fp16),
# logged in the same fork (MeshGEMM/WSE-3/wse_result.json at commit f27d41f, 769 runs; the per-run logs
# under wse_in_out/outputs say "Running on simulator: False"): (P, M, K, N, mean cycles per iteration over
# the PEs over 50 timed iterations after 5 warm-up ones). Each step of the program shifts whole X and W
# tiles (Mt x Kt and Kt x Nt values) between PEs, so the larger tiles time long PE-to-PE streams. Here:
# every run at P = 16 (tiles 1, 2, 3 and 8 on each side); at P = 80 the square ones.
MESHGEMM_HARDWARE: tuple[tuple[int, int, int, int, float], ...] = (
    (16, 16, 16, 16, 2637.40),
    (16, 16, 16, 32, 2716.90),
    (16, 16, 16, 48, 2780.27),
    (16, 16, 16, 128, 2918.64),
    (16, 16, 32, 16, 3382.77),
    (16, 16, 32, 32, 3427.47),
    (16, 16, 32, 48, 3608.16),
    (16, 16, 32, 128, 3876.97),
    (16, 16, 48, 16, 4112.84),
    (16, 16, 48, 32, 4190.92),
    (16, 16, 48, 48, 4330.11),
    (16, 16, 48, 128, 4984.30),
    (16, 16, 128, 16, 7279.94),
    (16, 16, 128, 32, 7357.63),
    (16, 16, 128, 48, 8024.47),
    (16, 16, 128, 128, 9297.41),
    (16, 32, 16, 16, 2703.40),
    (16, 32, 16, 32, 2798.00),
    (16, 32, 16, 48, 2777.46),
    (16, 32, 16, 128, 3003.69),
    (16, 32, 32, 16, 3365.52),
    (16, 32, 32, 32, 3463.73),
    (16, 32, 32, 48, 3565.21),
    (16, 32, 32, 128, 3928.62),
    (16, 32, 48, 16, 4076.58),
    (16, 32, 48, 32, 4233.94),
    (16, 32, 48, 48, 4422.30),
    (16, 32, 48, 128, 4991.47),
    (16, 32, 128, 16, 7117.54),
    (16, 32, 128, 32, 7384.49),
    (16, 32, 128, 48, 7873.48),
    (16, 32, 128, 128, 9408.46),
    (16, 48, 16, 16, 2721.76),
    (16, 48, 16, 32, 2753.29),
    (16, 48, 16, 48, 2776.59),
    (16, 48, 16, 128, 3035.67),
    (16, 48, 32, 16, 3450.56),
    (16, 48, 32, 32, 3496.95),
    (16, 48, 32, 48, 3578.64),
    (16, 48, 32, 128, 4034.69),
    (16, 48, 48, 16, 4150.43),
    (16, 48, 48, 32, 4320.00),
    (16, 48, 48, 48, 4389.49),
    (16, 48, 48, 128, 5098.96),
    (16, 48, 128, 16, 7460.00),
    (16, 48, 128, 32, 7613.56),
    (16, 48, 128, 48, 8099.96),
    (16, 48, 128, 128, 10153.88),
    (16, 128, 16, 16, 2740.06),
    (16, 128, 16, 32, 2820.79),
    (16, 128, 16, 48, 2852.33),
    (16, 128, 16, 128, 3100.59),
    (16, 128, 32, 16, 3479.18),
    (16, 128, 32, 32, 3595.44),
    (16, 128, 32, 48, 3678.16),
    (16, 128, 32, 128, 4156.50),
    (16, 128, 48, 16, 4315.35),
    (16, 128, 48, 32, 4540.92),
    (16, 128, 48, 48, 4583.02),
    (16, 128, 48, 128, 5455.67),
    (16, 128, 128, 16, 7568.32),
    (16, 128, 128, 32, 8101.14),
    (16, 128, 128, 48, 8629.28),
    (16, 128, 128, 128, 10818.46),
    (80, 80, 80, 80, 12828.40),
    (80, 160, 160, 160, 17051.01),
    (80, 240, 240, 240, 21818.08),
    (80, 640, 640, 640, 53526.35),
)


@dataclass(frozen=True)
class Point:
    program: str  # "MeshGEMV" or "MeshGEMM"
    config: str
    hardware: float
    executor: float

    @property
    def ratio(self) -> float:
        return self.executor / self.hardware


def meshgemv_params(p: int, m: int, n: int, groups: int) -> str:
    """`--params` as WaferLLM's MeshGEMV run_sim.sh computes them."""
    per_group = p // groups
    root1 = per_group // 2
    root2 = (groups // 2) * per_group + root1
    return f"P:{p},Mt:{m // p},Nt:{n // p},pe_num_group:{per_group},root_1st_phase:{root1},root_2nd_phase:{root2}"


def meshgemm_params(p: int, m: int, k: int, n: int) -> str:
    """`--params` as WaferLLM's MeshGEMM run_sim.sh computes them."""
    return f"P:{p},Mt:{m // p},Kt:{k // p},Nt:{n // p}"


def run_waferllm(source: Path, p: int, params: str, launch: list[str]) -> float:
    """Mean cycles per iteration of one of WaferLLM's programs (its WSE-3 folder `source`) on the
    executor: compiled on a (P + 7) x (P + 2) fabric as its run_sim.sh does, run by its launch_sim.py
    with the arguments `launch`."""
    name = source.parent.name
    with tempfile.TemporaryDirectory(prefix=f"{name.lower()}-") as tmp:
        work = Path(tmp) / name
        shutil.copytree(source, work, ignore=shutil.ignore_patterns("out", "compile_out"))
        cwd = Path.cwd()
        os.chdir(work)
        try:
            err = io.StringIO()
            with contextlib.redirect_stderr(err):
                code = cslc_main(
                    ["--arch=wse3", "./src/layout.csl", f"--fabric-dims={p + 7},{p + 2}", "--fabric-offsets=4,1",
                     f"--params={params}", "-o", "out", "--memcpy", "--channels", "1"]
                )  # fmt: skip
            if code != 0:
                raise RuntimeError(f"cslc failed on {name} P={p}: {err.getvalue().strip()}")
            out = io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                code = cs_python_main(["launch_sim.py", *launch])
            found = re.search(r"Mean cycle count: ([\d.]+)", out.getvalue())
            if code != 0 or found is None:
                raise RuntimeError(f"{name} {params} did not run: {err.getvalue().strip()[-2000:]}")
            return float(found.group(1))
        finally:
            os.chdir(cwd)


def run_meshgemv(source: Path, p: int, m: int, n: int, groups: int) -> float:
    """Mean cycles per iteration of WaferLLM's MeshGEMV (its WSE-3 folder `source`) on the executor."""
    launch = ["--P", str(p), "--M", str(m), "--N", str(n)]
    return run_waferllm(source, p, meshgemv_params(p, m, n, groups), launch)


def run_meshgemm(source: Path, p: int, m: int, k: int, n: int) -> float:
    """Mean cycles per iteration of WaferLLM's MeshGEMM (its WSE-3 folder `source`) on the executor."""
    launch = ["--P", str(p), "--M", str(m), "--K", str(k), "--N", str(n)]
    return run_waferllm(source, p, meshgemm_params(p, m, k, n), launch)


def _source(checkout: Path, program: str) -> Path:
    source = checkout / program / "WSE-3"
    if not (source / "src" / "layout.csl").is_file():
        raise FileNotFoundError(f"{checkout}: not a checkout of MeshInfra/WaferLLM (no {program}/WSE-3/src)")
    return source


def calibrate_meshgemv(checkout: Path, max_p: int = 80) -> list[Point]:
    source = _source(checkout, "MeshGEMV")
    return [
        Point(
            "MeshGEMV", f"P={p}, {m} x {n}, {groups} groups", hardware, run_meshgemv(source, p, m, n, groups)
        )
        for p, m, n, groups, hardware in HARDWARE
        if p <= max_p
    ]


def calibrate_meshgemm(checkout: Path, max_p: int = 16) -> list[Point]:
    source = _source(checkout, "MeshGEMM")
    return [
        Point(
            "MeshGEMM",
            f"P={p}, tiles {m // p} x {k // p} x {n // p} (M={m}, K={k}, N={n})",
            hardware,
            run_meshgemm(source, p, m, k, n),
        )
        for p, m, k, n, hardware in MESHGEMM_HARDWARE
        if p <= max_p
    ]


PROGRAMS: dict[str, Callable[[Path, int], list[Point]]] = {
    "meshgemv": calibrate_meshgemv,
    "meshgemm": calibrate_meshgemm,
}


def calibrate(checkout: Path, max_p: int = 80, programs: tuple[str, ...] = ("meshgemv",)) -> list[Point]:
    return [pt for name in programs for pt in PROGRAMS[name](checkout, max_p)]


def table(points: list[Point]) -> str:
    lines = [
        "| program | config | CS-3 cycles (measured, published) | executor cycles (modeled) | executor / CS-3 |",
        "|---|---|---|---|---|",
    ]
    for pt in points:
        lines.append(
            f"| WaferLLM {pt.program} (WSE-3) | {pt.config} | {pt.hardware:,.2f} | {pt.executor:,.1f} | {pt.ratio:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="csl-executor calibrate",
        description="Run WaferLLM's MeshGEMV and MeshGEMM at the published CS-3 points and compare cycles.",
    )
    parser.add_argument("checkout", type=Path, help="a checkout of github.com/MeshInfra/WaferLLM")
    parser.add_argument(
        "--max-p", type=int, default=80, help="leave out grids larger than P x P (default 80)"
    )
    parser.add_argument(
        "--program",
        choices=(*PROGRAMS, "all"),
        default="meshgemv",
        help="which program's published points to run (default meshgemv)",
    )
    args = parser.parse_args(argv)
    programs = tuple(PROGRAMS) if args.program == "all" else (args.program,)
    points = calibrate(args.checkout, args.max_p, programs)
    print(table(points))
    worst = [pt for pt in points if not 0.8 <= pt.ratio <= 1.25]
    return 1 if worst else 0
