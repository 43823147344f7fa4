"""``dapple show``: pictures of a plan and of its simulated iteration."""

from __future__ import annotations

import os

import click

import planner
from planner.errors import DappleIOError
from planner.files import output_target, write_all_atomic

from .options import FILE_PATH, profile_for, plan_options, reports_errors


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
@plan_options
@click.option("--schedule", type=click.Choice(planner.SCHEDULE_KINDS), default=None,
              help="Order of forwards and backwards on each stage (for --gantt and --memory). "
                   "Default: the plan's own.")
@click.option("--recompute", is_flag=True, help="Keep only stage inputs; re-run forwards before backwards.")
@_picture_option("gantt", "the simulated timeline of one iteration (like Fig. 4 of the DAPPLE paper)")
@_picture_option("memory", "the memory of each stage over the iteration")
@_picture_option("diagram", "the plan drawn on the cluster's machines and GPUs")
@reports_errors
def show_command(plan_path, profile_path, schedule, recompute, gantt_path, memory_path, diagram_path):
    """Draw a plan: its simulated timeline, memory over time, or placement.

    The picture format follows each file's extension: .png or .svg.

    \b
    dapple show --plan plan.json --gantt gantt.png --memory memory.svg --diagram plan.png
    """
    from planner import pictures

    wanted = [(k, p) for k, p in (("gantt", gantt_path), ("memory", memory_path), ("diagram", diagram_path)) if p]
    if not wanted:
        raise click.UsageError("nothing to draw: give at least one of --gantt, --memory, --diagram")
    seen = {}
    for kind, path in wanted:
        key = os.path.abspath(path)
        if key in seen:
            raise click.UsageError(f"--{seen[key]} and --{kind} both write {path}")
        seen[key] = kind
    # Check every name before any work, so a typo costs nothing and writes nothing.
    for _, path in wanted:
        pictures.picture_format(path)
        output_target(path)

    needs_sim = gantt_path or memory_path
    plan = planner.Plan.load(plan_path)
    if needs_sim or profile_path:
        profile = profile_for(plan, plan_path, profile_path)
    else:
        # The diagram only uses the profile for layer counts: do without it
        # when the one the plan records is not there.
        try:
            profile = profile_for(plan, plan_path, None)
        except (DappleIOError, planner.InvalidInputError):
            profile = None
            click.echo("note: the plan's profile is not available; the diagram omits model layer counts", err=True)

    if gantt_path:
        pictures.check_timeline_size(plan, gantt_path)  # before simulating, and naming the target
    sim = planner.simulate(plan, profile, schedule=schedule, recompute=recompute) if needs_sim else None
    draw = {
        "gantt": (lambda out: pictures.gantt(plan, sim, out), "timeline, {schedule}"),
        "memory": (lambda out: pictures.memory(plan, sim, out), "memory per stage, {schedule}"),
        "diagram": (lambda out: pictures.diagram(plan, out, profile), "plan on the cluster"),
    }
    # All pictures or none: each is drawn to a temporary file beside its
    # target, and they replace their targets only when every one is drawn.
    write_all_atomic([(path, draw[kind][0]) for kind, path in wanted])
    for kind, path in wanted:
        what = draw[kind][1].format(schedule=sim.schedule if sim is not None else "")
        click.echo(f"wrote {path} ({what})", err=True)
