"""``dapple compare``: DAPPLE's plan against data parallelism, GPipe, straight
pipelines and PipeDream's planner, all simulated."""

from __future__ import annotations

import json

import click
from rich.table import Table

from dapple import planner
from dapple.planner.plan import SHAPE_KEY, stage_shapes_text

from .options import (count_option_type, global_batch_size_or_default, json_option, max_passes_option, profile_option,
                      reports_errors, topology_option, warmup_policy_option)
from .progress import quiet_option, working
from .render import GIB, console


@click.command("compare")
@profile_option
@topology_option
@click.option("--global-batch-size", type=count_option_type(), default=None,
              help="Samples per iteration. Default: the profile's largest measured batch size x the GPUs, as "
                   "dapple plan takes it.")
@click.option("--min-micro-batch-size", type=count_option_type(), default=None,
              help="Smallest per-GPU slice of a micro-batch. Default: the profile's smallest measured batch size.")
@warmup_policy_option
@json_option
@max_passes_option
@quiet_option
@reports_errors
def compare_command(profile_path, topology, global_batch_size, min_micro_batch_size, warmup_policy, as_json, quiet):
    """Compare strategies by simulated iteration time."""
    profile = planner.Profile.load(profile_path)
    topo = planner.Topology.resolve(topology)
    global_batch_size, batch_note = global_batch_size_or_default(global_batch_size, profile, topo)
    with working(f"comparing strategies for {profile.model} on {topo.name}", quiet):
        rows = planner.compare(
            profile,
            topo,
            global_batch_size,
            min_micro_batch_size=min_micro_batch_size,
            warmup_policy=warmup_policy,
        )
    if batch_note:
        click.echo(batch_note, err=True)
    if as_json:
        click.echo(json.dumps([r.as_dict() for r in rows], indent=1))
        return
    t = Table(show_edge=False, pad_edge=False)
    columns = ["strategy", "plan", "micro-batches", "schedule", "simulated ms", "bound ms", "speedup", "peak GiB", "fits"]
    for col in columns:
        # Piped, every cell on one line (`console(fit=)`); on a narrow
        # terminal, cells wrap rather than cut their text (issue 67: "early-ba…").
        t.add_column(col, justify="left" if col in ("strategy", "plan", "schedule", "fits") else "right",
                     overflow="fold")
    for r in rows:
        if r.error:
            t.add_row(r.strategy, *["-"] * (len(columns) - 1))
            continue
        t.add_row(
            r.strategy,
            r.shape,
            f"{r.micro_batches} x {r.micro_batch_size}",
            r.schedule,
            f"{r.simulated_ms:.1f}",
            "-" if r.estimated_ms is None else f"{r.estimated_ms:.1f}",
            f"{r.speedup:.2f}x",
            f"{r.peak_memory_bytes / GIB:.2f}",
            "yes" if r.fits_memory else "no",
        )
    console(fit=t).print(t)
    if any(r.recompute for r in rows):
        console().print("rc: every stage re-runs its forward in its backward, keeping only its input")
    # Stage shapes under the table, not in a column the fixed width would
    # squeeze; only where a row has a stage that is not plain, so that a
    # comparison of plain plans prints as it did.
    if any(any(r.stage_shapes or []) for r in rows):
        out = console()
        out.print("stage shapes (" + SHAPE_KEY + "):")
        width = max(len(r.strategy) for r in rows)
        for r in rows:
            if r.stage_shapes is not None:
                out.print(f"  {r.strategy:<{width}}  {stage_shapes_text(r.stage_shapes)}")
    for r in rows:
        if r.error:
            click.echo(f"{r.strategy}: {r.error}", err=True)
