"""``dapple estimate``: cost any plan with the planner's model."""

from __future__ import annotations

import os

import click

import planner
from planner.errors import InvalidInputError

from .options import json_option, reports_errors
from .render import plan_table


@click.command("estimate")
@click.option("--plan", "plan_path", required=True, type=click.Path(dir_okay=False), help="Plan JSON (dapple.plan).")
@click.option("--profile", "profile_path", type=click.Path(dir_okay=False), default=None,
              help="Profile to cost with. Default: the path recorded in the plan.")
@json_option
@reports_errors
def estimate_command(plan_path, profile_path, as_json):
    """Estimate a plan, also one written by hand or by another planner."""
    plan = planner.Plan.load(plan_path)
    recorded = plan.data["inputs"].get("profile_path")
    path = profile_path or recorded
    if path is None:
        raise InvalidInputError(f"{plan_path}: field inputs.profile_path: missing; pass --profile")
    if profile_path is None and not os.path.isabs(path) and not os.path.exists(path):
        # A relative path in the plan is relative to where planning ran;
        # fall back to the plan file's folder.
        beside = os.path.join(os.path.dirname(plan_path), path)
        path = beside if os.path.exists(beside) else path
    profile = planner.Profile.load(path)
    result = planner.evaluate(plan, profile)
    if as_json:
        click.echo(result.text, nl=False)
    else:
        plan_table(result, profile)
