"""``dapple export``: a plan in the form another runtime takes."""

from __future__ import annotations

import click

from dapple import planner
from dapple.planner.files import check_writable, path_text, write_atomic

from .options import FILE_PATH, reports_errors

#: The forms a plan can be written in.
TARGETS = ("torch-csv",)


@click.command("export")
@click.option("--plan", "plan_path", required=True, type=FILE_PATH, help="Plan JSON (dapple.plan).")
@click.option("--to", "target", required=True, type=click.Choice(TARGETS),
              help="torch-csv: the plan's schedule as torch.distributed.pipelining's schedule CSV.")
@click.option("--out", "out_path", required=True, type=FILE_PATH, help="File to write.")
@reports_errors
def export_command(plan_path, target, out_path):
    """Write a plan in the form another runtime takes.

    torch-csv: one row per pipeline rank (stage i on rank i), each the
    rank's forwards and backwards in order, written as torch's actions
    (0F0, 0B0), with the plan's own warm-up depths. torch's runtime loads it
    with `_PipelineScheduleRuntime._load_csv`; it also needs each rank's
    stage module (a `PipelineStage` over the stage's layers) and the
    micro-batch count, and it reduces gradients and steps the optimizer
    after each step. Refused (exit 4) where torch cannot run the plan as it
    is: stages replicated or split unevenly, uneven slices on mixed GPUs,
    an asynchronous schedule."""
    check_writable(out_path)
    plan = planner.Plan.load(plan_path)
    order = plan.pipeline_order()
    write_atomic(out_path, order.to_csv())
    layers = ", ".join(f"{s['layer_start']}..{s['layer_end']}" for s in plan.stages)
    click.echo(f"{path_text(out_path)}: {len(order.rank_actions)} pipeline ranks, {order.micro_batches} micro-batches of "
               f"{plan.micro_batch_size}; stage layers {layers}; each replica group runs the same rows", err=True)
