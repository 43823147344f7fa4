"""``dapple simulate``: run one iteration of a plan in the simulator."""

from __future__ import annotations

import json

import click

from dapple import planner
from dapple.planner.plan import SHAPE_KEY, shape_label

from .options import json_option, load_plan_and_profile, max_passes_option, plan_options, reports_errors
from .render import GIB, console


@click.command("simulate")
@plan_options
@click.option("--schedule", type=click.Choice(planner.SCHEDULE_KINDS), default=None,
              help="Order of forwards and backwards on each stage. Default: the plan's.")
@click.option("--recompute", is_flag=True,
              help="Every stage keeps only its input and re-runs its forward before its backward (without it, only the stages whose plan says so).")
@click.option("--actions", "show_actions", is_flag=True,
              help="Print each stage's action list instead, with the weights every pass uses "
                   "(F4@0+2: version 0, predicted 2 updates ahead).")
@click.option("--chunks", type=click.IntRange(min=1), default=None,
              help="Run the plan's ranks (its stages) with this many chunks each, in --order: the layers cut "
                   "again by the ranks' speeds (docs/schedules.md). What interleaving would give; the search "
                   "does not plan chunks yet.")
@click.option("--order", type=click.Choice(planner.CHUNKED_ORDERS), default=None,
              help="torch's order for --chunks (zb-v: two chunks a rank). Default: interleaved-1f1b.")
@json_option
@max_passes_option
@reports_errors
def simulate_command(plan_path, profile_path, schedule, recompute, show_actions, chunks, order, as_json):
    """Simulate one training iteration of a plan, task by task.

    An asynchronous schedule (xpipe, pipedream, spectrain, async) runs
    mini-batches back to back without a flush; its iteration is the
    steady-state time of one mini-batch."""
    if chunks is not None and (schedule or recompute or show_actions):
        raise click.UsageError("--chunks runs the order of --order: it takes no --schedule, --recompute or --actions")
    if order is not None and chunks is None:
        raise click.UsageError("--order applies to --chunks")
    plan, profile = load_plan_and_profile(plan_path, profile_path)
    if chunks is not None:
        print_interleaved(plan, profile, (order or "interleaved-1f1b", chunks), as_json)
        return
    if show_actions:
        # The lists the simulation would run (an asynchronous kind over its
        # steady-state run): nothing to simulate.
        click.echo(plan.core.weights_table(schedule))
        return
    sim = planner.simulate(plan, profile, schedule=schedule, recompute=recompute)
    if as_json:
        click.echo(sim.text, nl=False)
        return
    out = console()
    out.print(
        f"{plan.data['inputs']['model']} {plan.kind} {plan.shape}, {plan.micro_batches} micro-batches of "
        f"{plan.micro_batch_size}, {sim.schedule}{' with re-computation' if sim.recompute else ''}"
    )
    samples_per_s = plan.micro_batch_size * plan.micro_batches / sim.iteration_ms * 1e3
    if sim.mini_batches > 1:
        out.print(
            f"steady state: {sim.iteration_ms:.1f} ms per mini-batch ({samples_per_s:.1f} samples/s), "
            f"over {sim.mini_batches} mini-batches without a flush ({sim.span_ms:.1f} ms)"
        )
    else:
        est = planner.evaluate(plan, profile).estimate
        gap = (sim.iteration_ms / est["latency_ms"] - 1.0) * 100.0
        out.print(
            f"simulated iteration {sim.iteration_ms:.1f} ms ({samples_per_s:.1f} samples/s); "
            f"formula (2) lower bound {est['latency_ms']:.1f} ms ({gap:+.1f}%)"
        )
    shapes = [shape_label(s) for s in plan.stage_shapes]
    for i, st in enumerate(sim.stages):
        copies = f", {st['peak_weight_copies']} weight copies" if sim.mini_batches > 1 else ""
        shape = f" ({shapes[i]})" if shapes[i] else ""
        out.print(
            f"stage {i}{shape}: busy {st['compute_ms']:.1f} ms, bubbles {st['bubble_fraction'] * 100:.1f}%, "
            f"peak memory {st['peak_memory_bytes'] / GIB:.2f} / {st['memory_limit_bytes'] / GIB:.0f} GiB, "
            f"{st['peak_in_flight']} micro-batches in flight{copies}"
        )
    if any(shapes):
        out.print(f"shape {SHAPE_KEY}")


def print_interleaved(plan, profile, order_and_chunks: tuple[str, int], as_json: bool) -> None:
    """The plan's ranks running ``order`` with ``chunks`` chunks each,
    beside the plan's own simulated iteration."""
    order, chunks = order_and_chunks
    run = planner.simulate_interleaved(plan, profile, chunks, order=order)
    if as_json:
        click.echo(json.dumps(run))
        return
    out = console()
    own = planner.simulate(plan, profile).iteration_ms
    out.print(
        f"{plan.data['inputs']['model']} {plan.shape} as {order}, {chunks} chunks a rank, "
        f"{plan.micro_batches} micro-batches of {plan.micro_batch_size}: {run['iteration_ms']:.1f} ms "
        f"({own / run['iteration_ms']:.3f}x the plan's own {own:.1f} ms)"
    )
    for r, st in enumerate(run["ranks"]):
        mine = [layers for layers, rank in zip(run["chunk_layers"], run["chunk_ranks"]) if rank == r]
        layers = ", ".join(f"{a}-{b - 1}" for a, b in mine)
        out.print(
            f"rank {r} (layers {layers}): busy {st['compute_ms']:.1f} ms, bubbles {st['bubble_fraction'] * 100:.1f}%, "
            f"peak memory {st['peak_memory_bytes'] / GIB:.2f} / {st['memory_limit_bytes'] / GIB:.0f} GiB, "
            f"{st['peak_in_flight']} micro-batches in flight"
        )
