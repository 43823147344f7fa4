"""``dapple export``: a plan in the form another runtime takes."""

from __future__ import annotations

from pathlib import Path

import click

from dapple import planner
from dapple.planner.export.deepspeed import deepspeed_partition
from dapple.planner.export.megatron import megatron_arguments
from dapple.planner.export.module_map import MODULE_MAPS
from dapple.planner.export.torchtitan import torchtitan_config
from dapple.planner.files import check_writable, path_text, write_all_atomic, write_atomic
from dapple.planner.plan import counted

from .options import FILE_PATH, profile_for, reports_errors

#: The forms a plan can be written in.
TARGETS = ("torch-csv", "torchtitan", "megatron", "deepspeed")
#: The module map of --to torchtitan unless --module-map names another.
DEFAULT_MODULE_MAP = "torchtitan-llama"


def schedule_csv_path(out_path: str) -> str:
    """Where the torchtitan target writes its schedule CSV: beside the
    TOML, ``job.toml`` -> ``job.schedule.csv``."""
    path = Path(out_path)
    stem = path.name[: -len(".toml")] if path.name.endswith(".toml") else path.name
    return str(path.with_name(f"{stem}.schedule.csv"))


@click.command("export")
@click.option("--plan", "plan_path", required=True, type=FILE_PATH, help="Plan JSON (dapple.plan).")
@click.option("--to", "target", required=True, type=click.Choice(TARGETS),
              help="torch-csv: the plan's schedule as torch.distributed.pipelining's schedule CSV; torchtitan: "
                   "job config TOML (and the schedule CSV beside it); megatron: Megatron-LM's arguments as a bash "
                   "array; deepspeed: PipelineModule's parts and config keys as JSON (docs/export.md).")
@click.option("--out", "out_path", type=FILE_PATH, default=None,
              help="File to write. Default: stdout (torchtitan, which writes a TOML and a schedule CSV: required).")
@click.option("--profile", "profile_path", type=FILE_PATH, default=None,
              help="Profile whose layers the plan's stages hold (torchtitan, megatron; deepspeed: a mixture's "
                   "experts, needed where the plan spreads them). Default: the path recorded in the plan.")
@click.option("--module-map", default=None, metavar="NAME|FILE",
              help=f"torchtitan: the model's modules of each profile layer: {', '.join(MODULE_MAPS)} "
                   f"(default {DEFAULT_MODULE_MAP}), or a JSON map file (docs/export.md).")
@click.option("--approximate", is_flag=True,
              help="Where the target cannot express the plan (uneven replicas or splits, per-stage ZeRO-1 or "
                   "re-computation, uneven slices, another schedule), round to what it can (the most common "
                   "value among the stages) and say on stderr what changed, instead of refusing.")
@reports_errors
def export_command(plan_path, target, out_path, profile_path, module_map, approximate):
    """Write a plan in the form another runtime takes (docs/export.md).

    torch-csv: one row per pipeline rank (stage i on rank i, or where a
    chunked kind's order puts it), each the rank's forwards and backwards
    in order, written as torch's actions (0F0, 0B0), with the plan's own
    warm-up depths. torch's runtime loads it
    with `_PipelineScheduleRuntime._load_csv`; it also needs each rank's
    stage module (a `PipelineStage` over the stage's layers) and the
    micro-batch count, and it reduces gradients and steps the optimizer
    after each step.

    torchtitan, megatron, deepspeed: each stage's layers, the pipeline,
    tensor and data-parallel degrees, micro-batch and global batch,
    ZeRO-1 and re-computation, in the target's own terms.

    What a target cannot express (stages replicated or split unevenly,
    uneven slices on mixed GPUs, an asynchronous schedule, and per target
    more) is refused in one line naming it (exit 4), unless --approximate."""
    for given, name, applies in ((module_map, "--module-map", ("torchtitan",)),
                                 (profile_path, "--profile", ("torchtitan", "megatron", "deepspeed")),
                                 (approximate or None, "--approximate", ("torchtitan", "megatron", "deepspeed"))):
        if given is not None and target not in applies:
            raise click.UsageError(f"{name} applies to --to {' and '.join(applies)}, not {target}")
    if out_path is None and target == "torchtitan":
        raise click.UsageError("--to torchtitan writes a TOML and its schedule CSV beside it: give --out job.toml")
    if out_path is not None:
        check_writable(out_path)
    plan = planner.Plan.load(plan_path)
    if target == "torch-csv":
        _torch_csv(plan, out_path)
        return
    files, result = _exported(plan, plan_path, target, out_path, profile_path, module_map, approximate)
    if out_path is None:
        (_, text), = files
        click.echo(text, nl=False)
    else:
        write_all_atomic([(path, lambda tmp, text=text: Path(tmp).write_text(text, encoding="utf-8"))
                          for path, text in files])
    for change in result.changes:
        click.echo(f"approximated: {change}", err=True)
    shape = result.shape
    written = " and ".join(path_text(path) for path, _ in files) if out_path is not None else "stdout"
    click.echo(f"{written}: {target}, {shape.describe()}, {shape.micro_batching()}", err=True)


def _exported(plan, plan_path, target, out_path, profile_path, module_map, approximate):
    """The files to write, as (path, text), and the target's result (its
    ``shape`` and ``changes``)."""
    if target == "deepspeed":
        # The profile names a mixture's experts: asked for where the plan
        # spreads them, else read where given.
        spreads = any(stage.get("expert_parallel", 1) > 1 for stage in plan.stages)
        profile = profile_for(plan, plan_path, profile_path) if spreads or profile_path else None
        result = deepspeed_partition(plan, profile, approximate=approximate)
        return [(out_path, result.text)], result
    profile = profile_for(plan, plan_path, profile_path)
    if target == "megatron":
        result = megatron_arguments(plan, profile, approximate=approximate)
        return [(out_path, result.text)], result
    csv_path = schedule_csv_path(out_path)
    result = torchtitan_config(plan, profile, module_map=module_map or DEFAULT_MODULE_MAP,
                               schedule_csv_path=path_text(csv_path), approximate=approximate)
    files = [(out_path, result.toml)]
    if result.schedule_csv is not None:
        files.append((csv_path, result.schedule_csv))
    return files, result


def _torch_csv(plan, out_path) -> None:
    """Refused (exit 4) where torch cannot run the plan as it is: stages
    replicated or split unevenly, uneven slices on mixed GPUs, an
    asynchronous schedule."""
    order = plan.pipeline_order()
    if out_path is None:
        click.echo(order.to_csv(), nl=False)
    else:
        write_atomic(out_path, order.to_csv())
    layers = ", ".join(f"{s['layer_start']}..{s['layer_end']}" for s in plan.stages)
    written = path_text(out_path) if out_path is not None else "stdout"
    click.echo(f"{written}: {counted(len(order.rank_actions), 'pipeline rank')}, "
               f"{counted(order.micro_batches, 'micro-batch')} of {plan.micro_batch_size}; stage layers {layers}; each replica group runs the same rows", err=True)
