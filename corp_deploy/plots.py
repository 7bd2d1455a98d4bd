"""Pictures of a compression: how a MAC budget was spent over the blocks."""

from __future__ import annotations

from pathlib import Path

from .cost import share_text
from .parts import UNIT_PARTS


def plot_allocation(budget: dict, path: str | Path, title: str = "") -> None:
    """PNG of a budget report (``report["budget"]``): per block and part, the fraction of dims
    kept (left) and the unit's distortion at that size (right, log scale when any unit is pruned)."""
    import matplotlib  # loaded when a picture is drawn: heavy, and its backend chosen first

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = list(dict.fromkeys(u["part"] for u in budget["units"]))
    blocks = sorted({u["block"] for u in budget["units"]})
    width = 0.8 / max(len(parts), 1)
    fig, (kept_ax, dist_ax) = plt.subplots(1, 2, figsize=(12, 4))
    for i, part in enumerate(parts):
        units = {u["block"]: u for u in budget["units"] if u["part"] == part}
        x = [b + (i - (len(parts) - 1) / 2) * width for b in blocks]
        kept_ax.bar(
            x, [units[b]["kept"] / units[b]["total"] for b in blocks], width, label=UNIT_PARTS[part].short_label
        )
        dist_ax.bar(x, [units[b]["distortion"] for b in blocks], width, label=UNIT_PARTS[part].short_label)
    kept_ax.set(
        xlabel="block",
        ylabel="fraction of dims kept",
        ylim=(0, 1.05),
        xticks=blocks,
        title=f"Budget {share_text(budget['macs_fraction'])} of the dense MACs "
        f"({budget['planned_macs'] / 1e9:.3g} of {budget['dense_macs'] / 1e9:.3g} GMACs)",
    )
    positive = [u["distortion"] for u in budget["units"] if u["distortion"] > 0]
    dist_ax.set(
        xlabel="block",
        ylabel=f"distortion ({budget['distortion']})",
        yscale="log" if positive else "linear",  # every unit kept whole (a budget of 1): nothing to log
        xticks=blocks,
        title="Distortion at the kept size (none: unit kept whole)",
    )
    if positive:  # log scale over the pruned units only
        dist_ax.set_ylim(min(positive) / 3, max(positive) * 3)
    for ax in (kept_ax, dist_ax):
        ax.grid(alpha=0.3, axis="y")
    fig.legend(*kept_ax.get_legend_handles_labels(), loc="lower center", ncol=len(parts), fontsize=9)
    if title:
        fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
