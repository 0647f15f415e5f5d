"""Where every value lives in the PEs' memory: the layout shared by the host, the simulator and the CSL.

A region's symbol is an (h, w, elems) image: one row of `elems` per PE of its rectangle. Which PE holds
which piece follows the region's tiling (`wafer_gpt2.core.tiling`) and its `axes`, which say how the tiling's
indices grow on the fabric ("+x": eastward from the region's west edge, "-x": westward from its east
edge, "+y"/"-y" likewise for south/north):

- gemv / embed_head: PE (r, c) (r along K: axis "k", c along N: axis "n") holds the row-major
  [tile_k, tile_n] tile of W (`wte^T` for the head), and the bias slice of column c (`column_order`).
- layernorm: PE i (axis "i") holds chunk i of gain and bias.
- embed: PE (j, i) (j: axis "row", i: axis "k") holds wte[j*tpp:(j+1)*tpp, i*tile_k:(i+1)*tile_k] and
  wpe[j*ppp:(j+1)*ppp, i*tile_k:(i+1)*tile_k], each row-major [token or position in PE][dim chunk].
- attention: PE (g, p) holds K and V of head group g at chain index p, laid out
  [slot][position in PE][head in PE][head_dim]. Head group g owns `fold` rows along "head_group";
  its chain runs along "position" over those rows in a snake: row j = p // Lc of the group holds
  p = j*Lc .. j*Lc + Lc - 1, forwards on even rows, backwards on odd ones (Lc = chain / fold); laid
  out as a comb, each row's halves run in from its two edges (`AttentionTiling.snake`).

`pe_coords` gives, for every tiling index, the (y, x) of its PE inside the region; `scatter` and
`gather` move between tiling-indexed arrays and memory images. The `pack_*` functions turn checkpoint
tensors into the images the host copies in with memcpy_h2d.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from wafer_gpt2.core.tiling import AttentionTiling, GemvTiling, HeadTiling, NormTiling, ceil_div
from wafer_gpt2.errors import WaferGPT2Error


class LayoutError(WaferGPT2Error, ValueError):
    """A region whose axes do not describe its rectangle."""


_DTYPE_NAMES = {
    "f16": np.float16,
    "f32": np.float32,
    "u16": np.uint16,
    "u32": np.uint32,
    "i16": np.int16,
    "i32": np.int32,
}


def symbol_dtype(dtype: Any) -> np.dtype:
    """A plan symbol's dtype ('f16', 'f32', 'u32', 'i32', ... or a NumPy dtype) as a NumPy dtype."""
    resolved = np.dtype(_DTYPE_NAMES.get(dtype, dtype) if isinstance(dtype, str) else dtype)
    if resolved.itemsize not in (2, 4):
        raise LayoutError(f"symbol dtype {dtype!r}: PE memory holds 16- or 32-bit elements")
    return resolved


def default_axes(tiling: Any) -> dict[str, str]:
    if isinstance(tiling, HeadTiling):
        tiling = tiling.gemv
    if isinstance(tiling, GemvTiling):
        return {"k": "+y", "n": "+x"} if tiling.orientation == "k_along_y" else {"k": "+x", "n": "+y"}
    if isinstance(tiling, NormTiling):
        return {"i": "+x" if tiling.axis == "x" else "+y"}
    if isinstance(tiling, AttentionTiling):
        return {"position": "+x", "head_group": "+y"}
    return {"k": "+x", "row": "+y", "i": "+x"}


def _place(index: np.ndarray, spec: str, region: Any) -> tuple[str, np.ndarray]:
    """An index along one tiling axis -> (fabric axis, coordinate inside the region)."""
    if len(spec) != 2 or spec[0] not in "+-" or spec[1] not in "xy":
        raise LayoutError(f"region {region.name!r}: axis spec {spec!r} is not one of +x, -x, +y, -y")
    extent = region.w if spec[1] == "x" else region.h
    return spec[1], index if spec[0] == "+" else extent - 1 - index


def _grid(region: Any, shape: tuple[int, int], names: tuple[str, str]) -> tuple[np.ndarray, np.ndarray]:
    axes = {**default_axes(region.tiling), **(getattr(region, "axes", None) or {})}
    first, second = np.meshgrid(np.arange(shape[0]), np.arange(shape[1]), indexing="ij")
    coords: dict[str, np.ndarray] = {}
    for index, name in ((first, names[0]), (second, names[1])):
        axis, value = _place(index, axes[name], region)
        if axis in coords:
            raise LayoutError(
                f"region {region.name!r}: axes {names[0]!r} and {names[1]!r} both run along {axis}"
            )
        coords[axis] = value
    return coords["y"], coords["x"]


def pe_coords(region: Any) -> tuple[np.ndarray, np.ndarray]:
    """(ys, xs), each shaped like the tiling's PE grid, of the PE holding each tiling index."""
    tiling = region.tiling
    if isinstance(tiling, HeadTiling):
        tiling = tiling.gemv
    if isinstance(tiling, GemvTiling):
        ys, xs = _grid(region, (tiling.rows, tiling.cols), ("k", "n"))
    elif isinstance(tiling, NormTiling):
        ys, xs = _strip(region, tiling.pes)
    elif isinstance(tiling, AttentionTiling):
        ys, xs = _snake(region, tiling)
    elif region.kind == "embed":
        ys, xs = _grid(region, (region.h, region.w), ("row", "k"))
    else:  # residual, io: a strip or a single PE, in x order
        ys, xs = _strip(region, region.w * region.h)
    if ys.min() < 0 or xs.min() < 0 or ys.max() >= region.h or xs.max() >= region.w:
        raise LayoutError(
            f"region {region.name!r}: its tiling does not fit its {region.w} x {region.h} rectangle"
        )
    return ys, xs


def _strip(region: Any, pes: int) -> tuple[np.ndarray, np.ndarray]:
    axes = {**default_axes(region.tiling), **(getattr(region, "axes", None) or {})}
    axis, value = _place(np.arange(pes), axes.get("i", "+x"), region)
    zeros = np.zeros(pes, dtype=np.int64)
    return (zeros, value) if axis == "x" else (value, zeros)


def _snake(region: Any, tiling: AttentionTiling) -> tuple[np.ndarray, np.ndarray]:
    axes = {**default_axes(tiling), **(getattr(region, "axes", None) or {})}
    group, chain = np.meshgrid(np.arange(tiling.head_groups), np.arange(tiling.chain), indexing="ij")
    along, row = tiling.snake(chain)
    coords = {}
    for value, spec in ((group * tiling.fold + row, axes["head_group"]), (along, axes["position"])):
        axis, placed = _place(value, spec, region)
        coords[axis] = placed
    if len(coords) != 2:
        raise LayoutError(
            f"region {region.name!r}: 'position' and 'head_group' must run along different axes"
        )
    return coords["y"], coords["x"]


def gather(image: np.ndarray, coords: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """(h, w, elems) memory image -> tiling-indexed [*grid, elems] (a copy)."""
    return image[coords[0], coords[1]]


def scatter(values: np.ndarray, coords: tuple[np.ndarray, np.ndarray], h: int, w: int) -> np.ndarray:
    """Tiling-indexed [*grid, elems] -> a zero-filled (h, w, elems) memory image."""
    image = np.zeros((h, w, values.shape[-1]), dtype=values.dtype)
    image[coords[0], coords[1]] = values
    return image


# ----------------------------------------------------------------------------------------------------
# Tiling-indexed contents, from checkpoint tensors


def tiled_positions(tiling: GemvTiling) -> np.ndarray:
    """For every output index n (in N order), its position c * tile_n + j among the tiled outputs."""
    order = np.array(tiling.column_order())
    positions = np.flatnonzero(order >= 0)
    return positions[np.argsort(order[positions])]


def gemv_weight_tiles(weight: np.ndarray, tiling: GemvTiling) -> np.ndarray:
    """W [K, N] -> [rows, cols, tile_k * tile_n]: PE (r, c)'s row-major tile, zero-padded."""
    if weight.shape != (tiling.k, tiling.n):
        raise LayoutError(
            f"weight of shape {weight.shape} does not match the tiling's {tiling.k} x {tiling.n}"
        )
    tk, tn = tiling.tile_k, tiling.tile_n
    padded = np.zeros((tiling.rows * tk, tiling.cols * tn), dtype=weight.dtype)
    padded[: tiling.k, tiled_positions(tiling)] = weight
    return (
        padded.reshape(tiling.rows, tk, tiling.cols, tn)
        .transpose(0, 2, 1, 3)
        .reshape(tiling.rows, tiling.cols, tk * tn)
    )


def gemv_bias_tiles(bias: np.ndarray, tiling: GemvTiling) -> np.ndarray:
    """b [N] -> [rows, cols, tile_n]: every PE of output column c holds that column's slice."""
    padded = np.zeros(tiling.cols * tiling.tile_n, dtype=bias.dtype)
    padded[tiled_positions(tiling)] = bias
    return np.broadcast_to(
        padded.reshape(1, tiling.cols, tiling.tile_n), (tiling.rows, tiling.cols, tiling.tile_n)
    )


def fold_layernorm(
    weight: np.ndarray, bias: np.ndarray, gain: np.ndarray, beta: np.ndarray, stored: np.dtype
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The LayerNorm (gain, beta) before a GEMV (W, bias) folded into the GEMV (wafer_gpt2/core/tiling.py
    `GemvTiling.norm_fold`, wafer_gpt2/kernels/pe/gemv.csl):

        LayerNorm(x) @ W + bias = (x @ W' - mean * colsum(W')) * rstd + bias'

    with W' = diag(gain) @ W as the PEs hold it (`stored`: fp16 rounds it), colsum(W') of those stored
    values, so that the mean's share cancels exactly as x @ W' computes it, and bias' = bias + beta @ W.
    Returns (W', bias', colsum(W')); the sums are taken in float64."""
    folded = (gain.astype(np.float64)[:, None] * weight).astype(stored)
    colsum = folded.astype(np.float64).sum(axis=0).astype(np.float32)
    shifted = (bias.astype(np.float64) + beta.astype(np.float64) @ weight).astype(np.float32)
    return folded, shifted, colsum


def norm_tiles(vector: np.ndarray, tiling: NormTiling) -> np.ndarray:
    """gain or bias [C] -> [pes, chunk]."""
    padded = np.zeros(tiling.pes * tiling.chunk, dtype=vector.dtype)
    padded[: tiling.dim] = vector
    return padded.reshape(tiling.pes, tiling.chunk)


def embed_geometry(region: Any, symbol: str, dim: int) -> tuple[int, int]:
    """(rows of the table `symbol` ("wte" or "wpe") per embedding PE, tile_k), from the symbol's size."""
    tile_k = ceil_div(dim, region.w)
    return region.symbols[symbol].elems // tile_k, tile_k


def table_tiles(table: np.ndarray, region: Any, symbol: str) -> np.ndarray:
    """An embedding table [rows, C] (wte or wpe) -> [PE rows, k chunks, per PE * tile_k]: PE row j holds
    the table's rows j*per .. +per, chunk i of each."""
    per, tk = embed_geometry(region, symbol, table.shape[1])
    padded = np.zeros((region.h * per, region.w * tk), dtype=table.dtype)
    padded[: table.shape[0], : table.shape[1]] = table
    return (
        padded.reshape(region.h, per, region.w, tk)
        .transpose(0, 2, 1, 3)
        .reshape(region.h, region.w, per * tk)
    )
