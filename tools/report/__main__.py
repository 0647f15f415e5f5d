"""`python -m tools.report --out docs [--measure]`: the performance report (tools/report/command.py)."""

import sys

from tools.report.command import main

if __name__ == "__main__":
    sys.exit(main())
