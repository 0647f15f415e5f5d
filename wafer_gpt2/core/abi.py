"""The contract between the host program, the simulator, the CSL executor and the CSL program: the one
place for the names and numbers all of them must agree on.

- Host-callable functions every PE program exports (`launch`), with their arguments.
- The arrays the host reads or writes with memcpy copy mode: the weights each kind of region takes
  from the checkpoint, and the `cycles` counter every PE keeps.
- memcpy's two streaming colors, and the wire format of what crosses them (`wafer_gpt2.core.wire`).
- The operations of one layer, in the order a token meets them (region `L3.qkv` is layer 3's qkv).
"""

from __future__ import annotations

from wafer_gpt2.core.wire import D2H_COLOR, H2D_COLOR

# name -> ((argument, CSL type), ...), in order, as cslc lists them in out_rpc.json
HOST_FUNCTIONS: dict[str, tuple[tuple[str, str], ...]] = {
    "clear_slot": (("replica_id", "u16"), ("slot_id", "u16")),  # zero one slot's K/V in the replica
    "reset_cycles": (),  # zero every PE's `cycles` counter
}

# Per PE: u32[4] = busy cycles of the last item (lo, hi), since reset (lo, hi). The simulator fills it
# with modeled cycles, the PE programs with their timestamp counter (wafer_gpt2/kernels/lib/timing.csl).
CYCLES_SYMBOL = "cycles"

# The symbols the checkpoint fills, per kind of region (everything else is working memory); a region
# holds those its tiling declares (norm_b and norm_g instead of b: a GEMV with the LayerNorm folded
# in; gain and bias: a LayerNorm strip that normalises).
WEIGHT_SYMBOLS: dict[str, tuple[str, ...]] = {
    "gemv": ("w", "b", "norm_b", "norm_g"),
    "layernorm": ("gain", "bias"),
    "embed": ("wte", "wpe"),
    "embed_head": ("w",),
}

# Every array layout.csl exports, with its element type ("w": the weights' dtype, f16 or f32).
EXPORTED_ARRAYS: dict[str, str] = {
    "w": "w",
    "b": "w",
    "wte": "w",
    "wpe": "w",
    "gain": "f32",
    "bias": "f32",
    "norm_b": "f32",
    "norm_g": "f32",
    CYCLES_SYMBOL: "u32",
}

LAYER_OPS = ("ln_1", "qkv", "attn", "attn_proj", "res_1", "ln_2", "fc", "proj", "res_2")

__all__ = [
    "CYCLES_SYMBOL",
    "D2H_COLOR",
    "EXPORTED_ARRAYS",
    "H2D_COLOR",
    "HOST_FUNCTIONS",
    "LAYER_OPS",
    "WEIGHT_SYMBOLS",
]
