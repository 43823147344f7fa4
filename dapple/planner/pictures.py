"""Pictures of a plan and of its simulated iteration, as PNG or SVG files.

    gantt(plan, sim, "gantt.png")      # the timeline, like Fig. 4 of the DAPPLE paper
    memory(plan, sim, "memory.svg")    # memory per stage over time, like Fig. 3(c)
    diagram(plan, "plan.png", profile) # the stages drawn on the cluster's machines

matplotlib is imported here, lazily, and only its Agg canvas is used: the
global pyplot backend of an interactive session is left alone, and
``from dapple import planner`` stays light.
"""

from __future__ import annotations

import io
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from .errors import DappleError, InvalidInputError, LimitExceededError
from .files import write_atomic_bytes
from .limits import MAX_TASKS_DRAWN
from .plan import Plan, counted, device_ranges, shape_label
from .profile import Profile
from .simulation import Simulation

FORMATS = {".png": "png", ".svg": "svg"}
GIB = float(1 << 30)
DPI = 110

# Fig. 4 of the paper: blue forwards, green backwards, gray bubbles.
COLORS = {
    "forward": "#2f6fc0",
    "backward": "#2e9a47",
    # A split backward (ZB-H1): the input gradient as a backward, the
    # deferred weight gradient lighter.
    "input_gradient": "#2e9a47",
    "weight_gradient": "#7cc98f",
    "send_forward": "#9cc3ee",
    "send_backward": "#a8dba8",
    "all_reduce": "#f08c1e",
    "optimizer_step": "#3a3a3a",
    "idle": "#d5d5d5",
    "link_idle": "#f1f1f1",
}


#: The tasks that compute on a stage's GPUs, drawn in its row.
PASS_KINDS = ("forward", "backward", "input_gradient", "weight_gradient")


def picture_format(path: str | os.PathLike) -> str:
    """"png" or "svg" from the file name; anything else is invalid input."""
    ext = Path(path).suffix.lower()
    if ext not in FORMATS:
        shown = f"'{Path(path).suffix}'" if Path(path).suffix else "no extension"
        raise InvalidInputError(f"{path}: unsupported picture format ({shown}); use .png or .svg")
    return FORMATS[ext]


def check_timeline_size(plan: Plan, path: str | os.PathLike, max_tasks: int = MAX_TASKS_DRAWN) -> None:
    """Refuse (LimitExceededError) a timeline of more than ``max_tasks``
    tasks, counted from the plan before any task is read: there can be
    millions. ``path`` is the picture named in the error."""
    n, m = len(plan.stages), plan.micro_batches
    links = max(n - 1, 0)
    count = 2 * m * (n + links) + 2 * n  # passes and transfers both ways, AllReduce and optimizer steps
    if count > max_tasks:
        raise LimitExceededError(
            f"{path}: the timeline would draw about {count} tasks ({n} stages x {m} micro-batches), "
            f"over the limit of {max_tasks}; draw a plan with fewer micro-batches, or raise the limit "
            "(--max-tasks-drawn)"
        )


def gantt(plan: Plan, sim: Simulation, path: str | os.PathLike, max_tasks: int = MAX_TASKS_DRAWN) -> None:
    """The simulated iteration: one row per stage, a thin row per link."""
    fmt = picture_format(path)
    _matplotlib()  # missing matplotlib is the first error, before any other check
    check_timeline_size(plan, path, max_tasks)
    total = sim.iteration_ms if sim.iteration_ms > 0 else 1.0
    labels = _timeline_row_labels(plan)
    g = _timeline_geometry(len(plan.stages), total, sim.tasks, _label_width_in(labels, STAGE_LABEL_SIZE))
    fig, ax = _timeline_axes(g)
    _draw_idle_rows(ax, g)
    _draw_tasks(ax, g, sim.tasks)
    _label_timeline_rows(ax, g, labels)
    _label_idle_shares(ax, g, sim.tasks)
    ax.set_xlabel("time (ms)", fontsize=9)
    ax.tick_params(axis="x", labelsize=8.5)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    _timeline_title_and_legend(fig, g, plan, sim)
    _save(fig, path, fmt)


@dataclass(frozen=True)
class _TimelineGeometry:
    """Where the timeline's rows lie (data units, y downwards) and how big
    the figure is (inches)."""

    total: float  # ms, the x axis
    stage_top: list[float]
    link_top: list[float]
    row_h: float
    lane_h: float
    y_max: float
    unit_in: float  # inches per data unit of height
    plot_w: float
    plot_h: float
    left: float
    bottom: float
    fig_w: float
    fig_h: float
    px_per_ms: float
    number_size: float  # of the micro-batch numbers in a stage's row

    @property
    def n(self) -> int:
        return len(self.stage_top)


#: Point size of a stage's label on the timeline's left.
STAGE_LABEL_SIZE = 9.5


def _label_width_in(labels: list[str], fontsize: float) -> float:
    """The widest line of ``labels`` set at ``fontsize``, inches (the
    glyphs' own extents, as matplotlib lays them out)."""
    from matplotlib.textpath import TextPath

    lines = [line for label in labels for line in label.split("\n")]
    return max((TextPath((0, 0), line, size=fontsize).get_extents().width / 72 for line in lines), default=0.0)


def _timeline_geometry(n: int, total: float, tasks, label_w: float = 0.0) -> _TimelineGeometry:
    # Row geometry in data units (y grows downwards): a stage row of height
    # 1, then under it the link to the next stage in two lanes (activations
    # forward on top, gradients backward below).
    pitch, row_h, lane_h, lane_gap = 1.75, 1.0, 0.28, 0.1
    stage_top = [i * pitch for i in range(n)]
    link_top = [stage_top[i] + row_h + lane_gap for i in range(n - 1)]
    y_max = stage_top[-1] + row_h

    # Wide enough that the shortest forward or backward is ~0.2 inch.
    compute = [t for t in tasks if t["kind"] in ("forward", "backward") and t["end_ms"] > t["start_ms"]]
    shortest = min((t["end_ms"] - t["start_ms"] for t in compute), default=total)
    plot_w = min(32.0, max(10.0, 0.2 * total / max(shortest, 1e-9)))
    unit_in = 0.42
    plot_h = (y_max + 0.2) * unit_in
    # The left margin holds the widest stage label whole (a tick's padding
    # and a little air beside it).
    left, right, top, bottom = max(2.3, label_w + 0.3), 1.0, 0.9, 0.6
    return _TimelineGeometry(
        total=total, stage_top=stage_top, link_top=link_top, row_h=row_h, lane_h=lane_h, y_max=y_max,
        unit_in=unit_in, plot_w=plot_w, plot_h=plot_h, left=left, bottom=bottom,
        fig_w=left + plot_w + right, fig_h=top + plot_h + bottom, px_per_ms=plot_w * DPI / total,
        number_size=8 if plot_w * DPI / max(len(compute) / n, 1) > 14 else 7,
    )


def _timeline_axes(g: _TimelineGeometry):
    _, Figure, _, _ = _matplotlib()
    fig = Figure(figsize=(g.fig_w, g.fig_h), dpi=DPI)
    ax = fig.add_axes((g.left / g.fig_w, g.bottom / g.fig_h, g.plot_w / g.fig_w, g.plot_h / g.fig_h))
    ax.set_xlim(0, g.total)
    ax.set_ylim(g.y_max + 0.1, -0.1)
    return fig, ax


def _draw_idle_rows(ax, g: _TimelineGeometry) -> None:
    """Idle background: gray for a stage (bubbles), near-white for a link."""
    _, _, Rectangle, _ = _matplotlib()
    for i in range(g.n):
        ax.add_patch(Rectangle((0, g.stage_top[i]), g.total, g.row_h, facecolor=COLORS["idle"], edgecolor="none",
                               zorder=0))
    for i in range(g.n - 1):
        ax.add_patch(
            Rectangle((0, g.link_top[i]), g.total, 2 * g.lane_h, facecolor=COLORS["link_idle"], edgecolor="none",
                      zorder=0)
        )


def _draw_tasks(ax, g: _TimelineGeometry, tasks) -> None:
    """Passes in the stages' rows, transfers in the links' lanes, the
    AllReduce and the optimizer step at the end of a stage's row."""
    n, stage_top, row_h = g.n, g.stage_top, g.row_h
    min_mark_ms = 1.5 / g.px_per_ms  # a zero-length task still shows as a 1.5 px line
    for t in tasks:
        s, kind, x0, x1 = t["stage"], t["kind"], t["start_ms"], t["end_ms"]
        mb = t.get("micro_batch")
        label = None if mb is None else str(mb)
        if kind in PASS_KINDS:
            _task_block(ax, g, x0, x1, stage_top[s], row_h, COLORS[kind], label)
        elif kind in ("send_forward", "send_backward") and s < n - 1:
            y = g.link_top[s] + (0 if kind == "send_forward" else g.lane_h)
            _task_block(ax, g, x0, x1, y, g.lane_h, COLORS[kind], label, text_color="#20324a")
        elif kind in ("all_reduce", "optimizer_step"):
            if x1 - x0 >= min_mark_ms:
                label = "AR" if kind == "all_reduce" else None
                _task_block(ax, g, x0, x1, stage_top[s], row_h, COLORS[kind], label)
            elif kind == "optimizer_step" or x1 > x0:  # an AllReduce of zero time (one GPU) is not drawn
                ax.plot([x0, x0], [stage_top[s], stage_top[s] + row_h], color=COLORS[kind], linewidth=2.2,
                        solid_capstyle="butt", zorder=4, clip_on=False)


def _task_block(ax, g: _TimelineGeometry, x0, x1, y, h, color, label=None, text_color="white") -> None:
    """One task as a box, with its label inside when the label fits."""
    _, _, Rectangle, _ = _matplotlib()
    ax.add_patch(
        Rectangle((x0, y), x1 - x0, h, facecolor=color, edgecolor="white", linewidth=0.6, zorder=2)
    )
    if label is not None:
        width_px = (x1 - x0) * g.px_per_ms
        size = g.number_size if h >= g.row_h else 6
        need_px = len(label) * size * 0.62 * DPI / 72 + 3
        if width_px >= need_px and h * g.unit_in * 72 >= size + 1:
            ax.text((x0 + x1) / 2, y + h / 2, label, ha="center", va="center", fontsize=size,
                    color=text_color, zorder=3)


def _timeline_row_labels(plan: Plan) -> list[str]:
    """The timeline's row labels: each stage's (``_stage_name``), then each link's."""
    n = len(plan.stages)
    return [_stage_name(plan, i) for i in range(n)] + [f"link {i}\u2192{i + 1}: act. / grad." for i in range(n - 1)]


def _label_timeline_rows(ax, g: _TimelineGeometry, labels: list[str]) -> None:
    """Labels on the left: stages in the normal size, links smaller and gray."""
    n = g.n
    ticks = [g.stage_top[i] + g.row_h / 2 for i in range(n)] + [g.link_top[i] + g.lane_h for i in range(n - 1)]
    ax.set_yticks(ticks, labels)
    for k, lab in enumerate(ax.get_yticklabels()):
        if k < n:
            lab.set_fontsize(STAGE_LABEL_SIZE)
        else:
            lab.set_fontsize(7.5)
            lab.set_color("#555555")
            lab.set_fontstyle("italic")
    ax.tick_params(axis="y", length=0)


def _label_idle_shares(ax, g: _TimelineGeometry, tasks) -> None:
    """On the right: the gray share of each stage's row (the simulator's
    bubble_fraction also counts the AllReduce as idle; this does not)."""
    n = g.n
    busy = [0.0] * n
    for t in tasks:
        if t["kind"] in (*PASS_KINDS, "all_reduce", "optimizer_step") and t["stage"] < n:
            busy[t["stage"]] += t["end_ms"] - t["start_ms"]
    for i in range(n):
        ax.text(1.006, g.stage_top[i] + g.row_h / 2, f"idle {max(0.0, 1 - busy[i] / g.total) * 100:.0f}%",
                fontsize=8.5, color="#444444", va="center", ha="left", transform=_blend(ax))


def _timeline_title_and_legend(fig, g: _TimelineGeometry, plan: Plan, sim: Simulation) -> None:
    recompute = sim.recompute
    _title(fig, g.left, 0.22,
           f"{_model(plan)} {plan.layout}: {sim.schedule}"
           f"{' with re-computation' if recompute else ''}, {plan.micro_batching}; simulated iteration {sim.iteration_ms:.1f} ms")
    split = any(t["kind"] == "weight_gradient" for t in sim.tasks)
    backward = [("input gradient", COLORS["input_gradient"]), ("weight gradient", COLORS["weight_gradient"])] \
        if split else [("backward + re-run forward" if recompute else "backward", COLORS["backward"])]
    _legend_line(fig, g.left / g.fig_w, 1 - 0.6 / g.fig_h, [
        ("forward (micro-batch #)", COLORS["forward"]),
        *backward,
        ("activations \u2192", COLORS["send_forward"]),
        ("\u2190 gradients", COLORS["send_backward"]),
        ("AllReduce", COLORS["all_reduce"]),
        ("optimizer step", COLORS["optimizer_step"]),
        ("idle (bubble)", COLORS["idle"]),
    ])


def memory(plan: Plan, sim: Simulation, path: str | os.PathLike) -> None:
    """Memory of one GPU of each stage over the iteration, in GiB."""
    fmt = picture_format(path)
    _matplotlib()  # missing matplotlib is the first error, before any other check
    m = _memory_scale(sim)
    fig, axes = _memory_axes_one(m.n) if m.one_axis else _memory_axes_grid(m.n)
    for i, st in enumerate(sim.stages):
        _draw_stage_memory(axes[i], i, st, m, plan)
    first = axes[0]
    first.set_xlim(0, m.total)
    first.set_ylim(0, m.y_top)
    if m.one_axis:
        _finish_memory_axis(first, m, plan, sim)
    else:
        _finish_memory_grid(fig, axes, m.n)
    title = (f"{_model(plan)} {plan.layout}: memory of one GPU per stage, "
             f"{sim.schedule}{' with re-computation' if sim.recompute else ''}, "
             f"{plan.micro_batching}")
    _title(fig, 0.6, 0.2, title, fontsize=11)
    fig.text(0.6 / fig.get_figwidth(), 1 - 0.48 / fig.get_figheight(),
             "solid: memory in use; dotted: weights and optimizer state (held all the time; the gradients "
             "come with the first backward and go with the optimizer step); dashed: GPU memory",
             fontsize=8.5, ha="left", va="top", color="#444444")
    _save(fig, path, fmt)


@dataclass(frozen=True)
class _MemoryScale:
    """What every stage's memory plot shares: the time and GiB ranges, the
    colours and the GPUs' memory limits."""

    n: int
    total: float  # ms
    colors: list
    limits: list[float]  # GiB
    peaks: list[float]  # GiB
    y_top: float
    shared_limit: bool  # every stage's GPU has the same memory

    @property
    def one_axis(self) -> bool:
        return self.n <= 4


def _memory_scale(sim: Simulation) -> _MemoryScale:
    n = len(sim.stages)
    # One axis for a few stages, coloured as in the diagram; small multiples
    # (one stage each, titled) for more, in one dark colour that reads well.
    colors = _stage_colors(n) if n <= 4 else ["#1f4e8c"] * n
    limits = [st["memory_limit_bytes"] / GIB for st in sim.stages]
    peaks = [st["peak_memory_bytes"] / GIB for st in sim.stages]
    return _MemoryScale(n=n, total=sim.iteration_ms if sim.iteration_ms > 0 else 1.0, colors=colors, limits=limits,
                        peaks=peaks, y_top=max(limits + peaks) * 1.12, shared_limit=len(set(limits)) == 1)


def _memory_axes_one(n: int):
    """One axis for all the stages, with room on its right for their names."""
    _, Figure, _, _ = _matplotlib()
    fig_w, fig_h = 10.5, 5.2
    fig = Figure(figsize=(fig_w, fig_h), dpi=DPI)
    ax = fig.add_axes((0.8 / fig_w, 0.65 / fig_h, 7.6 / fig_w, (fig_h - 1.45) / fig_h))
    return fig, [ax] * n


def _memory_axes_grid(n: int):
    """Small multiples, four a row, on shared axes."""
    _, Figure, _, _ = _matplotlib()
    cols = 4
    rows = math.ceil(n / cols)
    fig_w, fig_h = 14.0, 1.15 + rows * 2.2
    fig = Figure(figsize=(fig_w, fig_h), dpi=DPI)
    grid = fig.add_gridspec(rows, cols, left=0.7 / fig_w, right=1 - 0.25 / fig_w, top=1 - 0.95 / fig_h,
                            bottom=0.55 / fig_h, hspace=0.45, wspace=0.12)
    axes = []
    for i in range(n):
        a = fig.add_subplot(grid[i // cols, i % cols], sharex=axes[0] if axes else None,
                            sharey=axes[0] if axes else None)
        axes.append(a)
    return fig, axes


def _draw_stage_memory(ax, i: int, st: dict, m: _MemoryScale, plan: Plan) -> None:
    """Stage i's memory over time, what it holds all the time, its peak and
    (where it is not drawn once for all) its GPU's memory."""
    color, peak = m.colors[i], m.peaks[i]
    xs, ys = _memory_series(st, m.total)
    ax.step(xs, ys, where="post", color=color, linewidth=1.8, label=f"stage {i}", zorder=3)
    # Dotted: what is held all the time (weights, gradients, optimizer state).
    ax.axhline(st["memory"][0][1] / GIB, color=color, linestyle=":", linewidth=1.0, alpha=0.8, zorder=2)
    t_peak = _memory_peak_at(st)
    ax.plot([t_peak], [peak], "o", color=color, markersize=5, zorder=4)
    # Stagger the annotations of a shared axis so they do not overlap.
    dy = 8 + (12 * i if m.one_axis else 0)
    label = f"stage {i} peak {peak:.2f} GiB" if m.one_axis else f"peak {peak:.2f} GiB"
    terms = st.get("memory_terms")
    if terms:
        label += " = " + memory_terms_text(terms)
    ax.annotate(label,
                (t_peak, peak), xytext=(6, dy), textcoords="offset points", fontsize=8.5,
                color=color, fontweight="bold", zorder=5,
                arrowprops=dict(arrowstyle="-", color=color, linewidth=0.8) if dy > 10 else None)
    if not m.one_axis:
        ax.set_title(_stage_name(plan, i), fontsize=9, loc="left")
    if not m.one_axis or not m.shared_limit:
        ax.axhline(m.limits[i], color=color if not m.shared_limit else "#b22222", linestyle="--", linewidth=1.1)


def memory_terms_text(terms: dict) -> str:
    """A stage's peak in its terms, in GiB: "state 5.73 + 4 x 1.153 in flight
    + working 0.010 + other 0.000"."""
    return (f"state {terms['model_state_bytes'] / GIB:.2f} + {terms['micro_batches_in_flight']} x "
            f"{terms['per_micro_batch_bytes'] / GIB:.3f} in flight + working {terms['working_bytes'] / GIB:.3f}"
            + (f" + other {terms['other_bytes'] / GIB:.3f}" if terms["other_bytes"] > 0 else ""))


def _memory_series(st: dict, total: float) -> tuple[list[float], list[float]]:
    """A stage's memory as steps: times (ms) and GiB, held until ``total``."""
    # Several changes at one instant (a backward frees what the next
    # forward takes at once): only the level after the last one is real.
    xs, ys = [], []
    for t, b in st["memory"]:
        if xs and t <= xs[-1]:
            ys[-1] = b / GIB
        else:
            xs.append(t)
            ys.append(b / GIB)
    xs.append(max(total, xs[-1]))
    ys.append(ys[-1])
    return xs, ys


def _memory_peak_at(st: dict) -> float:
    """The first time (ms) a stage's memory reaches its peak."""
    peak = st["peak_memory_bytes"]
    for t, b in st["memory"]:
        if b >= peak * (1 - 1e-12):
            return t
    return 0.0


def _finish_memory_axis(ax, m: _MemoryScale, plan: Plan, sim: Simulation) -> None:
    """The shared axis: the one memory limit, the stages' names, labels and grid."""
    if m.shared_limit:
        ax.axhline(m.limits[0], color="#b22222", linestyle="--", linewidth=1.2, zorder=2)
        ax.text(m.total, m.limits[0], f"GPU memory {m.limits[0]:.0f} GiB ", color="#b22222", fontsize=9,
                ha="right", va="bottom")
    # Name each line at its right end, and keep a legend beside the plot.
    ends = sorted(((_memory_series(st, m.total)[1][-1], i) for i, st in enumerate(sim.stages)))
    names = [_stage_name(plan, i) for i in range(m.n)]
    # A shaped stage's name is two lines: twice the room between names.
    gap = m.y_top * 0.045 * max(name.count("\n") + 1 for name in names)
    last_y = -1e9
    for y, i in ends:
        y = max(y, last_y + gap)
        last_y = y
        ax.text(1.01, y, names[i], color=m.colors[i], fontsize=9,
                va="center", ha="left", transform=_blend(ax), fontweight="bold")
    ax.set_xlabel("time (ms)", fontsize=9.5)
    ax.set_ylabel("GiB on one GPU", fontsize=9.5)
    ax.grid(color="#e6e6e6", linewidth=0.7, zorder=0)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)


def _finish_memory_grid(fig, axes, n: int) -> None:
    """Small multiples: tick labels only on the outer edges, one label per axis for the figure."""
    for i, a in enumerate(axes):
        a.grid(color="#e6e6e6", linewidth=0.7, zorder=0)
        a.tick_params(labelsize=7.5)
        if i % 4:
            a.tick_params(labelleft=False)
        if i < n - 4:
            a.tick_params(labelbottom=False)
    fig_w, fig_h = fig.get_figwidth(), fig.get_figheight()
    fig.text(0.2 / fig_w, 0.5, "GiB on one GPU", rotation=90, va="center", fontsize=9.5)
    fig.text(0.5, 0.12 / fig_h, "time (ms)", ha="center", fontsize=9.5)


# The diagram's boxes in data units (a GPU is 1 x 1): GPUs and the gap
# between them, a machine's padding and the height of its label.
_GPU, _GPU_GAP, _MACHINE_PAD, _MACHINE_HEAD = 1.0, 0.22, 0.3, 0.55


class _MachineBox(NamedTuple):
    x: float
    y: float
    w: float
    h: float
    index: int
    group: int
    first_id: int
    count: int  # GPUs
    cols: int  # GPUs a row


def diagram(plan: Plan, path: str | os.PathLike, profile: Profile | None = None) -> None:
    """The plan on the cluster: machines as boxes, GPUs coloured by stage."""
    fmt = picture_format(path)
    _matplotlib()  # missing matplotlib is the first error, before any other check
    topo = plan.data["inputs"]["topology"]
    colors = _stage_colors(len(plan.stages))
    owner = {d: i for i, s in enumerate(plan.stages) for d in s["devices"]}
    tags = _gpu_tags(plan)
    blocks = _model_layers_per_stage(plan, profile)
    machines, width, height, devices = _lay_out_machines(topo["machine_groups"])

    unit = min(0.62, 14.0 / max(width, 1))  # inches per data unit
    entries = _stage_legend_entries(plan, profile, blocks, colors)
    if devices > len(owner):
        entries.append(("unused GPU", "white"))
    legend_font, line_h = 9, 0.3
    fig_w = max(9.0, width * unit + 1.0)
    lines, column = _wrap_legend(entries, legend_font, fig_w - 1.0)
    fig, ax = _diagram_axes(fig_w, width, height, unit, line_h * len(lines))
    id_size = 9.5 if unit >= 0.5 else 8
    for box in machines:
        _draw_machine(ax, box, topo["machine_groups"][box.group]["gpu"]["type"], unit)
        _draw_machine_gpus(ax, box, owner, tags, colors, id_size)
    split = _outline_split_groups(ax, plan, machines)
    _diagram_legend(fig, lines, column, legend_font, line_h)

    _title(fig, 0.5, 0.18,
           f"{_model(plan)} on {topo.get('name', '?')}: {plan.layout}, global batch "
           f"{plan.data['inputs'].get('global_batch_size', '?')} in {plan.micro_batching}")
    subtitle = _cluster_subtitle(topo, len(machines))
    if split:
        subtitle += "; outlined: a split group, one replica's GPUs (r0, r1, ...)"
    fig.text(0.5 / fig_w, 1 - 0.52 / fig.get_figheight(), subtitle,
             fontsize=9, ha="left", va="top", color="#444444")
    _save(fig, path, fmt)


def _model_layers_per_stage(plan: Plan, profile: Profile | None) -> list[int] | None:
    """The profile's model layers in each stage, or None where they cannot be told."""
    if profile is None:
        return None
    try:
        return plan.blocks_per_stage(profile)
    except DappleError:
        return None


def _lay_out_machines(groups) -> tuple[list[_MachineBox], float, float, int]:
    """Machines in rows, group after group, in device-id order: their boxes,
    the width and height they take and the number of GPUs."""
    machines = []
    y = 0.0
    device = 0
    width = 0.0
    for gi, g in enumerate(groups):
        per = g["gpus_per_machine"]
        cols = min(per, 8)
        rows = math.ceil(per / cols)
        w = 2 * _MACHINE_PAD + cols * _GPU + (cols - 1) * _GPU_GAP
        h = _MACHINE_HEAD + 2 * _MACHINE_PAD + rows * _GPU + (rows - 1) * _GPU_GAP - 0.1
        per_row = min(g["machines"], max(1, 16 // cols) if cols > 1 else 8)
        for m in range(g["machines"]):
            if m and m % per_row == 0:
                y += h + 0.5
            x = (m % per_row) * (w + 0.45)
            machines.append(_MachineBox(x, y, w, h, len(machines), gi, device, per, cols))
            width = max(width, x + w)
            device += per
        y += h + 0.5
    return machines, width, y - 0.5, device


def _stage_legend_entries(plan: Plan, profile: Profile | None, blocks, colors) -> list:
    """A legend entry per stage: its layers, named from the profile when there is one."""
    entries = []
    for i, s in enumerate(plan.stages):
        text = f"stage {i}: layers {s['layer_start']}-{s['layer_end'] - 1}"
        if profile is not None:
            first, last = profile.layers[s["layer_start"]]["name"], profile.layers[s["layer_end"] - 1]["name"]
            names = f"{_short(first)} .. {_short(last)}"
            count = f"; {counted(blocks[i], 'model layer')}" if blocks is not None and any(blocks) else ""
            text += f" ({names}{count})"
        shape = shape_label(plan.stage_shapes[i])
        entries.append((f"{text}, {shape}" if shape else text, colors[i]))
    return entries


def _diagram_axes(fig_w: float, width: float, height: float, unit: float, legend_h: float):
    """The figure and its axes (data units, y downwards) above ``legend_h`` inches of legend."""
    _, Figure, _, _ = _matplotlib()
    fig_h = height * unit + 1.05 + legend_h + 0.3
    fig = Figure(figsize=(fig_w, fig_h), dpi=DPI)
    plot_w, plot_h = width * unit, height * unit
    ax = fig.add_axes((0.5 / fig_w, (0.3 + legend_h) / fig_h, plot_w / fig_w, plot_h / fig_h))
    ax.set_xlim(0, width)
    ax.set_ylim(height, 0)
    ax.set_axis_off()
    return fig, ax


def _diagram_legend(fig, lines, column: float | None, fontsize: float, line_h: float) -> None:
    """The legend's lines under the machines, the first on top."""
    fig_w, fig_h = fig.get_figwidth(), fig.get_figheight()
    for r, line in enumerate(lines):
        _legend_line(fig, 0.5 / fig_w, (0.3 + line_h * (len(lines) - 1 - r) - line_h / 2 + 0.05) / fig_h, line,
                     fontsize=fontsize, column_in=column)


def _draw_machine(ax, box: _MachineBox, gpu_type: str, unit: float) -> None:
    """A machine's box and its name."""
    _, _, _, FancyBboxPatch = _matplotlib()
    x, y0, w, h, index = box.x, box.y, box.w, box.h, box.index
    ax.add_patch(FancyBboxPatch((x, y0), w, h, boxstyle="round,pad=0,rounding_size=0.15",
                                facecolor="#f7f7f7", edgecolor="#666666", linewidth=1.2))
    # The longest machine label that fits its box.
    room = (w - 2 * _MACHINE_PAD) * unit
    for label in (f"machine {index}: {gpu_type}", f"machine {index}", f"m{index}"):
        if _text_width_in(label, 8.5) <= room + 0.15:
            break
    ax.text(x + w / 2 if label.startswith("m") and not label.startswith("machine") else x + _MACHINE_PAD,
            y0 + _MACHINE_HEAD / 2 + 0.05, label, fontsize=8.5, va="center",
            ha="center" if not label.startswith("machine") else "left", color="#333333")


def _gpu_xy(box: _MachineBox, k: int) -> tuple[float, float]:
    """The top left corner of the machine's k-th GPU."""
    return (box.x + _MACHINE_PAD + (k % box.cols) * (_GPU + _GPU_GAP),
            box.y + _MACHINE_HEAD + _MACHINE_PAD / 2 + (k // box.cols) * (_GPU + _GPU_GAP))


def _gpu_tags(plan: Plan) -> dict[int, str]:
    """The text under each used GPU's id: its stage ("s1"), and in a stage
    that splits its layers the replica whose split group it is in ("s1 r0")."""
    tags = {}
    for i, shape in enumerate(plan.stage_shapes):
        for r, group in enumerate(shape.split_groups):
            for d in group:
                tags[d] = f"s{i} r{r}" if shape.tensor_parallel > 1 else f"s{i}"
    return tags


def _draw_machine_gpus(ax, box: _MachineBox, owner: dict, tags: dict, colors, id_size: float) -> None:
    """A machine's GPUs, coloured by stage, each with its id and its tag (``_gpu_tags``)."""
    _, _, Rectangle, _ = _matplotlib()
    for k in range(box.count):
        d = box.first_id + k
        gx, gy = _gpu_xy(box, k)
        s = owner.get(d)
        face = colors[s] if s is not None else "white"
        ax.add_patch(Rectangle((gx, gy), _GPU, _GPU, facecolor=face, edgecolor="#444444", linewidth=0.8))
        ink = _ink(face)
        ax.text(gx + _GPU / 2, gy + _GPU * 0.4, str(d), fontsize=id_size, ha="center", va="center", color=ink,
                fontweight="bold")
        ax.text(gx + _GPU / 2, gy + _GPU * 0.78, tags.get(d, "-"), fontsize=id_size - 2.5,
                ha="center", va="center", color=ink)


def _outline_split_groups(ax, plan: Plan, machines: list[_MachineBox]) -> bool:
    """A dark outline around each split group of a stage that splits its
    layers: round the group's GPUs in each row of a machine they fill (a
    group may span machines). Whether any was drawn."""
    _, _, _, FancyBboxPatch = _matplotlib()
    where = {box.first_id + k: (box, k) for box in machines for k in range(box.count)}
    pad = 0.08  # less than half the gap between GPUs: neighbouring groups' outlines stay apart
    drawn = False
    for shape in plan.stage_shapes:
        if shape.tensor_parallel == 1:
            continue
        for group in shape.split_groups:
            rows: dict[tuple[int, int], list[int]] = {}
            for d in group:
                box, k = where[d]
                rows.setdefault((box.index, k // box.cols), []).append(k)
            for (index, _), ks in rows.items():
                (x0, y0), (x1, _) = _gpu_xy(machines[index], min(ks)), _gpu_xy(machines[index], max(ks))
                ax.add_patch(FancyBboxPatch((x0 - pad, y0 - pad), x1 - x0 + _GPU + 2 * pad, _GPU + 2 * pad,
                                            boxstyle="round,pad=0,rounding_size=0.12", facecolor="none",
                                            edgecolor="#111111", linewidth=1.8, zorder=5))
                drawn = True
    return drawn


def _cluster_subtitle(topo: dict, machine_count: int) -> str:
    """The machines and their links."""
    groups = topo["machine_groups"]
    parts = [f"{g['machines']} x {g['gpus_per_machine']} {g['gpu']['type']}" for g in groups]
    intra = {(g["intra_machine"]["kind"], g["intra_machine"]["bandwidth_gbps"])
             for g in groups if g["gpus_per_machine"] > 1 and "intra_machine" in g}
    links = [f"{k} {b:g} Gbps inside a machine" for k, b in sorted(intra)]
    inter = topo.get("inter_machine")
    if inter and machine_count > 1:
        links.append(f"{inter['kind']} {inter['bandwidth_gbps']:g} Gbps between machines")
    return " + ".join(parts) + ("; " + ", ".join(links) if links else "")


def curves(runs: list[dict], path: str | os.PathLike, steps_per_epoch: float | None = None) -> None:
    """Validation loss and accuracy against training steps (or epochs, with
    ``steps_per_epoch``) of runs' metrics (``dapple.run-metrics`` data with
    ``evaluations``). Runs with the same schedule and optimizer are one
    curve: the mean over them, and the band from the lowest to the highest
    when there are several (seeds). Runs that re-computed (``recompute``)
    are curves of their own, dashed, labelled "rc"."""
    fmt = picture_format(path)
    _, Figure, _, _ = _matplotlib()
    groups: dict[str, list[dict]] = {}
    for i, run in enumerate(runs):
        if not run.get("evaluations"):
            raise InvalidInputError(f"metrics {i + 1} of {len(runs)} hold no evaluations (run with --eval-every)")
        # Version 1 metrics did not record the optimizer.
        label = (f"{run.get('schedule') or 'synchronous'}{' rc' if run.get('recompute') else ''}, "
                 f"{run.get('optimizer') or 'optimizer unknown'}")
        groups.setdefault(label, []).append(run)
    has_accuracy = any(e.get("accuracy") is not None for r in runs for e in r["evaluations"])
    panels = [("validation loss", "loss")] + ([("validation accuracy", "accuracy")] if has_accuracy else [])
    fig_w, fig_h = 5.2 * len(panels) + 0.6, 4.4
    fig = Figure(figsize=(fig_w, fig_h), dpi=DPI)
    # One colour per schedule and optimizer, with or without re-computation.
    kinds = list(dict.fromkeys(label.replace(" rc,", ",") for label in groups))
    palette = _stage_colors(max(len(kinds), 1)) if len(kinds) <= 4 else [f"C{i % 10}" for i in range(len(kinds))]
    colors = [palette[kinds.index(label.replace(" rc,", ","))] for label in groups]
    for k, (title, key) in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), k + 1)
        for (label, members), color in zip(groups.items(), colors):
            steps = sorted({e["step"] for r in members for e in r["evaluations"]})
            # The values of every member at each step it was evaluated.
            at = {s: [e[key] for r in members for e in r["evaluations"] if e["step"] == s and e[key] is not None]
                  for s in steps}
            xs = [s / steps_per_epoch if steps_per_epoch else s for s in steps if at[s]]
            values = [at[s] for s in steps if at[s]]
            mean = [sum(v) / len(v) for v in values]
            style = "--" if members[0].get("recompute") else "-"
            line = ax.plot(xs, mean, style, label=f"{label} ({len(members)})", color=color, linewidth=1.6)[0]
            if len(members) > 1:
                ax.fill_between(xs, [min(v) for v in values], [max(v) for v in values], color=line.get_color(),
                                alpha=0.18, linewidth=0)
        ax.set_title(title, fontsize=10.5)
        ax.set_xlabel("epoch" if steps_per_epoch else "step")
        ax.grid(alpha=0.3)
        if k == len(panels) - 1:
            ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    _save(fig, path, fmt)


def _matplotlib():
    try:
        import matplotlib
        from matplotlib.figure import Figure
        from matplotlib.patches import FancyBboxPatch, Rectangle
    except ImportError:
        raise DappleError(
            "pictures need matplotlib: pip install 'matplotlib>=3.8'", code="missing_dependency"
        ) from None
    return matplotlib, Figure, Rectangle, FancyBboxPatch


def _save(fig, path, fmt: str) -> None:
    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    # Text stays text in SVG (searchable, selectable); no dates: same input, same file.
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "dapple"}):
        metadata = {"Date": None} if fmt == "svg" else {"Software": None}
        fig.savefig(buf, format=fmt, dpi=DPI, facecolor="white", metadata=metadata)
    write_atomic_bytes(path, buf.getvalue())


def _legend_line(fig, x: float, y: float, entries, fontsize: float = 8.5, column_in: float | None = None) -> None:
    """Colour swatches and their names in one line, starting at figure
    fraction (x, y): a legend where the eye already is. ``column_in``: fixed
    step between entries, in inches, to align several lines."""
    from matplotlib.patches import Rectangle

    fig_w_in = fig.get_figwidth()
    fig_h_in = fig.get_figheight()
    sw_w, sw_h = 0.17 / fig_w_in, 0.13 / fig_h_in
    for text, color in entries:
        fig.add_artist(Rectangle((x, y - sw_h / 2), sw_w, sw_h, facecolor=color, edgecolor="#555555",
                                 linewidth=0.5, transform=fig.transFigure))
        fig.text(x + sw_w + 0.05 / fig_w_in, y, text, fontsize=fontsize, va="center", ha="left")
        step = column_in if column_in is not None else 0.17 + 0.05 + _text_width_in(text, fontsize) + 0.28
        x += step / fig_w_in


def _title(fig, x_in: float, y_in: float, text: str, fontsize: float = 11.5) -> None:
    """A bold title from (x_in, y_in) inches off the top left corner, moved
    left and then shrunk until it fits the figure's width."""
    w, h = fig.get_figwidth(), fig.get_figheight()
    while True:
        need = _text_width_in(text, fontsize, bold=True)
        if x_in + need <= w - 0.15:
            break
        if x_in > 0.2:
            x_in = max(0.2, w - 0.15 - need)
            continue
        if fontsize <= 7:
            break
        fontsize -= 0.5
    fig.text(x_in / w, 1 - y_in / h, text, fontsize=fontsize, fontweight="bold", ha="left", va="top")


_MEASURE = {}


def _text_width_in(text: str, fontsize: float, bold: bool = False) -> float:
    """Width of ``text`` in inches, as the Agg renderer draws it."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if "renderer" not in _MEASURE:
        scratch = Figure(figsize=(4, 1), dpi=DPI)
        _MEASURE["renderer"] = (scratch, FigureCanvasAgg(scratch).get_renderer())
    scratch, renderer = _MEASURE["renderer"]
    t = scratch.text(0, 0, text, fontsize=fontsize, fontweight="bold" if bold else "normal")
    width = t.get_window_extent(renderer).width / DPI
    t.remove()
    return width


def _wrap_legend(entries, fontsize: float, max_in: float) -> tuple[list, float | None]:
    """Entries in lines no wider than ``max_in`` inches: all in one line if
    they fit, else in aligned columns. Returns the lines and the column
    width (None for one free line)."""
    needs = [0.17 + 0.05 + _text_width_in(text, fontsize) + 0.28 for text, _ in entries]
    if sum(needs) <= max_in:
        return [list(entries)], None
    column = max(needs)
    per_line = max(1, int(max_in // column))
    return [list(entries[i:i + per_line]) for i in range(0, len(entries), per_line)], column


def _blend(ax):
    from matplotlib.transforms import blended_transform_factory

    return blended_transform_factory(ax.transAxes, ax.transData)


def _stage_colors(n: int) -> list:
    from matplotlib import colormaps

    cmap = colormaps["tab10" if n <= 10 else "tab20"]
    return [cmap(i % cmap.N) for i in range(n)]


def _ink(face) -> str:
    """Black or white text, whichever reads better on ``face``."""
    from matplotlib.colors import to_rgb

    r, g, b = to_rgb(face)
    return "black" if 0.299 * r + 0.587 * g + 0.114 * b > 0.55 else "white"


#: From this many stages on, a stage's label is short: "s23 (512: 11776-12287)".
SHORT_STAGE_LABELS = 32


def _stage_name(plan: Plan, i: int) -> str:
    """"stage 1 (8 GPUs: 8-15)": a stage and its GPUs ("s23 (512:
    11776-12287)" from ``SHORT_STAGE_LABELS`` stages on); under it, for a
    stage that is not plain, its shape ("t4×r2 zero rc")."""
    ids = plan.stages[i]["devices"]
    if len(plan.stages) >= SHORT_STAGE_LABELS:
        name = f"s{i} ({len(ids)}: {device_ranges(ids)})"
    else:
        name = f"stage {i} ({_gpus(ids)})"
    shape = shape_label(plan.stage_shapes[i])
    return f"{name}\n{shape}" if shape else name


def _gpus(ids: list[int]) -> str:
    """"8 GPUs: 0-7" / "1 GPU: 3"."""
    return f"{counted(len(ids), 'GPU')}: {device_ranges(ids)}"


def _short(name: str, width: int = 16) -> str:
    return name if len(name) <= width else name[: width - 1] + "\u2026"


def _model(plan: Plan) -> str:
    return plan.data.get("inputs", {}).get("model", "model")

