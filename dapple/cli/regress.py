"""``dapple regress``: guard plan quality in CI."""

from __future__ import annotations

import sys

import click

from dapple.planner.regress import load_suite, run_suite, update_suite

from .exit_codes import REGRESSION
from .options import FILE_PATH, max_passes_option, reports_errors


@click.command("regress")
@click.argument("suite", type=FILE_PATH)
@click.option("--update", is_flag=True, help="Rewrite the suite's expected times and shapes with today's plans.")
@max_passes_option
@reports_errors
def regress_command(suite, update):
    """Plan every case of SUITE; fail when a plan got slower or infeasible."""
    data = load_suite(suite)
    outcomes = run_suite(suite, data)
    width = max(len(o.name) for o in outcomes)
    for o in outcomes:
        exp = f"{o.expected_ms:.1f} ms" if o.expected_ms is not None else "-"
        act = f"{o.actual_ms:.1f} ms" if o.actual_ms is not None else "no plan"
        change = ""
        if o.expected_ms and o.actual_ms is not None:
            change = f" ({(o.actual_ms / o.expected_ms - 1) * 100:+.1f}%)"
        shape = ""
        if o.expected_shape and o.actual_shape and o.expected_shape != o.actual_shape:
            shape = f"  plan {o.expected_shape} -> {o.actual_shape}"
        mark = {"ok": "ok", "faster": "FASTER", "slower": "SLOWER", "infeasible": "INFEASIBLE", "new": "new"}[o.status]
        click.echo(f"{mark:10s} {o.name:{width}s}  expected {exp:>12s}  got {act:>12s}{change}{shape}")
        if o.detail:
            click.echo(f"{'':10s} {o.detail}")
    failed = [o for o in outcomes if o.failed]
    if update:
        update_suite(suite, outcomes, data)
        click.echo(f"{suite}: expectations updated for {len(outcomes)} cases", err=True)
        return
    click.echo(f"{len(outcomes) - len(failed)} passed, {len(failed)} failed", err=True)
    if failed:
        sys.exit(REGRESSION)
