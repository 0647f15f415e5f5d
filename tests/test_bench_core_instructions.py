"""tools/bench/core_instructions.py: its workload and its reading of valgrind's output (valgrind itself is
too slow for the suite: it runs each counted process many times slower)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "tools" / "bench" / "core_instructions.py"


def load():
    spec = importlib.util.spec_from_file_location("core_instructions", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("pipe", [False, True])
@pytest.mark.parametrize("stream", [False, True])
def test_the_workload_generates_every_token_of_every_round(stream, pipe):
    """`--pipe`: the events go to the engine process's sink, encoded for its pipe."""
    bench = load()
    assert bench.workload(rounds=2, requests=4, new_tokens=8, stream=stream, pipe=pipe) == 2 * 4 * 8


def test_varied_lengths_keep_the_rounds_total_and_end_one_after_another():
    """`--varied`: requests of different lengths, so the ends spread over the round as under the server,
    every token still generated (the per-token figure divides by the same total)."""
    bench = load()
    lengths = bench.lengths(16, 32, varied=True)
    assert sum(lengths) == 16 * 32 and len(set(lengths)) > 8 and min(lengths) >= 16
    assert bench.lengths(5, 10, varied=False) == [10] * 5
    assert bench.workload(rounds=2, requests=5, new_tokens=8, stream=False, varied=True) == 2 * 5 * 8


@pytest.mark.parametrize("stream", [False, True])
def test_a_closed_loop_serves_n_of_a_round_at_a_time_and_generates_every_token(stream):
    """`--closed-loop N`: N of a round's requests at a time, the next joining as one ends (a group's run
    ends at each join), every token of every round still generated."""
    bench = load()
    assert bench.workload(2, 8, 8, stream, varied=True, pipe=True, closed_loop=3) == 2 * 8 * 8
    assert bench.workload(2, 5, 8, stream, closed_loop=2) == 2 * 5 * 8


def test_the_instruction_count_is_read_from_cachegrind_and_its_absence_is_an_error():
    bench = load()
    assert bench.parse_instructions("==12== \n==12== I   refs:      1,748,121,465\n") == 1_748_121_465
    with pytest.raises(RuntimeError, match="no instruction count"):
        bench.parse_instructions("valgrind: command not found")


def test_the_modeled_workload_runs_over_a_pickled_plan_without_waiting(small_config, tmp_path):
    """`--backend modeled`: the counted process steps the modeled stand-in of the plan the parent pickled,
    its waits cut to nothing; every token of every round comes back."""
    import pickle

    from wafer_gpt2.plan import build_plan

    plan_file = tmp_path / "plan.pickle"
    plan_file.write_bytes(pickle.dumps(build_plan(small_config, slots=4, context=32)))
    bench = load()
    assert bench.workload(rounds=2, requests=4, new_tokens=8, stream=False, plan_file=str(plan_file)) == 64
