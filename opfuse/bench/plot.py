"""``opfuse bench --plot FILE.png``: latency and traffic per configuration, traffic per layer.

Four panels, matplotlib with the Agg backend (no display needed):

1. measured ONNX Runtime latency per configuration (median, min-max whiskers; the int8
   rows in red);
2. predicted accelerator latency per configuration, with the chapter's values as markers
   when the model is the chapter's ResNet-50 (a model's predictions, labelled so);
3. memory traffic per configuration, with the ideal lower bound as a line;
4. traffic per layer for the configurations that change the graph.
"""

from __future__ import annotations

__all__ = ["plot_result"]

import os


def plot_result(result, path: str | os.PathLike) -> None:
    """Write the figure for a :class:`~opfuse.bench.result.BenchResult` to ``path`` (PNG)."""
    import matplotlib  # an optional extra (opfuse[plot]): imported only to draw

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt  # after choosing the Agg backend

    fig = plt.figure(figsize=(15, 9), layout="constrained")
    grid = fig.add_gridspec(2, 3)
    ax_measured = fig.add_subplot(grid[0, 0])
    ax_predicted = fig.add_subplot(grid[0, 1])
    ax_traffic = fig.add_subplot(grid[0, 2])
    ax_layers = fig.add_subplot(grid[1, :])
    fig.suptitle(f"opfuse bench: {result.model}")

    _measured(ax_measured, result)
    _predicted(ax_predicted, result)
    _traffic(ax_traffic, result)
    _layers(ax_layers, result)

    fig.savefig(path, format="png", dpi=100)
    plt.close(fig)


def _measured(ax, result) -> None:
    rows = [r for r in result.rows if r.timing is not None]
    if not rows:
        ax.text(0.5, 0.5, "not measured (--no-measure)", ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
        return
    med = [r.timing.median for r in rows]
    lo = [r.timing.median - r.timing.min for r in rows]
    hi = [r.timing.max - r.timing.median for r in rows]
    colors = [_color(r.kind) for r in rows]
    x = range(len(rows))
    ax.bar(x, med, yerr=[lo, hi], color=colors, capsize=3)
    ax.set_xticks(list(x), [r.key for r in rows], rotation=45, ha="right")
    ax.set_ylabel("ms (median, min-max)")
    ax.set_title(f"measured: ONNX Runtime CPU, {result.options.threads} threads")


def _predicted(ax, result) -> None:
    if not result.profiles:
        ax.set_axis_off()
        return
    name = next(iter(result.profiles))
    rows = [r for r in result.rows if name in r.predictions and not r.same_as]
    values = [r.predictions[name].latency_s * 1e3 for r in rows]
    x = list(range(len(rows)))
    ax.bar(x, values, color=[_color(r.kind) for r in rows], label="predicted")
    ax.set_ylim(0, max(values, default=1) * 1.3)  # room for the legend
    if result.chapter_applies and name == "npu-chapter":
        pts = [(i, r.chapter[1]) for i, r in enumerate(rows) if r.chapter is not None]
        if pts:
            ax.scatter([p[0] for p in pts], [p[1] for p in pts], color="black", marker="D", zorder=3,
                       label="chapter (measured on its NPU)")
            ax.legend(loc="upper right", fontsize="small")
    ax.set_xticks(x, [r.key for r in rows], rotation=45, ha="right")
    ax.set_ylabel("ms")
    ax.set_title(f"predicted for {name} (a model, not a measurement)")


def _traffic(ax, result) -> None:
    rows = [r for r in result.rows if r.traffic is not None and r.kind in ("config", "hardware-fit")
            and not r.same_as]
    values = [r.traffic.total / 1e6 for r in rows]
    x = list(range(len(rows)))
    ax.bar(x, values, color=[_color(r.kind) for r in rows])
    ax.set_ylim(0, max(values, default=1) * 1.2)
    if result.ideal_bytes:
        ax.axhline(result.ideal_bytes / 1e6, color="black", linestyle="--", linewidth=1, label="ideal lower bound")
        ax.legend(loc="upper right", fontsize="small")
    ax.set_xticks(x, [r.key for r in rows], rotation=45, ha="right")
    ax.set_ylabel(f"MB per inference ({result.dtype or 'model dtype'})")
    ax.set_title("memory traffic (exact, from shapes)")


def _layers(ax, result) -> None:
    labels, data = result.layer_labels, result.layer_bytes
    drawn = False
    for config, values in data.items():
        if not values or all(v is None for v in values):
            continue
        ax.plot(range(len(values)), [(v or 0) / 1e6 for v in values], marker=".", linewidth=1, label=config)
        drawn = True
    if not drawn:
        ax.text(0.5, 0.5, "no per-layer data", ha="center", va="center", transform=ax.transAxes)
        return
    step = max(1, len(labels) // 40)
    ticks = list(range(0, len(labels), step))
    ax.set_xticks(ticks, [labels[i] for i in ticks], rotation=90, fontsize="x-small")
    ax.set_ylabel("MB")
    ax.set_title("traffic per layer (a layer and the element-wise nodes working on its output)")
    ax.legend(fontsize="small")
    ax.grid(axis="y", alpha=0.3)


def _color(kind: str) -> str:
    return {
        "config": "tab:blue",
        "control": "tab:gray",
        "runtime": "tab:orange",
        "modelled": "tab:purple",
        "hardware-fit": "tab:green",
        "reference": "tab:orange",
        "int8": "tab:red",
    }.get(kind, "tab:blue")
