"""The host program: weights land where the layout says, the CLI drives the simulator, the bench runs."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from tools.bench.bench_sim import main as bench_main
from wafer_gpt2.backends.registry import BackendOptions, build_backend
from wafer_gpt2.cli.main import main
from wafer_gpt2.core.runtime import MemcpyDataType, from_wire, to_wire
from wafer_gpt2.core.steps import HAS_TARGET, WANT_SCORES, BackendError, StepInputs, StepItem
from wafer_gpt2.core.tiling import ceil_div
from wafer_gpt2.core.wire import (
    WireError,
    decode_items,
    decode_scores,
    encode_scores,
    step_message,
)
from wafer_gpt2.plan.structure import PlanError


@pytest.fixture(scope="module")
def sim16(small_params):
    sim = build_backend("sim", small_params, BackendOptions(slots=2, dtype="fp16", context=32))
    yield sim
    sim.close()


def read_pe(sim, region, symbol: str) -> np.ndarray:
    """One symbol of every PE of a region, read back with memcpy_d2h: (h, w, elems) values."""
    spec = region.symbols[symbol]
    bits = MemcpyDataType.MEMCPY_16BIT if spec.dtype == "f16" else MemcpyDataType.MEMCPY_32BIT
    words = np.zeros(region.w * region.h * spec.elems, dtype=np.uint32)
    sim.runtime.memcpy_d2h(
        words, sim.runtime.get_id(symbol), region.x, region.y, region.w, region.h, spec.elems, data_type=bits
    )
    return from_wire(words, np.float16 if spec.dtype == "f16" else np.float32).reshape(
        region.h, region.w, spec.elems
    )


def pe_at(region, **indices: int) -> tuple[int, int]:
    """(y, x) inside the region of the PE with these tiling indices, from the region's `axes`
    ("+x": counted from the west edge, "-x": from the east edge; y likewise)."""
    where = {"y": 0, "x": 0}  # a strip has only one index
    for name, index in indices.items():
        sign, axis = region.axes[name]
        extent = region.w if axis == "x" else region.h
        where[axis] = index if sign == "+" else extent - 1 - index
    return where["y"], where["x"]


def test_upload_puts_each_tile_on_its_pe(sim16, small_params):
    """Check a few PEs against the layout's definition, computed here from the tensors directly."""
    plan = sim16.plan
    # qkv: PE (r, c) holds rows r*tk.. of diag(ln_1 gain) @ W (the LayerNorm folded in); its columns
    # are a run's [k | q | v] (a run of G columns holds the run's G*st outputs of each of k, q and v, in
    # that order, tile_n to a column); the roots hold the column sums of those fp16 weights.
    qkv = plan.region("L1.qkv")
    t = qkv.tiling
    assert t.norm_fold
    memory = read_pe(sim16, qkv, "w")
    layer = small_params.layers[1]
    folded = (layer.ln_1_g.astype(np.float64)[:, None] * layer.attn_w).astype(np.float16)
    c_dim = small_params.config.n_embd
    run = t.split_cols * t.segment_tile  # a run's outputs of each of q, k, v

    def outputs(c: int) -> np.ndarray:  # the indices of W's columns that column c holds
        b, j = divmod(c, t.split_cols)
        ids = np.concatenate([s * c_dim + np.arange(b * run, (b + 1) * run) for s in (1, 0, 2)])
        return ids[j * t.tile_n : (j + 1) * t.tile_n]

    assert t.split_cols > 1 and t.segment_order == (1, 0, 2)  # a head group's columns hold its k, q and v
    for r, c in ((0, 0), (t.rows - 1, t.cols - 1), (1, 2)):
        tile = memory[pe_at(qkv, k=r, n=c)].reshape(t.tile_k, t.tile_n)
        want = folded[r * t.tile_k : (r + 1) * t.tile_k][:, outputs(c)]
        np.testing.assert_array_equal(tile[: want.shape[0]], want)
    colsum = read_pe(sim16, qkv, "norm_g")[pe_at(qkv, k=t.rows - 1, n=0)]
    want = folded.astype(np.float64).sum(axis=0).astype(np.float32)
    np.testing.assert_array_equal(colsum, want[outputs(0)])  # column 0's outputs (k's first)
    # proj: PE (0, 1) holds the first tile_k rows of the second tile_n columns.
    proj = plan.region("L1.proj")
    t = proj.tiling
    memory = read_pe(sim16, proj, "w")
    tile = memory[pe_at(proj, k=0, n=1)].reshape(t.tile_k, t.tile_n)
    np.testing.assert_array_equal(
        tile, small_params.layers[1].proj_w[: t.tile_k, t.tile_n : 2 * t.tile_n].astype(np.float16)
    )
    # ln_f: PE i holds chunk i of the gain (fp32 in every mode).
    ln_f = plan.region("ln_f")
    gain = read_pe(sim16, ln_f, "gain")
    chunk = ln_f.tiling.chunk
    np.testing.assert_array_equal(gain[pe_at(ln_f, i=1)][:chunk], small_params.ln_f_g[chunk : 2 * chunk])
    # wte and wpe: embedding PE (k = i, row = j) holds rows j*per.. of dims i*tk.. of each, row-major.
    embed = plan.region("embed")
    tk = ceil_div(c_dim, embed.w)
    for name in ("wte", "wpe"):
        per = embed.symbols[name].elems // tk
        table = getattr(small_params, name)
        held = read_pe(sim16, embed, name)
        for row in {0, embed.h - 1}:
            tile = held[pe_at(embed, row=row, k=2)].reshape(per, tk)
            expect = table[row * per : (row + 1) * per, 2 * tk : 3 * tk].astype(np.float16)
            np.testing.assert_array_equal(tile[: len(expect)], expect)


def test_upload_refuses_a_checkpoint_of_another_shape(sim16, gpt2_params):
    with pytest.raises(ValueError, match="does not match the plan"):
        sim16.upload(gpt2_params)


def test_output_records_decode_to_the_scores_the_wafer_sent():
    """A step's output records (as the head region writes them) read back as the step's score arrays,
    a row per scored item in item order, the target logit only where the item asked for one; a stream of the wrong length, or a record of
    another item where one was due, is a WireError naming it."""
    rng = np.random.default_rng(3)
    n, k = 5, 8
    ids = rng.integers(0, 50257, size=(n, k)).astype(np.int32)
    logits = np.sort(rng.normal(size=(n, k)).astype(np.float32))[:, ::-1]
    lse = rng.normal(size=n).astype(np.float32)
    targets = rng.normal(size=n).astype(np.float32)
    expected = np.array([0, 2, 3, 6, 7])
    asked = np.array([False, True, False, True, False])
    words = encode_scores(np.array(expected), ids, logits, lse, targets)
    decoded = decode_scores(words, k, expected, asked)
    assert decoded.count == 8 and decoded.index.tolist() == expected.tolist()
    assert decoded.topk_ids.dtype == np.int32 and decoded.topk_logits.dtype == np.float32
    assert decoded.logsumexp.dtype == np.float64 and decoded.target_logit.dtype == np.float64
    np.testing.assert_array_equal(decoded.has_target, asked)
    assert np.isnan(decoded.target_logit[~decoded.has_target]).all()
    assert decode_scores(words, k, expected, asked, count=10).count == 10
    renumbered = decode_scores(words, k, expected, asked, count=12, index=np.array([1, 4, 5, 9, 11]))
    assert renumbered.index.tolist() == [1, 4, 5, 9, 11] and renumbered.rows()[4] is not None
    for i, scores in enumerate(decoded.rows()[j] for j in expected):
        assert scores is not None
        np.testing.assert_array_equal(scores.topk_ids, ids[i])
        np.testing.assert_array_equal(scores.topk_logits, logits[i])
        assert scores.topk_ids.dtype == np.int32 and scores.topk_logits.dtype == np.float32
        assert type(scores.logsumexp) is float and scores.logsumexp == float(lse[i])
        assert scores.target_logit == (float(targets[i]) if asked[i] else None)
        assert not asked[i] or type(scores.target_logit) is float
        assert not np.shares_memory(scores.topk_logits, words)  # the caller's buffer may be reused
    with pytest.raises(WireError, match=r"output stream of \d+ words, expected 4 records"):
        decode_scores(words, k, expected[:4], asked[:4])
    with pytest.raises(WireError, match="output record for item 3 arrived where item 4 was due"):
        decode_scores(words, k, np.array([0, 2, 4, 6, 7]), asked)


def test_a_step_message_is_the_items_encoded():
    """The host program's input message of a replica's items (`step_message`): the header, then per
    item its slot within the replica, position, token, flags and target, as the wire format says; the
    embed side (`decode_items`) reads back the same step; no items, the header alone."""
    items = [StepItem(9, 3, 464), StepItem(8, 0, 11, want_scores=False), StepItem(10, 7, 13, target=50256)]
    words = step_message(StepInputs.of_items(items), 8)
    want, both = WANT_SCORES, WANT_SCORES | HAS_TARGET
    expected = [3, 1, 3, 464, want, 0, 0, 0, 11, 0, 0, 2, 7, 13, both, 50256]
    assert words.dtype == np.uint32 and words.tolist() == expected
    back = decode_items(words)
    assert back.items() == [item._replace(slot=item.slot % 8) for item in items]
    assert step_message(StepInputs.of_items([]), 8).tolist() == [0]


def test_step_inputs_refuse_bad_items_naming_the_first():
    """Every backend's check (`StepInputs.validate`): a slot, position, token or target outside its
    range, or a slot's positions not consecutive, names the item; a good step passes."""
    good = [StepItem(0, 4, 7), StepItem(1, 0, 3), StepItem(0, 5, 9, target=2), StepItem(1, 1, 5)]
    StepInputs.of_items(good).validate(num_slots=2, context_length=8, vocab_size=10)
    for bad, message in (
        (StepItem(2, 0, 1), "item 4: slot 2 outside 0..1"),
        (StepItem(1, 8, 1), "item 4: position 8 outside 0..7"),
        (StepItem(1, 2, 10), "item 4: token 10 outside 0..9"),
        (StepItem(1, 2, 1, target=10), "item 4: target 10 outside 0..9"),
        (StepItem(1, 2, 1, target=-1), "item 4: target -1 outside 0..9"),
        (StepItem(0, 7, 1), r"item 4: slot 0 positions in one step must be consecutive \(5 then 7\)"),
    ):
        with pytest.raises(BackendError, match=message):
            StepInputs.of_items([*good, bad]).validate(num_slots=2, context_length=8, vocab_size=10)


def test_upload_refuses_a_plan_that_normalises_in_a_layers_strip(small_params):
    """The host folds every layer's LayerNorm into its GEMV, as the program does: a plan whose layer
    strip normalises has no home for that strip's gain and bias, and is refused before any copy."""
    sim = build_backend("sim", small_params, BackendOptions(slots=1, dtype="fp32", context=16))
    try:
        strip = sim.plan.region("L0.ln_1")
        strip.tiling = dataclasses.replace(strip.tiling, normalise=True)
        with pytest.raises(PlanError, match=r"L0\.ln_1: a layer's LayerNorm is folded into L0\.qkv"):
            sim.upload(small_params)
    finally:
        sim.close()


def test_attention_reads_the_kv_cache_the_pe_memory_holds(small_params):
    """K/V the host writes into the attention PEs' memory are what the next step attends to (the
    simulator's float32 copy of the cache is rebuilt from the memory after a host write)."""
    options = BackendOptions(slots=2, dtype="fp16", context=32)
    first, second = (build_backend("sim", small_params, options) for _ in range(2))
    prompt, other_prompt = [5, 6, 7, 8, 9], [40, 41, 42, 43, 44]
    try:
        first.step(StepInputs.of_items([StepItem(0, pos, token) for pos, token in enumerate(prompt)]))
        regions = [r for r in first.plan.regions if r.kind == "attention"]
        saved = {(r.name, s): read_pe(first, r, s) for r in regions for s in ("k_cache", "v_cache")}
        (expected,) = first.step(StepInputs.of_items([StepItem(0, 5, 17)])).rows()

        second.step(
            StepInputs.of_items(
                [StepItem(slot, pos, token) for slot in (0, 1) for pos, token in enumerate(other_prompt)]
            )
        )
        (other,) = second.step(
            StepInputs.of_items([StepItem(1, 5, 17)])
        ).rows()  # another prompt in the cache: other scores
        assert not np.allclose(other.topk_logits, expected.topk_logits)
        for region in regions:
            for symbol in ("k_cache", "v_cache"):
                values = saved[(region.name, symbol)]
                second.runtime.memcpy_h2d(
                    second.runtime.get_id(symbol),
                    to_wire(values.reshape(-1)),
                    region.x,
                    region.y,
                    region.w,
                    region.h,
                    values.shape[2],
                    data_type=MemcpyDataType.MEMCPY_16BIT,
                )
        (got,) = second.step(StepInputs.of_items([StepItem(0, 5, 17)])).rows()
        np.testing.assert_array_equal(got.topk_ids, expected.topk_ids)
        np.testing.assert_array_equal(got.topk_logits, expected.topk_logits)
    finally:
        first.close()
        second.close()


def test_generate_on_the_simulator_matches_the_reference(small_params, tmp_path, capsys):
    from wafer_gpt2.model.hf_format import save_hf

    checkpoint = save_hf(small_params, tmp_path / "small", dtype="float32")
    outputs = {}
    for backend in ("reference", "sim"):
        argv = [
            "generate",
            "The wafer",
            "--weights",
            str(checkpoint),
            "--backend",
            backend,
            "--dtype",
            "fp32",
            "--greedy",
            "--max-new-tokens",
            "10",
            "--ignore-eos",
        ]
        assert main(argv) == 0
        captured = capsys.readouterr()
        outputs[backend] = captured.out
        assert f"measured on backend {backend}" in captured.err
    assert outputs["sim"] == outputs["reference"] and outputs["sim"].strip()


def test_bench_command_reports_both_rates(tmp_path, capsys):
    # A small config (CI time): on GPT-2 124M the same command builds both full-size models.
    config = tmp_path / "config.json"
    config.write_text(
        json.dumps({"n_layer": 2, "n_head": 2, "n_embd": 64, "vocab_size": 512, "n_positions": 32})
    )
    argv = ["sim", "--model", str(config), "--batch", "1,2", "--new-tokens", "2",
            "--prompt-tokens", "2", "--reps", "1", "--dtype", "fp32"]  # fmt: skip
    code = bench_main(argv)
    out = capsys.readouterr().out
    assert code == 0
    assert "transformers   batch  1:" in out and "simulator      batch  2:" in out
    assert "greedy tokens of simulator and transformers: identical" in out
    assert out.strip().splitlines()[-1].startswith("bench sim summary: transformers batch 1")
