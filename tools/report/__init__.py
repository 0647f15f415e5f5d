"""The performance report: `generate_report(out_dir)` writes `performance.md` and its PNGs.

data.py gathers the modeled figures from the planner, peers.py holds the published and computed
comparisons, measured.py holds the benchmarks' rows (measured by the command line and passed in as
`measured`), plots.py draws, markdown.py writes. `python -m tools.report --out DIR` is the command line for it.

What the report writes and what it keeps: every modeled figure is written anew; the measured rows are
kept in `<out>/performance/measured.json` by a `--measure` run and read back by the runs without it;
the sections written by hand (between KEPT_BEGIN and KEPT_END: the host's figures) are carried over
from the file being replaced.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tools.report.data import ReportSettings, collect
from tools.report.markdown import FIGURE_DIR, MEASURED_FILE, render
from tools.report.measured import Measured
from tools.report.plots import Figure, draw_all


@dataclass(frozen=True)
class Report:
    markdown_path: Path
    figures: list[Figure]


def generate_report(
    out_dir: str | Path,
    settings: ReportSettings | None = None,
    measured: Measured | None = None,
    command: str | None = None,
    progress=None,
) -> Report:
    """Write <out_dir>/performance.md and <out_dir>/performance/*.png; return where they went.

    `measured`: benchmark rows measured on this machine (`python -m tools.report --measure` runs them),
    kept in <out_dir>/performance/measured.json; without them, the rows kept there by the last run that
    measured, if any."""
    out_dir = Path(out_dir)
    settings = settings or ReportSettings()
    command = command or default_command(out_dir, settings)
    data = collect(settings, progress)
    kept = out_dir / FIGURE_DIR / MEASURED_FILE
    if measured is not None:
        measured.save(kept)
    data.measured = measured or Measured.load(kept)
    figures = draw_all(data, out_dir / FIGURE_DIR, command)
    markdown_path = out_dir / "performance.md"
    text = render(data, figures, command)
    if markdown_path.exists():
        text = keep_sections(markdown_path.read_text(), text)
    markdown_path.write_text(text)
    return Report(markdown_path, figures)


KEPT_BEGIN, KEPT_END = "<!-- kept: begin -->", "<!-- kept: end -->"


def keep_sections(old: str, new: str) -> str:
    """Carry the sections written by hand (between KEPT_BEGIN and KEPT_END: the host stack's
    measurements of `wafer-gpt2 bench host`, which the report does not run) from the old report into the
    new one, before its Reproduce section."""
    kept = []
    rest = old
    while KEPT_BEGIN in rest and KEPT_END in rest.split(KEPT_BEGIN, 1)[1]:
        before, after = rest.split(KEPT_BEGIN, 1)
        block, rest = after.split(KEPT_END, 1)
        kept.append(KEPT_BEGIN + block + KEPT_END + "\n\n")
    if not kept:
        return new
    anchor = "## Reproduce"
    at = new.find(anchor)
    if at < 0:
        return new.rstrip("\n") + "\n\n" + "".join(kept).rstrip("\n") + "\n"
    return new[:at] + "".join(kept) + new[at:]


def default_command(out_dir: Path, settings: ReportSettings) -> str:
    """The command line that regenerates the report with these settings."""
    words = ["python", "-m", "tools.report", "--out", str(out_dir)]
    defaults = ReportSettings()
    for name in ("model", "arch", "dtype", "slots"):
        if getattr(settings, name) != getattr(defaults, name):
            words += [f"--{name}", str(getattr(settings, name))]
    return " ".join(words)
