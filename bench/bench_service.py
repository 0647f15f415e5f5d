"""The service benchmark as a script: `python bench/bench_service.py [--streams 16] [--new-tokens N]`.

The same as `wafer-gpt2 bench service ...` (service/commands/bench_service.py holds the code).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from service.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["bench", "service", *sys.argv[1:]]))
