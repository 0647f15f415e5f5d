"""`python -m tools.bench service`: a real server on 127.0.0.1, streaming clients, the same requests run
directly, and one summary line (a tiny random GPT-2 keeps it to seconds)."""

from __future__ import annotations

import math

import pytest

from tools.bench.bench_service import MODES, measure, print_result
from tools.bench.bench_sim import main
from wafer_gpt2.model.config import GPT2Config
from wafer_gpt2.model.params import GPT2Params

STREAMS, NEW_TOKENS = 4, 5


@pytest.fixture(scope="module")
def result():
    config = GPT2Config(n_layer=2, n_head=2, n_embd=64, n_positions=64, name="tiny")
    return measure(
        GPT2Params.random(config, seed=1),
        "tiny",
        streams=STREAMS,
        prompt_tokens=4,
        new_tokens=NEW_TOKENS,
        reps=2,
        log=lambda message: None,
    )


def test_every_mode_generates_every_token(result):
    for mode in MODES:
        runs = result.runs[mode]
        assert len(runs) == 2
        for run in runs:
            assert run.tokens == STREAMS * NEW_TOKENS  # EOS ignored: every stream runs to the end
            # A prefill step, then one step per token after the first (HTTP requests may straggle in).
            assert len(run.steps) >= NEW_TOKENS
            assert all(end > start for start, end, _ in run.steps)
            assert run.wall_s >= sum(run.step_times)
    assert result.same_tokens is True  # greedy: the engine picks what the direct loop picks


def test_figures_and_summary_line(result, capsys):
    for mode in MODES:
        assert result.tokens_per_s(mode) > 0 and result.period_ms(mode) > 0
    assert result.overhead_pct("direct") == 0.0
    assert math.isfinite(result.overhead_pct("http"))
    print_result(result)
    lines = capsys.readouterr().out.strip().splitlines()
    assert sum("(measured)" in line for line in lines) == len(MODES)
    summary = lines[-1]
    assert summary.startswith("bench service summary: tiny, 4 streams x 5 tokens: decode step ")
    assert "service overhead" in summary and "% of step time (goal < 10% at 16 streams: " in summary


def test_bad_arguments_get_one_line(capsys, tmp_path):
    assert main(["service", "--new-tokens", "2"]) == 2
    assert "--new-tokens must be at least 3" in capsys.readouterr().err
    assert main(["service", "--streams", "0"]) == 2
    assert "--streams must be at least 1" in capsys.readouterr().err
    assert main(["service", "--weights", str(tmp_path / "missing")]) == 2
    assert "no such file or directory" in capsys.readouterr().err
