"""PNG plots (matplotlib, Agg backend: no display needed).

Every figure is `width_px x height_px` pixels exactly: the figure size is set in
inches as pixels / dpi and saved without tight bounding boxes. Files are written
to a temporary name and renamed.
"""
from __future__ import annotations

import math

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)

from megatron_lev.utils.files import atomic_path  # noqa: E402

DEFAULT_SIZE_PX = (1200, 800)
DEFAULT_DPI = 100


def _figure(size_px, dpi, nrows=1, height_ratios=None):
    width, height = size_px
    return plt.subplots(nrows, 1, figsize=(width / dpi, height / dpi), dpi=dpi, squeeze=False,
                        gridspec_kw={"height_ratios": height_ratios} if height_ratios else None)


def _save(fig, path: str, dpi: int) -> str:
    try:
        with atomic_path(path) as tmp:
            fig.savefig(tmp, dpi=dpi, format="png")
    finally:
        plt.close(fig)
    return path


def _finish_single_axes(fig, ax, path: str, dpi: int, xlabel: str, ylabel: str, title: str,
                        grid_axis: str = "both") -> str:
    """Labels, grid and legend of a one-panel figure, then save it."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(axis=grid_axis, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return _save(fig, path, dpi)


def plot_bucket_comparison(labels, values: dict[str, list], path: str, baseline: str | None = None,
                           title: str = "Perplexity by token-frequency bucket", ylabel: str = "perplexity",
                           xlabel: str = "token-frequency bucket (rarest first)", log_y: bool = True,
                           size_px=DEFAULT_SIZE_PX, dpi: int = DEFAULT_DPI) -> str:
    """Grouped bars, one group per bucket, one bar per model. With a baseline, a lower
    panel shows each other model's per-cent change vs the baseline per bucket."""
    models = list(values)
    others = [m for m in models if m != baseline] if baseline else []
    fig, axes = _figure(size_px, dpi, nrows=2 if others else 1, height_ratios=[3, 2] if others else None)
    x = range(len(labels))
    width = 0.8 / max(len(models), 1)

    def bars(ax, series: dict[str, list]):
        for k, (name, vals) in enumerate(series.items()):
            offset = (k - (len(series) - 1) / 2) * width
            heights = [math.nan if v is None else v for v in vals]
            # One colour per model in both panels.
            ax.bar([i + offset for i in x], heights, width, label=name, color=f"C{models.index(name)}")
        ax.set_xticks(list(x))
        ax.set_xticklabels(labels, rotation=20, ha="right", fontsize=8)
        ax.grid(axis="y", alpha=0.3)

    top = axes[0][0]
    bars(top, values)
    if log_y:
        top.set_yscale("log")
    top.set_ylabel(ylabel)
    top.set_title(title)
    top.legend()
    if others:
        from megatron_lev.evaluation.report import relative_change

        rel = {m: [relative_change(v, b) for v, b in zip(values[m], values[baseline])] for m in others}
        bottom = axes[1][0]
        bars(bottom, rel)
        bottom.axhline(0, color="black", linewidth=0.8)
        bottom.set_ylabel(f"% change vs {baseline}")
        bottom.set_xlabel(xlabel)
        for k, (name, vals) in enumerate(rel.items()):
            offset = (k - (len(rel) - 1) / 2) * width
            for i, v in zip(x, vals):
                if v is not None:
                    bottom.annotate(f"{v:+.0f}%", (i + offset, v), ha="center",
                                    va="bottom" if v >= 0 else "top", fontsize=7)
    else:
        top.set_xlabel(xlabel)
    fig.tight_layout()
    return _save(fig, path, dpi)


def plot_loss_curves(curves: dict[str, tuple], path: str, target: float | None = None,
                     crossings: dict[str, float | None] | None = None, ylabel: str = "loss",
                     title: str = "Loss vs training tokens", log_x: bool = False,
                     size_px=DEFAULT_SIZE_PX, dpi: int = DEFAULT_DPI) -> str:
    """One line per run (tokens, loss); optional horizontal target line and a marker where
    each run first reaches it."""
    fig, axes = _figure(size_px, dpi)
    ax = axes[0][0]
    for name, (tokens, loss) in curves.items():
        (line,) = ax.plot(tokens, loss, label=name, linewidth=1.5)
        hit = (crossings or {}).get(name)
        if hit is not None and target is not None:
            ax.plot([hit], [target], marker="o", color=line.get_color())
            ax.annotate(f"{hit:.3g}", (hit, target), textcoords="offset points", xytext=(4, 6), fontsize=8,
                        color=line.get_color())
    if target is not None:
        ax.axhline(target, color="gray", linestyle="--", linewidth=1, label=f"target {target:.4f}")
    if log_x:
        ax.set_xscale("log")
    return _finish_single_axes(fig, ax, path, dpi, "training tokens", ylabel, title)


def plot_changes_with_error_bars(labels, series: dict[str, tuple[list, list]], path: str,
                                 title: str = "Change vs baseline, mean over seeds",
                                 ylabel: str = "% change in perplexity", xlabel: str = "bucket (rarest first)",
                                 size_px=DEFAULT_SIZE_PX, dpi: int = DEFAULT_DPI) -> str:
    """Grouped bars of per-cent changes, one group per label, one bar per series
    (`name: (means, stds)`), each with a +-std error bar and its mean written on it."""
    fig, axes = _figure(size_px, dpi)
    ax = axes[0][0]
    x = range(len(labels))
    width = 0.8 / max(len(series), 1)
    for k, (name, (means, stds)) in enumerate(series.items()):
        offset = (k - (len(series) - 1) / 2) * width
        heights = [math.nan if v is None else v for v in means]
        errors = [0.0 if v is None else v for v in stds]
        ax.bar([i + offset for i in x], heights, width, yerr=errors, capsize=4, label=name, color=f"C{k}")
        for i, v in zip(x, means):
            if v is not None:
                ax.annotate(f"{v:+.1f}", (i + offset, v), ha="center", va="bottom" if v >= 0 else "top", fontsize=7)
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set_xticks(list(x))
    ax.set_xticklabels(labels, rotation=20, ha="right", fontsize=8)
    return _finish_single_axes(fig, ax, path, dpi, xlabel, ylabel, title, grid_axis="y")


def plot_loss_bands(curves: dict[str, tuple], path: str, ylabel: str = "validation loss",
                    title: str = "Loss vs training tokens, mean +- std over seeds",
                    size_px=DEFAULT_SIZE_PX, dpi: int = DEFAULT_DPI) -> str:
    """One line per model (`name: (tokens, mean, std)`) with a shaded +-std band."""
    fig, axes = _figure(size_px, dpi)
    ax = axes[0][0]
    for k, (name, (tokens, mean, std)) in enumerate(curves.items()):
        ax.plot(tokens, mean, label=name, linewidth=1.5, color=f"C{k}")
        ax.fill_between(tokens, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)],
                        color=f"C{k}", alpha=0.2, linewidth=0)
    return _finish_single_axes(fig, ax, path, dpi, "training tokens", ylabel, title)
