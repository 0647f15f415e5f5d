"""The host program: drives any runtime (simulator or SDK) through memcpy only.

    runtime = SimRuntime(plan)                     # or an SDK runtime with the same contract
    model = WaferGPT2(plan, runtime)                # load() + run()
    model.upload(params)                            # every region's symbols, memcpy_h2d copy mode
    scores = model.step(StepInputs.of_items([StepItem(slot, position, token), ...]))  # a StepScores
    model.submit(inputs); ...; scores = model.collect()                              # steps in flight

Each step sends one message per pipeline replica onto its input stream and reads back one record per
item that asked for scores (`wafer_gpt2.core.wire`). Both are non-blocking memcpy commands issued
by `submit`; `collect` waits for the oldest step's records. With `steps_in_flight` above 1 the
engine sends the next step while the wafer computes one, on slots the earlier ones do not touch.
Where memcpy runs one command at a time (the SDK's runtimes: `serial_memcpy`), a D2H holds back every
command after it until its records have come, so the host asks for records as late as each replica's
io.out allows (`Plan.records_held`): the next step's messages go in before this one's records are read.
Slots are numbered across replicas: replica r owns slots r * plan.slots .. (r + 1) * plan.slots - 1.
The host never looks inside the runtime: everything it knows about the wafer comes from the plan and
from what memcpy returns.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from tqdm import tqdm

from wafer_gpt2.core import memory_layout
from wafer_gpt2.core.abi import CYCLES_SYMBOL, WEIGHT_SYMBOLS
from wafer_gpt2.core.runtime import (
    MemcpyDataType,
    MemcpyOrder,
    Runtime,
    Task,
    from_wire,
    hwl_to_flat,
    to_wire,
)
from wafer_gpt2.core.steps import SLOT, Backend, BackendError, StepInputs, StepScores
from wafer_gpt2.core.wire import D2H_COLOR, H2D_COLOR, decode_scores, record_words, step_message
from wafer_gpt2.errors import InvalidInput
from wafer_gpt2.model.params import GPT2Params
from wafer_gpt2.plan.checks import check_layer_norms_folded

if TYPE_CHECKING:
    from wafer_gpt2.plan.structure import Plan

# What `describe` shows of the plan (its regions and routes are for `wafer-gpt2 plan`, not for /info).
PLAN_SUMMARY_KEYS = (
    "version",
    "arch",
    "dtype",
    "objective",
    "slots",
    "context",
    "top_k",
    "fabric",
    "kernel",
    "summary",
)


@dataclass
class _Read:
    """The records of one message's scored items: how many items it has, which of them are scored
    (message numbering) and their numbers in the step, which asked for a target, the buffer the
    runtime fills, where they come from, and the runtime's task once they are asked for."""

    count: int  # the message's items
    scored: np.ndarray  # int64, in the message's numbering
    index: np.ndarray | None  # the scored items' numbers in the step (None: the message is the step)
    asked: np.ndarray  # bool
    words: np.ndarray
    replica: int
    task: Any = None  # None until the D2H is issued (`WaferGPT2._ask`)


class WaferGPT2:
    """GPT-2 on a wafer: implements `wafer_gpt2.core.steps.PipelinedBackend` (`step`, or `submit` and
    `collect` apart with up to `steps_in_flight` steps in flight)."""

    def __init__(
        self,
        plan: Plan,
        runtime: Runtime,
        params: GPT2Params | None = None,
        progress: bool = False,
        steps_in_flight: int = 1,
    ) -> None:
        """Start the program (load + run, unless the runtime already runs) and, given `params`, upload them."""
        if steps_in_flight < 1:
            raise InvalidInput(f"steps_in_flight must be at least 1, got {steps_in_flight}")
        self.plan = plan
        self.steps_in_flight = steps_in_flight
        # (items, records asked for, slots) of each step submitted and not collected, oldest first
        self._in_flight: deque[tuple[int, list[_Read], frozenset[int]]] = deque()
        self._slots_in_flight: set[int] = set()
        # Where memcpy runs one command at a time: the reads sent and not yet asked for, oldest first,
        # and per replica the records they leave in its io.out.
        self._unasked: deque[_Read] = deque()
        self._unread = [0] * plan.replicas
        self.runtime = runtime
        self.num_slots = plan.slots * plan.replicas
        self.context_length = plan.context
        self.vocab_size = plan.config.vocab_size
        self.top_k = plan.top_k
        # Positions held per slot (the next position to write).
        self._lengths = np.zeros(self.num_slots, dtype=np.int64)
        if not getattr(runtime, "running", False):
            runtime.load()
            runtime.run()
        if params is not None:
            self.upload(params, progress=progress)

    def describe(self) -> dict:
        # Each runtime names its backend; the host program is the same on all of them.
        backend = getattr(self.runtime, "backend", type(self.runtime).__name__)
        plan = self.plan.to_json() if hasattr(self.plan, "to_json") else {}
        return {
            "backend": backend,
            "device_type": "wafer" if backend.startswith("sdk") else backend,
            "dtype": self.plan.dtype,
            "num_slots": self.num_slots,
            "context_length": self.context_length,
            "vocab_size": self.vocab_size,
            "top_k": self.top_k,
            "plan": {key: plan[key] for key in PLAN_SUMMARY_KEYS if key in plan},
        }

    # -- weights -----------------------------------------------------------------------------------

    def upload(self, params: GPT2Params, progress: bool = False) -> None:
        """Copy every region's weights into its PEs, region by region (memcpy_h2d, copy mode).

        Transfers are non-blocking: the next region is packed while the previous one is copied."""
        have, want = params.config, self.plan.config
        shape = ("n_layer", "n_head", "n_embd", "vocab_size")
        if any(getattr(have, f) != getattr(want, f) for f in shape):
            raise InvalidInput(
                "the checkpoint's config ("
                + ", ".join(f"{f}={getattr(have, f)}" for f in shape)
                + ") does not match the plan's ("
                + ", ".join(f"{f}={getattr(want, f)}" for f in shape)
                + ")"
            )
        check_layer_norms_folded(self.plan)  # a layer strip's gain and bias have no home on its PEs
        weights = [r for r in self.plan.regions if r.kind in WEIGHT_SYMBOLS]
        total = sum(
            r.symbols[s].nbytes * r.w * r.h for r in weights for s in WEIGHT_SYMBOLS[r.kind] if s in r.symbols
        )
        tasks: list[Task] = []
        with tqdm(total=total, unit="B", unit_scale=True, desc="upload", disable=not progress) as bar:
            for region in weights:
                for symbol, tiles in _region_tensors(region, params):
                    tasks.append(self._copy_in(region, symbol, tiles))
                    bar.update(region.symbols[symbol].nbytes * region.w * region.h)
            for task in tasks:
                self.runtime.task_wait(task)

    def _copy_in(self, region: Any, symbol: str, tiles: np.ndarray) -> Task:
        """Tiling-indexed values -> the region's memory image -> 32-bit wire words -> memcpy_h2d."""
        spec = region.symbols[symbol]
        dtype = memory_layout.symbol_dtype(spec.dtype)
        values = tiles.astype(dtype)
        if not np.isfinite(values).all() and np.isfinite(tiles).all():
            raise InvalidInput(
                f"region {region.name!r} symbol {symbol!r}: a weight overflows {dtype} (|w| > 65504)"
            )
        flat = values.reshape(*values.shape[:-1], -1)
        padded = np.zeros((*flat.shape[:-1], spec.elems), dtype=dtype)
        padded[..., : flat.shape[-1]] = flat
        image = memory_layout.scatter(padded, memory_layout.pe_coords(region), region.h, region.w)
        words = hwl_to_flat(to_wire(image), MemcpyOrder.ROW_MAJOR)
        return self.runtime.memcpy_h2d(
            self.runtime.get_id(symbol),
            words,
            region.x,
            region.y,
            region.w,
            region.h,
            spec.elems,
            streaming=False,
            data_type=MemcpyDataType.MEMCPY_16BIT if dtype.itemsize == 2 else MemcpyDataType.MEMCPY_32BIT,
            order=MemcpyOrder.ROW_MAJOR,
            nonblock=True,
        )

    # -- steps -------------------------------------------------------------------------------------

    def step(self, inputs: StepInputs) -> StepScores:
        if self._in_flight:
            raise BackendError("step() with steps in flight: collect them first")
        self.submit(inputs)
        return self.collect()

    def submit(self, inputs: StepInputs) -> None:
        """Send a step's messages and ask for its records (non-blocking memcpy both ways), so the host
        prepares the next step while the wafer computes this one; `collect` waits for them. Where
        memcpy runs one command at a time, the records are asked for as late as what io.out holds
        allows (at the latest by `collect`), so that a later step's messages go in before them."""
        if len(self._in_flight) >= self.steps_in_flight:
            raise BackendError(f"{len(self._in_flight)} steps are in flight already: collect one first")
        inputs.validate(self.num_slots, self.context_length, self.vocab_size)
        slot_set = inputs.slot_set
        if busy := slot_set & self._slots_in_flight:
            raise BackendError(f"slots {sorted(busy)} have items in a step still in flight")
        # Each slot's first position, and the next position to write after the step.
        first: np.ndarray | None = None
        if len(slot_set) == len(inputs):  # one item per slot (a decode step)
            slots, starts = inputs.slot, inputs.position
            ends = starts + 1
        else:
            slots, first, counts = np.unique(inputs.slot, return_index=True, return_counts=True)
            starts = inputs.position[first]
            ends = starts + counts
        gaps = np.flatnonzero(starts > self._lengths[slots])
        if gaps.size:
            gap = int(gaps[0])
            slot, index = int(slots[gap]), gap if first is None else int(first[gap])
            raise BackendError(
                f"item {index}: slot {slot} position {starts[gap]} leaves a gap (the slot holds "
                f"{self._lengths[slot]} positions)"
            )
        per_replica: list[np.ndarray | None]  # each replica's items (None: the whole step is one message)
        if self.plan.replicas == 1:
            per_replica = [None] if len(inputs) else []
        else:
            replica = inputs.slot // self.plan.slots
            per_replica = [np.flatnonzero(replica == r) for r in np.unique(replica).tolist()]
        reads: list[_Read | None] = []
        if not getattr(self.runtime, "serial_memcpy", False):
            # Stream every replica's message in, then ask for every replica's records.
            for indices in per_replica:
                self._send(inputs if indices is None else inputs.take(indices))
            reads = [self._ask(self._read(indices, inputs)) for indices in per_replica]
        else:
            # memcpy runs one command at a time: a D2H starts only when the H2D before it has ended, so
            # a message whose records do not fit what its replica's io.out still has room for would
            # stall its H2D and everything behind it. Each message carries at most `records_held`
            # scored items; the records are asked for only when the next message would not fit
            # (every one asked for then, oldest first), or at `collect`. So every replica's message
            # goes in before any record is read, and a later step's before this one's records.
            bound = self.plan.records_held
            parts = []
            for indices in per_replica:
                whole = np.arange(len(inputs)) if indices is None else indices
                parts.append(_parts(whole, inputs.want_scores[whole], bound))
            for k in range(max((len(p) for p in parts), default=0)):
                for part in (p[k] for p in parts if k < len(p)):
                    read = self._read(part, inputs)
                    if read is not None and self._unread[read.replica] + read.scored.size > bound:
                        self._ask_unasked(len(self._unasked))
                    self._send(inputs.take(part))
                    if read is not None:
                        self._unasked.append(read)
                        self._unread[read.replica] += read.scored.size
                    reads.append(read)
        self._lengths[slots] = ends
        self._in_flight.append((len(inputs), [read for read in reads if read is not None], slot_set))
        self._slots_in_flight |= slot_set

    def collect(self) -> StepScores:
        """The oldest step in flight's scores, once its records are read (waiting for them)."""
        if not self._in_flight:
            raise BackendError("no step is in flight")
        count, reads, slots = self._in_flight.popleft()
        self._slots_in_flight -= slots
        self._ask_unasked(sum(read.task is None for read in reads))  # this step's: the oldest unasked
        parts = [self._decode(read) for read in reads]
        return StepScores.concat(parts, count) if parts else StepScores.empty(count, self.top_k)

    def _read(self, indices: np.ndarray | None, inputs: StepInputs) -> _Read | None:
        """The records of one message's scored items, `indices` of the step's (None: all of them), not
        yet asked for; None when it has none."""
        if indices is None:
            count, first_slot = len(inputs), int(inputs.columns[SLOT, 0])
            if inputs.decode_only:
                scored, asked = np.arange(count), np.zeros(count, dtype=bool)
            else:
                scored = np.flatnonzero(inputs.want_scores)
                asked = inputs.has_target[scored]
        else:
            count, first_slot = indices.size, int(inputs.slot[indices[0]])
            scored = np.flatnonzero(inputs.want_scores[indices])
            asked = inputs.has_target[indices[scored]]
        if not scored.size:
            return None
        words = np.zeros(scored.size * record_words(self.top_k), dtype=np.uint32)
        index = None if indices is None else indices[scored]  # the rows' items in the step
        return _Read(count, scored, index, asked, words, first_slot // self.plan.slots)

    def _ask(self, read: _Read | None) -> _Read | None:
        """Ask (non-blocking) for a message's records: the D2H from its replica's output port."""
        if read is not None:
            _, port_out = self.plan.io_ports(read.replica)
            words = read.words
            read.task = self.runtime.memcpy_d2h(
                words, D2H_COLOR, port_out.x, port_out.y, 1, 1, words.size, streaming=True, nonblock=True
            )
        return read

    def _ask_unasked(self, n: int) -> None:
        """Ask for the `n` oldest reads not yet asked for, in the order their messages went in."""
        for _ in range(n):
            read = self._unasked.popleft()
            self._ask(read)
            self._unread[read.replica] -= read.scored.size

    def _decode(self, read: _Read) -> StepScores:
        """Wait for one message's records and decode them, numbered as the step's items."""
        self.runtime.task_wait(read.task)
        return decode_scores(
            read.words, self.top_k, read.scored, read.asked, count=read.count, index=read.index
        )

    def _send(self, inputs: StepInputs) -> None:
        replica = int(inputs.slot[0]) // self.plan.slots
        port_in, _ = self.plan.io_ports(replica)
        words = step_message(inputs, self.plan.slots)
        self.runtime.memcpy_h2d(
            H2D_COLOR, words, port_in.x, port_in.y, 1, 1, words.size, streaming=True, nonblock=True
        )

    # -- slots ---------------------------------------------------------------------------------------

    def free_slot(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise BackendError(f"slot {slot} outside 0..{self.num_slots - 1}")
        if slot in self._slots_in_flight:
            raise BackendError(f"slot {slot} has items in a step still in flight: it cannot be freed yet")
        replica, local = divmod(slot, self.plan.slots)
        self.runtime.launch("clear_slot", np.uint16(replica), np.uint16(local))
        self._lengths[slot] = 0

    def reset(self) -> None:
        # The steps in flight are dropped (a reset follows a failed step), but their records are still
        # asked for: left in io.out, they would be read as the next step's.
        self._ask_unasked(len(self._unasked))
        self._in_flight.clear()
        self._slots_in_flight.clear()
        for slot in range(self.num_slots):
            if self._lengths[slot]:
                self.free_slot(slot)

    def close(self) -> None:
        self.runtime.stop()

    # -- modeled cycles ------------------------------------------------------------------------------

    def last_step_cycles(self, replica: int = 0) -> dict[str, int]:
        """Every region's modeled busy cycles in the last step, read back from its `cycles` counter
        (the simulator fills it from the cost model; on hardware the PE programs' timestamps)."""
        out: dict[str, int] = {}
        symbol = self.runtime.get_id(CYCLES_SYMBOL)
        for region in self.plan.regions:
            if region.replica != replica:
                continue
            words = np.zeros(2, dtype=np.uint32)
            self.runtime.memcpy_d2h(words, symbol, region.x, region.y, 1, 1, 2, streaming=False)
            value = from_wire(words, np.uint32).astype(np.uint64)
            out[region.name] = int(value[0] | (value[1] << np.uint64(32)))
        return out


def _parts(indices: np.ndarray, scored: np.ndarray, bound: int) -> list[np.ndarray]:
    """Split a message's items (in order) into messages of at most `bound` scored items each: a new
    part starts at each scored item numbered bound, 2 bound, ... among the scored."""
    number = np.cumsum(scored) - 1  # each scored item's number among the scored
    starts = np.flatnonzero(scored & (number > 0) & (number % bound == 0))
    return [part for part in np.split(indices, starts) if part.size]


def _region_tensors(region: Any, params: GPT2Params) -> list[tuple[str, np.ndarray]]:
    """The tiling-indexed values of every weight symbol of one region (none for activations)."""
    tiling = region.tiling
    op = region.name.rsplit(".", 1)[-1]
    if region.kind == "gemv":
        layer = params.layers[region.layer]
        weight, bias = {
            "qkv": (layer.attn_w, layer.attn_b),
            "attn_proj": (layer.attn_proj_w, layer.attn_proj_b),
            "fc": (layer.fc_w, layer.fc_b),
            "proj": (layer.proj_w, layer.proj_b),
        }[op]
        if not tiling.norm_fold:
            return [
                ("w", memory_layout.gemv_weight_tiles(weight, tiling)),
                ("b", memory_layout.gemv_bias_tiles(bias, tiling)),
            ]
        # the LayerNorm before it folded in
        gain, beta = {"qkv": (layer.ln_1_g, layer.ln_1_b), "fc": (layer.ln_2_g, layer.ln_2_b)}[op]
        stored = memory_layout.symbol_dtype(region.symbols["w"].dtype)
        weight, bias, colsum = memory_layout.fold_layernorm(weight, bias, gain, beta, stored)
        return [
            ("w", memory_layout.gemv_weight_tiles(weight, tiling)),
            ("norm_b", memory_layout.gemv_bias_tiles(bias, tiling)),
            ("norm_g", memory_layout.gemv_bias_tiles(colsum, tiling)),
        ]
    if region.kind == "layernorm":
        if not tiling.normalise:
            return []  # it passes x on to a GEMV that has the LayerNorm folded in
        return [  # ln_f: `upload` refused a plan that normalises in a layer's strip
            ("gain", memory_layout.norm_tiles(params.ln_f_g, tiling)),
            ("bias", memory_layout.norm_tiles(params.ln_f_b, tiling)),
        ]
    if region.kind == "embed":
        tables = [name for name in ("wte", "wpe") if name in region.symbols]  # wte where it holds a copy
        return [(name, memory_layout.table_tiles(getattr(params, name), region, name)) for name in tables]
    if region.kind == "embed_head":
        return [("w", memory_layout.gemv_weight_tiles(params.wte.T, tiling.gemv))]
    return []


# ----------------------------------------------------------------------------------------------------
# Starting the host program on a runtime: what every wafer backend (sim, csl, SDK) shares.


@dataclass(frozen=True)
class BackendOptions:
    slots: int = 16
    context: int | None = None  # None: the model's n_positions
    dtype: str = "fp16"  # fp16 (hardware default) or fp32; the reference is always fp32
    top_k: int = 64
    arch: str = "wse2"
    replicas: int = 1  # pipeline replicas on the wafer (sim / SDK); slots are divided among them
    objective: str | None = None  # the plan's objective; None: latency, compact for the csl backend
    steps_in_flight: int = 1  # steps the host program keeps on the wafer at a time (`WaferGPT2.submit`)


def plan_for(params: GPT2Params, options: BackendOptions) -> Plan:
    """The plan every wafer backend (sim and SDK) runs for these options: slots split among the replicas."""
    from wafer_gpt2.plan import build_plan

    if options.replicas < 1 or options.slots % options.replicas:
        raise InvalidInput(
            f"slots ({options.slots}) must be a positive multiple of replicas ({options.replicas}): "
            "every replica holds the same number of slots"
        )
    return build_plan(
        params.config,
        arch=options.arch,
        dtype=options.dtype,
        slots=options.slots // options.replicas,
        context=options.context,
        replicas=options.replicas,
        top_k=options.top_k,
        objective=options.objective or "latency",
    )


def start_model(
    plan: Plan, runtime: Runtime, params: GPT2Params, progress: bool = False, steps_in_flight: int = 1
) -> Backend:
    """The host program on a runtime: load and run the wafer program, upload the weights; if any of
    that fails the runtime is stopped (no half-started wafer is left behind)."""
    try:
        return WaferGPT2(plan, runtime, params, progress=progress, steps_in_flight=steps_in_flight)
    except BaseException:
        runtime.stop()
        raise
