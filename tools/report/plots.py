"""The report's figures (matplotlib, PNG). Each function draws one figure from `ReportData` and returns a
`Figure`: its file, its title, whether it is modeled or measured, its caption and the command that
reproduces it. Nothing is computed here that the data module does not already hold."""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from pathlib import Path

from wafer_gpt2.core.code_bytes import program_of
from wafer_gpt2.plan.pyplot import pyplot

plt = pyplot()  # MissingExtra with the install line when matplotlib is left out
from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter  # noqa: E402

from tools.report.data import (  # noqa: E402
    PHASE_CLASSES,
    SYMBOL_CLASSES,
    ReportData,
    layer_phases,
    pareto_front,
    pes_per_layer,
    sram_by_part,
    sram_per_pe,
    time_by_layer,
    time_by_part,
)
from wafer_gpt2.core.cost import cycles_to_us  # noqa: E402
from wafer_gpt2.plan import LAYER_OPS  # noqa: E402

DPI = 120
MODELED = "modeled"
MEASURED = "measured"
TAB10 = plt.get_cmap("tab10").colors  # type: ignore[attr-defined]  # tab10 is a ListedColormap
OP_COLORS = dict(zip(LAYER_OPS, TAB10, strict=False))
# Stages outside the layers, in colors none of the layer operations use.
OUTER_COLORS = {
    "io.in": "#d9d9d9",
    "embed": "#b15928",
    "route": "#000000",
    "to ln_f": "#525252",
    "ln_f": "#ffd92f",
    "head": "#e5c494",
    "io.out": "#bdbdbd",
}
SYMBOL_COLORS = ("#4c72b0", "#dd8452", "#8c8c8c")  # weights, KV cache, working buffers
CLASS_COLORS = {"data movement": "#4c72b0", "compute": "#dd8452", "reduction / merge": "#55a868"}


@dataclass(frozen=True)
class Figure:
    filename: str
    title: str
    kind: str  # MODELED or MEASURED (or a mix, spelled out in the caption)
    caption: str
    command: str
    basis: str = ""  # what the figure rests on, when "the cost model on the plan" does not say it


def _save(fig, out_dir: Path, filename: str) -> None:
    fig.savefig(out_dir / filename, dpi=DPI, bbox_inches="tight")
    plt.close(fig)


def _thousands(value, _pos=None) -> str:
    return f"{value:,.0f}"


def _log_pe_axis(ax, values: list[int]) -> None:
    """A log x axis of PE counts with plain tick labels (1,000 / 2,000 / 5,000 ...)."""
    ax.set_xscale("log")
    lo, hi = min(values), max(values)
    ticks = [m * 10**e for e in range(1, 8) for m in (1, 2, 5) if lo / 1.5 <= m * 10**e <= hi * 1.5]
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.xaxis.set_major_formatter(FuncFormatter(_thousands))
    ax.xaxis.set_minor_formatter(NullFormatter())


def _model_label(data: ReportData) -> str:
    s = data.settings
    return f"{data.config.name}, {s.arch}, {s.dtype}, {s.slots} KV slots x {data.plan.context} tokens"


# ----------------------------------------------------------------------------------------------------


def wafer_map(data: ReportData, out_dir: Path, command: str) -> Figure:
    from wafer_gpt2.plan.drawing import draw_wafer_map

    draw_wafer_map(data.plan, out_dir / "wafer_map.png", dpi=DPI)
    s = data.settings
    return Figure(
        "wafer_map.png",
        "The wafer map",
        MODELED,
        "Every region of the plan at its place on the fabric, coloured by kind: the west strip holds the "
        "output port, `wte` transposed (the tied LM head with the top-k) and the final LayerNorm; the "
        "transformer layers follow in bands that turn at the fabric's edge, the embedding (`wte` and `wpe` by "
        "rows) under layer 0's first strip with the input port under it, or at the top of the west strip where "
        "it needs more rows (the input port then at the strip's bottom). This is the "
        "layout `wafer_gpt2.plan` computes (and the CSL and the simulator execute); the figures in its title are "
        f"modeled. The same map alone: `wafer-gpt2 plan --model {data.config.name} --arch {s.arch} --dtype "
        f"{s.dtype} --slots {s.slots} --png map.png`.",
        command,
        "modeled: the layout planned by `wafer_gpt2.plan`, with figures from the cost model `wafer_gpt2.core.cost`; not measured",
    )


def time_per_token(data: ReportData, out_dir: Path, command: str) -> Figure:
    plan = data.plan
    parts = sorted(time_by_part(plan).items(), key=lambda kv: kv[1])
    total = plan.decode_cycles
    phases = layer_phases(plan)

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5.2), gridspec_kw={"width_ratios": [1.15, 1]})
    names = [name for name, _ in parts]
    us = [cycles_to_us(c) for _, c in parts]
    bars = left.barh(names, us, color="#4c72b0")
    for bar, (_, cycles) in zip(bars, parts, strict=True):
        left.text(
            bar.get_width(),
            bar.get_y() + bar.get_height() / 2,
            f" {cycles_to_us(cycles):.1f} us ({100 * cycles / total:.0f}%)",
            va="center",
            fontsize=9,
        )
    left.set_xlabel("modeled microseconds per token at 1.1 GHz (critical path, full context)")
    left.set_title(f"Where one decode token's {cycles_to_us(total):.1f} us go")
    left.set_xlim(0, max(us) * 1.35)
    left.grid(axis="x", alpha=0.3)

    ops = list(phases)
    bottom = [0] * len(ops)
    for cls in PHASE_CLASSES:
        values = [phases[op][cls] for op in ops]
        right.bar(ops, values, bottom=bottom, label=cls, color=CLASS_COLORS[cls])
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    right.set_ylabel("modeled cycles per token")
    right.set_title("One layer, operation by operation")
    right.legend(frameon=False)
    right.tick_params(axis="x", rotation=30)
    right.grid(axis="y", alpha=0.3)
    fig.suptitle(f"Modeled decode time per token: {_model_label(data)}", fontsize=12)
    _save(fig, out_dir, "time_per_token.png")
    return Figure(
        "time_per_token.png",
        "Where the time of a token goes",
        MODELED,
        "Left: the critical path of one decode token (memcpy edge in to memcpy edge out, attention over the "
        "full context), grouped by part; each layer operation is summed over all layers. Right: the stages "
        "of one layer split into data movement (multicasts, hand-offs), compute (FMAC, exp, GELU, "
        "normalise) and reductions/merges, converted at 1.1 GHz.",
        command,
    )


def time_per_layer(data: ReportData, out_dir: Path, command: str) -> Figure:
    rows = time_by_layer(data.plan)
    labels = [label for label, _ in rows]
    keys: list[str] = []
    for _, parts in rows:
        keys += [k for k in parts if k not in keys]
    fig, ax = plt.subplots(figsize=(13, 5))
    bottom = [0.0] * len(rows)
    for key in keys:
        values = [cycles_to_us(parts.get(key, 0)) for _, parts in rows]
        color = OP_COLORS.get(key, OUTER_COLORS.get(key, "#999999"))
        ax.bar(labels, values, bottom=bottom, label=key, color=color, width=0.75)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set_ylabel("modeled microseconds at 1.1 GHz")
    ax.set_title(f"Modeled time of one token in each pipeline stage: {_model_label(data)}")
    ax.legend(ncol=2, fontsize=8, frameon=False, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.tick_params(axis="x", rotation=90 if len(rows) > 30 else 0)
    ax.grid(axis="y", alpha=0.3)
    _save(fig, out_dir, "time_per_layer.png")
    return Figure(
        "time_per_layer.png",
        "Per-layer modeled time",
        MODELED,
        "The same critical path as above, stage group by stage group in pipeline order: the embedding "
        "(with the host's item entering), every transformer layer (its nine operations; `route` is the "
        "turn to the next band of layers), and the final LayerNorm, LM head and top-k with the record "
        "leaving. Layers cost the same because they are tiled alike.",
        command,
    )


def tradeoff(data: ReportData, out_dir: Path, command: str) -> Figure:
    plan, cands = data.plan, data.candidates
    chosen_pes = pes_per_layer(plan)
    chosen = plan.modeled()
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    xs = [c.pes_per_layer for c in cands]
    lat = [c.latency_us for c in cands]
    tps = [c.tokens_per_s for c in cands]
    left.scatter(xs, lat, s=8, alpha=0.35, color="#4c72b0", label=f"{len(cands):,} feasible candidates")
    front = pareto_front(list(zip(xs, lat, strict=True)))
    left.plot(*zip(*front, strict=True), color="#c44e52", lw=1.5, label="best latency for the PEs (front)")
    left.scatter(
        [chosen_pes],
        [chosen["decode_latency_us"]],
        marker="*",
        s=260,
        color="#ffb000",
        edgecolor="black",
        zorder=5,
        label="the plan build_plan picks",
    )
    _log_pe_axis(left, xs)
    left.set_xlabel("PEs per transformer layer")
    left.set_ylabel("modeled decode latency per token (us, 1.1 GHz)")
    left.set_title("Latency against PEs per layer")
    left.grid(alpha=0.3, which="both")
    left.legend(frameon=False, fontsize=9)

    right.scatter(xs, [t / 1e3 for t in tps], s=8, alpha=0.35, color="#55a868")
    right.scatter(
        [chosen_pes],
        [chosen["tokens_per_s_per_replica"] / 1e3],
        marker="*",
        s=260,
        color="#ffb000",
        edgecolor="black",
        zorder=5,
    )
    _log_pe_axis(right, xs)
    right.set_xlabel("PEs per transformer layer")
    right.set_ylabel(f"modeled tokens/s per replica, {plan.slots} streams (thousands)")
    right.set_title("Throughput against PEs per layer")
    right.grid(alpha=0.3, which="both")
    fig.suptitle(f"The planner's trade-off (modeled): {_model_label(data)}", fontsize=12)
    _save(fig, out_dir, "tradeoff.png")
    return Figure(
        "tradeoff.png",
        "Latency and throughput against PEs per layer",
        MODELED,
        "Every candidate size the planner considers (residual-stream PEs, attention fold and chain, FC and "
        "LM-head widths) that fits the 48 KB per PE and the kernel area, priced by the cost model. More PEs "
        "per layer shorten each GEMV but lengthen its multicasts and reductions; throughput at "
        f"{plan.slots} streams is capped by the slowest stage. The star is the plan `build_plan` returns "
        "(objective latency, after its routing-color check).",
        command,
    )


def throughput_scaling(data: ReportData, out_dir: Path, command: str) -> Figure:
    fig, ax = plt.subplots(figsize=(10, 5.2))
    for curve in data.replica_curves:
        ax.plot(curve.streams, [t / 1e3 for t in curve.tokens_per_s], marker="o", ms=3, label=curve.label)
    ax.set_xlabel("concurrent streams per replica (batch size; each stream holds one KV slot)")
    ax.set_ylabel("modeled tokens/s, all replicas (thousands)")
    ax.set_title(
        f"Modeled throughput against batch size and replicas: {data.config.name}, "
        f"{data.settings.arch}, {data.settings.dtype}, objective throughput"
    )
    ax.grid(alpha=0.3)
    ax.legend(frameon=False)
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    _save(fig, out_dir, "throughput_scaling.png")
    return Figure(
        "throughput_scaling.png",
        "Throughput against batch size and replicas",
        MODELED,
        "A decode stream can have one token in the pipeline at a time, so one replica delivers streams / "
        "latency tokens per second until its slowest stage is busy every cycle; then it is flat. Replicas "
        "are whole pipelines placed side by side (planned with objective throughput, so each is smaller "
        "and slower per token than the latency plan). At 1.1 GHz.",
        command,
    )


def sizes(data: ReportData, out_dir: Path, command: str) -> Figure:
    names = list(data.sizes)
    plans = [data.sizes[n] for n in names]
    modeled = [p.modeled() for p in plans]
    panels = [
        ("PEs used (thousands)", [p.pes_used / 1e3 for p in plans], "{:,.0f}k"),
        ("SRAM planned (GiB)", [p.sram_bytes_used / 2**30 for p in plans], "{:.2f}"),
        ("decode latency (us / token)", [m["decode_latency_us"] for m in modeled], "{:,.0f}"),
        ("tokens/s, one stream", [m["tokens_per_s_single_stream"] for m in modeled], "{:,.0f}"),
        (f"tokens/s, {data.settings.slots} streams", [m["tokens_per_s_total"] for m in modeled], "{:,.0f}"),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(16, 4.2))
    for ax, (title, values, fmt) in zip(axes, panels, strict=True):
        bars = ax.bar(names, values, color=TAB10[: len(names)])
        for bar, v in zip(bars, values, strict=True):
            ax.text(
                bar.get_x() + bar.get_width() / 2,
                bar.get_height(),
                fmt.format(v),
                ha="center",
                va="bottom",
                fontsize=8,
            )
        ax.set_title(title, fontsize=10)
        ax.tick_params(axis="x", rotation=30, labelsize=8)
        ax.set_ylim(0, max(values) * 1.18)
        ax.yaxis.set_major_formatter(
            FuncFormatter(_thousands if max(values) > 1000 else lambda v, _pos: f"{v:g}")
        )
        ax.grid(axis="y", alpha=0.3)
    kernel = data.plan.arch.kernel_pes
    axes[0].axhline(kernel / 1e3, color="black", ls="--", lw=1)
    axes[0].text(0, kernel / 1e3, "kernel area", va="bottom", fontsize=8)
    axes[0].set_ylim(0, kernel / 1e3 * 1.15)
    fig.suptitle(
        f"The four GPT-2 sizes on one {data.settings.arch} wafer (modeled; {data.settings.dtype}, "
        f"{data.settings.slots} slots x {data.plan.context} tokens, objective latency, 1.1 GHz)",
        fontsize=12,
    )
    fig.tight_layout()
    _save(fig, out_dir, "sizes.png")
    return Figure(
        "sizes.png",
        "The four GPT-2 sizes side by side",
        MODELED,
        "For each published GPT-2 size, the plan `build_plan` returns with the default settings: PEs and "
        "planned SRAM (weights, KV cache, buffers), modeled decode latency per token at full context, and "
        "modeled tokens/s for one stream and for every KV slot busy.",
        command,
    )


def sram(data: ReportData, out_dir: Path, command: str) -> Figure:
    plan = data.plan
    per_pe = sram_per_pe(plan)
    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 5.4), gridspec_kw={"width_ratios": [1.3, 1]})
    names = [name for name, _ in per_pe][::-1]
    left_edge = [0.0] * len(names)
    for cls, color in zip(SYMBOL_CLASSES, SYMBOL_COLORS, strict=True):
        values = [classes[cls] / 1024 for _, classes in per_pe][::-1]
        left.barh(names, values, left=left_edge, color=color, label=cls)
        left_edge = [a + b for a, b in zip(left_edge, values, strict=True)]
    # each region's limit: 48 KB less its program's code and the stack
    for y, name in enumerate(names):
        region = plan.region(name)
        usable = plan.arch.data_bytes(program_of(region.kind, region.name)) / 1024
        left.plot([usable, usable], [y - 0.45, y + 0.45], color="black", ls="--", lw=1)
    left.axvline(plan.arch.pe_sram_bytes / 1024, color="#c44e52", ls=":", lw=1)
    left.text(plan.arch.pe_sram_bytes / 1024, -0.9, " 48 KB", fontsize=8, color="#c44e52")
    left.set_xlim(0, plan.arch.pe_sram_bytes / 1024 * 1.12)
    left.set_xlabel("KB on the fullest PE of the region")
    left.set_title("Per PE (layer 0 shown; every layer alike)")
    left.legend(fontsize=9, frameon=False, loc="lower right")
    left.grid(axis="x", alpha=0.3)

    parts = sram_by_part(plan)
    names = list(parts)[::-1]
    left_edge = [0.0] * len(names)
    for cls, color in zip(SYMBOL_CLASSES, SYMBOL_COLORS, strict=True):
        values = [parts[name][cls] / 2**20 for name in names]
        right.barh(names, values, left=left_edge, color=color, label=cls)
        left_edge = [a + b for a, b in zip(left_edge, values, strict=True)]
    for y, total in enumerate(left_edge):
        right.text(total, y, f" {total:,.1f}", va="center", fontsize=8)
    right.set_xlim(0, max(left_edge) * 1.2)
    right.set_xlabel("MiB planned, all layers")
    right.set_title(f"Whole wafer: {plan.sram_bytes_used / 2**20:,.0f} MiB planned")
    right.grid(axis="x", alpha=0.3)
    fig.suptitle(f"SRAM use per region (planned): {_model_label(data)}", fontsize=12)
    fig.tight_layout()
    _save(fig, out_dir, "sram.png")
    return Figure(
        "sram.png",
        "SRAM use per region",
        MODELED,
        "What the plan places on each PE (left: the fullest PE of each region, split into weights, KV cache "
        "and working buffers such as inputs, partial sums and top-k lists, against what the region may use "
        "(dashed: 48 KB less its PE program's code, estimated by the CSL executor, and 1 KB of stack) "
        "and in total (right: bytes per PE times PEs, each layer operation summed over the layers). These "
        "are the plan's allocations, which the simulator enforces; code and stack are not included.",
        command,
    )


def gpu_comparison(data: ReportData, out_dir: Path, command: str) -> Figure:
    names = list(data.sizes)
    wafer = [data.sizes[n].modeled()["tokens_per_s_single_stream"] for n in names]
    gpus = []
    for floor in data.floors:
        if floor.gpu.name not in gpus:
            gpus.append(floor.gpu.name)
    width = 0.8 / (len(gpus) + 1)
    fig, ax = plt.subplots(figsize=(12, 5.2))
    xs = range(len(names))
    ax.bar(
        [x - 0.4 + width / 2 for x in xs],
        wafer,
        width,
        label=f"wafer, one stream (modeled, {data.settings.arch})",
        color="#ffb000",
        edgecolor="black",
    )
    colors = plt.get_cmap("Blues")([0.45, 0.65, 0.85])
    for i, gpu in enumerate(gpus):
        floors = [next(f for f in data.floors if f.gpu.name == gpu and f.model == n) for n in names]
        ax.bar(
            [x - 0.4 + width * (i + 1.5) for x in xs],
            [f.tokens_per_s for f in floors],
            width,
            label=f"{gpu}: HBM-bandwidth ceiling (computed)",
            color=colors[i % len(colors)],
        )
    # Published GPT-2 runs that decoded one sequence at a time, at the size they ran.
    size_of = {"GPT-2 124M": "gpt2", "GPT-2 XL 1558M": "gpt2-xl"}
    for p in data.published:
        target = size_of.get(p.model)
        if p.one_stream and target in names:
            x = names.index(target)
            ax.scatter([x], [p.tokens_per_s], marker="D", color="#c44e52", edgecolor="black", zorder=5, s=50)
            ax.annotate(
                f"{p.tokens_per_s:,.0f} tokens/s: {p.system.split(',')[0]}, published",
                (x, p.tokens_per_s),
                textcoords="offset points",
                xytext=(9, -3),
                fontsize=8,
                color="#8b0000",
                bbox={"boxstyle": "round,pad=0.2", "fc": "white", "ec": "none", "alpha": 0.85},
            )
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(FuncFormatter(_thousands))
    ax.set_xticks(list(xs), names)
    ax.set_ylabel("tokens/s for one stream (batch-1 decode), log scale")
    ax.set_title(
        "One stream: wafer (modeled) vs the GPU memory-bandwidth ceiling (computed) and published GPU runs"
    )
    ax.legend(frameon=False, fontsize=8, loc="upper right")
    ax.grid(axis="y", alpha=0.3, which="major")
    _save(fig, out_dir, "gpu_comparison.png")
    return Figure(
        "gpu_comparison.png",
        "Against GPUs, one stream",
        MODELED,
        "Yellow: the wafer's modeled single-stream decode rate. "
        "Blue: the most a GPU could reach at batch 1 if it read every fp16 weight from HBM once per token "
        "at its datasheet bandwidth (KV cache not counted), a ceiling no real run reaches. Red diamonds: "
        "published measurements of one sequence at a time (sources in the table above).",
        command,
        "modeled (the wafer), computed from datasheets (the GPU ceilings) and published (the GPU runs); "
        "nothing here was measured",
    )


def measured(data: ReportData, out_dir: Path, command: str) -> Figure | None:
    m = data.measured
    if m is None or not m.rows:
        return None
    fig, ax = plt.subplots(figsize=(11, 5.2))
    xs = list(range(len(m.rows)))
    ours = [row.tokens_per_s for row in m.rows]
    peers = [row.peer_tokens_per_s for row in m.rows]
    ax.bar([x - 0.2 for x in xs], ours, 0.4, label="this project", color="#ffb000", edgecolor="black")
    ax.bar([x + 0.2 for x in xs], peers, 0.4, label="its peer, timed in the same run", color="#4c72b0")
    top = max(ours + peers)
    for x, row in zip(xs, m.rows, strict=True):
        ax.text(
            x,
            max(row.tokens_per_s, row.peer_tokens_per_s) + top * 0.02,
            f"{row.ratio:.2f}x\npeer: {row.peer}",
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax.set_xticks(xs, [row.label for row in m.rows], fontsize=9)
    ax.set_ylim(0, top * 1.35)
    ax.set_ylabel("measured tokens/s (median)")
    ax.set_title("\n".join(textwrap.wrap(f"Measured here: {m.machine}", 110)), fontsize=9)
    ax.legend(frameon=False, loc="upper left")
    ax.grid(axis="y", alpha=0.3)
    _save(fig, out_dir, "measured.png")
    return Figure(
        "measured.png",
        "Simulator and service against their peers",
        MEASURED,
        "One run on the machine named above (CPU only; no wafer, no GPU). Each pair is this "
        "project and its peer timed in the same run, and the ratio is the result: timings on a shared machine "
        "are noisy. The simulator executes the whole wafer program in NumPy, so its rate says how usable the "
        "simulator is for development, not how fast a wafer is. The service pair compares full decode steps "
        "(one token per stream) under HTTP with the same steps driven directly.",
        m.command,
        "measured on the day and the machine named above",
    )


def draw_all(data: ReportData, out_dir: Path, command: str) -> list[Figure]:
    out_dir.mkdir(parents=True, exist_ok=True)
    figures = [
        wafer_map(data, out_dir, command),
        time_per_token(data, out_dir, command),
        time_per_layer(data, out_dir, command),
        tradeoff(data, out_dir, command),
        throughput_scaling(data, out_dir, command),
        sizes(data, out_dir, command),
        sram(data, out_dir, command),
        gpu_comparison(data, out_dir, command),
    ]
    extra = measured(data, out_dir, command)
    if extra is not None:
        figures.append(extra)
    return figures
