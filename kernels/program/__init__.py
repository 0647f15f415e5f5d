"""The program generator: a plan -> layout.csl for the PE programs in kernels/pe/.

- frames.py: where a region's logical indices sit on the fabric (the Python side of lib/frame.csl).
- routes.py: flows of wavelets as route trees, and their colors.
- build.py: every PE's program and params, every hand-off between regions.
- layout_csl.py: the layout file, tile codes and routes grouped into rectangles.
"""

from kernels.program.build import Program, Tile, build_program
from kernels.program.errors import ProgramError
from kernels.program.layout_csl import LAYOUT_HEADER, layout_csl, layout_params

__all__ = [
    "LAYOUT_HEADER",
    "Program",
    "ProgramError",
    "Tile",
    "build_program",
    "layout_csl",
    "layout_params",
]
