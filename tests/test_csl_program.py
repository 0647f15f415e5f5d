"""The GPT-2 CSL program on the CSL executor, end to end.

`wafer_gpt2.codegen` writes layout.csl for a plan, the executor (csl_executor) compiles it with the PE
programs of wafer_gpt2/kernels/pe and runs it, and the host program that drives the simulator (wafer_gpt2/host/program.py)
drives it through the executor's SdkRuntime: weights go up with memcpy copy mode, tokens in and
scores out through the memcpy streams. On WSE-2 and WSE-3, for a tiny GPT-2 (2 layers, n_embd 64,
2 heads, 64 positions, 2 slots; a 512-token vocabulary here, the real one in the `executor_full`
test): fp32 scores equal the simulator's, greedy continuations equal the NumPy reference's and
Hugging Face's; fp16 (on WSE-2) stays within the simulator's fp16 bound. Running on the executor is not
compiling with Cerebras cslc.
"""

from __future__ import annotations

import numpy as np
import pytest

from csl_executor.errors import CslDeadlock
from wafer_gpt2.backends.registry import BackendOptions, build_backend
from wafer_gpt2.core.steps import StepInputs, StepItem
from wafer_gpt2.model.config import GPT2Config
from wafer_gpt2.model.params import GPT2Params

TINY = GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=512, n_positions=64, name="tiny-csl")
FP32_TOLERANCE = 1e-5  # |logit|, |log-sum-exp| and |target logit| differences from the simulator
FP16_BOUND = 0.01  # tests/test_sim_fp16.py's bound between the simulator's fp16 and fp32 modes
OPTIONS = dict(slots=2, context=64, top_k=16, objective="compact")
# Scored items in one message: more records than this plan's pipeline and io.out hold (15 fill them:
# 14 pass unbounded), so sending them all before reading any deadlocks memcpy.
RECORDS = 18


@pytest.fixture(scope="module")
def tiny_params() -> GPT2Params:
    return GPT2Params.random(TINY, seed=3)


def backends(params: GPT2Params, arch: str, dtype: str):
    options = BackendOptions(arch=arch, dtype=dtype, **OPTIONS)
    return build_backend("csl", params, options), build_backend("sim", params, options)


def scripted_steps(vocab: int, seed: int = 0) -> list[list[StepItem]]:
    """Two prompts prefilled in one step (the last position of each scored, one with a target), then
    decode steps for both slots with targets."""
    rng = np.random.default_rng(seed)
    steps = [
        [
            StepItem(0, p, int(rng.integers(vocab)), want_scores=p == 4, target=7 if p == 4 else None)
            for p in range(5)
        ]
        + [StepItem(1, p, int(rng.integers(vocab)), want_scores=p == 2) for p in range(3)]
    ]
    for n in range(3):
        steps.append(
            [
                StepItem(
                    0, 5 + n, int(rng.integers(vocab)), want_scores=True, target=int(rng.integers(vocab))
                ),
                StepItem(1, 3 + n, int(rng.integers(vocab)), want_scores=True),
            ]
        )
    return steps


def worst_difference(ours, theirs, same_ids: bool) -> float:
    worst = 0.0
    for a, b in zip(ours.rows(), theirs.rows(), strict=True):
        assert (a is None) == (b is None)
        if a is None:
            continue
        if same_ids:
            np.testing.assert_array_equal(a.topk_ids, b.topk_ids)
            worst = max(worst, float(np.abs(a.topk_logits - b.topk_logits).max()))
        else:
            _, ia, ib = np.intersect1d(a.topk_ids, b.topk_ids, return_indices=True)
            worst = max(worst, float(np.abs(a.topk_logits[ia] - b.topk_logits[ib]).max()))
        worst = max(worst, abs(a.logsumexp - b.logsumexp))
        assert (a.target_logit is None) == (b.target_logit is None)
        if a.target_logit is not None:
            worst = max(worst, abs(a.target_logit - b.target_logit))
    return worst


def greedy(backend, prompt: list[int], new_tokens: int, slot: int = 0) -> list[int]:
    scores = backend.step(
        StepInputs.of_items(
            [StepItem(slot, p, t, want_scores=p == len(prompt) - 1) for p, t in enumerate(prompt)]
        )
    )
    out = [int(scores.topk_ids[-1, 0])]
    for n in range(new_tokens - 1):
        scores = backend.step(StepInputs.of_items([StepItem(slot, len(prompt) + n, out[-1])]))
        out.append(int(scores.topk_ids[0, 0]))
    return out


@pytest.mark.slow  # among the slowest tests (make test-fast leaves it out)
# CI time: WSE-3 with -m executor_full (its seeded-schedule run below stays in `make test`)
@pytest.mark.parametrize("arch", ["wse2", pytest.param("wse3", marks=pytest.mark.executor_full)])
def test_fp32_scores_equal_the_simulator(tiny_params, arch):
    csl, sim = backends(tiny_params, arch, "fp32")
    try:
        for items in scripted_steps(TINY.vocab_size):
            assert (
                worst_difference(
                    csl.step(StepInputs.of_items(items)), sim.step(StepInputs.of_items(items)), same_ids=True
                )
                <= FP32_TOLERANCE
            )
        # A freed slot starts again from position 0 and sees none of its old keys and values.
        csl.free_slot(1)
        sim.free_slot(1)
        items = [StepItem(1, 0, 11, want_scores=True)]
        assert (
            worst_difference(
                csl.step(StepInputs.of_items(items)), sim.step(StepInputs.of_items(items)), same_ids=True
            )
            <= FP32_TOLERANCE
        )
    finally:
        csl.close()
        sim.close()


# Two seeds per architecture; CI runs one of each (16-29 s a run measured on 2 busy cores, most of it
# the weights' upload), -m executor_full the other two. The default schedule runs above.
@pytest.mark.slow
@pytest.mark.parametrize(
    ("arch", "seed"),
    [
        ("wse2", 1),
        ("wse3", 2),
        pytest.param("wse2", 2, marks=pytest.mark.executor_full),
        pytest.param("wse3", 1, marks=pytest.mark.executor_full),
    ],
)
def test_fp32_scores_equal_the_simulator_under_a_seeded_schedule(tiny_params, arch, seed, monkeypatch):
    """The program's results do not depend on an order of tasks the SDK does not promise: under
    `seed:N` every PE picks among its runnable tasks at random and task starts, operation starts and
    deliveries are a few cycles late (csl_executor/schedule.py), and the scores still equal the
    simulator's, for a prefill of two slots and a decode step that reads their keys and values."""
    monkeypatch.setenv("WAFER_CSL_SCHEDULE", f"seed:{seed}")
    csl, sim = backends(tiny_params, arch, "fp32")
    try:
        assert csl.runtime._runner.machine.schedule.seed == seed  # the executor took the seed
        steps = [
            [StepItem(0, 0, 5), StepItem(0, 1, 300), StepItem(0, 2, 42, want_scores=True, target=7)]
            + [StepItem(1, 0, 17, want_scores=True)],
            [StepItem(0, 3, 9, want_scores=True, target=11), StepItem(1, 1, 60, want_scores=True)],
        ]
        for items in steps:
            assert (
                worst_difference(
                    csl.step(StepInputs.of_items(items)), sim.step(StepInputs.of_items(items)), same_ids=True
                )
                <= FP32_TOLERANCE
            )
    finally:
        csl.close()
        sim.close()


# WSE-3 with -m executor_full (CI time): the fp32 scores above equal the simulator's on both.
@pytest.mark.parametrize("arch", ["wse2", pytest.param("wse3", marks=pytest.mark.executor_full)])
def test_fp32_greedy_equals_the_reference_and_hugging_face(tiny_params, arch, write_checkpoint):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from wafer_gpt2.backends.reference import ReferenceBackend

    prompt, new = [5, 300, 42, 17], 6
    csl = build_backend("csl", tiny_params, BackendOptions(arch=arch, dtype="fp32", **OPTIONS))
    try:
        ours = greedy(csl, prompt, new)
    finally:
        csl.close()
    reference = ReferenceBackend(tiny_params, slots=1, context=64, top_k=16)
    assert greedy(reference, prompt, new) == ours
    model = transformers.GPT2LMHeadModel.from_pretrained(
        write_checkpoint(tiny_params), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        hf = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False, pad_token_id=0)
    assert hf[0, len(prompt) :].tolist() == ours


@pytest.mark.slow  # among the slowest tests (make test-fast leaves it out)
def test_fp16_stays_within_the_simulators_bound(tiny_params):
    # WSE-2 only (CI time): the kernels' fp16 code is the same on both; what differs by architecture
    # (queues, colors) runs in fp32 on both above.
    csl, sim = backends(tiny_params, "wse2", "fp16")
    try:
        for items in scripted_steps(TINY.vocab_size, seed=1):
            assert (
                worst_difference(
                    csl.step(StepInputs.of_items(items)), sim.step(StepInputs.of_items(items)), same_ids=False
                )
                < FP16_BOUND
            )
        prompt = [9, 8, 7, 6]
        csl.reset()
        sim.reset()
        assert greedy(csl, prompt, 4) == greedy(sim, prompt, 4)
    finally:
        csl.close()
        sim.close()


@pytest.mark.slow  # among the slowest tests (make test-fast leaves it out)
def test_a_message_with_more_records_than_the_wafer_buffers_needs_the_host_bound(tiny_params):
    """The defect the host had: every H2D of a step before any D2H. memcpy runs one command at a
    time, so when a message's records fill what the pipeline and io.out hold, the H2D never ends and
    the D2H behind it never starts. The runtime says its memcpy is serial; the host splits messages
    at the records io.out holds (`Plan.records_held`, a replica's slots)."""
    items = [StepItem(0, p, 3 * p + 1, want_scores=True) for p in range(RECORDS)]
    csl = build_backend("csl", tiny_params, BackendOptions(arch="wse2", dtype="fp32", **OPTIONS))
    try:
        assert csl.runtime.serial_memcpy and csl.plan.records_held == OPTIONS["slots"]
        bounded = csl.step(StepInputs.of_items(items))
        assert bounded.count == RECORDS and bounded.index.tolist() == list(range(RECORDS))
        csl.reset()
        csl.runtime.serial_memcpy = False  # what the host did before: the whole step in one message
        with pytest.raises(CslDeadlock, match="memcpy_d2h"):
            csl.step(StepInputs.of_items(items))
    finally:
        try:
            csl.close()
        except CslDeadlock:
            pass  # the deadlocked program cannot drain its commands


def test_a_decode_step_goes_in_one_message_per_replica(tiny_params):
    """io.out holds a replica's slots' records (its ring, `Plan.records_held`): the host sends every
    replica its whole decode step in one message, all of them before it reads any record, then reads
    each replica's records in one command; the scores equal the simulator's."""
    options = BackendOptions(arch="wse2", dtype="fp32", **{**OPTIONS, "slots": 4}, replicas=2)
    csl, sim = build_backend("csl", tiny_params, options), build_backend("sim", tiny_params, options)
    try:
        assert csl.plan.records_held == 2
        prompts = [StepItem(s, p, 5 * s + p + 1, want_scores=p == 2) for s in range(4) for p in range(3)]
        decode = [StepItem(s, 3, 7 * s + 2, want_scores=True, target=s) for s in range(4)]
        for items in (prompts, decode):
            csl.runtime.machine.command_times.clear()
            ours = csl.step(StepInputs.of_items(items))
            kinds = [kind for kind, _, _ in csl.runtime.machine.command_times]
            assert kinds == ["StreamH2D", "StreamH2D", "StreamD2H", "StreamD2H"]
            assert (
                worst_difference(ours, sim.step(StepInputs.of_items(items)), same_ids=True) < FP32_TOLERANCE
            )
    finally:
        csl.close()
        sim.close()


def two_steps_in_flight(csl, sim, first: list[StepItem], second: list[StepItem]) -> list[str]:
    """Submit two steps, then collect both; each step's scores equal the simulator's. Returns the
    kinds of the memcpy commands the executor ran for them, in order."""
    csl.runtime.machine.command_times.clear()
    csl.submit(StepInputs.of_items(first))
    csl.submit(StepInputs.of_items(second))
    ours = [csl.collect(), csl.collect()]
    for mine, items in zip(ours, (first, second), strict=True):
        assert worst_difference(mine, sim.step(StepInputs.of_items(items)), same_ids=True) < FP32_TOLERANCE
    return [kind for kind, _, _ in csl.runtime.machine.command_times]


def test_a_later_steps_messages_go_in_before_the_records_of_the_one_before(tiny_params):
    """Steps in flight on serial memcpy: a D2H holds back every command after it until its records
    have come, so the host asks for a step's records only at `collect` (or when the next message would
    not fit what io.out still has room for): the second step's message goes in before the first
    one's records are read, and both steps' scores equal the simulator's."""
    options = BackendOptions(arch="wse2", dtype="fp32", **{**OPTIONS, "slots": 4}, steps_in_flight=2)
    csl, sim = build_backend("csl", tiny_params, options), build_backend("sim", tiny_params, options)
    try:
        first = [StepItem(s, p, 3 * s + p + 1, want_scores=p == 1) for s in (0, 1) for p in range(2)]
        second = [StepItem(s, p, 5 * s + p + 2, want_scores=p == 1) for s in (2, 3) for p in range(2)]
        kinds = two_steps_in_flight(csl, sim, first, second)
        assert kinds == ["StreamH2D", "StreamH2D", "StreamD2H", "StreamD2H"]
        # a fourth step whose records do not fit io.out (4) beside the third's unread ones: the third's
        # are asked for before its message goes in
        third = [StepItem(s, 2, s + 1, want_scores=True) for s in (0, 1)]
        fourth = [StepItem(2, p, p + 3, want_scores=True) for p in (2, 3, 4)] + [
            StepItem(3, 2, 9, want_scores=True)
        ]
        kinds = two_steps_in_flight(csl, sim, third, fourth)
        assert kinds == ["StreamH2D", "StreamD2H", "StreamH2D", "StreamD2H"]
    finally:
        csl.close()
        sim.close()


class _ApplianceClientOnTheExecutor:
    """The appliance client's SdkRuntime (cerebras.sdk.client) as `wafer_gpt2.backends.sdk_appliance` uses it, run
    on the executor's SdkRuntime: the host's memcpy traffic meets memcpy's serialization as on a wafer."""

    def __init__(self, artifact, simulator=False, **options) -> None:
        from wafer_gpt2.backends.csl import runtime_module

        self._runtime = runtime_module().SdkRuntime(str(artifact))

    def __enter__(self):
        self._runtime.load()
        self._runtime.run()
        return self

    def __exit__(self, *exc) -> None:
        self._runtime.stop()

    def memcpy_h2d(self, *args, **kwargs):
        return self._task(self._runtime.memcpy_h2d(*args, **kwargs))

    def memcpy_d2h(self, *args, **kwargs):
        return self._task(self._runtime.memcpy_d2h(*args, **kwargs))

    def launch(self, *args, **kwargs):
        return self._task(self._runtime.launch(*args, **kwargs))

    def get_id(self, name):
        return self._runtime.get_id(name)

    def _task(self, task):
        """The client's tasks have wait() and done()."""
        from types import SimpleNamespace

        return SimpleNamespace(
            wait=lambda: self._runtime.task_wait(task), done=lambda: self._runtime.is_task_done(task)
        )


@pytest.mark.slow
def test_the_appliance_backend_reads_each_record_before_it_sends_on(tiny_params, monkeypatch):
    """The sdk-appliance backend sent a step's every scored item before reading any record: RECORDS of them
    deadlock memcpy (the H2D waits for io.out, the D2H behind it never starts), as the container path
    did before. It now says, as every wafer target does, that one record may be in flight."""
    from types import SimpleNamespace

    from wafer_gpt2.backends import sdk_appliance
    from wafer_gpt2.backends.csl import compile_plan, runtime_module
    from wafer_gpt2.host.program import plan_for, start_model

    sdk = runtime_module()
    enums = (
        SimpleNamespace(Value=lambda name: getattr(sdk.MemcpyDataType, name)),
        SimpleNamespace(Value=lambda name: getattr(sdk.MemcpyOrder, name)),
    )
    monkeypatch.setattr(sdk_appliance, "import_client", lambda: (None, *enums))
    monkeypatch.setattr(sdk_appliance, "_classes", lambda: (_ApplianceClientOnTheExecutor, None))
    monkeypatch.setattr(sdk_appliance, "client_version", lambda: "1.4.0")
    options = BackendOptions(arch="wse2", dtype="fp32", **OPTIONS)
    plan = plan_for(tiny_params, options)
    model = start_model(plan, sdk_appliance.ApplianceRuntime(compile_plan(plan)), tiny_params)
    items = [StepItem(0, p, 3 * p + 1, want_scores=True) for p in range(RECORDS)]
    try:
        got = model.step(StepInputs.of_items(items))
    finally:
        try:
            model.close()
        except CslDeadlock:
            pass  # the deadlocked program cannot drain its commands
    sim = build_backend("sim", tiny_params, options)
    try:
        assert worst_difference(got, sim.step(StepInputs.of_items(items)), same_ids=True) < FP32_TOLERANCE
    finally:
        sim.close()


@pytest.mark.executor_full
@pytest.mark.parametrize("arch", ["wse2", "wse3"])
def test_full_vocabulary_fp32_scores_equal_the_simulator(arch):
    """The acceptance configuration with GPT-2's 50257-token vocabulary (minutes on the executor)."""
    config = GPT2Config(
        n_layer=2, n_head=2, n_embd=64, vocab_size=50257, n_positions=64, name="tiny-csl-full"
    )
    params = GPT2Params.random(config, seed=3)
    options = BackendOptions(arch=arch, dtype="fp32", slots=2, context=64, top_k=64, objective="compact")
    csl, sim = build_backend("csl", params, options), build_backend("sim", params, options)
    try:
        for items in scripted_steps(config.vocab_size)[:2]:
            assert (
                worst_difference(
                    csl.step(StepInputs.of_items(items)), sim.step(StepInputs.of_items(items)), same_ids=True
                )
                <= FP32_TOLERANCE
            )
    finally:
        csl.close()
        sim.close()


@pytest.mark.slow  # among the slowest tests (make test-fast leaves it out)
def test_multi_level_reductions_equal_the_simulator():
    """A plan whose LayerNorms and attention merges reduce in two levels and whose GEMVs in three (the
    latency objective picks them for this config), with 8-PE
    strips, a folded attention snake and gathers between regions, and the head's tree over its roots
    in two levels too (runs of 2: set here): the generator's general case, on WSE-3 (whose queue rules
    are the tighter ones)."""
    from dataclasses import replace

    from wafer_gpt2.plan import build_plan

    config = GPT2Config(n_layer=2, n_head=2, n_embd=16, vocab_size=200, n_positions=32, name="tiny-two-level")
    plan = build_plan(config, arch="wse3", dtype="fp32", slots=2, context=32, top_k=8, objective="latency")
    tilings = [r.tiling for r in plan.regions if r.tiling is not None]
    kinds = {(type(t).__name__, getattr(t, "reduction", None)) for t in tilings}
    assert {
        ("HeadTiling", None),
        ("NormTiling", "two_level"),
        ("AttentionTiling", "two_level"),
        ("GemvTiling", "three_level"),
    } <= kinds, kinds
    head = plan.region("head")
    assert head.tiling.gemv.cols >= 4
    plan.head = head.tiling = replace(head.tiling, tree="two_level", tree_group=2)
    params = GPT2Params.random(config, seed=5)
    csl, sim = start_both(plan, params)
    try:
        items = [
            StepItem(0, p, 3 * p + 1, want_scores=p >= 4, target=9 if p == 5 else None) for p in range(6)
        ]
        items.append(StepItem(1, 0, 5, want_scores=True))
        assert (
            worst_difference(
                csl.step(StepInputs.of_items(items)), sim.step(StepInputs.of_items(items)), same_ids=True
            )
            <= FP32_TOLERANCE
        )
    finally:
        csl.close()
        sim.close()


@pytest.mark.slow
def test_two_level_attention_merge_equals_the_simulator():
    """Attention's two merge rounds (the max, then the rescaled sums) over runs of 3 and their ends,
    the last run shorter, on the plan's folded snake, M multicast back from the chain's last PE; 14
    positions fill only some of the PEs, so the others take part with (-inf, 0, 0). On WSE-2 only:
    the two-level test above runs a two-level merge on WSE-3 (CI time)."""
    from dataclasses import replace

    from wafer_gpt2.backends.csl import CslExecutorRuntime, compile_plan
    from wafer_gpt2.host.program import start_model
    from wafer_gpt2.plan import build_plan
    from wafer_gpt2.sim import SimRuntime

    config = GPT2Config(
        n_layer=1, n_head=2, n_embd=16, vocab_size=100, n_positions=32, name="tiny-two-level-attn"
    )
    plan = build_plan(config, arch="wse2", dtype="fp32", slots=1, context=32, top_k=8, objective="latency")
    for region in plan.regions:
        if region.kind == "attention":
            t = region.tiling
            assert t.fold > 1 and t.chain % 3 and t.chain > 6 and -(-14 // t.positions_per_pe) < t.chain, t
            region.tiling = replace(region.tiling, reduction="two_level", group=3)
    params = GPT2Params.random(config, seed=7)
    csl = start_model(plan, CslExecutorRuntime(compile_plan(plan)), params)
    sim = start_model(plan, SimRuntime(plan), params)
    try:
        items = [StepItem(0, p, (5 * p + 2) % 100, want_scores=p in (3, 8, 13)) for p in range(14)]
        assert (
            worst_difference(
                csl.step(StepInputs.of_items(items)), sim.step(StepInputs.of_items(items)), same_ids=True
            )
            <= FP32_TOLERANCE
        )
    finally:
        csl.close()
        sim.close()


@pytest.mark.parametrize(
    ("arch", "fold"), [("wse2", 4), pytest.param("wse3", 2, marks=pytest.mark.executor_full)]
)  # CI time: WSE-3's with -m executor_full
def test_the_attention_merge_on_a_comb_equals_the_simulator(arch, fold, monkeypatch):
    """Attention's rows laid out as a comb (`AttentionTiling.with_comb`): each row's halves run in from
    its edges and end side by side in its middle, and both merge rounds (the max, then the rescaled
    sums) take the halves as runs whose ends chain down the rows' middle; the PEs find their chain
    index from their place. 22 positions fill only some of the PEs, so the others take part with
    (-inf, 0, 0)."""
    from dataclasses import replace

    from wafer_gpt2.plan import build_plan
    from wafer_gpt2.plan import search as search_module

    config = GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=512, n_positions=32, name="tiny-comb")
    knobs = search_module._candidate_knobs

    def rows_of_four(*args, **kwargs):
        return [
            replace(k, attn_chain=4 * fold)
            for k in knobs(*args, **kwargs)
            if k.stream_pes == 2 and k.fold == fold
        ]

    monkeypatch.setattr(search_module, "_candidate_knobs", rows_of_four)
    search_module.forget_kept_plans()
    plan = build_plan(config, arch=arch, dtype="fp32", slots=1, context=32, top_k=8, objective="compact")
    search_module.forget_kept_plans()
    region = plan.region("L0.attn")
    # the model lays so short a chain out as a snake; the comb is what longer chains take
    region.tiling = t = region.tiling.with_comb()
    assert (t.reduction, t.fold, t.chain, t.group) == ("two_level", fold, 4 * fold, 2), t
    assert -(-23 // t.positions_per_pe) < t.chain
    for row in range(fold):  # the row's halves end side by side
        assert t.snake(row * 4 + 1) == (1, row) and t.snake(row * 4 + 3) == (2, row)

    def chain_index_where_the_layout_says(csl, sim) -> None:
        # every PE takes the chain index (its positions, its part in the merge) the layout
        # (`AttentionTiling.snake`, the simulator's) gives its place: the scores alone would not
        # tell, the merge's sums being the same in any order within the tolerance
        from wafer_gpt2.core.memory_layout import pe_coords

        ys, xs = pe_coords(region)  # [group, chain index]
        for (g, p), y in np.ndenumerate(ys):
            pe = csl.runtime.machine.pes[(region.x + int(xs[g, p]), region.y + int(y))]
            var = next(v for v in pe.program.symbols if v.name == "chain_index")
            assert int(pe.mH[var.addr]) == p, (g, p)

    two_steps_equal_the_simulator(
        plan, GPT2Params.random(config, seed=11), prompt=22, then=chain_index_where_the_layout_says
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("arch", "vocab", "gelu_pes", "multicast", "workers"),
    [
        # CI runs the multicast on WSE-2, on 3 PEs, which do not split fc's 4 outputs evenly; the
        # compact plans of the GPT-2 runs share the relayed way
        pytest.param("wse2", 100, 4, False, 5, marks=pytest.mark.executor_full),
        pytest.param("wse3", 86, 2, False, 5, marks=pytest.mark.executor_full),
        ("wse2", 100, 3, True, 5),
        pytest.param("wse3", 86, 4, True, 5, marks=pytest.mark.executor_full),
    ],
)
def test_a_shared_gelu_and_the_heads_workers_equal_the_simulator(arch, vocab, gelu_pes, multicast, workers):
    """fc's GELU shared by the last `gelu_pes` PEs of every K-line (pe/gemv.csl): relayed
    (comm/scatter.csl), the root sends the others their slices of the sum back along the line and a
    gather line carries them out through the root's lane; multicast (comm/spread.csl), the root sends
    the others' sums in one multicast and their results come back as one chain sum, each PE's vector
    zero outside its slice, the farthest PEs one output more where the count does not divide the
    outputs. GELU is elementwise and a sum with zeros exact, so the numbers are unchanged. The head's
    logits held by the `workers` PEs before each root (pe/head.csl): each sums its slice's exps
    against its own max and rescales the sum to the global max, the sums added along the K-line's chain
    links (wafer_gpt2.sim.kernels._logsumexp in that order). 86 tokens on 6 columns of 15 leave the last
    column's last slices short or empty (11 logits in slices of 3)."""
    from dataclasses import replace

    from wafer_gpt2.codegen.build import build_program
    from wafer_gpt2.plan import build_plan

    config = GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=vocab, n_positions=32, name="tiny-shared")
    plan = build_plan(config, arch=arch, dtype="fp32", slots=1, context=32, top_k=8, objective="latency")
    fc, head = plan.region("L0.fc"), plan.region("head")
    assert (multicast or fc.tiling.tile_n % gelu_pes == 0) and fc.tiling.rows >= gelu_pes
    assert head.tiling.gemv.tile_n % workers == 0 and head.tiling.gemv.rows > workers
    fc.tiling = replace(fc.tiling, epilogue_pes=gelu_pes, epilogue_multicast=multicast)
    plan.head = head.tiling = replace(head.tiling, workers=workers)
    tiles = build_program(plan).tiles.values()
    # every fc column: one PE sends the slices (FIRST), the farthest keeps the last of them (LAST);
    # multicast: the farthest starts the sum (FIRST), the root ends it (LAST)
    roles = [
        tile.params["spread_role" if multicast else "scatter_role"]
        for tile in tiles
        if tile.region == fc.name
    ]
    assert roles.count(0) == fc.tiling.cols and roles.count(2) == fc.tiling.cols
    cols = head.tiling.gemv.cols
    slots = sorted(tile.params["worker_slot"] for tile in tiles if tile.region == "head")
    assert slots[: workers * cols] == sorted(list(range(workers)) * cols)
    two_steps_equal_the_simulator(plan, GPT2Params.random(config, seed=7))


@pytest.mark.slow
@pytest.mark.parametrize(
    "arch", ["wse2", pytest.param("wse3", marks=pytest.mark.executor_full)]
)  # CI time: WSE-3's with -m executor_full
def test_ragged_fc_and_proj_tiles_equal_the_simulator(arch):
    """fc's outputs and proj's K cut in tiles that do not divide 4 n_embd (5 rows of 13 for 64: the
    last tile's last output is padding), as a throughput plan's fc filling the rows the kernel leaves
    takes them: the padded output's weights and bias are zero, so its GELU is 0 and proj's padded row
    adds nothing; fc's GELU is shared multicast by a count of PEs that divides neither 13 nor 12."""
    from dataclasses import replace

    from wafer_gpt2.plan import build_plan, plan_for_knobs

    config = GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=100, n_positions=32, name="tiny-ragged")
    base = build_plan(config, arch=arch, dtype="fp32", slots=1, context=32, top_k=8, objective="latency")
    plan = plan_for_knobs(
        config, replace(base.knobs, fc_cols=5), arch=arch, dtype="fp32", slots=1, context=32, top_k=8
    )
    fc, proj = plan.layers[0].fc, plan.layers[0].proj
    assert (fc.cols, fc.tile_n, proj.rows, proj.tile_k) == (5, 13, 5, 13)
    assert fc.epilogue_multicast and 13 % fc.epilogue_pes and 12 % fc.epilogue_pes
    two_steps_equal_the_simulator(plan, GPT2Params.random(config, seed=5))


@pytest.mark.slow
@pytest.mark.parametrize(
    "arch", ["wse2", pytest.param("wse3", marks=pytest.mark.executor_full)]
)  # CI time: WSE-3's with -m executor_full
def test_the_heads_tree_in_two_levels_equals_the_simulator(arch):
    """The head's rounds over a tree of 19 roots: on either side of the centre a line of 9 in runs of 3
    (the latency plan's on WSE-2; set on WSE-3), whose runs' ends fold their run into their own before
    passing the ends' stream on, and whose ends join the centre (comm/tree.csl); round C's lists
    relayed through all of them in id order."""
    from dataclasses import replace

    from wafer_gpt2.plan import build_plan

    config = GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=600, n_positions=32, name="tiny-head-tree")
    plan = build_plan(config, arch=arch, dtype="fp32", slots=1, context=32, top_k=8, objective="latency")
    head = plan.region("head")
    assert head.tiling.gemv.cols >= 10
    plan.head = head.tiling = replace(head.tiling, tree="two_level", tree_group=3)
    two_steps_equal_the_simulator(plan, GPT2Params.random(config, seed=11))


def crafted_logits(config: GPT2Config, column0: np.ndarray, seed: int = 13) -> GPT2Params:
    """Random weights whose final LayerNorm has gain 0 and bias e_0: every item's logits are exactly
    wte[:, 0] (the head's products with 0 add nothing), which the caller sets."""
    params = GPT2Params.random(config, seed=seed)
    params.ln_f_g[:] = 0.0
    params.ln_f_b[:] = 0.0
    params.ln_f_b[0] = 1.0
    params.wte[:, 0] = column0
    return params


@pytest.mark.slow
@pytest.mark.parametrize(
    "arch", ["wse2", pytest.param("wse3", marks=pytest.mark.executor_full)]
)  # CI time: WSE-3's with -m executor_full
def test_the_heads_selection_is_exact_on_ties(arch):
    """Threshold selection keeps the exact top-k (ties to the lower id) and the exact log-sum-exp on
    the logits that test it hardest (100 tokens on 4 columns of 25, k = 4, so [L, M] runs from the
    least column max):
    - a tie across the cut: two clear winners, then four tokens at one value in the threshold bin, of
      which the two with the lower ids make the k best;
    - every column's max equal (M = L: the bins' width is 0 and every entry of round C is in bin 0):
      the first and third token of every column at the max, the four lowest ids win;
    - every logit equal: round C carries all 100 entries (more than a chunk of the centre's reads)."""
    from wafer_gpt2.plan import build_plan

    config = GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=100, n_positions=32, name="tiny-ties")
    plan = build_plan(config, arch=arch, dtype="fp32", slots=1, context=32, top_k=4, objective="latency")
    head = plan.head
    assert head.gemv.cols >= head.top_k and head.gemv.cols * head.gemv.tile_n >= 100
    rng = np.random.default_rng(1)
    base = rng.uniform(-2.0, -1.0, 100).astype(np.float32)
    tie = base.copy()
    tie[[7, 50]] = [3.0, 2.5]
    tie[[3, 33, 64, 90]] = 1.0
    maxima = rng.uniform(-1.0, 0.5, 100).astype(np.float32)
    at_max = [
        i for c in range(head.gemv.cols) for i in (c * head.gemv.tile_n, c * head.gemv.tile_n + 2) if i < 100
    ]
    maxima[at_max] = 1.0
    flat = np.full(100, 0.5, dtype=np.float32)
    expect = {"tie": [7, 50, 3, 33], "maxima": sorted(at_max)[:4], "flat": [0, 1, 2, 3]}
    for name, column0 in (("tie", tie), ("maxima", maxima), ("flat", flat)):
        csl, sim = start_both(plan, crafted_logits(config, column0))
        try:
            items = [StepItem(0, 0, 3, want_scores=True, target=64), StepItem(0, 1, 8, want_scores=True)]
            ours, theirs = csl.step(StepInputs.of_items(items)), sim.step(StepInputs.of_items(items))
            assert worst_difference(ours, theirs, same_ids=True) <= FP32_TOLERANCE, name
            first, second = ours.row(0), ours.row(1)
            assert [int(i) for i in first.topk_ids] == expect[name], name
            logsumexp = np.logaddexp.reduce(column0.astype(np.float64))
            assert abs(second.logsumexp - logsumexp) < 1e-5, name
            assert first.target_logit == column0[64]
        finally:
            csl.close()
            sim.close()


@pytest.mark.parametrize(
    "arch", ["wse2", pytest.param("wse3", marks=pytest.mark.executor_full)]
)  # CI time: WSE-3's with -m executor_full
def test_a_head_that_embeds_equals_the_simulator(arch):
    """Where the copy of wte by rows would need more rows than layer 0 leaves under its ln_1 (narrow
    strips over a large vocabulary: here 2 PEs of 16 values against 4,096 tokens), the head's columns
    serve the token's row (pe/head.csl `embeds`), chained down each K-line into the embedding's wpe rows
    at the top of the strip, which hand off to layer 0 as a gather line; a chain on WSE-3, whose head
    leaves no input queue for a second level."""
    from wafer_gpt2.plan import build_plan

    config = GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=4096, n_positions=32, name="tiny-embeds")
    plan = build_plan(config, arch=arch, dtype="fp32", slots=1, context=32, top_k=8, objective="compact")
    embed, head = plan.region("embed"), plan.region("head")
    assert "wte" not in embed.symbols and embed.x == head.x and embed.y < head.y
    two_steps_equal_the_simulator(plan, GPT2Params.random(config, seed=5))


@pytest.mark.parametrize(
    ("embeds", "arch", "strip"),
    [
        (True, "wse2", 4),
        (False, "wse2", 3),
        pytest.param(True, "wse3", 3, marks=pytest.mark.executor_full),
        pytest.param(False, "wse3", 4, marks=pytest.mark.executor_full),
    ],
)  # CI time: WSE-3's with -m executor_full
def test_a_west_strip_wider_than_the_stream_equals_the_simulator(embeds, arch, strip, monkeypatch):
    """The west strip (the head's K-lines, ln_f, the embedding where the head serves it) wider than
    the layers' strips (`Knobs.strip_pes`): the stream re-cut by the gather lines into ln_f and, where
    the embedding lies in the strip, out of it into layer 0; the head's tiles shorter along K. A strip
    of 3 PEs does not divide the 32 channels: its chunks are ragged (11, 11 and 10), the head's K
    zero-padded, as a head with its rounds apart often has its weighted PEs."""
    from dataclasses import replace

    from wafer_gpt2.plan import build_plan
    from wafer_gpt2.plan import search as search_module

    vocab = 4096 if embeds else 512  # the copy of wte by rows needs more rows than layer 0 leaves
    config = GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=vocab, n_positions=32, name="tiny-strip")
    knobs = search_module._candidate_knobs

    def wider(*args, **kwargs):
        return [replace(k, strip_pes=strip) for k in knobs(*args, **kwargs) if k.stream_pes == 2]

    monkeypatch.setattr(search_module, "_candidate_knobs", wider)
    search_module.forget_kept_plans()
    plan = build_plan(config, arch=arch, dtype="fp32", slots=1, context=32, top_k=8, objective="compact")
    search_module.forget_kept_plans()
    head, ln_f, embed = plan.region("head"), plan.region("ln_f"), plan.region("embed")
    assert head.w == ln_f.w == head.tiling.gemv.rows == strip and plan.layers[0].ln_1.pes == 2
    assert ("wte" not in embed.symbols) == embeds and (embed.w == head.w) == embeds
    two_steps_equal_the_simulator(plan, GPT2Params.random(config, seed=5))


def start_both(plan, params: GPT2Params):
    """The host program on the executor and on the simulator, for one plan and its weights."""
    from wafer_gpt2.backends.csl import CslExecutorRuntime, compile_plan
    from wafer_gpt2.host.program import start_model
    from wafer_gpt2.sim import SimRuntime

    return start_model(plan, CslExecutorRuntime(compile_plan(plan)), params), start_model(
        plan, SimRuntime(plan), params
    )


def two_steps_equal_the_simulator(plan, params: GPT2Params, prompt: int = 8, then=None) -> None:
    """`prompt` prompt items (two scored, the last with a target), then a decode item, whose scores on
    the executor equal the simulator's: the second step finds every PE waiting for its next item
    again. `then(csl, sim)`, if given, checks more before both close."""
    from wafer_gpt2.backends.csl import CslExecutorRuntime, compile_plan
    from wafer_gpt2.host.program import start_model
    from wafer_gpt2.sim import SimRuntime

    vocab = plan.config.vocab_size
    csl = start_model(plan, CslExecutorRuntime(compile_plan(plan)), params)
    sim = start_model(plan, SimRuntime(plan), params)
    try:
        last = prompt - 1
        items = [StepItem(0, p, (5 * p + 2) % vocab, want_scores=p in (3, last), target=1 if p == last else None)
                 for p in range(prompt)]  # fmt: skip
        assert (
            worst_difference(
                csl.step(StepInputs.of_items(items)), sim.step(StepInputs.of_items(items)), same_ids=True
            )
            <= FP32_TOLERANCE
        )
        items = [StepItem(0, prompt, 11, want_scores=True)]
        assert (
            worst_difference(
                csl.step(StepInputs.of_items(items)), sim.step(StepInputs.of_items(items)), same_ids=True
            )
            <= FP32_TOLERANCE
        )
        if then is not None:
            then(csl, sim)
    finally:
        csl.close()
        sim.close()


@pytest.mark.parametrize("west", [True, False])
@pytest.mark.parametrize("north", [True, False])
def test_lanes_that_turn_share_no_router(west: bool, north: bool) -> None:
    """A row of sources handing off to a row of PEs in other columns, rows apart: lanes that each turn
    at a row of their own share no router (so one color serves them all), each crosses as many routers
    as a straight lane of the same reach, and starts and ends at the ramps; sources in the opposite
    column order would cross, and rows too close leave no turn rows."""
    from wafer_gpt2.codegen.build import _disjoint
    from wafer_gpt2.codegen.routes import make_flow, make_path_flow, staircase_corners

    sy, dy = (20, 3) if north else (3, 20)
    sources = [(30 + i, sy) for i in range(6)] if west else [(i, sy) for i in range(6)]
    dsts = [(2 + i, dy) for i in range(6)] if west else [(40 + i, dy) for i in range(6)]
    straight = [make_flow(f"s{i}", s, [d]) for i, (s, d) in enumerate(zip(sources, dsts, strict=True))]
    assert not _disjoint(straight)
    corners = staircase_corners(sources, dsts)
    assert corners is not None
    lanes = [make_path_flow(f"l{i}", path) for i, path in enumerate(corners)]
    assert _disjoint(lanes)
    for lane, src, dst in zip(lanes, sources, dsts, strict=True):
        assert len(lane.routes) == abs(dst[0] - src[0]) + abs(dst[1] - src[1]) + 1
        assert lane.routes[src][0] == "RAMP" and "RAMP" in lane.routes[dst][1]
        assert lane.destinations == (dst,)
    crossed = staircase_corners(sources, dsts[::-1])
    assert crossed is not None and not _disjoint([make_path_flow(f"c{i}", p) for i, p in enumerate(crossed)])
    assert staircase_corners(sources, [(x, sy + (6 if sy < dy else -6)) for x, _ in dsts]) is None


@pytest.mark.parametrize(
    ("embeds", "arch", "sets", "rows"),
    [
        pytest.param(True, "wse2", 1, 2, marks=pytest.mark.executor_full),
        (False, "wse2", 1, 2),
        (True, "wse2", 2, 2),
        pytest.param(False, "wse2", 2, 1, marks=pytest.mark.executor_full),
        pytest.param(True, "wse3", 1, 2, marks=pytest.mark.executor_full),
        pytest.param(False, "wse3", 2, 2, marks=pytest.mark.executor_full),
    ],
)  # CI time: WSE-3's, a K-line of one weighted PE and one set with the embedding with -m executor_full
def test_the_heads_rounds_apart_equal_the_simulator(embeds, arch, sets, rows, monkeypatch):
    """The head's workers and root on PEs of their own after each K-line (`Knobs.head_workers`,
    HeadTiling.apart): the header and the sum multicast from the last weighted PE to all of them, each
    worker's slice kept from it, the weighted PEs on to the next item during the rounds (two of the
    prompt's items are scored); ln_f and an embedding in the strip span the weighted PEs alone. In two
    sets (`Knobs.head_sets`) the three scored items go to the first set, the second and the first again
    (the turn holds across steps), and io.out reads their records in that turn. A K-line of one
    weighted PE multicasts its own logits.
    The rounds' chains back up into full output queues: the executor looks at an operation held so
    again only when the queue's room changes, not at every wavelet that becomes ready at its input
    (once a cycle per operation, most of this run's time before)."""
    from dataclasses import replace

    from csl_executor import pe as pe_module
    from wafer_gpt2.plan import build_plan
    from wafer_gpt2.plan import search as search_module

    advance = pe_module.StreamOp.advance
    moved, held = [0], [0]

    def counted(op, t):
        before = op.pos
        advance(op, t)
        if op.pos != before:
            moved[0] += 1
        elif not op.done and op.blocked_on.startswith("no room"):
            held[0] += 1

    monkeypatch.setattr(pe_module.StreamOp, "advance", counted)

    vocab = 4096 if embeds else 512  # the copy of wte by rows needs more rows than layer 0 leaves
    config = GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=vocab, n_positions=32, name="tiny-apart")
    knobs = search_module._candidate_knobs

    def apart(*args, **kwargs):
        return [
            replace(k, strip_pes=rows + 3 * sets, head_workers=2, head_sets=sets)
            for k in knobs(*args, **kwargs)
            if k.stream_pes == 2
        ]

    monkeypatch.setattr(search_module, "_candidate_knobs", apart)
    search_module.forget_kept_plans()
    plan = build_plan(config, arch=arch, dtype="fp32", slots=1, context=32, top_k=8, objective="compact")
    search_module.forget_kept_plans()
    head, ln_f, embed = plan.region("head"), plan.region("ln_f"), plan.region("embed")
    assert head.tiling.apart and head.tiling.workers == 2 and head.tiling.sets == sets
    assert head.w == head.tiling.line == rows + 3 * sets
    assert ln_f.w == head.tiling.gemv.rows == rows
    assert ("wte" not in embed.symbols) == embeds and (embed.x == head.x and embed.w == 2) == embeds
    two_steps_equal_the_simulator(plan, GPT2Params.random(config, seed=5))
    assert held[0] <= moved[0], f"{held[0]} looks at operations held by a full output queue, {moved[0]} moves"


@pytest.mark.parametrize(
    ("arch", "bands"),
    [("wse2", 3), ("wse2", 2), pytest.param("wse3", 3, marks=pytest.mark.executor_full)],
)
def test_interlocked_bands_equal_the_simulator(arch, bands, monkeypatch):
    """Bands of one layer, interlocked (`Knobs.interlock`): the second band upside down, a stream's
    width east, its FC and proj in the rows under the first band's attention; the stream turns into it
    from the first band's east end and out of it from its top, past its attention, into the third
    band, or (two bands) from there to ln_f in the strip."""
    from dataclasses import replace

    from wafer_gpt2.plan import build_plan
    from wafer_gpt2.plan import search as search_module

    config = GPT2Config(
        n_layer=bands, n_head=2, n_embd=32, vocab_size=512, n_positions=32, name="tiny-interlock"
    )
    knobs = search_module._candidate_knobs

    def interlocked(*args, **kwargs):
        return [  # attention as wide as FC and proj together, which stand under it
            replace(k, attn_chain=4 * k.fold, bands=bands, interlock=True)
            for k in knobs(*args, **kwargs)
            if k.stream_pes == 2 and k.fold <= 2
        ]

    monkeypatch.setattr(search_module, "_candidate_knobs", interlocked)
    search_module.forget_kept_plans()
    plan = build_plan(config, arch=arch, dtype="fp32", slots=1, context=32, top_k=8, objective="compact")
    search_module.forget_kept_plans()
    assert plan.knobs.interlock
    attention, fc, proj = plan.region("L0.attn"), plan.region("L1.fc"), plan.region("L1.proj")
    west, east = min(fc.x, proj.x), max(fc.x + fc.w, proj.x + proj.w)
    assert fc.y >= attention.y + attention.h and attention.x <= west < east <= attention.x + attention.w
    assert plan.region("L1.attn").y >= fc.y + fc.h
    if bands > 2:
        assert plan.region("L2.qkv").y > plan.region("L1.attn").y
    two_steps_equal_the_simulator(plan, GPT2Params.random(config, seed=7))
