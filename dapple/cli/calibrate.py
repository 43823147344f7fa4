"""``dapple calibrate``: a profile corrected by what a run of its plan measured."""

from __future__ import annotations

import click

from dapple import planner
from dapple.planner.calibrate import EXACT_MEMORY_SOURCE, load_metrics
from dapple.planner.files import check_writable, path_text

from .options import FILE_PATH, plan_options, profile_for, reports_errors
from .render import calibration_table


@click.command("calibrate")
@plan_options
@click.option("--metrics", "metrics_path", required=True, type=FILE_PATH,
              help="What `dapple run --metrics` wrote for a run of the plan (dapple.run-metrics).")
@click.option("--out", "out_path", required=True, type=FILE_PATH, help="Calibrated profile JSON to write.")
@reports_errors
def calibrate_command(plan_path, profile_path, metrics_path, out_path):
    """Correct the plan's profile by a run's measured per-stage compute time
    and peak memory, so that the next `dapple plan` uses what was measured.

    Each stage's measured compute (median over the steps, slowest rank)
    over the cost model's scales its layers' forward and backward times;
    a CUDA allocator peak (memory source cuda-allocated) scales their
    stored activations. Process RSS peaks leave memory alone."""
    check_writable(out_path)
    plan = planner.Plan.load(plan_path)
    metrics = load_metrics(metrics_path)
    profile = profile_for(plan, plan_path, profile_path)
    result = planner.calibrate(plan, metrics, profile)
    result.profile.save(out_path)
    calibration_table(result)
    for note in result.memory_notes:
        click.echo(f"memory left alone where {note} (only {EXACT_MEMORY_SOURCE} peaks calibrate stored activations)",
                   err=True)
    click.echo(f"calibrated profile written to {path_text(out_path)}", err=True)

