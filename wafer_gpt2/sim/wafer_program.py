"""The wafer program of a plan, executed region by region on the simulated PE memory.

One replica is one pipeline: io.in -> embed -> per layer [ln_1, qkv, attn, attn_proj, res_1, ln_2,
fc, proj, res_2] -> ln_f -> head -> io.out. A step is one input-stream message (`wafer_gpt2.core.wire`): its
items pass every region in turn, the whole batch at once (region by region, the order a token
stream takes through the pipeline). Within a layer every item's K/V is written before attention
runs, and item b only sees positions <= its own: the same as tokens streaming through back to back.

Every region reads its weights from its PE memory (`WaferMemory`); the float32 compute caches derived
from them are rebuilt whenever the host writes the symbol again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from wafer_gpt2.core import memory_layout
from wafer_gpt2.core.abi import CYCLES_SYMBOL, LAYER_OPS
from wafer_gpt2.core.cost import attention_cost
from wafer_gpt2.core.steps import StepInputs
from wafer_gpt2.core.tiling import AttentionTiling
from wafer_gpt2.core.wire import encode_scores
from wafer_gpt2.sim import kernels, parallel
from wafer_gpt2.sim.memory import RegionMemory, WaferMemory

if TYPE_CHECKING:
    from wafer_gpt2.plan.structure import Plan

# Steps of at least this many items run the layers as one part per thread, split by slot; smaller ones
# split the work inside each region instead (the measurement behind it: docs/simulator.md, "Speed").
LAYER_SPLIT_ITEMS = 64


def slot_parts(slots: np.ndarray, parts: int) -> list[np.ndarray]:
    """Split item indices into at most `parts` groups of whole slots with near-equal item counts
    (largest slots first, each to the lightest group); each group keeps the items' order."""
    names, counts = np.unique(slots, return_counts=True)
    if parts < 2 or len(names) < 2:
        return [np.arange(len(slots))]
    load = [0] * parts
    owner = {}
    for index in np.argsort(-counts, kind="stable"):
        lightest = load.index(min(load))
        owner[int(names[index])] = lightest
        load[lightest] += int(counts[index])
    part_of = np.array([owner[int(slot)] for slot in slots])
    return [rows for p in range(parts) if (rows := np.flatnonzero(part_of == p)).size]


class KernelFault(RuntimeError):
    """What would crash or corrupt the wafer program (an item outside the plan's limits)."""


@dataclass
class Pipeline:
    """The regions of one replica, by role."""

    replica: int
    io_in: RegionMemory
    io_out: RegionMemory
    embed: RegionMemory
    head: RegionMemory
    ln_f: RegionMemory
    layers: list[dict[str, RegionMemory]] = field(default_factory=list)

    def regions(self) -> list[RegionMemory]:
        fixed = [self.io_in, self.embed]
        per_layer = [layer[op] for layer in self.layers for op in LAYER_OPS]
        return fixed + per_layer + [self.ln_f, self.head, self.io_out]


@dataclass
class _PipelineCosts:
    """Per-item modeled cycles of one replica's regions, in `Pipeline.regions()` order."""

    regions: list[RegionMemory]
    indices: np.ndarray  # memory region index of each row
    per_item: np.ndarray  # cycles per item handled
    scored_only: np.ndarray  # ln_f, head, io.out see only the items that asked for scores
    attention: dict[int, np.ndarray]  # row -> cycles by attended positions (0..context)


class WaferProgram:
    def __init__(self, plan: Plan, memory: WaferMemory) -> None:
        self.plan = plan
        self.memory = memory
        self.config = plan.config
        self.fp16 = plan.dtype == "fp16"
        self.pipelines = [self._pipeline(plan, memory, replica) for replica in range(plan.replicas)]
        self._caches: dict[tuple[int, str], tuple[int, np.ndarray]] = {}
        self._kv: dict[tuple[int, str], tuple[int, np.ndarray]] = {}
        self._coords: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._costs: dict[int, _PipelineCosts] = {}
        self._attention_tables: dict[AttentionTiling, np.ndarray] = {}
        self.total_cycles = np.zeros(len(memory.regions), dtype=np.uint64)

    @staticmethod
    def _pipeline(plan: Plan, memory: WaferMemory, replica: int) -> Pipeline:
        by_name = {m.region.name: m for m in memory.regions if m.region.replica == replica}
        try:
            pipeline = Pipeline(
                replica,
                io_in=by_name["io.in"],
                io_out=by_name["io.out"],
                embed=by_name["embed"],
                head=by_name["head"],
                ln_f=by_name["ln_f"],
            )
            for layer in range(plan.config.n_layer):
                pipeline.layers.append({op: by_name[f"L{layer}.{op}"] for op in LAYER_OPS})
        except KeyError as missing:
            raise KernelFault(f"the plan has no region {missing.args[0]!r} in replica {replica}") from None
        return pipeline

    # -- caches derived from PE memory ------------------------------------------------------------

    def coords(self, region: RegionMemory) -> tuple[np.ndarray, np.ndarray]:
        if region.index not in self._coords:
            self._coords[region.index] = memory_layout.pe_coords(region.region)
        return self._coords[region.index]

    def _cached(self, region: RegionMemory, symbol: str, build) -> np.ndarray:
        key = (region.index, symbol)
        version = region.versions[symbol]
        hit = self._caches.get(key)
        if hit is None or hit[0] != version:
            tiles = memory_layout.gather(region.arrays[symbol], self.coords(region))
            hit = (version, build(tiles))
            self._caches[key] = hit
        return hit[1]

    def gemv_weights(self, region: RegionMemory) -> tuple[np.ndarray, np.ndarray | None]:
        """(weights, bias) of a GEMV or the head; the bias is `norm_b` where the LayerNorm is folded in."""
        tiling = region.region.tiling
        gemv = getattr(tiling, "gemv", tiling)
        weight = self._cached(region, "w", lambda tiles: kernels.gemv_weight_cache(tiles, gemv))
        bias = next((s for s in ("b", "norm_b") if s in region.arrays), None)
        if bias is None:
            return weight, None
        return weight, self._cached(region, bias, lambda tiles: kernels.gemv_bias_cache(tiles, gemv))

    def norm_colsum(self, region: RegionMemory) -> np.ndarray:
        """colsum(diag(gain) @ W) of a GEMV with the LayerNorm folded in, [N] float32 in N order."""
        tiling = region.region.tiling
        return self._cached(region, "norm_g", lambda tiles: kernels.gemv_bias_cache(tiles, tiling))

    def norm_params(self, region: RegionMemory) -> tuple[np.ndarray, np.ndarray]:
        tiling = region.region.tiling
        gain = self._cached(region, "gain", lambda tiles: kernels.norm_cache(tiles, tiling))
        return gain, self._cached(region, "bias", lambda tiles: kernels.norm_cache(tiles, tiling))

    def kv_store(self, region: RegionMemory, symbol: str) -> np.ndarray:
        """The float32 [slot, head, position, head_dim] copy of an attention region's `k_cache` or
        `v_cache` (`kernels.kv_logical`): kept in step with the PE memory by every write the program
        makes (`write_kv`, `clear_slot`), rebuilt from the memory when the host wrote the symbol.
        Until the symbol is first written the memory is zeros, and so is the copy (allocated lazily by
        the OS, so a slot's pages cost memory only once the slot is used)."""
        key, version = (region.index, symbol), region.versions[symbol]
        hit = self._kv.get(key)
        if hit is None or hit[0] != version:
            tiling: AttentionTiling = region.region.tiling
            if version == 0:
                positions = tiling.chain * tiling.positions_per_pe
                store = np.zeros((tiling.slots, tiling.n_head, positions, tiling.head_dim), np.float32)
            else:
                store = kernels.kv_logical(region.arrays[symbol], tiling, *self.coords(region), symbol)
            hit = (version, store)
            self._kv[key] = hit
        return hit[1]

    def _write_kv(
        self, region: RegionMemory, symbol: str, values: np.ndarray, slots: np.ndarray, positions: np.ndarray
    ) -> None:
        """Each item's K or V [B, C] into the PE that owns its position, and into the float32 copy.
        Threads write disjoint slots; `run_step` counts the write (`_bump_kv`) once they are done."""
        tiling: AttentionTiling = region.region.tiling
        store = self.kv_store(region, symbol)
        memory = region.arrays[symbol]
        kernels.write_kv(memory, values, slots, positions, tiling, *self.coords(region), symbol)
        stored = values.astype(memory.dtype).astype(np.float32)  # what the memory's dtype kept
        store[slots, :, positions] = stored.reshape(len(slots), tiling.n_head, tiling.head_dim)

    def _bump_kv(self, region: RegionMemory, symbol: str, store: np.ndarray) -> None:
        region.versions[symbol] += 1
        self._kv[(region.index, symbol)] = (region.versions[symbol], store)

    def embedding_rows(self, region: RegionMemory, symbol: str, rows: np.ndarray) -> np.ndarray:
        """Rows [B, C] float32 of the embedding's table `symbol` ("wte" or "wpe"), read where the PEs
        hold them (memory_layout.table_tiles: PE row j holds the table's rows j*per .. +per): no copy
        of the table is kept beside the PE memory."""
        dim = self.config.n_embd
        per, tk = memory_layout.embed_geometry(region.region, symbol, dim)
        ys, xs = self.coords(region)  # [PE rows, k chunks]
        j, p = np.divmod(rows, per)
        within = (p * tk)[:, None] + np.arange(tk)  # [B, tk]
        values = region.arrays[symbol][ys[j][:, :, None], xs[j][:, :, None], within[:, None, :]]
        return values.reshape(len(rows), -1)[:, :dim].astype(np.float32)

    # -- one step ----------------------------------------------------------------------------------

    def check_items(self, items: StepInputs) -> None:
        """The limits the PE programs rely on (the host checks them first; this is the wafer's guard)."""
        plan, cfg = self.plan, self.config
        for field_name, values, limit in (
            ("slot", items.slot, plan.slots),
            ("position", items.position, plan.context),
            ("token", items.token, cfg.vocab_size),
        ):
            bad = np.flatnonzero(values >= limit)
            if bad.size:
                raise KernelFault(
                    f"input stream item {int(bad[0])}: {field_name} {int(values[bad[0]])} is outside the "
                    f"program's 0..{limit - 1}"
                )
        bad = np.flatnonzero(items.target >= cfg.vocab_size)
        if bad.size:
            raise KernelFault(
                f"input stream item {int(bad[0])}: target {int(items.target[bad[0]])} outside the vocabulary"
            )

    def run_step(self, replica: int, items: StepInputs) -> np.ndarray:
        """Execute one input message on one replica; returns the output-stream words.

        The layers of different slots share nothing within a step (each slot attends only to its
        own K/V), so a large step is split by slot into one part per simulator thread and each part
        runs through the layers on its own thread (`wafer_gpt2.sim.parallel`); a small step runs them
        whole, its large GEMVs split by columns. ln_f and the head take every scored item at once.
        Each item's arithmetic is the same either way, up to the order BLAS picks for the products
        inside one PE's tile, which varies with the shape of the call (docs/simulator.md)."""
        self.check_items(items)
        pipe = self.pipelines[replica]
        self._prepare(pipe)
        x = np.empty((len(items), self.config.n_embd), dtype=np.float32)

        def run_layers(rows: np.ndarray) -> None:
            x[rows] = self._layers(pipe, items.token[rows], items.slot[rows], items.position[rows])

        split = len(items) >= LAYER_SPLIT_ITEMS
        parallel.map_all(run_layers, slot_parts(items.slot, parallel.threads() if split else 1))
        for layer in pipe.layers:
            for symbol in ("k_cache", "v_cache"):
                self._bump_kv(layer["attn"], symbol, self.kv_store(layer["attn"], symbol))

        scored = np.flatnonzero(items.want_scores)
        self._count_cycles(pipe, items, scored.size)
        if scored.size == 0:
            return np.zeros(0, dtype=np.uint32)
        eps = self.config.layer_norm_epsilon
        h = kernels.layernorm_region(x[scored], *self.norm_params(pipe.ln_f), pipe.ln_f.region.tiling, eps)
        head_weights, _ = self.gemv_weights(pipe.head)
        ids, logits, lse, target = kernels.head_scores(
            h, head_weights, self.plan.head, items.target[scored], self.fp16
        )
        return encode_scores(scored, ids, logits, lse, target)

    def _prepare(self, pipe: Pipeline) -> None:
        """Build (or check) every compute cache and K/V store here, so the threads only read them."""
        self.gemv_weights(pipe.head)
        self.norm_params(pipe.ln_f)
        for layer in pipe.layers:
            for op in ("qkv", "attn_proj", "fc", "proj"):
                self.gemv_weights(layer[op])
            for op in ("qkv", "fc"):
                self.norm_colsum(layer[op])
            for symbol in ("k_cache", "v_cache"):
                self.kv_store(layer["attn"], symbol)

    def _layers(
        self, pipe: Pipeline, tokens: np.ndarray, slots: np.ndarray, positions: np.ndarray
    ) -> np.ndarray:
        """embed and every layer for these items (whole slots) -> the residual stream [B, C]."""
        c, fp16 = self.config.n_embd, self.fp16
        # embed: the token's wte row from the embedding's copy, or the head's tiles where it has none, and
        # the position's wpe row from the embedding's PEs (fp32 sum).
        if "wte" in pipe.embed.arrays:
            x = self.embedding_rows(pipe.embed, "wte", tokens)
        else:
            x = kernels.embed(tokens, self.gemv_weights(pipe.head)[0], self.plan.head)
        x = x + self.embedding_rows(pipe.embed, "wpe", positions)
        for layer in pipe.layers:
            # qkv has ln_1 folded in, its statistics made by ln_1's strip (wafer_gpt2/core/tiling.py); so has fc ln_2
            qkv = self._gemv(layer["qkv"], x, layer["ln_1"])
            attn = layer["attn"]
            self._write_kv(attn, "k_cache", qkv[:, c : 2 * c], slots, positions)
            self._write_kv(attn, "v_cache", qkv[:, 2 * c :], slots, positions)
            a = kernels.attention_region(
                qkv[:, :c],
                self.kv_store(attn, "k_cache"),
                self.kv_store(attn, "v_cache"),
                slots,
                positions,
                attn.region.tiling,
                fp16,
            )
            x = kernels.residual_add(self._gemv(layer["attn_proj"], a), x)  # res_1
            f = kernels.gelu_tanh(self._gemv(layer["fc"], x, layer["ln_2"]))
            x = kernels.residual_add(self._gemv(layer["proj"], f), x)  # res_2
        return x

    def _gemv(self, region: RegionMemory, x: np.ndarray, strip: RegionMemory | None = None) -> np.ndarray:
        """The GEMV `region` on x; with the LayerNorm folded in, `strip` is the LayerNorm strip that
        makes its statistics."""
        weight, bias = self.gemv_weights(region)
        tiling = region.region.tiling
        if tiling.bias_at_root:
            return kernels.gemv_region(x, weight, tiling, self.fp16, bias)
        sums = kernels.gemv_region(x, weight, tiling, self.fp16)
        if tiling.norm_fold:
            assert strip is not None, f"{region.region.name}: the LayerNorm folded in needs its strip"
            sums = kernels.folded_norm(
                sums, x, self.norm_colsum(region), strip.region.tiling, self.config.layer_norm_epsilon
            )
        return sums + bias  # bias on the finished sum, fp32

    # -- modeled cycles ----------------------------------------------------------------------------

    def _count_cycles(self, pipe: Pipeline, items: StepInputs, scored: int) -> None:
        """Each region's modeled busy cycles this step: its per-item stage cost (wafer_gpt2.core.cost, via the
        plan) times the items it handled; attention is priced per item at the item's own length."""
        costs = self._pipeline_costs(pipe)
        busy = costs.per_item * np.where(costs.scored_only, scored, len(items))
        for row, table in costs.attention.items():
            busy[row] += int(table[items.position + 1].sum())
        self.total_cycles[costs.indices] += busy.astype(np.uint64)
        for row, region in enumerate(costs.regions):
            words = region.arrays.get(CYCLES_SYMBOL)
            if words is not None:
                step, total = int(busy[row]), int(self.total_cycles[region.index])
                words[...] = (step & 0xFFFFFFFF, step >> 32, total & 0xFFFFFFFF, total >> 32)

    def _pipeline_costs(self, pipe: Pipeline) -> _PipelineCosts:
        if pipe.replica in self._costs:
            return self._costs[pipe.replica]
        regions = pipe.regions()
        stages = {stage.name: stage for stage in self.plan.stage_costs}
        per_item, scored_only, attention = [], [], {}
        for row, region in enumerate(regions):
            stage = stages.get(region.region.name)
            if region.region.kind == "attention":
                # The plan prices attention at full context; here each item pays for its own length.
                tiling = region.region.tiling
                handoff = stage.phases.get("hand-off", 0) if stage is not None else 0
                attention[row] = self._attention_table(tiling) + handoff
                per_item.append(0)
            else:
                per_item.append(stage.cycles if stage is not None else 0)
            scored_only.append(region.region.name in ("ln_f", "head", "io.out"))
        costs = _PipelineCosts(
            regions,
            np.array([r.index for r in regions]),
            np.array(per_item, dtype=np.int64),
            np.array(scored_only),
            attention,
        )
        self._costs[pipe.replica] = costs
        return costs

    def _attention_table(self, tiling: AttentionTiling) -> np.ndarray:
        """Modeled cycles of one item attending to p positions, for p = 0..context."""
        if tiling not in self._attention_tables:
            arch, dtype = self.plan.arch, self.plan.dtype
            cycles = [0] + [
                attention_cost(tiling, arch, dtype, p).cycles for p in range(1, tiling.context + 1)
            ]
            self._attention_tables[tiling] = np.array(cycles, dtype=np.int64)
        return self._attention_tables[tiling]

    def reset_cycles(self) -> None:
        self.total_cycles[...] = 0
        for region in self.memory.regions:
            if CYCLES_SYMBOL in region.arrays:
                region.arrays[CYCLES_SYMBOL][...] = 0

    def clear_slot(self, replica: int, slot: int) -> None:
        """Zero one slot's K and V in every attention region of one replica."""
        for layer in self.pipelines[replica].layers:
            attn = layer["attn"]
            tiling = attn.region.tiling
            for symbol in ("k_cache", "v_cache"):
                store = self.kv_store(attn, symbol)
                view = attn.arrays[symbol].reshape(attn.region.h, attn.region.w, tiling.slots, -1)
                view[:, :, slot] = 0
                store[slot] = 0
                self._bump_kv(attn, symbol, store)
