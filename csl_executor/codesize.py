"""A PE program's code, estimated, so that code and data are held to the PE's 48 KB together.

"Each PE has its own executable code in its memory" (SDK, "A Conceptual View"): arrays, stack and
code share the 48 KB. `cslc` reports no code size and the instruction set is not public, so the
executor counts the instructions a program's statements need and prices each at a size at least as
large as any instruction of a 32-bit machine; the figure is an upper estimate, meant to refuse a
program whose data leaves too little room, not to size code exactly.

What is counted, per generated function (a `fn` or `task` a PE runs):
- every scalar statement: one instruction per operation it performs (an operator, a memory access
  through an index or a pointer, a call), at least one (the count `csl_executor.compiler.operations`
  gives, the same that prices a statement's cycles);
- every DSD operation and `@map`: `DSD_OP_INSTRUCTIONS` (loading up to three DSD registers and
  issuing the operation) plus its scalar operands;
- every loop: `LOOP_INSTRUCTIONS` (the test and the branch back), every `if`: one branch;
- every function: `FUNCTION_INSTRUCTIONS` (entry, saving and restoring registers, return).
Libraries implemented natively add what they would bring: memcpy's per-PE component
(`MEMCPY_CODE_BYTES`).

`program_code_bytes(program)` is the estimate for one compiled PE program; `layout_code_bytes`
maps every program of a compiled layout to it, for the planner.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from csl_executor.layout import CompiledLayout
    from csl_executor.program import Program

INSTRUCTION_BYTES = 4  # assumption: every instruction counted as 32 bits, the widest common encoding
DSD_OP_INSTRUCTIONS = 4  # three DSD register loads and the operation (assumption)
LOOP_INSTRUCTIONS = 2  # compare and branch back (assumption)
IF_INSTRUCTIONS = 1  # the conditional branch (assumption)
FUNCTION_INSTRUCTIONS = 8  # entry, register saves and restores, return (assumption)
# memcpy links a small executable component into every kernel PE ("Tensor streaming"); its size is
# not published. 1 KB is an assumption, about what the command stream and copy handlers need.
MEMCPY_CODE_BYTES = 1024


def program_code_bytes(program: Program) -> int:
    """Estimated bytes of code of a compiled PE program (its functions, tasks and libraries)."""
    instructions = sum(fn.code_instructions for fn in program.compiled_fns)
    extra = MEMCPY_CODE_BYTES if program.memcpy is not None else 0
    return instructions * INSTRUCTION_BYTES + extra


def layout_code_bytes(compiled: CompiledLayout) -> dict[str, int]:
    """Each distinct PE program of a layout (by file and index) -> its estimated code bytes."""
    return {f"{p.path}#{i}": program_code_bytes(p) for i, p in enumerate(compiled.programs)}


def breakdown(program: Program) -> str:
    """Words for an error message: how the estimate is made up."""
    instructions = sum(fn.code_instructions for fn in program.compiled_fns)
    memcpy = f" + memcpy's component {MEMCPY_CODE_BYTES} B" if program.memcpy is not None else ""
    return f"{instructions} instructions x {INSTRUCTION_BYTES} B{memcpy}"
