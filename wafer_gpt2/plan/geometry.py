"""Where one replica's regions and routes go, as arithmetic cheap enough for every candidate.

Layout of one layer (flow east; odd bands are mirrored and flow west), R = PEs of the residual
stream, T = head_groups * fold, Lc = attention columns, F = FC output columns:

    x:   0 ...... R ....... R+Lc ..... 2R+Lc ...... 3R+Lc
    0    [ qkv   ][ attn    ][ attn_proj ]             QKV: K along x (R), reduce east, out rows
         [ R x T ][ Lc x T  ][  R x T    ]             ATTN: head group g = rows g*fold..; LSE merge
    T    [ ln_1  ]           [ res_1     ]             O:   K along y (T), reduce south, out columns
    T+1                      [ ln_2      ][ res_2    ]  FC:  K along x (R), reduce east, GELU, out rows
    T+2                      [ fc  R x F ][ proj R x F]  PROJ: K along y (F), reduce north, out columns

The next layer starts at x = 2R + Lc: its ln_1 sits right above this layer's res_2, its qkv above this
layer's proj. Every GEMV hands its output to the next one along the axis that one multicasts on, so
orientations alternate (k_along_x, k_along_y, ...) and nothing is transposed. West of the layers a
strip of S columns (R, or more where a small replica leaves them: `Knobs.strip_pes`) holds the I/O
ports, the LM head (wte^T, tied), the final LayerNorm and the top-k; the stream enters and leaves it
by gather lines, which re-cut its chunks. Where the head's rounds run apart (`Knobs.head_workers`),
the strip's east PEs of every K-line are its workers and root (in `Knobs.head_sets` sets, one after
the other), without weights, and ln_f (and an embedding in the strip) spans the K-lines' weighted PEs,
the strip's west end.
Interlocked bands (`Knobs.interlock`, where 2R <= Lc): every odd band is also upside down (FC, proj
and the strips above its qkv, attention and attn_proj) and a stream's width further east, so that its
FC and proj, R + R wide, stand in the rows under the even band's attention, which are empty otherwise:
a pair of bands takes 2T + F + 2 rows instead of 2(T + F + 2), and the replica R more columns.
The embedding, a copy of wte and wpe by rows, fills layer 0's columns under its ln_1, where a later
layer has the previous one's res_2 and proj: its columns are ln_1's chunks, so it hands off as lanes.
Where the copy needs more rows than that (narrow strips, whose PEs hold few rows of the tables), there
is none: the head's columns serve the token's row, chained down each K-line into wpe's rows at the top
of the strip, which hand off to layer 0 as a gather line.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache

from wafer_gpt2.core.abi import LAYER_OPS
from wafer_gpt2.core.arch import Arch
from wafer_gpt2.core.tiling import HeadTiling, allreduce_root, ceil_div, gather_lines
from wafer_gpt2.core.wire import record_words
from wafer_gpt2.model.config import GPT2Config
from wafer_gpt2.plan.structure import SYMBOL_BYTES, Knobs
from wafer_gpt2.plan.symbols import embed_symbols, pe_bytes, weight_symbol_dtype
from wafer_gpt2.plan.tilings import LayerTilings


def _mirror(axis: str) -> str:
    return {"+x": "-x", "-x": "+x"}.get(axis, axis)


def _upside_down(axis: str) -> str:
    return {"+y": "-y", "-y": "+y"}.get(axis, axis)


def exit_dirs(reduction: str, toward: str) -> str:
    """Which way a GEMV's reduction index must grow so the reduction ends at the `toward` edge: every
    reduction the program implements (chain, two_level) ends at index rows - 1."""
    del reduction  # both end on the last index
    return {"east": "+x", "west": "-x", "south": "+y", "north": "-y"}[toward]


@dataclass(frozen=True)
class Dirs:
    """How the indices of the stream and of each tiling run in a layer flowing east (see docs/plan.md):
    every producer's output order equals its consumer's input order, so hand-offs need no reordering."""

    stream_1: str  # ln_1 chunks = qkv K (exit east) = the previous layer's proj N / res_2
    rows: str  # qkv N = attention head groups = attn_proj K (exit south)
    stream_2: str  # attn_proj N = res_1 = ln_2 = fc K (exit east)
    hidden: str  # fc N = proj K (exit north)
    head_k: str  # the head's K (exit east, to its roots' column); the strip is never mirrored
    attn_position: str = "-x"  # the attention chain's snake (see `_layer_rects`)

    @staticmethod
    def of(lt: LayerTilings, head: HeadTiling) -> Dirs:
        chain_odd = lt.attn.fold % 2 == 1  # the merge ends on the chain's last PE
        return Dirs(
            exit_dirs(lt.qkv.reduction, "east"),
            exit_dirs(lt.attn_proj.reduction, "south"),
            exit_dirs(lt.fc.reduction, "east"),
            exit_dirs(lt.proj.reduction, "north"),
            exit_dirs(head.gemv.reduction, "east"),
            "+x" if chain_odd else "-x",
        )


# Sub-regions of one layer in its own coordinates (flow east): name -> (kind, x, y, w, h, axes), with
# R = stream PEs, T = attention rows, Lc = attention columns, F = FC columns; `out` is the order of
# proj's output (the next ln_1's order, or the order a band turn or the head strip needs).
@lru_cache(maxsize=4096)  # asked for every region and route of every candidate; callers copy `axes`
def _layer_rects(r: int, t: int, lc: int, f: int, d: Dirs, out: str) -> dict[str, tuple]:
    return {
        "qkv": ("gemv", 0, 0, r, t, {"k": d.stream_1, "n": d.rows}),
        # the merge ends next to attn_proj, on the chain's last index, which ends the snake's last
        # row: that row runs forwards (east) when the fold is odd
        "attn": ("attention", r, 0, lc, t, {"position": d.attn_position, "head_group": d.rows}),
        "attn_proj": ("gemv", r + lc, 0, r, t, {"k": d.rows, "n": d.stream_2}),
        "ln_1": ("layernorm", 0, t, r, 1, {"i": d.stream_1}),
        "res_1": ("residual", r + lc, t, r, 1, {"i": d.stream_2}),
        "ln_2": ("layernorm", r + lc, t + 1, r, 1, {"i": d.stream_2}),
        "fc": ("gemv", r + lc, t + 2, r, f, {"k": d.stream_2, "n": d.hidden}),
        "proj": ("gemv", 2 * r + lc, t + 2, r, f, {"k": d.hidden, "n": out}),
        "res_2": ("residual", 2 * r + lc, t + 1, r, 1, {"i": out}),
    }


@dataclass(frozen=True)
class Geometry:
    """Where everything of one replica goes, as arithmetic (no Region objects): cheap enough to
    evaluate for every candidate. Coordinates are relative to the replica's top-left corner."""

    r: int  # stream PEs (width of every strip of the layers)
    t_rows: int
    lc: int
    f: int
    n_layer: int
    per_band: int
    bands: int
    embed_rows: int  # rows of the embedding
    tokens_per_pe: int  # wte rows per embedding PE (of its dim chunk); 0: no copy, the head serves them
    positions_per_pe: int  # wpe rows per embedding PE
    head_cols: int
    dirs: Dirs
    s: int  # PEs across the west strip (the head's K-lines, ln_f, and the embedding where it lies there)
    k_rows: int = 0  # PEs of each head K-line that hold weights, which ln_f and an embedding in the
    # strip span (its west end); 0: the whole strip (the head's rounds run on its last weighted PEs)
    interlocked: bool = False  # odd bands upside down in the even bands' rows under attention (above)

    @property
    def k_pes(self) -> int:
        """PEs across ln_f, and the embedding where it lies in the strip."""
        return self.k_rows or self.s

    @cached_property  # on the search's hot path (every region of every candidate)
    def pitch(self) -> int:
        return 2 * self.r + self.lc

    @cached_property
    def band_h(self) -> int:
        return self.t_rows + 2 + self.f

    @cached_property
    def band_w(self) -> int:
        return self.per_band * self.pitch + self.r

    @cached_property
    def pair_h(self) -> int:
        """Rows of an even band and the odd band after it: interlocked, the odd one's FC and proj
        share the even one's rows under its attention."""
        return 2 * self.t_rows + self.f + 2 if self.interlocked else 2 * self.band_h

    @property
    def bands_h(self) -> int:
        """Rows of all the bands."""
        return (self.bands // 2) * self.pair_h + (self.bands % 2) * self.band_h

    @property
    def width(self) -> int:
        return self.s + self.band_w + (self.r if self.interlocked else 0)

    @property
    def layer_pes(self) -> int:
        return sum(self.layer_rect(0, op)[3] * self.layer_rect(0, op)[4] for op in LAYER_OPS)

    @property
    def strip_h(self) -> int:
        return 2 + self.head_cols if self.embed_copy else 3 + self.embed_rows + self.head_cols

    @property
    def embed_copy(self) -> bool:
        """Whether the embedding holds its own copy of wte (under layer 0's ln_1), else the head's
        columns serve the token's row and the embedding holds wpe at the top of the strip."""
        return self.tokens_per_pe > 0

    @property
    def height(self) -> int:
        return max(self.strip_h, self.bands_h)

    def strip_rects(self) -> dict[str, tuple[int, int, int, int]]:
        """The strip west of the layers, top down, and io.in. With a copy of wte beside layer 0
        (`embed_copy`): io.out in its first row, the LM head, the final LayerNorm (fed by the last
        layer); io.in under the copy's far row, where layer 0's columns leave one free (the request
        reaches every line's first PE a row and at most a strip's width away; memcpy's stream crosses
        the strip's routers on its own color), else beside io.out. Without: io.out, the embedding
        (wpe), the LM head, the final LayerNorm and io.in, the token's request entering at the bottom
        and running up, as the embedding's lines do (every head column, then the wpe rows, then layer 0
        at the top). Either way ln_f's output runs up the head, whose
        rounds end on its centre column's root, which sends the output record up to io.out
        (`wafer_gpt2.core.cost.head_cost`)."""
        return self._strip_rects

    @cached_property
    def _strip_rects(self) -> dict[str, tuple[int, int, int, int]]:
        """`strip_rects`, made once per geometry (the search asks it for every stage)."""
        e, v, s, k = self.embed_rows, self.head_cols, self.s, self.k_pes
        if self.embed_copy:
            x, y, _, h = self.embed_rect()
            return {
                "io.out": (0, 0, 1, 1),
                "io.in": (x, y + h, 1, 1) if self.embed_rows <= self.f else (1, 0, 1, 1),
                "head": (0, 1, s, v),
                "ln_f": (0, 1 + v, k, 1),
            }
        return {
            "io.out": (0, 0, 1, 1),
            "embed": (0, 1, k, e),
            "head": (0, 1 + e, s, v),
            "ln_f": (0, 1 + e + v, k, 1),
            "io.in": (0, 2 + e + v, 1, 1),
        }

    def embed_rect(self) -> tuple[int, int, int, int]:
        """The embedding: with its copy of wte, the rows under layer 0's ln_1 in its columns (band 0 is
        never mirrored); else the top of the strip. Its row 0, which sends, is its top row."""
        if not self.embed_copy:
            return self.strip_rects()["embed"]
        x, y, w, _ = self._layer_box(0, "ln_1")
        return x, y + 1, w, self.embed_rows

    @property
    def embed_k_axis(self) -> str:
        """The way the embedding's chunk index grows: layer 0's (its copy hands off as lanes), else
        the head's K (its lines run on from the head's K-lines)."""
        return self.layer_rect(0, "ln_1")[5]["i"] if self.embed_copy else self.dirs.head_k

    def layer_rect(self, layer: int, name: str) -> tuple[str, int, int, int, int, dict[str, str]]:
        band = layer // self.per_band
        mirrored = band % 2 == 1  # odd bands flow west: mirrored inside the band
        out = self.dirs.stream_1
        if layer == self.n_layer - 1:  # ln_f and the head take the stream in the strip's order
            out = _mirror(self.dirs.head_k) if mirrored else self.dirs.head_k
        elif (layer + 1) % self.per_band == 0:  # the next band is mirrored: hand it the mirrored order
            out = _mirror(self.dirs.stream_1)
        kind, *_, axes = _layer_rects(self.r, self.t_rows, self.lc, self.f, self.dirs, out)[name]
        if mirrored:  # indices that grew east grow west
            axes = {k: _mirror(v) for k, v in axes.items()}
            if self.interlocked:  # and those that grew south grow north
                axes = {k: _upside_down(v) for k, v in axes.items()}
        else:
            axes = dict(axes)  # the cached table's stays as it is
        return (kind, *self._layer_box(layer, name), axes)

    def _layer_box(self, layer: int, name: str) -> tuple[int, int, int, int]:
        """(x, y, w, h) of a layer's region: `layer_rect` without its axes, which the search's routes
        and stages ask for far more often (a region's box does not depend on its axes)."""
        band, j = divmod(layer, self.per_band)
        _, x, y, w, h, _ = _layer_rects(self.r, self.t_rows, self.lc, self.f, self.dirs, self.dirs.stream_1)[
            name
        ]
        lx = j * self.pitch + x
        top = (band // 2) * self.pair_h
        if band % 2 == 1:  # mirrored: indices that grew east grow west
            lx = self.band_w - lx - w
            top += self.band_h
            if self.interlocked:  # upside down and R further east: FC and proj under attention
                lx += self.r
                top, y = top - self.f - 2, self.band_h - y - h
        return self.s + lx, top + y, w, h

    @cached_property
    def _rects(self) -> dict[str, tuple[int, int, int, int]]:
        """`rect`'s answers so far: the search asks every candidate's routes and stages for the same
        few regions many times (a frozen dataclass's instance dictionary still takes the cache)."""
        return {}

    def rect(self, name: str) -> tuple[int, int, int, int]:
        found = self._rects.get(name)
        if found is None:
            found = self._rects[name] = self._rect(name)
        return found

    def _rect(self, name: str) -> tuple[int, int, int, int]:
        if name.startswith("L"):
            layer, op = name[1:].split(".", 1)
            return self._layer_box(int(layer), op)
        if name == "embed":
            return self.embed_rect()
        return self.strip_rects()[name]

    def routes(self) -> list[tuple[str, str, str]]:
        """(route name, src, dst) of the hand-offs that are not between touching regions."""
        first, *turns, final, scores = self.outer_routes()
        turn_after = {int(route[0].split(".")[1]): route for route in turns}  # "turn.{layer}"
        out = [first]
        for layer in range(self.n_layer):
            out.append((f"L{layer}.resid_1", f"L{layer}.ln_1", f"L{layer}.res_1"))
            out.append((f"L{layer}.resid_2", f"L{layer}.res_1", f"L{layer}.res_2"))
            if layer in turn_after:
                out.append(turn_after[layer])
        return [*out, final, scores]

    def outer_routes(self) -> list[tuple[str, str, str]]:
        """`routes` on a token's path outside the layers: into layer 0, the band turns, to ln_f and
        out (a layer's residual buses run beside its stages)."""
        turns = [
            (f"turn.{layer}", f"L{layer}.res_2", f"L{layer + 1}.ln_1")
            for layer in range(self.per_band - 1, self.n_layer - 1, self.per_band)
        ]
        return [
            ("embed.out", "embed", "L0.ln_1"),
            *turns,
            ("final", f"L{self.n_layer - 1}.res_2", "ln_f"),
            ("scores", "head.root", "io.out"),
        ]

    def gathered(self, src: str, dst: str) -> bool:
        """Whether the hand-off from the strip `src` to `dst` is a gather line and one multicast, not a
        bundle of lanes (wafer_gpt2/codegen/build.py `connect`): straight lanes leave a strip along x
        at its row, so they share routers unless the strip lies in dst's own columns, and lanes that
        turn (`staircase`) need rows between the two strips."""
        found = self._gathered.get((src, dst))
        if found is None:
            found = self._gathered[src, dst] = self._is_gathered(src, dst)
        return found

    @cached_property
    def _gathered(self) -> dict[tuple[str, str], bool]:
        """`gathered`'s answers so far (the search's stages ask each hand-off several times)."""
        return {}

    def _is_gathered(self, src: str, dst: str) -> bool:
        if src == "head.root":
            return False
        sx, _, sw, sh = self.rect(src)
        dx, _, dw, _ = self.rect(dst)
        if src == "embed":  # it sends from its row 0
            sh = 1
        return sh == 1 and sw > 1 and (sx, sw) != (dx, dw) and not self.staircase(src, dst)

    def staircase(self, src: str, dst: str) -> bool:
        """Whether the hand-off from the strip `src` to the strip `dst` is a bundle of lanes that turn
        (wafer_gpt2/codegen/routes.py `staircase_corners`): both are rows of the same width in
        columns apart, their indices grow the same way, a row of its own between them for every lane
        to turn along x, and dst's PEs are the lanes' only readers (not a LayerNorm fed on into its
        GEMV's K-lines)."""
        if src in ("embed", "head.root") or self.multicast_readers(dst) != (dst,):
            return False
        sx, sy, sw, sh = self.rect(src)
        dx, dy, dw, dh = self.rect(dst)
        return (
            sh == dh == 1
            and sw == dw > 1
            and (sx + sw <= dx or dx + dw <= sx)
            and abs(dy - sy) > sw
            and self._strip_axis(src) == self._strip_axis(dst)
        )

    @staticmethod
    def multicast_readers(dst: str) -> tuple[str, ...]:
        """The regions a gathered hand-off's multicast into `dst` feeds: a layer's ln_1 strip and the
        qkv behind it (the stream crosses ln_1's routers into qkv's K-lines, the LayerNorm folded in),
        else `dst` alone."""
        return (dst, dst.replace(".ln_1", ".qkv")) if dst.endswith(".ln_1") else (dst,)

    def handoff_lines(self, name: str, src: str, dst: str, n_embd: int) -> int:
        """The gather lines of the hand-off `name` (`gather_lines`): a hand-off on the token's way
        outside the layers that is gathered (into a layer's first strip, into ln_f) is split into as
        many as its two strips' slices allow; the residual buses beside the layers stay one line."""
        if name.endswith(("resid_1", "resid_2")) or not self.gathered(src, dst):
            return 1
        sources, readers = self.rect(src)[2], self.rect(dst)[2]
        return gather_lines(sources, ceil_div(n_embd, sources), readers, ceil_div(n_embd, readers))

    def gather_hops(self, src: str, dst: str, lines: int = 1) -> int:
        """Routers from the PE that leads a gather line of the strip `src` to the farthest PE its
        multicast into `dst` reaches (`multicast_readers`), the most of its `lines` lines: line g is
        led by src's index g * (its PEs / lines) and read by dst's indices g * (its PEs / lines) on
        (the strips' indices along their axes; a reader behind dst, qkv's K-lines, in dst's columns)."""
        sx, sy, sw, _ = self.rect(src)
        dw = self.rect(dst)[2]
        per_src, per_dst = sw // lines, dw // lines
        far = 0
        for g in range(lines):
            lead = self._index_x(src, g * per_src)
            ends = (self._index_x(dst, g * per_dst), self._index_x(dst, (g + 1) * per_dst - 1))
            for name in self.multicast_readers(dst):
                _, y, _, h = self.rect(name)
                far = max(far, max(abs(lead - e) for e in ends) + max(abs(sy - y), abs(sy - (y + h - 1))))
        return far + 1

    def _index_x(self, name: str, i: int) -> int:
        """The column of index i of the strip `name`."""
        x, _, w, _ = self.rect(name)
        return x + w - 1 - i if self._strip_axis(name) == "-x" else x + i

    def _strip_axis(self, name: str) -> str:
        """The way a strip's index grows: a layer strip's own axis, the embedding's `embed_k_axis`, the
        west strip's the head's K."""
        if name == "embed":
            return self.embed_k_axis
        if name.startswith("L"):
            layer, op = name[1:].split(".", 1)
            return self.layer_rect(int(layer), op)[5]["i"]
        return self.dirs.head_k

    def route_legs(self, src: str, dst: str) -> tuple[int, tuple[tuple[int, int, int, int], ...]]:
        """(hops, legs) of a bundle of lanes from src to dst: along x at src's rows, then along y at
        dst's columns. "head.root" is the PE where the head's selection ends: the root of its centre
        column (`HeadTiling.centre`; column 0 is the bottom row, next to ln_f), the last set's where
        the rounds run apart in sets (the strip's last PE; the sets before it are as many hops nearer
        or farther)."""
        if src == "head.root":
            hx, hy, hw, hh = self.rect("head")
            sx, sy, sw, sh = hx + hw - 1, hy + hh - 1 - allreduce_root(self.head_cols), 1, 1
        else:
            sx, sy, sw, sh = self.rect(src)
        dx, dy, dw, dh = self.rect(dst)
        x0, x1 = min(sx, dx), max(sx + sw, dx + dw)
        y0, y1 = min(sy, dy), max(sy + sh, dy + dh)
        hops = abs(dx - sx) + abs(dy - sy) + 1
        if src != "head.root" and self.staircase(src, dst):
            # along y in src's columns to the turn rows next to src, along x, along y in dst's columns
            turns = (sy + 1, sy + sw) if dy > sy else (sy - sw, sy - 1)
            top = min(sy, turns[0])
            return hops, ((sx, top, sw, sw + 1), (x0, turns[0], x1 - x0, sw), (dx, y0, dw, y1 - y0))
        return hops, ((x0, sy, x1 - x0, sh), (dx, y0, dw, y1 - y0))


def layer_bands(
    config: GPT2Config, knobs: Knobs, arch: Arch, asked: int | None = None
) -> int | tuple[float, str]:
    """How many bands the replica's layers take: the fewest whose layers fit the kernel's width
    beside the head strip, or the bands asked for (`knobs.bands` unless `asked`) where more (one more
    to make them even with `knobs.even_bands`), the layers then spread evenly (so several requests
    give one count); or (how far over, why) where one layer does not fit."""
    r, s = knobs.stream_pes, knobs.strip
    pitch = 2 * r + ceil_div(knobs.attn_chain, knobs.fold)
    shift = r if knobs.interlock else 0  # the odd bands a stream's width east
    per_band = (arch.kernel_w - s - r - shift) // pitch
    if per_band < 1:
        need = pitch + r + s + shift
        return need / arch.kernel_w, (
            f"one layer and the head strip are {need} PEs wide, "
            f"{need - arch.kernel_w} over the kernel width {arch.kernel_w}"
        )
    bands = max(ceil_div(config.n_layer, per_band), knobs.bands if asked is None else asked)
    if knobs.even_bands and bands % 2 and bands < config.n_layer:
        bands += 1
    per_band = ceil_div(config.n_layer, bands)  # spread the layers evenly over the bands
    return ceil_div(config.n_layer, per_band)


def replica_geometry(
    config: GPT2Config, knobs: Knobs, arch: Arch, dtype: str, dirs: Dirs
) -> Geometry | tuple[float, str]:
    """The replica's geometry, or (how far over, which limit of the kernel area it exceeds)."""
    r, s = knobs.stream_pes, knobs.strip
    t_rows = config.n_head * knobs.fold
    lc = ceil_div(knobs.attn_chain, knobs.fold)
    # the copy of wte under layer 0's ln_1 (in the stream's chunks) where its rows fit there (F + 1),
    # else wpe alone in the strip (in the strip's)
    embed_rows, tokens_per_pe, positions_per_pe = embed_spread(
        config, ceil_div(config.n_embd, r), arch, dtype, copy=True
    )
    if embed_rows > knobs.fc_cols + 1:
        embed_rows, tokens_per_pe, positions_per_pe = embed_spread(
            config, ceil_div(config.n_embd, knobs.head_rows), arch, dtype, copy=False
        )
    if knobs.interlock and 2 * r > lc:
        return 2 * r / lc, f"interlocked bands need attention {2 * r} PEs wide or wider, not {lc}"
    bands = layer_bands(config, knobs, arch)
    if not isinstance(bands, int):
        return bands
    per_band = ceil_div(config.n_layer, bands)
    if knobs.interlock and bands < 2:
        return 1.0, "interlocked bands need two bands of layers or more"
    g = Geometry(
        r,
        t_rows,
        lc,
        knobs.fc_cols,
        config.n_layer,
        per_band,
        bands,
        embed_rows,
        tokens_per_pe,
        positions_per_pe,
        knobs.head_cols,
        dirs,
        s,
        knobs.head_rows if knobs.head_workers else 0,
        knobs.interlock,
    )
    if g.strip_h > arch.kernel_h:
        return g.strip_h / arch.kernel_h, (
            f"the head strip is {g.strip_h} rows, {g.strip_h - arch.kernel_h} "
            f"over the kernel height {arch.kernel_h}"
        )
    if g.bands_h > arch.kernel_h:
        need = g.bands_h
        shape = "interlocked in pairs" if g.interlocked else f"x {g.band_h} rows"
        return need / arch.kernel_h, (
            f"{g.bands} bands of layers {shape} = {need} rows, "
            f"{need - arch.kernel_h} over the kernel height {arch.kernel_h}"
        )
    return g


@lru_cache(maxsize=1024)  # the search asks it for every candidate and band count
def embed_spread(config: GPT2Config, tile_k: int, arch: Arch, dtype: str, copy: bool) -> tuple[int, int, int]:
    """(rows, wte rows per PE, wpe rows per PE) of the embedding: each PE holds its dim chunk of a block
    of the positions, and with a `copy` of wte of a block of the vocabulary too (+ its fixed buffers),
    spread evenly over the fewest rows that hold them."""
    vocab = config.vocab_size if copy else 0
    fixed = embed_symbols(0, 0, tile_k, dtype)  # the buffers of a PE that holds no table rows
    if copy:
        fixed.pop("relay")  # a copy hands off by lanes, without the gather line's relay FIFO
    room = arch.data_bytes("embed") - pe_bytes(fixed)
    per_row = tile_k * SYMBOL_BYTES[weight_symbol_dtype(dtype)]
    rows = max(1, ceil_div(vocab + config.n_positions, max(1, room // per_row)))
    while (
        rows < vocab + config.n_positions
        and (ceil_div(vocab, rows) + ceil_div(config.n_positions, rows)) * per_row > room
    ):
        rows += 1
    return rows, ceil_div(vocab, rows), ceil_div(config.n_positions, rows)


def route_words(name: str, config: GPT2Config, geo: Geometry, head: HeadTiling) -> int:
    if name == "scores":
        return record_words(head.top_k)
    if name.endswith(("resid_1", "resid_2")):
        return (
            config.n_embd
        )  # the residual bus carries the whole vector past the strip (off the critical path)
    return ceil_div(config.n_embd, geo.r)  # one stream chunk per lane
