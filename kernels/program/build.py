"""`build_program`: every replica laid out, the routes checked, colors assigned, idle PEs listed.

Colors are assigned per channel, first fit, from 0-20 without memcpy's streaming colors 14 and 15
(memcpy keeps 21-23); a color is never used twice on one router. `plan_request` records what the plan
was asked for (plan_params.csl's header; `build_plan` is deterministic, so it rebuilds the plan).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kernels.program.builder import _Builder
from kernels.program.codes import ROUTABLE, ProgramError
from kernels.program.replica import _build_replica
from kernels.program.tables import Channel, Program


def build_program(plan: Any) -> Program:
    """Region rows, roles and routes for every replica of the plan, colors assigned."""
    b = _Builder(plan)
    for replica in range(plan.replicas):
        _build_replica(b, plan, replica)
    kw = max(r.x + r.w for r in b.rows)
    kh = max(r.y + r.h for r in b.rows)
    program = Program(kw, kh, plan.arch.name, b.rows, b.channels, b.roles, b.g_flags, b.g_before, b.g_own, b.g_after,
                      gathers=b.gathers)  # fmt: skip
    for ch in b.channels:
        xs, ys, _, _ = ch.arrays()
        if xs.size and (xs.min() < 0 or ys.min() < 0 or xs.max() >= kw or ys.max() >= kh):
            raise ProgramError(f"{ch.name}: the route leaves the {kw}x{kh} kernel rectangle")
        _check_unique(ch)
    _assign_colors(program)
    program.idle = _idle_rects(b.owner, kw, kh)
    program.request = plan_request(plan)
    return program


def plan_request(plan: Any) -> dict:
    """What `wafer.plan.build_plan` was asked for (it is deterministic, so this rebuilds the plan)."""
    c = plan.config
    return {
        "model": {"n_layer": c.n_layer, "n_head": c.n_head, "n_embd": c.n_embd, "vocab_size": c.vocab_size,
                  "n_positions": c.n_positions, "layer_norm_epsilon": c.layer_norm_epsilon, "name": c.name},
        "arch": plan.arch.name, "dtype": plan.dtype, "slots": plan.slots, "context": plan.context,
        "objective": plan.objective, "replicas": plan.replicas, "top_k": plan.top_k,
    }  # fmt: skip


def _check_unique(ch: Channel) -> None:
    seen: dict[tuple[int, int], tuple[int, int]] = {}
    for x, y, rx, tx in zip(ch.xs, ch.ys, ch.rx, ch.tx, strict=True):
        if (x, y) in seen and seen[(x, y)] != (rx, tx):
            raise ProgramError(f"{ch.name}: two settings for one router at PE ({x}, {y})")
        seen[(x, y)] = (rx, tx)


def _assign_colors(program: Program) -> None:
    """First fit, most constrained channel first: channels through the busiest routers pick first."""
    load = np.zeros((program.kernel_h, program.kernel_w), dtype=np.int32)
    cells = [ch.arrays()[:2] for ch in program.channels]
    for xs, ys in cells:
        np.add.at(load, (ys, xs), 1)
    pressure = [int(load[ys, xs].max()) if xs.size else 0 for xs, ys in cells]
    order = sorted(range(len(program.channels)), key=lambda k: (-pressure[k], -cells[k][0].size, k))
    used = np.zeros((program.kernel_h, program.kernel_w), dtype=np.int64)
    allowed = sum(1 << c for c in ROUTABLE)
    for k in order:
        ch = program.channels[k]
        xs, ys = cells[k]
        taken = int(np.bitwise_or.reduce(used[ys, xs])) if xs.size else 0
        free = allowed & ~taken
        if not free:
            worst = int(np.argmax(load[ys, xs]))
            raise ProgramError(
                f"{ch.name}: no free color: its routers already use all {len(ROUTABLE)} usable colors "
                f"(0-20 without memcpy's 14 and 15); PE ({xs[worst]}, {ys[worst]}) carries {load[ys[worst], xs[worst]]} routes"
            )
        ch.color = (free & -free).bit_length() - 1
        used[ys, xs] |= 1 << ch.color
    for ch in program.channels:
        for index, slot in ch.users:
            row = program.regions[index]
            if row.slots.get(slot, ch.color) != ch.color:
                raise ProgramError(f"region {row.name}: slot {slot!r} would need two colors ({ch.name})")
            row.slots[slot] = ch.color


def _idle_rects(owner: dict[tuple[int, int], int], kw: int, kh: int) -> list[tuple[int, int, int, int]]:
    taken = np.zeros((kh, kw), dtype=bool)
    for x, y in owner:
        taken[y, x] = True
    rects = []
    for y in range(kh):
        free = np.flatnonzero(~taken[y])
        if free.size == 0:
            continue
        brk = np.flatnonzero(np.diff(free) != 1)
        for s, e in zip(np.r_[0, brk + 1], np.r_[brk, free.size - 1], strict=True):
            rects.append((int(free[s]), y, int(free[e] - free[s] + 1), 1))
    merged: list[tuple[int, int, int, int]] = []
    open_: dict[tuple[int, int], int] = {}
    for x, y, w, _ in rects:
        key = (x, w)
        if key in open_ and merged[open_[key]][1] + merged[open_[key]][3] == y:
            mx, my, mw, mh = merged[open_[key]]
            merged[open_[key]] = (mx, my, mw, mh + 1)
        else:
            open_[key] = len(merged)
            merged.append((x, y, w, 1))
    return merged
