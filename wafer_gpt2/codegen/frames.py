"""Where a region's logical indices sit on the fabric: the Python side of wafer_gpt2/kernels/lib/frame.csl.

Every PE program computes its indices (a, b) at run time from its coordinates and the region's frame
params; the generator uses the same mapping to place routes. The axis specs come from the plan
(`region.axes`, e.g. {"k": "+x", "n": "+y"}; "-x" grows westward from the region's east edge).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from wafer_gpt2.errors import ProgramError

# Which of a region's named axes are its frame axes a and b, per kind of region.
FRAME_AXES = {
    "gemv": ("k", "n"),
    "embed_head": ("k", "n"),
    "attention": ("position", "head_group"),
    "embed": ("k", "row"),
    "layernorm": ("i", None),
    "residual": ("i", None),
}


@dataclass(frozen=True)
class Frame:
    x0: int
    y0: int
    width: int
    height: int
    a_on_y: bool
    a_rev: bool
    b_rev: bool

    @property
    def a_len(self) -> int:
        return self.height if self.a_on_y else self.width

    @property
    def b_len(self) -> int:
        return self.width if self.a_on_y else self.height

    def pe(self, a: int, b: int = 0) -> tuple[int, int]:
        """Kernel (x, y) of the PE at logical (a, b)."""
        # a_len and b_len inline: the generator calls this for every PE of the wafer, often several times
        a_len, b_len = (self.height, self.width) if self.a_on_y else (self.width, self.height)
        if not (0 <= a < a_len and 0 <= b < b_len):
            raise ProgramError(f"logical index ({a}, {b}) outside a {a_len} x {b_len} frame")
        da = a_len - 1 - a if self.a_rev else a
        db = b_len - 1 - b if self.b_rev else b
        return (self.x0 + db, self.y0 + da) if self.a_on_y else (self.x0 + da, self.y0 + db)

    def params(self) -> dict[str, Any]:
        return {
            "x0": self.x0,
            "y0": self.y0,
            "width": self.width,
            "height": self.height,
            "a_on_y": self.a_on_y,
            "a_rev": self.a_rev,
            "b_rev": self.b_rev,
        }


def frame_of(region: Any) -> Frame:
    """The frame of a region from its kind and its plan axes."""
    from wafer_gpt2.core.memory_layout import default_axes

    if region.kind not in FRAME_AXES:
        raise ProgramError(f"region {region.name!r}: no frame for kind {region.kind!r}")
    axes = {**default_axes(region.tiling), **(region.axes or {})}
    a_name, b_name = FRAME_AXES[region.kind]
    a_spec = axes.get(a_name, "+x")
    other = "y" if a_spec[1] == "x" else "x"
    b_spec = axes.get(b_name, "+" + other) if b_name else "+" + other
    if a_spec[1] == b_spec[1]:
        raise ProgramError(
            f"region {region.name!r}: axes {a_name!r} and {b_name!r} both run along {a_spec[1]}"
        )
    return Frame(
        region.x,
        region.y,
        region.w,
        region.h,
        a_on_y=a_spec[1] == "y",
        a_rev=a_spec[0] == "-",
        b_rev=b_spec[0] == "-",
    )
