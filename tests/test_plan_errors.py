"""Requests no plan can meet fail with a PlanError that names the limit and by how much."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from wafer_gpt2.core.arch import ARCHS
from wafer_gpt2.model.config import PRESETS, GPT2Config
from wafer_gpt2.plan import PlanError, build_plan, largest_slots

TINY = GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64, n_positions=16, name="tiny")


def test_too_many_slots_names_the_per_pe_limit_and_the_excess() -> None:
    with pytest.raises(PlanError) as err:
        build_plan(PRESETS["gpt2"], "wse2", slots=200)
    msg = str(err.value)
    assert "per-PE memory" in msg and "200 slots" in msg
    over = int(re.search(r"([\d,]+) B over", msg).group(1).replace(",", ""))
    assert over > 0
    most = int(re.search(r"at most (\d+) slots", msg).group(1))
    assert 100 < most < 200


def test_kv_capacity_beyond_the_wafer_says_by_how_much() -> None:
    with pytest.raises(PlanError, match=r"KV cache .* GiB .* over by [\d.]+ GiB"):
        build_plan(PRESETS["gpt2-xl"], "wse2", slots=150, context=1024)


def test_model_too_big() -> None:
    huge = GPT2Config(n_layer=96, n_head=64, n_embd=8192, name="huge")
    with pytest.raises(PlanError, match=r"huge .* weights [\d.]+ GiB .* over by [\d.]+ GiB"):
        build_plan(huge, "wse2", slots=1, context=128)


def test_layout_limit_names_the_kernel_area() -> None:
    # Fits the wafer's SRAM in total but not the layout: the nearest candidate's limit is reported. (Not
    # gpt2-large at 96 slots: there the nearest candidate misses a GEMV PE's memory by a few dozen
    # bytes, so which limit is nearest moves with the programs' code size.)
    with pytest.raises(PlanError, match=r"kernel area: .* over the kernel (width|height)"):
        build_plan(PRESETS["gpt2-xl"], "wse2", slots=48, context=1024)


def test_too_many_replicas() -> None:
    with pytest.raises(
        PlanError, match=r"kernel area: 60 replicas do not fit; at most \d+ replicas of \d+x\d+ PEs do"
    ):
        build_plan(PRESETS["gpt2"], "wse2", slots=2, context=64, objective="throughput", replicas=60)
    with pytest.raises(PlanError, match=r"500 replica\(s\) .* over by [\d.]+ GiB"):
        build_plan(PRESETS["gpt2"], "wse2", slots=2, context=64, objective="throughput", replicas=500)


def test_colors_limit() -> None:
    few = replace(ARCHS["wse2"], name="few-colors", routable_colors=8)
    with pytest.raises(
        PlanError, match=r"colors: region .* needs \d+ colors on one PE, \d+ over the 5 usable"
    ):
        build_plan(TINY, few, slots=2)


def test_code_and_stack_limit() -> None:
    # programs of 45 KB of code leave every region 2 KB (less 1 KB of stack) for its data
    code = tuple((program, 45 * 1024) for program, _ in ARCHS["wse2"].code_bytes)
    cramped = replace(ARCHS["wse2"], name="cramped", code_bytes=code)
    with pytest.raises(
        PlanError,
        match=r"per-PE memory: .* [\d,]+ B over the 2,048 B usable by \w+ \(48 KB less its code, 46,080 B, "
        r"and the stack, 1,024 B\)",
    ):
        build_plan(PRESETS["gpt2"], cramped, slots=1, context=64)


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"dtype": "bf16"}, "dtype 'bf16'"),
        ({"objective": "fast"}, "objective 'fast'"),
        ({"slots": 0}, "slots must be a positive integer"),
        ({"context": 17}, r"context must be 1..16"),
        ({"replicas": "many"}, "replicas must be a positive integer or 'auto'"),
        ({"replicas": 0}, "replicas must be a positive integer or 'auto'"),
        ({"top_k": 0}, "top_k must be 1..64"),
        ({"arch": "wse9"}, "unknown architecture 'wse9'"),
    ],
)
def test_bad_arguments(kwargs: dict, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        build_plan(TINY, **kwargs)


def test_largest_slots_is_the_boundary() -> None:
    assert largest_slots(TINY, "wse2", context=16, limit=64) == 64  # a tiny model fits the search limit
    most = largest_slots(TINY, "wse2", context=16, limit=100_000)
    assert 64 < most < 100_000
    build_plan(TINY, slots=most, context=16)
    with pytest.raises(PlanError):
        build_plan(TINY, slots=most + 1, context=16)
