"""The checks a plan must pass: the request's arguments, the total SRAM, each candidate's per-PE
memory, and a placed plan's memory, kernel area, overlaps and routing colors. A failure names the
limit and by how much it is exceeded."""

from __future__ import annotations

from functools import lru_cache

from wafer_gpt2.core.arch import Arch
from wafer_gpt2.core.code_bytes import program_of
from wafer_gpt2.core.cost import embed_reduction
from wafer_gpt2.core.tiling import AttentionTiling, GemvTiling, HeadTiling, NormTiling
from wafer_gpt2.model.config import GPT2Config
from wafer_gpt2.plan.structure import DTYPES, OBJECTIVES, Plan, PlanError, Region, Route
from wafer_gpt2.plan.symbols import attention_symbols, gemv_symbols, head_symbols, norm_symbols, pe_bytes
from wafer_gpt2.plan.tilings import LayerTilings, strip_norm

# Each layer LayerNorm strip and the GEMV its LayerNorm is folded into (`GemvTiling.norm_fold`).
FOLDED_INTO = {"ln_1": "qkv", "ln_2": "fc"}


def check_layer_norms_folded(plan: Plan) -> None:
    """Every layer's LayerNorm is folded into the GEMV after it, its strip only passing x on: the
    generated program, the simulator and the host fold them all, so a plan that normalises in a layer's
    strip (a hand-edited one: the planner never makes it) is refused, naming the strip."""
    for region in plan.regions:
        if region.kind != "layernorm" or region.layer is None:
            continue
        gemv = plan.region(f"L{region.layer}.{FOLDED_INTO[region.name.rsplit('.', 1)[-1]]}", region.replica)
        strip, fold = region.tiling, gemv.tiling
        if not isinstance(strip, NormTiling) or not isinstance(fold, GemvTiling):
            raise PlanError(f"{region.name} and {gemv.name}: expected a LayerNorm strip and a GEMV")
        if strip.normalise or not fold.norm_fold:
            raise PlanError(
                f"{region.name}: a layer's LayerNorm is folded into {gemv.name} (GemvTiling.norm_fold, its "
                "strip passing x on) by the program, the simulator and the host; this plan normalises in the strip"
            )


def check_request(
    config: GPT2Config, dtype: str, slots: int, context: int | None, top_k: int, objective: str = "latency"
) -> int:
    """The request's context (the model's n_positions when None); PlanError naming a bad argument."""
    if dtype not in DTYPES:
        raise PlanError(f"dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    if objective not in OBJECTIVES:
        raise PlanError(f"objective {objective!r}: expected one of {', '.join(OBJECTIVES)}")
    context = config.n_positions if context is None else context
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
        raise PlanError(f"slots must be a positive integer, got {slots!r}")
    if isinstance(context, bool) or not isinstance(context, int) or not 1 <= context <= config.n_positions:
        raise PlanError(f"context must be 1..{config.n_positions} (the model's n_positions), got {context!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= config.vocab_size:
        raise PlanError(f"top_k must be 1..{config.vocab_size}, got {top_k!r}")
    return context


def check_total_capacity(config: GPT2Config, arch: Arch, dtype: str, slots: int, context: int, replicas: int):
    """A quick bound before the search: weights + KV cache of every replica against all usable SRAM."""
    wb = 2 if dtype == "fp16" else 4
    weights = config.n_params * wb
    kv = 2 * config.n_layer * config.n_embd * slots * context * wb
    need = replicas * (weights + kv)
    have = arch.kernel_pes * arch.data_bytes_per_pe
    if need > have:
        raise PlanError(
            f"{config.name} with {slots} slots x {context} tokens x {replicas} replica(s) does not fit {arch.name}: "
            f"weights {weights / 2**30:.2f} GiB + KV cache {kv / 2**30:.2f} GiB per replica = {need / 2**30:.2f} GiB "
            f"> {have / 2**30:.2f} GiB of usable PE memory ({arch.kernel_pes:,} PEs x {arch.data_bytes_per_pe:,} B), "
            f"over by {(need - have) / 2**30:.2f} GiB"
        )


def memory_over(lt: LayerTilings, head: HeadTiling, dtype: str, arch: Arch) -> tuple[float, str] | None:
    """(ratio, message) when some region's per-PE data exceeds what its program leaves for data."""
    ratio, name, need, program = max(_layer_memory(lt, dtype, arch), _strip_memory(head, dtype, arch))
    if ratio > 1:
        return (
            ratio,
            f"per-PE memory: the {name} region needs {need:,} B on one PE, "
            f"{need - arch.data_bytes(program):,} B over the {arch.budget_words(program)}",
        )
    return None


_Fill = tuple[float, str, int, str]  # (share of the program's data memory, region, bytes, program)


def _fullest(checks: dict[str, tuple[object, str]], dtype: str, arch: Arch) -> _Fill:
    return max(
        (_tiling_pe_bytes(t, dtype) / arch.data_bytes(program), name, _tiling_pe_bytes(t, dtype), program)
        for name, (t, program) in checks.items()
    )


# The search pairs each layer tiling with many heads and each head with many layer tilings: the
# fullest PE of each side is kept apart (thousands of pairs, a few hundred of each).
@lru_cache(maxsize=8192)
def _layer_memory(lt: LayerTilings, dtype: str, arch: Arch) -> _Fill:
    """The fullest PE of a layer's regions."""
    checks = {
        "qkv": (lt.qkv, "gemv"),
        "attn": (lt.attn, "attention"),
        "attn_proj": (lt.attn_proj, "gemv"),
        "fc": (lt.fc, "gemv"),
        "proj": (lt.proj, "gemv"),
    }
    return _fullest(checks, dtype, arch)


@lru_cache(maxsize=4096)
def _strip_memory(head: HeadTiling, dtype: str, arch: Arch) -> _Fill:
    """The fullest PE of the west strip's regions: the head, and the final LayerNorm across the
    head's strip (a layer's strips hold a chunk and its statistics: never the fullest)."""
    ln_f = strip_norm(head.gemv.k, head.gemv.rows, normalise=True)
    return _fullest({"head": (head, "embed_head"), "ln_f": (ln_f, "layernorm")}, dtype, arch)


def strip_over(head: HeadTiling, dtype: str, arch: Arch) -> bool:
    """Whether the west strip's own regions overflow a PE: the head (its weighted PEs' tile) or ln_f,
    which spans the head's weighted PEs."""
    return _strip_memory(head, dtype, arch)[0] > 1


@lru_cache(maxsize=8192)  # the search meets the same tilings in thousands of candidates
def _tiling_pe_bytes(tiling: GemvTiling | AttentionTiling | HeadTiling | NormTiling, dtype: str) -> int:
    """Bytes one PE of a region with this tiling declares (`pe_bytes` of its symbols)."""
    if isinstance(tiling, GemvTiling):
        return pe_bytes(gemv_symbols(tiling, dtype))
    if isinstance(tiling, AttentionTiling):
        return pe_bytes(attention_symbols(tiling, dtype))
    if isinstance(tiling, HeadTiling):
        return pe_bytes(head_symbols(tiling, dtype))
    return pe_bytes(norm_symbols(tiling))


def check_colors(regions: list[Region], arch: Arch) -> str | None:
    worst = max(regions, key=lambda r: r.colors)
    if worst.colors > arch.usable_colors:
        return (
            f"colors: region {worst.name} needs {worst.colors} colors on one PE, "
            f"{worst.colors - arch.usable_colors} over the {arch.usable_colors} usable "
            f"({arch.routable_colors} routable minus memcpy's {len(arch.memcpy_reserved_colors)})"
        )
    return None


def check_memory(regions: list[Region], arch: Arch) -> str | None:
    def over(r: Region) -> float:
        return r.max_pe_bytes / arch.data_bytes(program_of(r.kind, r.name))

    worst = max(regions, key=over)
    program = program_of(worst.kind, worst.name)
    if worst.max_pe_bytes > arch.data_bytes(program):
        return (
            f"per-PE memory: region {worst.name} needs {worst.max_pe_bytes:,} B on one PE, "
            f"{worst.max_pe_bytes - arch.data_bytes(program):,} B over the {arch.budget_words(program)}"
        )
    return None


def input_queue_roles(region: Region, head_embeds: str | None = None) -> dict[str, tuple[int, ...]]:
    """The input queues (by number, as wafer_gpt2/kernels/pe/*.csl fix them) of each PE role the region's tiling
    gives its program: a role's count must fit what the architecture leaves a program (WSE-2 1-7,
    WSE-3 2-7: memcpy keeps 0, and 1 on WSE-3), one color per queue. `head_embeds`: the reduction the
    embedding's lines run through the head's columns ("chain" or "two_level", whose chain of run ends
    takes head.csl's queue 1), None where a copy of wte does the embedding."""
    t = region.tiling
    two = lambda kind: kind == "two_level"  # noqa: E731
    roles: dict[str, tuple[int, ...]] = {}
    if isinstance(t, HeadTiling):
        # the request and the embedding (where the head embeds), ln_f's lane, the K chain (and the rounds
        # along it); a worker's slice (the scatter) and the centre's answers; a root's run of the tree
        # and the runs' ends; the centre's two halves
        embedding = () if head_embeds is None else (2, 3) + ((1,) if head_embeds == "two_level" else ())
        base = embedding + (4, 5)
        roles["K-line member"] = base + ((7,) if two(t.gemv.reduction) else ())
        roles["worker"] = base + (6, 7)
        roles["root"] = base + (6,) + ((7,) if two(t.tree) else ())
        roles["centre"] = base + (6, 7)
    elif isinstance(t, GemvTiling):
        # the input stream, the reduction's run; a gather line's links (an output that is gathered);
        # the runs' ends, and the third level's
        levels = {"chain": (), "two_level": (5,), "three_level": (5, 7)}[t.reduction]
        base = (2, 3, 4) + levels
        roles["K-line member"] = base
        if t.norm_fold:  # its LayerNorm's statistics from the strip before the region
            roles["K-line's last PE"] = base + (6,)
        if t.epilogue_pes > 1:
            roles["PE sharing the epilogue"] = base + (6,)
    elif isinstance(t, AttentionTiling):
        # the input, the merge's run (and the runs' ends), the output; M's multicast
        base = (2, 3, 4) + ((5,) if two(t.reduction) else ())
        roles["chain member"] = base + ((6,) if t.chain > 1 else ())
    elif isinstance(t, NormTiling):
        # input, run, broadcast (the join on the root), y and x gathers, run ends
        roles["strip member"] = (2, 3, 4, 5, 6) + ((7,) if two(t.reduction) else ())
    elif region.kind == "embed":
        # the request, the line's run and its runs' ends, an output gather's links
        roles["embed member"] = (2, 3, 4, 5)
    elif region.kind == "residual":
        roles["residual member"] = (2, 3, 4, 5)
    elif region.name == "io.out":
        # the records from the head's centre, and from the second set's where its rounds run in two
        roles["port"] = (2, 4)
    else:
        roles["port"] = (2,)
    return roles


def head_embedding(regions: list[Region], replica: int, arch: Arch) -> str | None:
    """The reduction of the embedding's lines through the replica's head columns (`input_queue_roles`),
    None where the embedding holds a copy of wte."""
    embed = next(r for r in regions if r.name == "embed" and r.replica == replica)
    if "wte" in embed.symbols:
        return None
    head = next(r for r in regions if r.name == "head" and r.replica == replica)
    return embed_reduction(arch, head.h + embed.h, embed.symbols["x"].elems, head=True)[0]


def check_input_queues(regions: list[Region], arch: Arch) -> str | None:
    """Every PE role within the input queues the architecture leaves a program."""
    allowed = set(arch.input_queue_ids)
    for region in regions:
        embeds = head_embedding(regions, region.replica, arch) if region.name == "head" else None
        for role, queues in input_queue_roles(region, embeds).items():
            extra = sorted(set(queues) - allowed)
            if extra:
                return (
                    f"input queues: a {role} of region {region.name} needs input queue(s) {extra} "
                    f"({len(queues)} in all), which {arch.name} does not leave a program "
                    f"(it has {', '.join(map(str, arch.input_queue_ids))})"
                )
    return None


def reduction_colors(kind: str, n: int) -> int:
    """Colors a reduction over n PEs needs: a chain alternates two (a PE never receives and sends on
    the same color); a two- or three-level reduction has a chain on each level."""
    if n <= 1:
        return 0
    return {"chain": 2, "two_level": 4, "three_level": 6}[kind]


def assign_colors(regions: list[Region], routes: list[Route]) -> None:
    for reg in regions:
        t = reg.tiling
        if isinstance(t, HeadTiling):
            # request, lane; the K chain; the slices; the tree's halves and the joins; the answers; the
            # output record; a later set of the rounds apart: its link over the sets before it and its
            # record's route
            half = max(len(h) for h in t.tree_halves())
            own = 2 + reduction_colors("chain", t.line) + 2 + reduction_colors(t.tree, half) + 2 + 1 + 1
            own += 2 * (t.sets - 1)
        elif isinstance(t, GemvTiling):
            # in/multicast + reduction + out, and the folded LayerNorm's statistics from its strip
            own = 2 + reduction_colors(t.reduction, t.rows) + (1 if t.norm_fold else 0)
        elif isinstance(t, AttentionTiling):
            # in, gather rows, merge, M's multicast, out
            own = 1 + t.fold + reduction_colors(t.reduction, t.chain) + (t.chain > 1) + 1
        elif isinstance(t, NormTiling):
            own = (
                1 + reduction_colors(t.reduction, t.pes) + 1 + 1 + 1
            )  # in, reduce, broadcast, out, resid tap
        elif reg.kind == "residual":
            own = 3  # gemv result in, residual bus in, out
        elif reg.kind == "embed":
            # the request, the lines (wafer_gpt2/codegen/build.py), the hand-off out
            own = 2 + reduction_colors("two_level", reg.h)
        else:
            own = 2
        reg.colors = own
    for rt in routes:
        for reg in regions:
            if reg.replica == rt.replica and reg.name not in (rt.src, rt.dst):
                if any(reg.touches(*leg) for leg in rt.legs):
                    reg.colors += rt.lines


def check_geometry(regions: list[Region], arch: Arch) -> None:
    """Every region inside the kernel rectangle, none overlapping (raises: a planner bug, not user input)."""
    for reg in regions:
        if reg.x < 0 or reg.y < 0 or reg.x + reg.w > arch.kernel_w or reg.y + reg.h > arch.kernel_h:
            raise PlanError(
                f"region {reg.name} at ({reg.x},{reg.y}) {reg.w}x{reg.h} leaves the "
                f"{arch.kernel_w}x{arch.kernel_h} kernel area"
            )
    ordered = sorted(regions, key=lambda r: r.x)
    for i, a in enumerate(ordered):
        for b in ordered[i + 1 :]:
            if b.x >= a.x + a.w:
                break
            if a.overlaps(b):
                raise PlanError(
                    f"regions {a.name} (replica {a.replica}) and {b.name} (replica {b.replica}) overlap"
                )
