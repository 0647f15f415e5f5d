"""The codes Python and layout.csl share: kinds, router directions, colors, slots, table layouts.

plan_params.csl carries them to the CSL (`csl_writer`), so both sides read one definition. Here too:
`ProgramError`, raised wherever the plan cannot be laid out as the kernels expect.
"""

from __future__ import annotations

from wafer.wire import D2H_COLOR, H2D_COLOR

KINDS = ("io_in", "io_out", "embed", "embed_head", "layernorm", "gemv", "attention", "residual")
PROGRAM_FILE = {k: f"{k}.csl" for k in KINDS}
K_IO_IN, K_IO_OUT, K_EMBED, K_HEAD, K_NORM, K_GEMV, K_ATTN, K_RES = range(len(KINDS))

# Router directions (layout.csl's `dirs` masks).
RAMP, EAST, WEST, NORTH, SOUTH = 1, 2, 4, 8, 16
STEP = {EAST: (1, 0), WEST: (-1, 0), NORTH: (0, -1), SOUTH: (0, 1)}
OPPOSITE = {EAST: WEST, WEST: EAST, NORTH: SOUTH, SOUTH: NORTH}

MEMCPY_H2D, MEMCPY_D2H = H2D_COLOR, D2H_COLOR
MEMCPY_RESERVED = (21, 22, 23)
ROUTABLE = tuple(c for c in range(21) if c not in (MEMCPY_H2D, MEMCPY_D2H))
NONE = 0xFFFF
MAX_RX = 10  # receives of one reduction on one PE (reduce.csl)
HDR = 5  # item header words on every message between regions
REQ = 6  # an embedding request: header + token

# Axis codes: how a tiling index grows across the region ("+x": eastward from the west edge, ...).
AXIS_CODE = {"+x": 0, "-x": 1, "+y": 2, "-y": 3}

# Color slots of a region (its row of the `slot_color` table).
SLOTS = (
    "in", "out", "og0", "og1", "bc", "rin", "rg0", "rg1", "rb", "req", "ech0", "ech1",
    *(f"red{j}" for j in range(MAX_RX)), *(f"mg{j}" for j in range(MAX_RX)),
)  # fmt: skip
SLOT = {name: i for i, name in enumerate(SLOTS)}

# Per-region numbers (the `t` table); which ones a kind uses is documented in layout.csl.
T_FIELDS = (
    "dim", "k", "n", "tile_k", "tile_n", "rows", "cols", "use_fp16", "epilogue",
    "in_mode", "in_len", "root", "red_off", "mg_off", "mroot", "og_off", "rg_off", "out_gather", "out_q16",
    "has_rg", "drop", "chunk", "pes", "heads", "head_dim", "slots", "hpp", "ppp", "chain", "fold", "lc",
    "st", "vocab", "top_k", "ch_y0", "ch_len", "replica", "rec_words",
)  # fmt: skip
T = {name: i for i, name in enumerate(T_FIELDS)}
IN_LANE, IN_GROUP, IN_BUS = 0, 1, 2  # input modes: exact chunk, window of a group's stream, window of a bus

# Role words (the `roles` table, one per index of a reduction line).
ROLE_TX_SHIFT, ROLE_HAS_TX, ROLE_STREAM = 10, 1 << 14, 1 << 15
# Gather flags (the `g_flags` table, one per chunk index of a gather line).
G_HDR, G_HAS_RX, G_EXIT, G_TX_ODD, G_RX_ODD = 1, 2, 4, 8, 16


class ProgramError(ValueError):
    """The plan cannot be laid out as the kernels expect (the message names the region or route)."""


__all__ = [
    "KINDS", "PROGRAM_FILE", "K_IO_IN", "K_IO_OUT", "K_EMBED", "K_HEAD", "K_NORM", "K_GEMV", "K_ATTN", "K_RES",
    "RAMP", "EAST", "WEST", "NORTH", "SOUTH", "STEP", "OPPOSITE",
    "MEMCPY_H2D", "MEMCPY_D2H", "MEMCPY_RESERVED", "ROUTABLE", "NONE", "MAX_RX", "HDR", "REQ",
    "AXIS_CODE", "SLOTS", "SLOT", "T_FIELDS", "T", "IN_LANE", "IN_GROUP", "IN_BUS",
    "ROLE_TX_SHIFT", "ROLE_HAS_TX", "ROLE_STREAM", "G_HDR", "G_HAS_RX", "G_EXIT", "G_TX_ODD", "G_RX_ODD",
    "ProgramError",
]  # fmt: skip
