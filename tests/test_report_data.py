"""The report's numbers: regrouped from the plan without losing or inventing cycles or bytes."""

from __future__ import annotations

import re

import pytest

from tools.report.data import (
    PHASE_CLASSES,
    OperatingPoint,
    ReportSettings,
    cached_plan,
    explore_candidates,
    layer_phases,
    pareto_front,
    path_by_class,
    pes_per_layer,
    phase_class,
    replica_curves,
    sram_by_part,
    sram_per_pe,
    time_by_layer,
    time_by_part,
)
from tools.report.peers import GPUS, PUBLISHED, bandwidth_floor, decode_bytes_per_token
from wafer_gpt2.core.cost import CLOCK_HZ
from wafer_gpt2.model.config import PRESETS


@pytest.fixture(scope="module")
def plan():
    return cached_plan(PRESETS["gpt2"], "wse2", "fp16", 16)


def test_time_groupings_add_up_to_the_critical_path(plan):
    assert sum(time_by_part(plan).values()) == plan.decode_cycles
    rows = time_by_layer(plan)
    assert sum(sum(parts.values()) for _, parts in rows) == plan.decode_cycles
    labels = [label for label, _ in rows]
    assert labels[0] == "in + embed" and labels[-1] == "head + out"
    assert labels[1:-1] == [f"L{i}" for i in range(plan.config.n_layer)]
    # Every layer holds its nine operations.
    assert all({"ln_1", "qkv", "attn", "fc", "proj", "res_2"} <= set(parts) for _, parts in rows[1:-1])


def test_layer_phases_keep_every_cycle(plan):
    phases = layer_phases(plan)
    for stage in plan.layer_stage_costs:
        op = stage.name.split(".", 1)[1]
        assert sum(phases[op].values()) == stage.cycles
        assert set(phases[op]) == set(PHASE_CLASSES)


def test_path_by_class_keeps_every_cycle_of_the_path(plan):
    path = path_by_class(plan)
    assert set(path) == set(PHASE_CLASSES)
    assert sum(path.values()) == plan.decode_cycles
    # The head's top-k merge and the embedding's chain of adds are reductions, the multicasts move data.
    head = next(stage for stage in plan.stage_costs if stage.name == "head")
    merges = sum(c for phase, c in head.phases.items() if phase_class(phase) == "reduction / merge")
    assert merges >= max(head.phases.values()) > 0
    embed = next(stage for stage in plan.stage_costs if stage.name == "embed")
    assert any(phase_class(phase) == "reduction / merge" for phase in embed.phases)
    assert 0 < path["compute"] < plan.decode_cycles
    assert path["data movement"] >= sum(
        c for stage in plan.stage_costs for phase, c in stage.phases.items() if "multicast" in phase
    )


def test_phase_classes():
    assert phase_class("two_level reduction (runs of 16)") == "reduction / merge"
    assert phase_class("sum merge round (two_level)") == "reduction / merge"
    assert phase_class("mean: two_level all-reduce") == "reduction / merge"
    assert phase_class("input multicast") == "data movement"
    assert phase_class("hand-off") == "data movement"
    assert phase_class("tile FMAC") == "compute"
    assert phase_class("exp") == "compute"


def test_sram_groupings_add_up_to_the_plan(plan):
    for name, classes in sram_per_pe(plan):
        assert sum(classes.values()) == plan.region(name).max_pe_bytes
    parts = sram_by_part(plan)
    assert sum(sum(c.values()) for c in parts.values()) == plan.sram_bytes_used
    assert max(parts, key=lambda p: parts[p]["KV cache"]) == "attn"  # the KV cache lives in attention
    assert parts["head"]["weights"] > 0


def test_operating_point_is_the_plans_own_formula(plan):
    assert OperatingPoint.of(plan, plan.slots).modeled() == plan.modeled()
    one = OperatingPoint.of(plan, 1).modeled()
    assert one["tokens_per_s_total"] == plan.modeled()["tokens_per_s_single_stream"]


def test_candidates_include_the_plan_build_plan_returns(plan):
    """The report's sweep prices candidates the way the planner does: the chosen one matches exactly."""
    cands = explore_candidates(plan.config, "wse2", "fp16", plan.slots, plan.top_k)
    assert len(cands) > 100
    chosen = [c for c in cands if c.knobs == plan.knobs]
    assert chosen, "the plan's knobs are not among the priced candidates"
    assert chosen[0].point.decode_cycles == plan.decode_cycles
    assert chosen[0].point.bottleneck_cycles == plan.bottleneck_cycles
    assert chosen[0].pes_per_layer == pes_per_layer(plan)
    assert chosen[0].latency_us == plan.modeled()["decode_latency_us"]


def test_pareto_front():
    points = [(1, 10), (2, 8), (2, 9), (3, 9), (4, 5), (5, 6)]
    assert pareto_front(points) == [(1, 10), (2, 8), (4, 5)]


def test_replica_curves_rise_then_saturate():
    notes: list[str] = []
    curves = replica_curves(PRESETS["gpt2"], ReportSettings(replica_counts=(1, 2)), notes)
    assert [c.plan.replicas for c in curves] == [1, 2] and not notes
    for curve in curves:
        assert curve.streams == list(range(1, curve.plan.slots + 1))
        assert curve.tokens_per_s == sorted(curve.tokens_per_s)
        ceiling = curve.plan.replicas * CLOCK_HZ / curve.plan.bottleneck_cycles
        assert curve.tokens_per_s[-1] <= ceiling * 1.001


def test_bandwidth_floor_of_gpt2_on_an_a100():
    config = PRESETS["gpt2"]
    nbytes = decode_bytes_per_token(config)
    # fp16 weights of GPT-2 124M with one row of the position table read per token.
    assert nbytes == 2 * (124_439_808 - 1023 * 768)
    a100 = next(g for g in GPUS if g.name == "NVIDIA A100 40GB SXM")
    floor = bandwidth_floor(config, a100)
    assert floor.seconds_per_token == pytest.approx(nbytes / 1.555e12)
    assert 150e-6 < floor.seconds_per_token < 170e-6
    assert decode_bytes_per_token(config, context=1024) - nbytes == 2 * 2 * 12 * 768 * 1024  # K and V


def test_published_figures_name_their_source_and_follow_from_it():
    derived = 0
    for figure in PUBLISHED:
        assert figure.source and ("http" in figure.source or "as above" in figure.source)
        assert figure.tokens_per_s > 0
        if figure.derivation:  # "6,400 tokens in 78.04 s": the figure is that quotient
            match = re.fullmatch(r"([\d,]+) tokens in ([\d.]+) s", figure.derivation)
            assert match, figure.derivation
            tokens, seconds = int(match[1].replace(",", "")), float(match[2])
            assert figure.tokens_per_s == pytest.approx(tokens / seconds), figure
            derived += 1
    assert derived >= 2


def test_sim_bench_returns_data_its_summary_line_is_printed_from():
    from tools.bench.bench_sim import SimBatchRate, SimBenchResult

    result = SimBenchResult(
        "simulator", "fp16", 1.4, 1.0, (SimBatchRate(1, 2.38, 2.0), SimBatchRate(16, 7.5, 6.0)), True
    )
    assert result.summary_line() == (
        "bench sim summary: transformers batch 1 1.4 tok/s; simulator batch 1 2.4 tok/s = 1.70x (goal >= 0.7x: "
        "met; 2.00x per CPU-second); batch 16 7.5 tok/s = 5.36x (goal >= 5.0x: met; 6.00x per CPU-second)"
    )


def test_report_rows_come_from_the_benchmarks_data(monkeypatch):
    from tools.bench import bench_sim
    from tools.bench.bench_sim import SimBatchRate, SimBenchResult
    from tools.report import command as report

    result = SimBenchResult("simulator", "fp16", 2.0, 1.0, (SimBatchRate(1, 3.0, 2.0),), True)
    monkeypatch.setattr(bench_sim, "measure_sim", lambda *args, **kwargs: result)
    rows, text = report.measure_sim_rows(lambda message: None)
    assert [(r.label, r.tokens_per_s, r.peer_tokens_per_s, r.ratio) for r in rows] == [
        ("simulator, batch 1", 3.0, 2.0, 1.5)
    ]
    assert text.splitlines()[-1] == result.summary_line()


def test_machine_description_names_what_timings_depend_on():
    from tools.report.measured import describe_machine

    text = describe_machine()
    assert "logical CPUs" in text and "NumPy" in text and "no GPU" in text
