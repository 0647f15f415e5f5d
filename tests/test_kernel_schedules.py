"""The kernels under other legal schedules than the CSL executor's default (csl_executor/schedule.py).

A schedule `seed:N` picks among runnable tasks at random and adds a few cycles of jitter to task
starts, operation starts and wavelet deliveries, always in an order the hardware could follow. A
kernel that is right under the default and wrong under a seed depends on an order the SDK does not
promise. Each kernel example runs its own commands script (as tests/test_kernel_examples.py does),
here three of them under one seed and architecture each, to keep CI short; csl_executor/README.md
("Schedules") lists the wider runs.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from csl_executor.cli import write_wrappers

KERNELS = Path(__file__).resolve().parent.parent / "wafer_gpt2" / "kernels"


@pytest.mark.parametrize(
    ("name", "arch", "seed"),
    [("head", "wse2", 1), ("layernorm", "wse3", 2), ("io", "wse3", 3)],
)
def test_kernel_example_under_a_seeded_schedule(name, arch, seed, tmp_path):
    wrappers = write_wrappers(tmp_path / "bin")
    env = {
        **os.environ,
        "PATH": f"{wrappers}{os.pathsep}{os.environ.get('PATH', '')}",
        "WAFER_CSL_SCHEDULE": f"seed:{seed}",
    }
    subprocess.run(["cp", "-r", str(KERNELS), str(tmp_path / "kernels")], check=True)
    work = tmp_path / "kernels" / "examples" / name
    result = subprocess.run(
        ["bash", f"commands_{arch}.sh"], cwd=work, env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    assert "SUCCESS!" in result.stdout
