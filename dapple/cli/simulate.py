"""``dapple simulate``: run one iteration of a plan in the simulator."""

from __future__ import annotations

import json

import click

from dapple import planner
from dapple.planner.files import check_writable, path_text, write_all_atomic
from dapple.planner.plan import SHAPE_KEY, shape_label
from dapple.planner.trace import write_trace

from .options import (
    FILE_PATH,
    check_chunks_go_with,
    chunked_kinds,
    json_option,
    load_plan_and_profile,
    max_passes_option,
    plan_options,
    reports_errors,
)
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
              help=f"With a chunked --schedule ({chunked_kinds()}) on a plan of one "
                   "stage a rank: this many chunks a rank, the layers cut again by the ranks' speeds "
                   "(docs/schedules.md). Default: the fastest count up to 8 (a V-shaped kind, zb-v or dualpipev: 2).")
@click.option("--trace", "trace_path", type=FILE_PATH, default=None, metavar="OUT",
              help="Also write the iteration to OUT as a Chrome trace (JSON) that Perfetto and chrome://tracing "
                   "open (docs/pictures.md).")
@json_option
@max_passes_option
@reports_errors
def simulate_command(plan_path, profile_path, schedule, recompute, show_actions, chunks, trace_path, as_json):
    """Simulate one training iteration of a plan, task by task.

    An asynchronous schedule (xpipe, pipedream, spectrain, async) runs
    mini-batches back to back without a flush; its iteration is the
    steady-state time of one mini-batch. A chunked schedule runs the plan's
    ranks with several chunks each."""
    check_chunks_go_with(chunks, schedule)
    rechunk = schedule in planner.CHUNKED_SCHEDULES
    if rechunk and (recompute or show_actions):
        raise click.UsageError(f"--schedule {schedule} runs the plan's ranks in chunks: it takes no --recompute "
                               "or --actions")
    if trace_path and show_actions:
        raise click.UsageError("--actions prints the lists without simulating: it takes no --trace")
    if trace_path:
        check_writable(trace_path)  # before simulating, not after
    plan, profile = load_plan_and_profile(plan_path, profile_path)
    if show_actions:
        # The lists the simulation would run (an asynchronous kind over its
        # steady-state run): nothing to simulate.
        click.echo(plan.core.weights_table(schedule))
        return
    own_ms = None
    if rechunk:
        own_ms = None if as_json else planner.simulate(plan, profile).iteration_ms
        plan = planner.chunked(plan, profile, schedule, chunks)
        schedule = None
    sim = planner.simulate(plan, profile, schedule=schedule, recompute=recompute)
    if trace_path:
        write_all_atomic([(trace_path, lambda tmp: write_trace(plan, sim, tmp))])
        click.echo(f"wrote {path_text(trace_path)} (Chrome trace, {sim.schedule})", err=True)
    if as_json:
        click.echo(sim.text, nl=False)
        return
    if sim.stage_ranks:
        print_chunked(plan, sim, own_ms)
        return
    out = console()
    out.print(
        f"{plan.data['inputs']['model']} {plan.layout}, {plan.micro_batching}, {sim.schedule}{' with re-computation' if sim.recompute else ''}"
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


def print_chunked(plan, sim, own_ms: float | None) -> None:
    """A plan whose ranks run in chunks: its iteration (beside ``own_ms``,
    the plan's own, where it was cut into chunks here), and each rank's
    layers and timeline."""
    out = console()
    than = f" ({own_ms / sim.iteration_ms:.3f}x the plan's own {own_ms:.1f} ms)" if own_ms is not None else ""
    out.print(
        f"{plan.data['inputs']['model']} as {sim.schedule}, {plan.core.chunks} chunks a rank, "
        f"{plan.micro_batching}: {sim.iteration_ms:.1f} ms{than}"
    )
    for r, st in enumerate(sim.stages):
        mine = [s for s, rank in zip(plan.stages, sim.stage_ranks) if rank == r]
        layers = ", ".join(f"{s['layer_start']}-{s['layer_end'] - 1}" for s in mine)
        out.print(
            f"rank {r} (layers {layers}): busy {st['compute_ms']:.1f} ms, bubbles {st['bubble_fraction'] * 100:.1f}%, "
            f"peak memory {st['peak_memory_bytes'] / GIB:.2f} / {st['memory_limit_bytes'] / GIB:.0f} GiB, "
            f"{st['peak_in_flight']} micro-batches in flight"
        )
