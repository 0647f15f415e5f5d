"""`wafer-gpt2 bench host` through the CLI's own entry: a tiny real run ends with its summary line, and a
bad option is one line and exit 2 (tests/test_host_stack.py measures the benchmark's cells themselves)."""

from __future__ import annotations

import re

import pytest

from wafer_gpt2.cli.main import main


@pytest.mark.slow
def test_bench_host_prints_its_table_and_summary_line(capsys):
    """The goal cell of the modeled wafer (16 streams), one route, a short window: the engine on a thread
    of the HTTP process, which spares the engine process's start (the host stack's tests run it)."""
    code = main(
        [
            "bench",
            "host",
            "--stand-in",
            "modeled",
            "--host-streams",
            "16",
            "--routes",
            "generate",
            "--new-tokens",
            "4",
            "--reps",
            "1",
            "--seconds",
            "0.4",
            "--warmup",
            "0.1",
            "--no-engine-process",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["backend", "streams", "route"]
    assert lines[1].split()[:3] == ["modeled", "16", "generate"]
    assert re.fullmatch(
        r"bench host summary: modeled 16 generate wafer \d+% busy \(modeled; goal 80%: (met|missed)\)",
        lines[-1],
    ), lines[-1]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--host-streams", "0"], "--host-streams must be positive integers, got '0'"),
        (["--stand-in", "gpu"], "--stand-in: expected some of null, modeled, got 'gpu'"),
        (["--seconds", "0"], "--seconds must be in (0, 600] and --warmup in [0, 60]"),
    ],
)
def test_a_bad_bench_host_option_is_one_line_and_exit_2(capsys, argv, message):
    assert main(["bench", "host", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.err == f"wafer-gpt2 bench: error: {message}\n" and captured.out == ""
