"""How one operation is cut into per-PE pieces: the shared vocabulary of plan, cost, sim and CSL.

A tiling says what each PE of a region holds and in what order partial results are combined.
The planner chooses tilings (`wafer_gpt2.plan`), the cost model prices them (`wafer_gpt2.core.cost`), the
simulator executes them (`wafer_gpt2.sim`) and the CSL programs (`wafer_gpt2/kernels/`) receive them as params.

Conventions (a region is a rectangle of w x h PEs, x grows east, y grows south):
- GEMV `y[N] = x[K] @ W[K, N]`: the region has `rows` PEs along the reduction (K) axis and `cols`
  along the output (N) axis. PE (r, c) holds W[r*tile_k:(r+1)*tile_k, c*tile_n:(c+1)*tile_n]
  (zero-padded at the ragged edge). With `n_split` = s > 1 (c_attn: s = 3 for q | k | v) N is s equal
  segments, and every run of `split_cols` consecutive columns holds the same slice of every segment,
  one segment after the other over the run's columns (in `segment_order`): c_attn's runs are a head
  group's columns, so their outputs read in column order are the group's [k | q | v] (`QKV_ORDER`),
  each contiguous.
  `column_order()` lists the N index of every tiled output (-1 for padding).
  The input chunk x[r*tile_k:...] is multicast to every PE of reduction index r; partial sums are
  combined over r in one of two orders (`reduction`, `group`; see "Reductions" below).
  `orientation` says which fabric axis is the K axis: "k_along_y" puts r on y (rows of PEs) and c
  on x, "k_along_x" the transpose. Consecutive GEMVs
  alternate orientation, so the output of one leaves along the axis the next one takes as input.
- Attention for one layer: `head_groups` PEs across heads, `chain` PEs along positions. PE (g, p)
  holds K and V of heads [g*heads_per_pe, ...) for positions [p*positions_per_pe, ...) of every slot.
  Per-PE partial (max, sum, weighted V) are merged in two rounds over p, both in the order of
  `reduction` and `group`: the max, then (sum, weighted V) rescaled to it. On the fabric a head group's chain is folded
  into `fold` rows of `chain // fold` PEs (row-major, snake order), so the region is
  (chain // fold) x (head_groups * fold) PEs. Laid out as a comb, each row's two halves run in from its
  edges and end side by side in its middle: a two-level merge whose runs are the halves then chains
  their ends down the rows' middle, a hop or two apart (`AttentionTiling.snake`).
- LayerNorm over C values: `pes` PEs each hold `chunk` values. One pass: every PE's sums of x and
  x^2 are combined over the PEs (`reduction`, `group`) into mean and variance, then every PE
  normalises its chunk. `axis` is the fabric axis the strip lies along. A strip that does not
  `normalise` makes the statistics alone, for the GEMV it feeds, which has the LayerNorm folded in
  (`GemvTiling.norm_fold`).
- A GEMV with `norm_fold` computes LayerNorm(x) @ W + b from the raw x: its weights are diag(g) @ W
  (the LayerNorm's gain folded in), the strip before it sends the statistics to the PEs that end its
  columns' reductions, and each of those finishes y = (s - mean * colsum(diag(g) @ W)) * rstd + (b + beta @ W).
- Head: the LM head is a GEMV with K = C, N = vocab on `wte` transposed; the top-k and the
  log-sum-exp by threshold selection over every column's logits, held by `workers` PEs per column and
  reduced over a tree of the columns' roots (`tree`, `tree_group`): `HeadTiling`.

Reductions: n partials, indices 0 .. n-1, are combined in one of these orders, each needing two
colors per level, so every input queue serves one color (wafer_gpt2/kernels/comm):
- "chain": ((p0 + p1) + p2) + ... : index i adds what index i-1 sends and passes the sum on.
- "two_level" with `group` = g: the indices split into runs of g (the last may be shorter), each run
  chains to its last index at the same time as the others, then those ends chain in run order:
  S_j = chain of run j, total = ((S_0 + S_1) + S_2) + ... . About g + n/g steps instead of n.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal

Orientation = Literal["k_along_y", "k_along_x"]

# c_attn's segments (q, k, v in its N order) in the order a head group's stream carries them: k
# first, so that the PE that stores the new position's k does so while q arrives, and every PE starts
# its scores with q in before v (wafer_gpt2/kernels/pe/attention.csl).
QKV_ORDER = (1, 0, 2)
Reduction = Literal["chain", "two_level", "three_level"]
REDUCTIONS = ("chain", "two_level", "three_level")
Axis = Literal["x", "y"]


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def reduction_runs(n: int, reduction: str, group: int) -> list[range]:
    """The runs of indices that are combined first (one run for a chain); their results then combine
    in run order (two_level), or in runs of runs first (three_level: `reduction_end_runs`)."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"unknown reduction {reduction!r}")
    if reduction == "chain" or group <= 0 or group >= n:
        return [range(n)]
    return [range(start, min(start + group, n)) for start in range(0, n, group)]


def reduction_end_runs(runs: int, reduction: str, end_group: int) -> list[range]:
    """The runs' results (by run index) combined at the second level: one run of them all, except in
    a three_level reduction, whose runs of `end_group` runs' ends chain first and whose second-level
    ends then chain their sums in order."""
    if reduction != "three_level" or end_group <= 0 or end_group >= runs:
        return [range(runs)]
    return [range(start, min(start + end_group, runs)) for start in range(0, runs, end_group)]


def three_level_fits(n: int, group: int, end_group: int) -> bool:
    """Whether a three_level reduction of n PEs in runs of `group`, their ends in runs of `end_group`,
    is one comm/reduce.csl implements: every run and every second-level run whole (at least two
    members each) and at least two second-level runs, so each PE's three roles are a chain's."""
    return group >= 2 and end_group >= 2 and n % (group * end_group) == 0 and n // (group * end_group) >= 2


# Most gather lines a hand-off on a token's way outside the layers (into a layer's first LayerNorm
# strip, into ln_f) is split into: each line a multicast of its own, so each color more on its way.
GATHER_LINES = 4


def gather_lines(sources: int, chunk: int, readers: int, reader_chunk: int, most: int = GATHER_LINES) -> int:
    """How many gather lines a vector held in `chunk`-word slices by `sources` PEs (in order) reaches
    `readers` destinations wanting `reader_chunk`-word windows through (comm/gather.csl, one multicast
    each; wafer_gpt2/codegen/build.py `connect`): the most, up to `most`, that split both sides into
    equal runs of whole slices and whole windows holding the same words, so that each line's stream
    serves its own readers, a line's place and a reader's window repeating every run."""
    for n in range(min(most, sources, readers), 1, -1):
        if sources % n == 0 and readers % n == 0 and (sources // n) * chunk == (readers // n) * reader_chunk:
            return n
    return 1


def allreduce_root(n: int) -> int:
    """The index of a line of n PEs that ends an all-reduce (comm/allreduce.csl): the PEs 0 .. root
    reduce towards it and the PEs n-1 down to root + 1 towards root + 1 at the same time, which hands
    its sum on to the root; the root's sum is broadcast both ways. In the middle, so both halves and
    both broadcast legs are about n/2 PEs long."""
    return max(n - 1, 0) // 2


def allreduce_halves(n: int) -> tuple[list[int], list[int]]:
    """The two lines of an all-reduce over n PEs, each in its reduction order: 0 .. root, and
    n-1 down to root + 1 (empty for one PE)."""
    root = allreduce_root(n)
    return list(range(root + 1)), list(range(n - 1, root, -1))


@dataclass(frozen=True)
class GemvTiling:
    k: int
    n: int
    rows: int  # PEs along K (the reduction axis)
    cols: int  # PEs along N
    orientation: Orientation = "k_along_y"
    reduction: Reduction = "chain"
    n_split: int = 1  # N = n_split equal segments (q | k | v)
    group: int = 0  # two_level and three_level: reduction indices per first-level run
    end_group: int = 0  # three_level only: first-level runs per second-level run
    # PEs at the end of every K-line that share the epilogue (fc's GELU): the last one scatters
    # slices back along the line, each applies the epilogue to its slice, a gather line sends them out
    # (relayed, epilogue_pes divides tile_n; multicast, the farthest PEs take one output more where
    # it does not: wafer_gpt2.core.cost.epilogue_slices)
    epilogue_pes: int = 1
    # how they share it: False, the slices relayed back along the line and gathered (comm/scatter.csl,
    # comm/gather.csl); True, the root multicasts the others' sums in one stream and their results
    # come back as one streamed sum, each PE's vector zero outside its slice (comm/spread.csl)
    epilogue_multicast: bool = False
    norm_fold: bool = False  # the LayerNorm before this GEMV is folded in (module docstring)
    # with n_split > 1: the columns of a run that holds its slice of every segment together (it
    # divides cols; the module docstring)
    split_cols: int = 1
    # with n_split > 1: the segments' order along a run (default 0, 1, ...): qkv's runs hold k first,
    # so that attention's owner stores k while q arrives (wafer_gpt2/kernels/pe/attention.csl)
    segment_order: tuple[int, ...] = ()

    @property
    def tile_k(self) -> int:
        return ceil_div(self.k, self.rows)

    @property
    def segment_tile(self) -> int:
        """Outputs of one segment held by one column (tile_n when n_split == 1)."""
        return ceil_div(self.n // self.n_split, self.cols)

    @property
    def tile_n(self) -> int:
        if self.n_split == 1:
            return ceil_div(self.n, self.cols)
        return self.n_split * self.segment_tile

    def column_order(self) -> list[int]:
        """The N index of output j of column c at position c * tile_n + j; -1 where zero-padded."""
        if self.n_split == 1:
            return [i if i < self.n else -1 for i in range(self.cols * self.tile_n)]
        if self.cols % self.split_cols:
            raise ValueError(f"runs of {self.split_cols} columns do not split {self.cols} columns")
        segments = self.segment_order or tuple(range(self.n_split))
        if sorted(segments) != list(range(self.n_split)):
            raise ValueError(f"segment order {segments} is not an order of {self.n_split} segments")
        seg, run = self.n // self.n_split, self.split_cols * self.segment_tile
        order: list[int] = []
        for b in range(self.cols // self.split_cols):
            for s in segments:
                order.extend(s * seg + i if i < seg else -1 for i in range(b * run, (b + 1) * run))
        return order

    @property
    def pes(self) -> int:
        return self.rows * self.cols

    @property
    def bias_at_root(self) -> bool:
        """Whether the bias joins the partial sum of the PE that ends the reduction before the reduction
        (((... + p_last-1) + (p_last + b)) in the reduction's order) instead of the finished sum: where
        no epilogue follows it (no LayerNorm folded in, one epilogue PE), so that the sums can leave
        as the reduction makes them (wafer_gpt2/kernels/pe/gemv.csl `bias_first`)."""
        return not self.norm_fold and self.epilogue_pes == 1

    @property
    def grid_wh(self) -> tuple[int, int]:
        """(w, h) of the rectangle on the fabric."""
        return (self.cols, self.rows) if self.orientation == "k_along_y" else (self.rows, self.cols)

    def runs(self) -> list[range]:
        return reduction_runs(self.rows, self.reduction, self.group)


@dataclass(frozen=True)
class AttentionTiling:
    n_head: int
    head_dim: int
    slots: int
    context: int
    head_groups: int
    chain: int
    fold: int = 1  # fabric rows per head group (the chain folded in a snake)
    reduction: Reduction = "chain"  # how the per-PE (max, sum, acc) partials are merged along p
    group: int = 0  # two_level only
    comb: bool = False  # the rows laid out as a comb (`snake`), each row's halves a run of the merge

    @property
    def heads_per_pe(self) -> int:
        return ceil_div(self.n_head, self.head_groups)

    @property
    def positions_per_pe(self) -> int:
        return ceil_div(self.context, self.chain)

    @property
    def pes(self) -> int:
        return self.head_groups * self.chain

    @property
    def grid_wh(self) -> tuple[int, int]:
        return (ceil_div(self.chain, self.fold), self.head_groups * self.fold)

    def runs(self) -> list[range]:
        return reduction_runs(self.chain, self.reduction, self.group)

    def snake(self, p: Any) -> tuple[Any, Any]:
        """(along, row) of chain index p (an int or an integer array) in its head group's rows: the
        chain runs along rows of ceil(chain / fold) PEs, every other row backwards. The comb
        (`with_comb`) lays each row out as two halves instead, the first eastward from the row's west
        edge, the second westward from its east edge, so that the halves' runs end side by side in
        the row's middle, the ends of consecutive rows a hop or two apart."""
        row_len = ceil_div(self.chain, self.fold)
        row, step = p // row_len, p % row_len
        if self.comb:
            half = row_len // 2
            return step + (step >= half) * (row_len - 1 + half - 2 * step), row
        return step + (row % 2) * (row_len - 1 - 2 * step), row

    @staticmethod
    def comb_fits(chain: int, fold: int) -> bool:
        """Whether a chain of `chain` PEs folded into `fold` rows can be laid out as a comb: two rows or
        more, whole and of an even length of four or more (halves of two PEs or more)."""
        row_len = chain // fold if fold else 0
        return fold >= 2 and chain == fold * row_len and row_len >= 4 and row_len % 2 == 0

    def with_comb(self) -> AttentionTiling:
        """The merge on a comb (`comb_fits`): two levels, each row's halves a run, the halves' ends
        chained in order down the rows' middle."""
        return replace(self, reduction="two_level", group=self.chain // self.fold // 2, comb=True)


@dataclass(frozen=True)
class NormTiling:
    dim: int
    pes: int
    reduction: Reduction = "chain"  # how the per-PE sums (of x and of x^2, one pass) are combined
    axis: Axis = "x"  # the fabric axis the strip of PEs lies along
    group: int = 0  # two_level only
    normalise: bool = True  # False: the strip passes x on to a GEMV with the LayerNorm folded in

    @property
    def chunk(self) -> int:
        return ceil_div(self.dim, self.pes)

    @property
    def grid_wh(self) -> tuple[int, int]:
        return (self.pes, 1) if self.axis == "x" else (1, self.pes)

    def runs(self) -> list[range]:
        return reduction_runs(self.pes, self.reduction, self.group)

    def halves(self) -> tuple[list[int], list[int]]:
        """The all-reduce's two lines of strip indices (`allreduce_halves`)."""
        return allreduce_halves(self.pes)


@dataclass(frozen=True)
class HeadTiling:
    """The LM head: logits = h @ wte^T on `gemv` (K = dim along x, reduced in a chain to each K-line's
    root; N = vocab, one column of tile_n logits per K-line), then the top-k and the log-sum-exp by
    threshold selection (wafer_gpt2/kernels/pe/head.csl): the root hands its logits to the `workers` PEs before it
    on its K-line (slices of tile_n // workers; the root keeps none), and three rounds over every
    slice reduce to the centre column and come back by one broadcast: A the max and the range of the
    histogram, B a histogram of the logits in it and the sum of exps, C the entries of the bins that
    hold the k best. The rounds ride the K-line's chain links to its root, then a tree over the roots:
    the columns on either side of the centre (`tree_halves`) reduce towards it (each half a chain or in
    two levels: `tree`, `tree_group`), and the halves' ends join the centre.

    `apart`: the workers and the root are PEs of their own after each K-line's `gemv.rows` PEs, which
    hold no weights: the K-line's chain runs on through them, and its weighted PEs take the next item
    while they run the rounds (two items in the stage at once). `sets` of them (apart only): that many
    sets of workers and root, one after the other along the K-line, each with its own tree and centre,
    take the items in turn (item i to set i % sets): the last weighted PE sends each item's header and
    sum to its set, over the routers of the sets before it."""

    vocab: int
    dim: int
    gemv: GemvTiling  # K = dim, N = vocab; reduced in a chain (the rounds ride its links)
    top_k: int = 64
    workers: int = 1  # PEs before every K-line's root holding its logits (workers divides tile_n)
    tree: Reduction = "chain"  # each half of the tree over the roots
    tree_group: int = 0  # two_level only: roots per first-level run
    apart: bool = False  # the workers and the root after the K-line, without weights
    sets: int = 1  # apart: sets of workers and root after the K-line, taking the items in turn

    def __post_init__(self) -> None:
        if self.sets < 1 or (self.sets > 1 and not self.apart):
            raise ValueError(f"a head's rounds run in sets only apart, at least one (sets {self.sets})")

    @property
    def slice(self) -> int:
        """Logits each worker holds."""
        return self.gemv.tile_n // self.workers

    @property
    def line(self) -> int:
        """PEs along each K-line: its weighted rows, and where the rounds run `apart` each set's
        workers and root after them."""
        return self.gemv.rows + (self.sets * self.rounds_pes if self.apart else 0)

    @property
    def rounds_pes(self) -> int:
        """PEs of one set of the rounds apart along a K-line: its workers and its root."""
        return self.workers + 1

    def set_start(self, s: int) -> int:
        """Index along the K-line of set s's first PE (its farthest worker), the rounds apart."""
        return self.gemv.rows + s * self.rounds_pes

    @property
    def pes(self) -> int:
        return self.line * self.gemv.cols

    @property
    def centre(self) -> int:
        """The column whose root ends the tree (the middle: both halves about cols / 2)."""
        return allreduce_root(self.gemv.cols)

    def tree_halves(self) -> tuple[list[int], list[int]]:
        """The two lines of columns that reduce towards the centre, each in its reduction order: 0 ..
        centre - 1 and cols - 1 down to centre + 1 (either may be empty); their ends join the centre."""
        c, n = self.centre, self.gemv.cols
        return list(range(c)), list(range(n - 1, c, -1))

    def half_runs(self, members: int) -> list[range]:
        return reduction_runs(members, self.tree, self.tree_group)
