"""The picture of a sweep (``dapple sweep --plot``): time to train, and
cost or GPU-hours, against GPUs, one line a GPU type, every planned size
marked and labelled with the figure the table prints for it, the knees and
the cheapest points marked.

matplotlib is imported lazily and only its Agg canvas is used, as in
``pictures.py``."""

from __future__ import annotations

import io
import os

from .errors import DappleError
from .files import write_atomic_bytes
from .pictures import DPI, picture_format
from .sweep import Sweep, SweepPoint, amount_text, duration_text, duration_unit, usd_text

KNEE_STYLE = dict(marker="o", markersize=15, markerfacecolor="none", markeredgecolor="#c0392b", markeredgewidth=1.8,
                  linestyle="none")
CHEAPEST_STYLE = dict(marker="*", markersize=16, markerfacecolor="#f5b700", markeredgecolor="#7a5b00",
                      markeredgewidth=0.8, linestyle="none")


def plot(result: Sweep, path: str | os.PathLike) -> None:
    """Draw ``result`` to ``path`` (.png or .svg), written whole."""
    fmt = picture_format(path)
    try:
        import matplotlib
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.lines import Line2D
        from matplotlib.ticker import FuncFormatter, LogFormatter
    except ImportError:
        raise DappleError("pictures need matplotlib: pip install 'matplotlib>=3.8'",
                          code="missing_dependency") from None
    planned = [p for p in result.points if p.plan is not None]
    priced = bool(planned) and planned[0].cost_usd is not None
    fig = Figure(figsize=(9.0, 7.6), dpi=DPI)
    time_ax, cost_ax = fig.subplots(2, 1, sharex=True)
    # The time axis in the unit of the longest time; each point's figure in
    # its own, as the table prints it.
    _, unit_name, unit_hours = duration_unit(max((p.train_hours for p in planned), default=1.0))
    panels = [
        (time_ax, lambda p: p.train_hours / unit_hours, lambda p: duration_text(p.train_hours),
         f"time to train, {unit_name} (log scale)"),
        (cost_ax, (lambda p: p.cost_usd) if priced else (lambda p: p.gpu_hours),
         (lambda p: usd_text(p.cost_usd)) if priced else (lambda p: amount_text(p.gpu_hours)),
         "cost, USD" if priced else "GPU-hours"),
    ]
    knees, cheapest = result.knees, result.cheapest
    for ax, value, text, label in panels:
        for k, gpu_type in enumerate(result.gpu_types):
            mine = [p for p in planned if p.gpu_type == gpu_type]
            ax.plot([p.gpus for p in mine], [value(p) for p in mine], "-o", color=f"C{k}", markersize=5,
                    linewidth=1.6, label=gpu_type)
            for p in mine:
                # The highest point of a size has its figure above, the others
                # below: lines that meet do not print over each other.
                above = value(p) >= max(value(q) for q in planned if q.gpus == p.gpus)
                ax.annotate(text(p), (p.gpus, value(p)), textcoords="offset points",
                            xytext=(0, 8 if above else -9), ha="center", va="bottom" if above else "top",
                            fontsize=7.5, color=f"C{k}")
        _mark(ax, knees, value, KNEE_STYLE)
        _mark(ax, cheapest, value, CHEAPEST_STYLE)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.margins(x=0.08, y=0.18)
    # Plain numbers on the log axis; its minor ticks labelled where it spans
    # about a decade or less, where the major ones are too few to read by.
    time_ax.set_yscale("log")
    time_ax.yaxis.set_major_formatter(LogFormatter(labelOnlyBase=False))
    time_ax.yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False, minor_thresholds=(1, 0.4)))
    cost_ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: usd_text(y) if priced else amount_text(y)))
    sizes = sorted({p.gpus for p in result.points})
    cost_ax.set_xscale("log", base=2)
    cost_ax.set_xticks(sizes, [_size_label(result, g) for g in sizes], fontsize=8)
    cost_ax.minorticks_off()
    cost_ax.set_xlabel("GPUs (machines x GPUs a machine), log scale")
    handles, _ = time_ax.get_legend_handles_labels()
    handles += [Line2D([], [], label=f"knee (step efficiency >= {result.knee_efficiency:g} up to it)", **KNEE_STYLE),
                Line2D([], [], label="cheapest" + ("" if priced else " (fewest GPU-hours of its type)"),
                       **CHEAPEST_STYLE)]
    time_ax.legend(handles=handles, fontsize=8, loc="upper right")
    fig.suptitle(f"{result.model}: {result.train_tokens:,} tokens to train, {result.global_batch_size:,} samples of "
                 f"{result.tokens_per_sample:,} tokens a batch", fontsize=11)
    unplanned = [p for p in result.points if p.plan is None]
    if unplanned:
        fig.text(0.01, 0.005, "no plan: " + ", ".join(f"{p.gpu_type} x {p.gpus}" for p in unplanned),
                 fontsize=7.5, ha="left", va="bottom", color="#555555")
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    # No dates: the same sweep draws the same file.
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "dapple"}):
        fig.savefig(buf, format=fmt, dpi=DPI, facecolor="white",
                    metadata={"Date": None} if fmt == "svg" else {"Software": None})
    write_atomic_bytes(path, buf.getvalue())


def _mark(ax, points: list[SweepPoint], value, style: dict) -> None:
    if points:
        ax.plot([p.gpus for p in points], [value(p) for p in points], zorder=5, **style)


def _size_label(result: Sweep, gpus: int) -> str:
    point = next(p for p in result.points if p.gpus == gpus)
    return f"{gpus}\n{point.machines}x{point.gpus_per_machine}"
