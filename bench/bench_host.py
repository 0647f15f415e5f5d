"""The host-stack benchmark as a script: `python bench/bench_host.py [--executor null,modeled] ...`.

The same as `wafer-gpt2 bench host ...` (service/commands/bench_host.py holds the code).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from service.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["bench", "host", *sys.argv[1:]]))
