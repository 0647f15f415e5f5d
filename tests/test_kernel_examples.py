"""Every kernel alone, laid out like a csl-examples folder (wafer_gpt2/kernels/examples/<kernel>/: layout.csl,
run.py, commands_wse2.sh, commands_wse3.sh), run by its own commands script with `cslc` and
`cs_python` resolving to the project's CSL executor. Each run.py checks its kernel's numbers and
prints SUCCESS!, as Cerebras' examples do; with the real SDK on PATH the same scripts would run
unchanged (no real cslc has compiled them yet)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from csl_executor.cli import write_wrappers

KERNELS = Path(__file__).resolve().parent.parent / "wafer_gpt2" / "kernels"
EXAMPLES = KERNELS / "examples"
FOLDERS = sorted(p.parent.name for p in EXAMPLES.glob("*/commands_wse2.sh"))


def test_every_kernel_has_an_example():
    assert set(FOLDERS) >= {"gemv", "layernorm", "attention", "head", "io"}


@pytest.mark.parametrize("arch", ["wse2", "wse3"])
@pytest.mark.parametrize("name", FOLDERS)
def test_example_runs_on_the_executor(name, arch, tmp_path):
    wrappers = write_wrappers(tmp_path / "bin")
    env = {**os.environ, "PATH": f"{wrappers}{os.pathsep}{os.environ.get('PATH', '')}"}
    # a copy of kernels/ (the examples use ../../pe etc.), so the out/ folders stay out of the checkout
    subprocess.run(["cp", "-r", str(KERNELS), str(tmp_path / "kernels")], check=True)
    work = tmp_path / "kernels" / "examples" / name
    result = subprocess.run(
        ["bash", f"commands_{arch}.sh"], cwd=work, env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    assert "SUCCESS!" in result.stdout
