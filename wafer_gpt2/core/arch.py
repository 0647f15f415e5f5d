"""The two wafers the planner targets, as numbers with their public sources.

Sources: the Cerebras SDK documentation and the `Cerebras/csl-examples` repository (fabric sizes,
memcpy's fabric offsets), and Cerebras' published CS-2 / CS-3 specifications.
- Fabric and kernel size: CS-2 fabric 757 x 996 with the kernel at most 750 x 994; memcpy takes three
  columns west and two east of the kernel plus a one-PE halo (`--fabric-offsets=4,1`), so the kernel
  is (fabric_w - 7) x (fabric_h - 2). CS-3: 762 x 1172 as projects use it, hence 755 x 1170.
- 48 KB SRAM per PE on both.
- Routable colors 0-23 (24 router entries per PE); memcpy reserves 21, 22, 23. The WSE-3 figure is
  assumed equal to WSE-2's (the SDK keeps the same color space; memcpy keeps the same reservation).
- fp16 SIMD FMAC: 4 per cycle on WSE-2, 8 on WSE-3, when operands are aligned; fp32: 1 per cycle.
"""

from __future__ import annotations

from dataclasses import dataclass

from wafer_gpt2.errors import InvalidInput

# What every PE keeps back from its 48 KB for things that are not planned data (see `sram_reserve_bytes`).
SRAM_RESERVE_BYTES = 8 * 1024


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
    # Reserve for what the planner does not place: the PE program's code (a GEMV or attention
    # program with the comm library and memcpy's runtime compiles to a few KB), its stack and task
    # tables (~1 KB), and memcpy's per-PE buffers and DSD state on port PEs (~1-2 KB). 8 KB covers the
    # largest of our PE programs with margin; usable data = 48 KB - 8 KB = 40 KB per PE.
    sram_reserve_bytes: int = SRAM_RESERVE_BYTES
    routable_colors: int = 24
    memcpy_reserved_colors: tuple[int, ...] = (21, 22, 23)
    # Input queues a kernel's PE program may use: WSE-2 has 0-7 and memcpy keeps 0; WSE-3 has 0-7 and
    # memcpy keeps 0 and 1 (csl-notes.md, "Resource rules"). One color per queue.
    input_queue_ids: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7)

    @property
    def data_bytes_per_pe(self) -> int:
        """What a region may place on one PE."""
        return self.pe_sram_bytes - self.sram_reserve_bytes

    @property
    def usable_colors(self) -> int:
        """Colors a kernel may route with on one PE (memcpy's reserved ones removed)."""
        return self.routable_colors - len(self.memcpy_reserved_colors)

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
    "wse2": Arch("wse2", fabric_w=757, fabric_h=996, kernel_w=750, kernel_h=994, fp16_macs_per_cycle=4),
    "wse3": Arch(
        "wse3",
        fabric_w=762,
        fabric_h=1172,
        kernel_w=755,
        kernel_h=1170,
        fp16_macs_per_cycle=8,
        input_queue_ids=(2, 3, 4, 5, 6, 7),
    ),
}


def resolve_arch(arch: str | Arch) -> Arch:
    if isinstance(arch, Arch):
        return arch
    if arch not in ARCHS:
        raise InvalidInput(f"unknown architecture {arch!r}: expected one of {', '.join(ARCHS)}")
    return ARCHS[arch]
