"""The measured part of the report (`python -m tools.report --measure`): the rows the two benchmarks give,
each against its peer in the same run, a description of the machine they ran on, and the day.

- `python -m tools.bench sim`: the simulator against Hugging Face `transformers` (CPU), batch 1 and 16;
- `python -m tools.bench service`: the HTTP service against direct backend steps, 16 streams.

The benchmarks (`tools/bench/bench_*.py`) return dataclasses; the report command
(`tools/report/command.py`) runs them with the settings below and hands the rows in as a `Measured`,
so the report itself never imports the service. `--measure` keeps them in
`<out>/performance/measured.json`; a run without it reads them back, so regenerating the modeled parts
keeps the last measured figures, with the day they were measured.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path

NEW_TOKENS = 16  # per stream, in the service benchmark
SIM_NEW_TOKENS = 32  # per sequence, in the simulator benchmark: its default, the length its goal is set at
REPS = 3
STREAMS = 16
SIM_COMMAND = f"python -m tools.bench sim --batch 1,16 --new-tokens {SIM_NEW_TOKENS} --reps {REPS}"
SERVICE_COMMAND = f"python -m tools.bench service --streams {STREAMS} --new-tokens {NEW_TOKENS} --reps {REPS}"


@dataclass(frozen=True)
class MeasuredRow:
    label: str
    tokens_per_s: float
    peer: str
    peer_tokens_per_s: float
    note: str = ""

    @property
    def ratio(self) -> float:
        return self.tokens_per_s / self.peer_tokens_per_s


@dataclass
class Measured:
    machine: str
    command: str
    rows: list[MeasuredRow] = field(default_factory=list)
    text: str = ""  # the benchmarks' own output, quoted in the report
    date: str = ""  # the day they were measured, ISO 8601

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(self), indent=1) + "\n")

    @classmethod
    def load(cls, path: Path) -> Measured | None:
        """The figures a `--measure` run kept at `path`, or None where there are none."""
        if not path.is_file():
            return None
        data = json.loads(path.read_text())
        rows = [MeasuredRow(**row) for row in data.pop("rows")]
        return cls(rows=rows, **data)


def describe_machine() -> str:
    """CPU model, cores, load, Python and library versions: what the measured figures depend on."""
    import numpy

    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        if names:
            cpu = names[0]
    parts = [
        f"{cpu}, {os.cpu_count()} logical CPUs",
        f"Python {platform.python_version()}",
        f"NumPy {numpy.__version__}",
    ]
    with contextlib.suppress(ImportError):
        import torch

        parts.append(f"torch {torch.__version__} (CPU, {torch.get_num_threads()} threads)")
    with contextlib.suppress(OSError):
        parts.append(f"load average {os.getloadavg()[0]:.1f} at the start")
    return "; ".join(parts) + "; no GPU, no Cerebras system"
