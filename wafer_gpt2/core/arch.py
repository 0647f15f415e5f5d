"""The two wafers the planner targets, as numbers with their public sources.

Sources: the Cerebras SDK documentation and the `Cerebras/csl-examples` repository (fabric sizes,
memcpy's fabric offsets), and Cerebras' published CS-2 / CS-3 specifications.
- Fabric and kernel size: CS-2 fabric 757 x 996 with the kernel at most 750 x 994; memcpy takes three
  columns west and two east of the kernel plus a one-PE halo (`--fabric-offsets=4,1`), so the kernel
  is (fabric_w - 7) x (fabric_h - 2). CS-3: 762 x 1172 as projects use it, hence 755 x 1170.
- 48 KB SRAM per PE on both, shared by a PE's data, its program's code, memcpy's component and the
  stack ("each PE has its own executable code in its memory"): what a region may place is 48 KB less
  its own program's code and the stack (`Arch.data_bytes`, `wafer_gpt2/core/code_bytes.py`).
- Routable colors 0-23 (24 router entries per PE); memcpy reserves 21, 22, 23. The WSE-3 figure is
  assumed equal to WSE-2's (the SDK keeps the same color space; memcpy keeps the same reservation).
- Local task IDs (SDK "Task IDs"): 0-30 on WSE-2, where they share one ID space with the colors, and
  8-30 on WSE-3, whose IDs 0-7 are its input queues' data tasks. memcpy keeps 21, 22, 23, 27, 28 and
  30, and 29 and 31 are reserved, on both: the WSE-2 and the WSE-3 task-ID maps of csl-examples 1.4
  (tutorials/topic-08-filters, topic-09-fifos) mark them so, and its 25-pt-stencil jumps from 20 to 24.
- fp16 SIMD FMAC: 4 per cycle on WSE-2, 8 on WSE-3, when operands are aligned; fp32: 1 per cycle.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from wafer_gpt2.core.code_bytes import CODE_BYTES, STACK_BYTES
from wafer_gpt2.errors import InvalidInput

# Task IDs memcpy keeps (21-23, 27, 28, 30) or that are reserved (29, 31), on both architectures.
MEMCPY_TASK_IDS = (21, 22, 23, 27, 28, 29, 30, 31)


@dataclass(frozen=True)
class Arch:
    name: str
    fabric_w: int
    fabric_h: int
    kernel_w: int
    kernel_h: int
    fp16_macs_per_cycle: int
    fp32_macs_per_cycle: int = 1
    pe_sram_bytes: int = 48 * 1024
    # What the planner does not place, beside the data: each PE program's code with memcpy's component
    # ((program, bytes) pairs: wafer_gpt2/core/code_bytes.py, the CSL executor's estimate), and the stack.
    code_bytes: tuple[tuple[str, int], ...] = ()
    stack_bytes: int = STACK_BYTES
    routable_colors: int = 24
    memcpy_reserved_colors: tuple[int, ...] = (21, 22, 23)
    # Input queues a kernel's PE program may use: WSE-2 has 0-7 and memcpy keeps 0; WSE-3 has 0-7 and
    # memcpy keeps 0 and 1 (the SDK's memcpy rules). One color per queue.
    input_queue_ids: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7)
    local_task_ids: range = range(0, 31)
    memcpy_task_ids: tuple[int, ...] = MEMCPY_TASK_IDS

    def __hash__(self) -> int:
        # The planner's caches key on the architecture at every lookup, and its code table is long: the
        # hash of the fields is kept (and left out of a pickle, since another process hashes strings
        # differently).
        kept = self.__dict__.get("_hash")
        if kept is None:
            kept = hash(tuple(getattr(self, f.name) for f in fields(self)))
            object.__setattr__(self, "_hash", kept)
        return kept

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    def program_code_bytes(self, program: str) -> int:
        """The code of one PE program (`wafer_gpt2.core.code_bytes.program_of`), memcpy's component included."""
        for name, size in self.code_bytes:
            if name == program:
                return size
        raise InvalidInput(
            f"no code size for PE program {program!r} on {self.name} (wafer_gpt2/core/code_bytes.py)"
        )

    def data_bytes(self, program: str) -> int:
        """What a PE running `program` may place: 48 KB less its code and the stack."""
        return self.pe_sram_bytes - self.program_code_bytes(program) - self.stack_bytes

    def budget_words(self, program: str) -> str:
        """How `data_bytes(program)` is made, for messages."""
        return (
            f"{self.data_bytes(program):,} B usable by {program} (48 KB less its code, "
            f"{self.program_code_bytes(program):,} B, and the stack, {self.stack_bytes:,} B)"
        )

    @property
    def data_bytes_per_pe(self) -> int:
        """What any PE may place, whichever program it runs (the largest program's code taken off)."""
        return self.pe_sram_bytes - max(size for _, size in self.code_bytes) - self.stack_bytes

    @property
    def usable_colors(self) -> int:
        """Colors a kernel may route with on one PE (memcpy's reserved ones removed)."""
        return self.routable_colors - len(self.memcpy_reserved_colors)

    @property
    def kernel_task_ids(self) -> list[int]:
        """Local task IDs a PE program may bind (memcpy's removed), highest first."""
        return [t for t in reversed(self.local_task_ids) if t not in self.memcpy_task_ids]

    @property
    def kernel_pes(self) -> int:
        return self.kernel_w * self.kernel_h

    def macs_per_cycle(self, dtype: str) -> int:
        """Peak FMAC elements per cycle of one PE for the weight dtype ("fp16" or "fp32")."""
        if dtype == "fp16":
            return self.fp16_macs_per_cycle
        if dtype == "fp32":
            return self.fp32_macs_per_cycle
        raise InvalidInput(f"unknown dtype {dtype!r}: expected fp16 or fp32")


ARCHS: dict[str, Arch] = {
    "wse2": Arch(
        "wse2",
        fabric_w=757,
        fabric_h=996,
        kernel_w=750,
        kernel_h=994,
        fp16_macs_per_cycle=4,
        code_bytes=tuple(CODE_BYTES["wse2"].items()),
    ),
    "wse3": Arch(
        "wse3",
        fabric_w=762,
        fabric_h=1172,
        kernel_w=755,
        kernel_h=1170,
        fp16_macs_per_cycle=8,
        input_queue_ids=(2, 3, 4, 5, 6, 7),
        local_task_ids=range(8, 31),
        code_bytes=tuple(CODE_BYTES["wse3"].items()),
    ),
}


def resolve_arch(arch: str | Arch) -> Arch:
    if isinstance(arch, Arch):
        return arch
    if arch not in ARCHS:
        raise InvalidInput(f"unknown architecture {arch!r}: expected one of {', '.join(ARCHS)}")
    return ARCHS[arch]
