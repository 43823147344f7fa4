"""``dapple estimate``: cost any plan with the planner's model."""

from __future__ import annotations

import click

from dapple import planner

from .options import json_option, load_plan_and_profile, max_passes_option, plan_options, reports_errors
from .render import plan_table


@click.command("estimate")
@plan_options
@json_option
@max_passes_option
@reports_errors
def estimate_command(plan_path, profile_path, as_json):
    """Estimate a plan, also one written by hand or by another planner."""
    plan, profile = load_plan_and_profile(plan_path, profile_path)
    result = planner.evaluate(plan, profile)
    if as_json:
        click.echo(result.text, nl=False)
    else:
        plan_table(result, profile)
