"""The program generator: a plan -> layout.csl for the PE programs in wafer_gpt2/kernels/pe/.

- frames.py: where a region's logical indices sit on the fabric (the Python side of lib/frame.csl).
- routes.py: flows of wavelets as route trees, and their colors.
- build.py: every PE's program and params, every hand-off between regions.
- layout_csl.py: the layout file, tile codes and routes grouped into rectangles.
"""

from wafer_gpt2.codegen.build import Program, Tile, build_program
from wafer_gpt2.codegen.layout_csl import LAYOUT_HEADER, layout_csl, layout_params
from wafer_gpt2.errors import ProgramError

__all__ = [
    "LAYOUT_HEADER",
    "Program",
    "ProgramError",
    "Tile",
    "build_program",
    "layout_csl",
    "layout_params",
]
