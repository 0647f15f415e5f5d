"""A picture of a plan: the kernel rectangle with every region coloured by kind and labelled.

Drawn with matplotlib's Agg backend (no display needed). Regions are shown at their true position
and size; labels go where they fit (each layer once, large regions by name), with a legend by kind
and the modeled figures in the title.
"""

from __future__ import annotations

from pathlib import Path

from wafer_gpt2.plan.pyplot import pyplot

plt = pyplot()  # MissingExtra with the install line when matplotlib is left out
from matplotlib.patches import Patch, Rectangle  # noqa: E402

from wafer_gpt2.plan import KINDS, Plan  # noqa: E402

KIND_COLORS = {
    "io": "#d62728",
    "embed": "#ff7f0e",
    "embed_head": "#9467bd",
    "layernorm": "#2ca02c",
    "gemv": "#1f77b4",
    "attention": "#e6b800",
    "residual": "#17becf",
}
# GEMVs of one layer in shades of the GEMV blue, so the four are told apart at a glance.
GEMV_SHADES = {"qkv": "#16537e", "attn_proj": "#1f77b4", "fc": "#4f9bd0", "proj": "#86bde6"}
KIND_LABELS = {
    "io": "I/O port (memcpy)",
    "embed": "embedding: wte + wpe by rows",
    "embed_head": "wte^T: LM head + top-k",
    "layernorm": "LayerNorm",
    "gemv": "GEMV: qkv, attn_proj, fc, proj (dark to light)",
    "attention": "attention + KV cache",
    "residual": "residual add",
}


def draw_wafer_map(plan: Plan, path: str | Path, dpi: int = 110) -> Path:
    """Write the map of `plan` as a PNG at `path`; returns the path."""
    arch = plan.arch
    fig_w = 11.0
    fig_h = fig_w * arch.fabric_h / arch.fabric_w * 0.92 + 1.2
    fig, ax = plt.subplots(figsize=(fig_w, fig_h), dpi=dpi)
    ax.add_patch(
        Rectangle((0, 0), arch.fabric_w, arch.fabric_h, facecolor="#f2f2f2", edgecolor="#999999", lw=0.8)
    )
    # The kernel sits at memcpy's offsets (4, 1) inside the fabric.
    kx, ky = 4, 1
    ax.add_patch(
        Rectangle((kx, ky), arch.kernel_w, arch.kernel_h, facecolor="white", edgecolor="#444444", lw=0.8)
    )
    for region in plan.regions:
        ax.add_patch(
            Rectangle(
                (kx + region.x, ky + region.y),
                region.w,
                region.h,
                facecolor=_color(region.name, region.kind),
                edgecolor="black",
                lw=0.15,
                alpha=0.9,
            )
        )
    _label_layers(ax, plan, kx, ky)
    _label_strip(ax, plan, kx, ky)
    ax.set_xlim(0, arch.fabric_w)
    ax.set_ylim(arch.fabric_h, 0)  # y grows south, as on the fabric
    ax.set_aspect("equal")
    ax.set_xlabel("x (PE column)")
    ax.set_ylabel("y (PE row)")
    m = plan.modeled()
    c = plan.config
    ax.set_title(
        f"{c.name} on {arch.name} ({plan.dtype}, {plan.objective}): {plan.replicas} replica(s), "
        f"{plan.slots} slots x {plan.context} tokens each\n"
        f"{plan.pes_used:,} PEs used, max {plan.max_pe_bytes:,} B/PE, {plan.colors_used} colors; modeled "
        f"{m['decode_latency_us']:.1f} us/token, {m['tokens_per_s_total']:,.0f} tokens/s total",
        fontsize=9,
    )
    used = [k for k in KINDS if any(r.kind == k for r in plan.regions)]
    ax.legend(
        handles=[Patch(facecolor=KIND_COLORS[k], edgecolor="black", label=KIND_LABELS[k]) for k in used],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.06),
        ncol=4,
        fontsize=7.5,
        frameon=False,
    )
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path


def _color(name: str, kind: str) -> str:
    if kind == "gemv":
        return GEMV_SHADES.get(name.rsplit(".", 1)[-1], KIND_COLORS["gemv"])
    return KIND_COLORS.get(kind, "#7f7f7f")


def _label_layers(ax, plan: Plan, kx: int, ky: int) -> None:
    """One label per layer (L0, L1, ...) on its attention region, the most recognisable block."""
    many = plan.replicas > 4
    for region in plan.regions:
        if region.kind != "attention" or (many and region.replica > 0):
            continue
        size = 7 if region.w >= 18 else 5.5
        label = f"L{region.layer}" if plan.replicas == 1 else f"r{region.replica}\nL{region.layer}"
        ax.text(
            kx + region.x + region.w / 2,
            ky + region.y + region.h / 2,
            label,
            ha="center",
            va="center",
            fontsize=size,
            color="black",
            fontweight="bold",
        )
    # Name the sub-regions of the first layer, where there is room.
    for region in plan.regions_of(layer=0):
        if region.kind == "attention" or min(region.w, region.h) < 4:
            continue  # the attention carries the layer's label; one-row strips have no room
        ax.text(
            kx + region.x + region.w / 2,
            ky + region.y + region.h / 2,
            region.name.split(".", 1)[1],
            ha="center",
            va="center",
            fontsize=5.5,
            rotation=90 if region.h > 2 * region.w else 0,
            color="white" if region.name.endswith(("qkv", "attn_proj")) else "black",
        )


def _label_strip(ax, plan: Plan, kx: int, ky: int) -> None:
    for replica in range(min(plan.replicas, 4)):
        head = plan.region("head", replica)
        ax.text(
            kx + head.x + head.w / 2,
            ky + head.y + head.h / 2,
            "wte / LM head",
            ha="center",
            va="center",
            fontsize=6.5,
            rotation=90,
            color="white",
            fontweight="bold",
        )
