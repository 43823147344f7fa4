"""``dapple calibrate``: a profile corrected by what a run of its plan
measured, or (``--runs``) the runtime's figures fitted to a user's measured runs."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys

import click
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from dapple import planner
from dapple.planner import measured_runs as runs_api
from dapple.planner.calibrate import EXACT_MEMORY_SOURCE, load_metrics
from dapple.planner.files import check_writable, path_text, write_atomic

from .options import FILE_PATH, plan_options, profile_for, reports_errors
from .render import calibration_table


@click.command("calibrate")
@plan_options(required=False)
@click.option("--metrics", "metrics_path", type=FILE_PATH,
              help="What `dapple run --metrics` wrote for a run of the plan (dapple.run-metrics).")
@click.option("--runs", "runs_path", type=FILE_PATH,
              help="Measured runs, a CSV with vTrain's columns (docs/fidelity.md, \"Measured runs\"): fit the "
                   "runtime's figures to them instead of correcting a plan's profile.")
@click.option("--gpu", default=runs_api.RunCosting.gpu, show_default=True, help="--runs: the runs' GPU type.")
@click.option("--attention", default=runs_api.RunCosting.attention, show_default=True,
              help="--runs: the runs' attention kernel (flash or unfused).")
@click.option("--recompute", default=runs_api.RunCosting.recompute, show_default=True,
              help="--runs: the runs' re-computation (none, full, per-layer, selective).")
@click.option("--gradients", default=runs_api.RunCosting.gradients, show_default=True,
              help="--runs: the precision the runtime reduces gradients in (bf16 or fp32).")
@click.option("--folds", default=5, show_default=True, type=int,
              help="--runs: folds of the cross-validation that measures the fit on runs it did not see.")
@click.option("--out", "out_path", required=True, type=FILE_PATH,
              help="Calibrated profile JSON to write; with --runs, the fitted figures (JSON).")
@click.option("--quiet", is_flag=True, help="No progress bar on stderr.")
@reports_errors
def calibrate_command(plan_path, profile_path, metrics_path, runs_path, gpu, attention, recompute, gradients, folds,
                      out_path, quiet):
    """Correct the plan's profile by a run's measured per-stage compute time
    and peak memory, so that the next `dapple plan` uses what was measured.

    Each stage's measured compute (median over the steps, slowest rank)
    over the cost model's scales its layers' forward and backward times;
    a CUDA allocator peak (memory source cuda-allocated) scales their
    stored activations. Process RSS peaks leave memory alone.

    With --runs, fit what the runtime's host takes to issue a kernel to
    measured runs (the least mean error), report the fit's error on runs it
    did not see (k-fold), and write the fitted figures; `dapple profile
    transformer --host-us-per-kernel` takes them."""
    if runs_path is not None:
        if plan_path is not None or metrics_path is not None:
            raise click.UsageError("--runs fits measured runs; give it without --plan and --metrics")
        costing = runs_api.RunCosting(gpu=gpu, attention=attention, recompute=recompute, gradients=gradients)
        fit_runs(runs_path, costing, folds, out_path, quiet)
        return
    if plan_path is None or metrics_path is None:
        raise click.UsageError("give --plan and --metrics (a run of the plan), or --runs (measured runs)")
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



@contextlib.contextmanager
def progress_bar(total: int, quiet: bool):
    """A step function that advances a bar of ``total`` steps on stderr
    (a terminal only, and not ``quiet``); a no-op elsewhere."""
    if quiet or not sys.stderr.isatty():
        yield lambda: None
        return
    progress = Progress(TextColumn("fitting"), BarColumn(), TextColumn("{task.completed}/{task.total} costings"),
                        TimeElapsedColumn(), console=Console(stderr=True), transient=True)
    task = progress.add_task("fit", total=total)
    with progress:
        yield lambda: progress.advance(task)


def fit_runs(runs_path, costing, folds: int, out_path, quiet: bool) -> None:
    """``dapple calibrate --runs``: the figures fitted to every run, the
    cross-validated error, the table on stdout, the figures written whole."""
    check_writable(out_path)
    runs = runs_api.read_runs(runs_path)
    runs_api.check_enough(runs, path_text(runs_path))
    with progress_bar((folds + 1) * (runs_api.FIT_STEPS + 2), quiet) as step:
        before = runs_api.score(runs, runs_api.cost_runs(runs, costing, {}))
        validated = runs_api.cross_validate(runs, costing, folds, step=step)
        result = runs_api.fit(runs, costing, step)
    if not result.converged:
        raise planner.InfeasibleError(f"{path_text(runs_path)}: the fit did not converge; nothing written")
    defaults = {"host_us_per_kernel": planner.HOST_US_PER_KERNEL}
    out = {
        "fitted_from": path_text(runs_path),
        "costing": dataclasses.asdict(costing),
        "figures": result.figures,
        "defaults": defaults,
        "in_sample_mape_percent": result.mape_percent,
        "uncalibrated": before,
        "cross_validation": {k: v for k, v in validated.items() if k != "predicted_ms"},
    }
    write_atomic(out_path, json.dumps(out, indent=1) + "\n")
    held = validated["held_out"]
    click.echo(f"{'figure':<22} {'default':>10} {'fitted':>10} {'change':>8}")
    for name, value in result.figures.items():
        click.echo(f"{name:<22} {defaults[name]:>10.3f} {value:>10.3f} {value / defaults[name]:>7.2f}x")
    click.echo(f"{'':<22} {'MAPE %':>10} {'Spearman':>10} {'regret':>8}")
    for label, s in (("uncalibrated", before), (f"calibrated, {folds}-fold", held)):
        spearman = "-" if s["median_spearman"] is None else f"{s['median_spearman']:.3f}"
        regret = "-" if s["worst_regret"] is None else f"{s['worst_regret']:.3f}"
        click.echo(f"{label:<22} {s['mape_percent']:>10.1f} {spearman:>10} {regret:>8}")
    click.echo(f"fitted figures written to {path_text(out_path)}", err=True)
