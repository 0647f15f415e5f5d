"""Per-architecture resources and the rules a compiler enforces on them, with their sources.

Sources: the Cerebras SDK documentation's "Task IDs" and "DSDs" pages
(queue counts and depths, task ID ranges), "Tensor streaming" (what memcpy reserves), and the task
ID maps at the top of csl-examples' tutorial programs (WSE-3 reserves data task IDs 0-1, which are
input queues 0-1, for memcpy). Each rule raises `CslCompileError` naming the file, line and rule.
"""

from __future__ import annotations

from dataclasses import dataclass

from csl_executor.errors import CslCompileError


@dataclass(frozen=True)
class ArchRules:
    name: str
    input_queues: tuple[int, ...]  # depth in wavelets of input queues 0..7
    output_queues: tuple[int, ...]  # depth of output queues 0..
    local_task_ids: range
    memcpy_input_queues: frozenset[int]
    memcpy_output_queues: frozenset[int]
    switch_colors: frozenset[int] | None  # None: every routable color can switch
    fabin_per_op: int | None  # None: no limit
    color_swap: bool
    data_tasks_by_queue: bool

    @property
    def label(self) -> str:
        return "WSE-2" if self.name == "wse2" else "WSE-3"


ROUTABLE_COLORS = range(24)
MEMCPY_COLORS = frozenset({21, 22, 23})
MEMCPY_LOCAL_TASKS = frozenset({27, 28, 30})
RESERVED_LOCAL_TASKS = frozenset({29, 31})
MEMCPY_CONTROL_TASKS = frozenset(range(33, 38))
CONTROL_TASK_IDS = range(64)
NO_ENTRYPOINT = 31  # a control wavelet whose entrypoint is 31 activates nothing (25-pt-stencil)

RULES = {
    "wse2": ArchRules(
        "wse2",
        input_queues=(6, 6, 4, 4, 2, 2, 2, 2),
        output_queues=(2, 2, 6, 6, 2, 2),
        local_task_ids=range(0, 31),
        memcpy_input_queues=frozenset({0}),
        # memcpy's D2H uses output queue 0, which WSE-2 lets colors share: 25-pt-stencil sends its
        # own colors through output queues 0-3 with memcpy linked (its task.csl says so).
        memcpy_output_queues=frozenset(),
        switch_colors=None,
        fabin_per_op=None,
        color_swap=True,
        data_tasks_by_queue=False,
    ),
    "wse3": ArchRules(
        "wse3",
        input_queues=(8, 8, 4, 4, 4, 4, 4, 4),
        output_queues=(8, 8, 8, 8, 8, 8, 8, 8),
        local_task_ids=range(8, 31),
        memcpy_input_queues=frozenset({0, 1}),
        memcpy_output_queues=frozenset({0, 1}),
        switch_colors=frozenset({0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 13, 16, 17, 20, 21}),
        fabin_per_op=1,
        color_swap=False,
        data_tasks_by_queue=True,
    ),
}


def rules(arch: str) -> ArchRules:
    return RULES[arch]


def check_color_id(arch: str, cid: int, where: str) -> None:
    if cid not in ROUTABLE_COLORS:
        raise CslCompileError(f"{where}: color {cid} is not a routable color (0-23)")


def check_routed_color(arch: str, cid: int, where: str, memcpy: bool) -> None:
    check_color_id(arch, cid, where)
    if memcpy and cid in MEMCPY_COLORS:
        raise CslCompileError(f"{where}: color {cid} is reserved by memcpy (21-23) and cannot be routed")


def check_local_task_id(arch: str, tid: int, where: str) -> None:
    r = RULES[arch]
    if tid not in r.local_task_ids:
        lo, hi = r.local_task_ids.start, r.local_task_ids.stop - 1
        raise CslCompileError(f"{where}: local task ID {tid} out of range: {r.label} has {lo}-{hi}")


def check_control_task_id(arch: str, tid: int, where: str) -> None:
    if tid not in CONTROL_TASK_IDS:
        raise CslCompileError(f"{where}: control task ID {tid} out of range 0-63")


def check_queue(arch: str, kind: str, q: int, where: str, memcpy: bool) -> None:
    r = RULES[arch]
    count = len(r.input_queues if kind == "input" else r.output_queues)
    if not 0 <= q < count:
        raise CslCompileError(
            f"{where}: {kind} queue {q} does not exist on {r.label} ({kind} queues 0-{count - 1})"
        )
    reserved = r.memcpy_input_queues if kind == "input" else r.memcpy_output_queues
    if memcpy and q in reserved:
        names = ", ".join(str(x) for x in sorted(reserved))
        raise CslCompileError(
            f"{where}: {kind} queue {q} is reserved by memcpy on {r.label} ({names}); use queue 2 or up"
        )


def check_bind(arch: str, kind: str, tid, fn, where: str, memcpy: bool) -> None:
    """Rules on `@bind_*_task`: the ID is in range and not memcpy's."""
    r = RULES[arch]
    if kind in ("local", "control") and memcpy and not r.data_tasks_by_queue and tid.id in MEMCPY_COLORS:
        # WSE-2: colors and task IDs are one ID space, so memcpy's colors 21-23 are its task IDs too
        # (csl-examples' task-ID maps mark them reserved; 25-pt-stencil skips them). WSE-3 data tasks
        # are input queues, and WaferLLM's MeshGEMM binds local tasks 22 and 23 there, run on a CS-3.
        raise CslCompileError(
            f"{where}: {kind} task ID {tid.id} is reserved on WSE-2: it is memcpy's color {tid.id} (colors "
            "and task IDs share one ID space; memcpy keeps 21-23)"
        )
    if kind == "local":
        if tid.id in RESERVED_LOCAL_TASKS or (memcpy and tid.id in MEMCPY_LOCAL_TASKS):
            raise CslCompileError(
                f"{where}: local task ID {tid.id} is reserved (memcpy keeps 27, 28, 30; 29, 31)"
            )
    elif kind == "data":
        if r.data_tasks_by_queue:
            if memcpy and tid.id in r.memcpy_input_queues:
                raise CslCompileError(f"{where}: data task ID {tid.id} (input queue) is reserved by memcpy")
        elif memcpy and tid.id in MEMCPY_COLORS:
            raise CslCompileError(f"{where}: data task ID {tid.id} (color) is reserved by memcpy")
    elif kind == "control" and memcpy and tid.id in MEMCPY_CONTROL_TASKS:
        raise CslCompileError(f"{where}: control task ID {tid.id} is reserved by memcpy (33-37)")
