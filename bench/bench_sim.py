"""The simulator benchmark as a script: `python bench/bench_sim.py [--batch 1,16] [--new-tokens N] [--threads T]`.

The same as `wafer-gpt2 bench sim ...` (service/commands/bench.py holds the code).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# --threads N must reach OpenBLAS and OpenMP before NumPy or torch start their thread pools.
if "--threads" in sys.argv[1:-1]:
    count = sys.argv[sys.argv.index("--threads") + 1]
    for variable in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[variable] = count

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from service.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["bench", "sim", *sys.argv[1:]]))
