"""The benchmarks' command line: `python -m tools.bench sim|service [options]`.

    python -m tools.bench sim [--batch 1,16] [--new-tokens N] [--threads T]   # simulator vs transformers
    python -m tools.bench service [--streams 16] [--new-tokens N]              # HTTP service vs the engine

tools/bench/bench_sim.py holds the parser (`--help` lists every option); bench_service.py the other.
The host stack's benchmark ships with the product: `wafer-gpt2 bench host` (wafer_gpt2/benchmarks/).
"""

from __future__ import annotations

import os
import sys

# --threads N must reach OpenBLAS and OpenMP before NumPy or torch start their thread pools.
if "--threads" in sys.argv[1:-1]:
    count = sys.argv[sys.argv.index("--threads") + 1]
    for variable in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[variable] = count

from tools.bench.bench_sim import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
