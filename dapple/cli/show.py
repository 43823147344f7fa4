"""``dapple show``: pictures of a plan and of its simulated iteration, and
learning curves of runs."""

from __future__ import annotations

import os

import click

from dapple import planner
from dapple.planner.errors import DappleIOError
from dapple.planner.files import output_target, path_text, read_text, write_all_atomic

from dapple.planner.limits import MAX_TASKS_DRAWN, MAX_TASKS_DRAWN_CEILING
from dapple.planner.trace import write_trace

from .options import FILE_PATH, covering_profile, max_passes_option, plan_options, profile_for, reports_errors


def _picture_option(name: str, what: str):
    return click.option(
        f"--{name}",
        f"{name}_path",
        type=FILE_PATH,
        default=None,
        metavar="OUT",
        help=f"Write {what} to OUT (.png or .svg).",
    )


@click.command("show")
@plan_options(required=False)
@click.option("--schedule", type=click.Choice(planner.SCHEDULE_KINDS), default=None,
              help="Order of forwards and backwards on each stage (for --gantt and --memory). "
                   "Default: the plan's own.")
@click.option("--recompute", is_flag=True, help="Keep only stage inputs; re-run forwards before backwards.")
@_picture_option("gantt", "the simulated timeline of one iteration (like Fig. 4 of the DAPPLE paper)")
@_picture_option("memory", "the memory of each stage over the iteration")
@_picture_option("diagram", "the plan drawn on the cluster's machines and GPUs")
@click.option("--trace", "trace_path", type=FILE_PATH, default=None, metavar="OUT",
              help="Write the simulated iteration to OUT as a Chrome trace (JSON) that Perfetto and "
                   "chrome://tracing open (docs/pictures.md).")
@click.option("--metrics", "metrics_paths", type=FILE_PATH, multiple=True,
              help="Run metrics (dapple run --metrics with --eval-every) for --curves; repeat for several runs.")
@_picture_option("curves", "the validation loss and accuracy of the --metrics runs (one curve per schedule "
                           "and optimizer: the mean, and the band from lowest to highest over its runs)")
@click.option("--steps-per-epoch", type=click.FloatRange(min=1e-6), default=None,
              help="Draw --curves against epochs of this many steps instead of steps (at least 1e-6: fewer "
                   "overflow the epoch axis).")
@click.option("--max-tasks-drawn", type=click.IntRange(min=1, max=MAX_TASKS_DRAWN_CEILING), default=MAX_TASKS_DRAWN,
              show_default=True, help="Most tasks --gantt draws; a larger timeline is refused with exit 9.")
@max_passes_option
@reports_errors
def show_command(plan_path, profile_path, schedule, recompute, gantt_path, memory_path, diagram_path,
                 trace_path, metrics_paths, curves_path, steps_per_epoch, max_tasks_drawn):
    """Draw a plan: its simulated timeline, memory over time, or placement;
    or the learning curves of runs.

    The picture format follows each file's extension: .png or .svg.

    \b
    dapple show --plan plan.json --gantt gantt.png --memory memory.svg --diagram plan.png
    dapple show --plan plan.json --trace trace.json   # open in ui.perfetto.dev
    dapple show --metrics xpipe.json --metrics sync.json --curves curves.png
    """
    from dapple.planner import pictures

    wanted = [(k, p) for k, p in (("gantt", gantt_path), ("memory", memory_path), ("diagram", diagram_path),
                                  ("trace", trace_path), ("curves", curves_path)) if p]
    if not wanted:
        raise click.UsageError("nothing to draw: give at least one of --gantt, --memory, --diagram, --trace, --curves")
    if curves_path and not metrics_paths:
        raise click.UsageError("--curves draws the runs of --metrics: give at least one")
    if any(k != "curves" for k, _ in wanted) and not plan_path:
        raise click.UsageError("--gantt, --memory, --diagram and --trace draw a plan: give --plan")
    seen = {}
    for kind, path in wanted:
        key = os.path.abspath(path)
        if key in seen:
            raise click.UsageError(f"--{seen[key]} and --{kind} both write {path_text(path)}")
        seen[key] = kind
    # Check every name before any work, so a typo costs nothing and writes nothing.
    for kind, path in wanted:
        if kind != "trace":
            pictures.picture_format(path)
        output_target(path)

    runs = [planner.RunMetrics.from_json(read_text(p), path_text(p)).to_dict() for p in metrics_paths] if curves_path else []
    needs_sim = gantt_path or memory_path or trace_path
    plan = planner.Plan.load(plan_path) if plan_path else None
    # Said after the pictures are written: a failure is one line, alone.
    notes = []
    if plan is None:
        profile = None
    elif needs_sim or profile_path:
        profile = covering_profile(plan, plan_path, profile_for(plan, plan_path, profile_path))
    else:
        # The diagram only uses the profile for layer counts: do without it
        # when the one the plan records is not there.
        try:
            profile = profile_for(plan, plan_path, None)
        except (DappleIOError, planner.InvalidInputError):
            profile = None
            notes.append("note: the plan's profile is not available; the diagram omits model layer counts")

    if gantt_path:
        pictures.check_timeline_size(plan, gantt_path, max_tasks_drawn)  # before simulating, and naming the target
    sim = planner.simulate(plan, profile, schedule=schedule, recompute=recompute) if needs_sim else None
    draw = {
        "gantt": (lambda out: pictures.gantt(plan, sim, out, max_tasks_drawn), "timeline, {schedule}"),
        "memory": (lambda out: pictures.memory(plan, sim, out), "memory per stage, {schedule}"),
        "diagram": (lambda out: pictures.diagram(plan, out, profile), "plan on the cluster"),
        "trace": (lambda out: write_trace(plan, sim, out), "Chrome trace, {schedule}"),
        "curves": (lambda out: pictures.curves(runs, out, steps_per_epoch), "learning curves"),
    }
    # All pictures or none: each is drawn to a temporary file beside its
    # target, and they replace their targets only when every one is drawn.
    write_all_atomic([(path, draw[kind][0]) for kind, path in wanted])
    for kind, path in wanted:
        what = draw[kind][1].format(schedule=sim.schedule if sim is not None else "")
        click.echo(f"wrote {path_text(path)} ({what})", err=True)
    for note in notes:
        click.echo(note, err=True)
