"""`python -m tools.report`, fast path: the files, the labels, and numbers that agree with `build_plan`."""

from __future__ import annotations

import re
import time

import pytest

from tools.report import generate_report
from tools.report.command import main
from tools.report.data import ReportSettings
from wafer_gpt2.model.config import PRESETS
from wafer_gpt2.plan import build_plan

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    # Two sizes and two replica counts keep the test short; the full report plans four of each.
    settings = ReportSettings(sizes=("gpt2", "gpt2-medium"), replica_counts=(1, 2))
    # this process's CPU time: the report's own work, which other processes on the machine do not slow
    start = time.process_time()
    result = generate_report(out, settings, command="python -m tools.report --out test")
    return result, result.markdown_path.read_text(), time.process_time() - start


def table_row(markdown: str, first_cell: str) -> list[str]:
    for line in markdown.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0] == first_cell:
            return cells
    raise AssertionError(f"no table row starting with {first_cell!r}")


def number(text: str) -> float:
    return float(re.search(r"-?[\d,]+(\.\d+)?", text).group(0).replace(",", ""))


def test_files_exist_and_every_image_is_a_png(report):
    result, markdown, _ = report
    links = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", markdown)
    assert len(links) == len(result.figures) >= 8
    for link in links:
        path = result.markdown_path.parent / link
        assert path.is_file(), link
        assert path.read_bytes()[:8] == PNG_MAGIC
        assert path.stat().st_size > 10_000  # a drawn figure, not an empty canvas


def test_every_figure_says_modeled_or_measured_and_how_to_reproduce(report):
    _, markdown, _ = report
    captions = [line for line in markdown.splitlines() if line.startswith("*Figure ")]
    assert len(captions) == markdown.count("![")
    for caption in captions:
        assert "modeled" in caption or "measured" in caption, caption
        assert "Reproduce: `python -m tools.report --out test`" in caption
    # Nothing measured or kept in this directory, and the report says so; no GPU was used, and that is said too.
    assert "(measured on" not in markdown
    assert "Nothing measured yet" in markdown
    assert "Nothing was measured on a GPU" in markdown


def test_numbers_agree_with_build_plan(report):
    _, markdown, _ = report
    for name in ("gpt2", "gpt2-medium"):
        plan = build_plan(PRESETS[name])
        m = plan.modeled()
        row = table_row(markdown, name)
        assert number(row[2]) == plan.pes_used
        assert number(row[5]) == pytest.approx(m["decode_latency_us"], abs=0.006)
        assert number(row[7]) == pytest.approx(m["tokens_per_s_single_stream"], abs=0.51)
        assert number(row[8]) == pytest.approx(m["tokens_per_s_total"], abs=0.51)
    plan = build_plan(PRESETS["gpt2"])
    assert number(table_row(markdown, "PEs used")[1]) == plan.pes_used
    latency = table_row(markdown, "decode latency per token, 1.1 GHz")[1]
    assert number(latency) == pytest.approx(plan.modeled()["decode_latency_us"], abs=0.006)
    assert number(table_row(markdown, "total")[1]) == plan.decode_cycles


def test_measured_rows_are_kept_for_the_runs_without_measure(tmp_path):
    """`--measure` keeps its rows in performance/measured.json; a later run without it reads them back
    and says the day they were measured."""
    from tools.report.markdown import FIGURE_DIR, MEASURED_FILE
    from tools.report.measured import Measured, MeasuredRow

    measured = Measured("a machine", "python -m tools.bench sim", [MeasuredRow("sim", 3.0, "hf", 2.0, "n")])
    measured.date = "2026-01-02"
    path = tmp_path / FIGURE_DIR / MEASURED_FILE
    measured.save(path)
    assert Measured.load(path) == measured
    assert Measured.load(tmp_path / "none.json") is None


def test_the_committed_report_states_the_present():
    """docs/performance.md: the figures of today, within 500 lines (the history is in docs/history.md)."""
    from pathlib import Path

    text = (Path(__file__).parents[1] / "docs" / "performance.md").read_text()
    assert len(text.splitlines()) <= 500
    assert "pass (" not in text and "issue " not in text.lower()


def test_fast_path_is_quick(report):
    *_, seconds = report
    assert seconds < 60


def test_bad_arguments_get_one_line(tmp_path, capsys):
    assert main(["--out", str(tmp_path), "--slots", "0"]) == 2
    assert "--slots must be at least 1" in capsys.readouterr().err
    assert main(["--out", str(tmp_path), "--model", "gpt5"]) == 2
    assert "unknown model 'gpt5'" in capsys.readouterr().err
    assert not (tmp_path / "performance.md").exists()
