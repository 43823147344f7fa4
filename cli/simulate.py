"""``dapple simulate``: run one iteration of a plan in the simulator."""

from __future__ import annotations

import click

import planner

from .options import json_option, load_plan_and_profile, plan_options, reports_errors
from .render import GIB, console


@click.command("simulate")
@plan_options
@click.option("--schedule", type=click.Choice(planner.SCHEDULE_KINDS), default=None,
              help="Order of forwards and backwards on each stage. Default: the plan's.")
@click.option("--recompute", is_flag=True, help="Keep only stage inputs; re-run forwards before backwards.")
@json_option
@reports_errors
def simulate_command(plan_path, profile_path, schedule, recompute, as_json):
    """Simulate one training iteration of a plan, task by task."""
    plan, profile = load_plan_and_profile(plan_path, profile_path)
    sim = planner.simulate(plan, profile, schedule=schedule, recompute=recompute)
    if as_json:
        click.echo(sim.text, nl=False)
        return
    est = planner.evaluate(plan, profile).estimate
    out = console()
    out.print(
        f"{plan.data['inputs']['model']} {plan.kind} {plan.shape}, {plan.micro_batches} micro-batches of "
        f"{plan.micro_batch_size}, {sim.schedule}{' with re-computation' if recompute else ''}"
    )
    gap = (sim.iteration_ms / est["latency_ms"] - 1.0) * 100.0
    out.print(
        f"simulated iteration {sim.iteration_ms:.1f} ms; formula (2) lower bound {est['latency_ms']:.1f} ms ({gap:+.1f}%)"
    )
    for i, st in enumerate(sim.stages):
        out.print(
            f"stage {i}: busy {st['compute_ms']:.1f} ms, bubbles {st['bubble_fraction'] * 100:.1f}%, "
            f"peak memory {st['peak_memory_bytes'] / GIB:.2f} / {st['memory_limit_bytes'] / GIB:.0f} GiB, "
            f"{st['peak_in_flight']} micro-batches in flight"
        )
