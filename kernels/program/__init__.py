"""From a plan to the wafer program: region rows, per-PE roles, every route and its color.

`build_program(plan)` is the single source of what `kernels/layout.csl` builds. The compile driver
writes it as `plan_params.csl` (the layout reads nothing else besides `--params`); the contract lint
(tests/test_csl_contract.py) checks the same tables: routes connected, colors in range and never two
on one router, every PE's params consistent with the routes through it, array sizes equal to the
plan's memory map. Where things are comes only from the plan: the regions' rectangles, tilings and
`axes`, read through `wafer.memory_layout.pe_coords` (the same map the host uploads with and the
simulator computes from).

What the CSL does not do (docs/kernels.md): the reduce-scatter refinement of the planner's trees
(`scatter` > 1) runs as the plain tree of the same pairs (bit-identical sums; the modeled timing
differs), and a head group spans one attention PE's heads (`heads_per_pe` is any value the plan picks).

The modules, in reading order:
- `codes`: the numbers shared with layout.csl (kinds, directions, colors, slots, `t` fields, role
  words, gather flags) and `ProgramError`;
- `tables`: `RegionRow`, `Channel`, `Rect` and `Program`, the tables everything else fills or reads;
- `indices`: a PE's tiling indices from its place in the region (the formulas layout.csl uses);
- `roles`: who receives and sends on which color in a chain or tree reduction;
- `build`: `build_program`, which lays out every replica, checks the routes, assigns colors;
- `builder`: `_Builder`, the tables under construction;
- `replica`: one replica's rows, their numbers, and its hand-offs in pipeline order, which are
  `cells` (which PEs take part), `lanes` (producer next to consumer), `bus` (gather, route,
  multicast), `embedding` (input port, embedding chains, head), `attention` and `reductions`;
- `layout_mirror`: `pe_params` / `pe_routes`, the params layout.csl gives each PE, for the lint;
- `csl_writer`: `plan_params_csl`, the tables as the CSL module layout.csl imports.
"""

from kernels.program import codes
from kernels.program.build import build_program, plan_request
from kernels.program.codes import *  # noqa: F403 (every code is public: codes.__all__)
from kernels.program.csl_writer import plan_params_csl
from kernels.program.indices import along, snake_index
from kernels.program.layout_mirror import pe_params, pe_routes
from kernels.program.roles import (
    decode_role,
    reduction_roles,
    reduction_root,
    rounds,
    tree_receives,
    tree_send_round,
)
from kernels.program.tables import Channel, Program, Rect, RegionRow
from wafer.wire import HEADER_WORDS, ITEM_WORDS  # re-exported: the message layout next to HDR

__all__ = [
    *codes.__all__, "HEADER_WORDS", "ITEM_WORDS", "Channel", "Program", "Rect", "RegionRow", "along", "build_program",
    "decode_role", "pe_params", "pe_routes", "plan_params_csl", "plan_request", "reduction_roles", "reduction_root",
    "rounds", "snake_index", "tree_receives", "tree_send_round",
]  # fmt: skip
