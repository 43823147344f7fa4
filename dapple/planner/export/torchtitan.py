"""torchtitan's job config (TOML, torchtitan 0.2 and before: ``--job.config_file``)
for a plan: the ``[parallelism]`` keys, the batch sizes of ``[training]`` and
``[activation_checkpoint]``'s mode, with the key names and types of
``torchtitan/config/job_config.py``.

The schedule is always the plan's own order, as torch's schedule CSV beside
the TOML (``pipeline_parallel_schedule_csv``): torchtitan then runs it with
torch's ``_PipelineScheduleRuntime``, whatever ``pipeline_parallel_schedule``
says (``PipelineScheduleSingle``, one stage a rank, as torchtitan's docs ask
with a CSV). A schedule name would run torch's own warm-up depths, which
differ from the plan's wherever the search chose them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ..plan import Plan
from ..profile import Profile
from .module_map import modules_per_stage
from .shape import (Rounding, RunShape, refuse_deduplicated_dispatch, refuse_experts_spread_on_some_stages,
                    run_shape)

TARGET = "torchtitan"


@dataclass(frozen=True)
class TorchtitanConfig:
    """The TOML text, the schedule CSV (None for one stage: no pipeline),
    the shape, and what ``--approximate`` changed (``changes``)."""

    toml: str
    schedule_csv: str | None
    shape: RunShape
    changes: tuple[str, ...]


def schedule_csv(plan: Plan) -> str:
    """torch's schedule CSV of the plan's own order (kind, M, K_i). The
    order does not depend on how stages replicate or split, so it is asked
    of the plan with each stage on one of its GPUs, which torch can run
    whatever the plan's shapes (they are exported, or refused, apart)."""
    data = json.loads(json.dumps(plan.data))
    for stage in data["stages"]:
        stage["devices"] = stage["devices"][:1]
        for key in ("slices", "tensor_parallel", "sequence_parallel", "shard_level", "reshard_after_forward",
                    "recompute", "expert_parallel", "expert_tensor_parallel", "offload", "context_parallel"):
            stage.pop(key, None)
    data.pop("estimate", None)
    data.pop("selection", None)
    return Plan.from_dict(data, plan.path).pipeline_order().to_csv()


def _data_parallel(shape: RunShape, rounding: Rounding) -> dict:
    """torchtitan's data-parallel keys, at the sharding level it runs.
    torchtitan replicates (DDP) only when nothing else is parallel: a
    single unsharded stage. Otherwise its data parallelism is FSDP2
    (``data_parallel_shard_degree``), and which ZeRO level that is depends
    on the pipeline. Beside one, torch's pipeline stages defer FSDP's
    gradient reduce-scatter and re-sharding to the last micro-batch's
    backward (``torch/distributed/pipelining/stage.py``,
    ``backward_maybe_with_nosync``): with ``fsdp_reshard_after_forward =
    "never"`` the weights are gathered once and the gradients kept whole and
    reduce-scattered once, which is level 1. Without one, torchtitan's
    gradient accumulation runs FSDP's hooks with every micro-batch: each
    gradient is reduce-scattered as it is made, which is level 3, its
    weights freed after the forward ("always") or kept to the backward
    ("never"). Other levels are refused, or rounded to these."""
    if shape.weight_replicas == 1:
        return {"data_parallel_replicate_degree": 1, "data_parallel_shard_degree": 1}
    # With context parallelism torchtitan's FSDP shards over the data and
    # context ranks together (its dp_shard_cp mesh).
    alone = shape.stages == 1 and shape.tensor_parallel == 1 and shape.expert_parallel == 1 \
        and shape.context_parallel == 1
    if alone and shape.shard_level == 0:
        return {"data_parallel_replicate_degree": shape.replicas, "data_parallel_shard_degree": 1}
    fsdp = {"data_parallel_replicate_degree": 1, "data_parallel_shard_degree": shape.replicas}
    if shape.stages > 1:
        if shape.shard_level != 1:
            rounding.refuse(f"{shape.shard_description} beside a pipeline", "its FSDP under a pipeline schedule "
                            "gathers the weights once and reduce-scatters whole gradients after the last "
                            "micro-batch: level 1", "level 1 (FSDP, fsdp_reshard_after_forward never)")
        return fsdp | {"fsdp_reshard_after_forward": "never"}
    if shape.shard_level != 3:
        rounding.refuse(shape.shard_description, "its FSDP reduce-scatters each micro-batch's gradients and "
                        "shards the weights: level 3", "level 3 keeping the weights after the forward (FSDP, "
                        "fsdp_reshard_after_forward never)")
        return fsdp | {"fsdp_reshard_after_forward": "never"}
    return fsdp | {"fsdp_reshard_after_forward": "always" if shape.reshard_after_forward else "never"}


def _expert_degrees(plan: Plan, profile: Profile, shape: RunShape, rounding: Rounding) -> dict:
    """torchtitan's expert keys where the plan spreads experts: the
    expert degree (its ``ep``: the GPUs of an expert group, at expert
    tensor degree 1 whole replicas' shards included) and the expert tensor
    degree, which its ParallelDims takes only at 1 or t, and at 1 only with
    whole replicas in each group."""
    if shape.expert_parallel == 1:
        return {}
    refuse_experts_spread_on_some_stages(plan, profile, shape, rounding)
    refuse_deduplicated_dispatch(profile, shape, rounding)
    e, et, t = shape.expert_parallel, shape.expert_tensor_parallel, shape.tensor_parallel
    if et not in (1, t):
        rounding.refuse(f"an expert tensor degree {et} between 1 and the tensor degree {t}",
                        "its ParallelDims takes ETP = TP or ETP = 1", None)
    if et == 1 and t > 1 and e % t:
        rounding.refuse(f"expert groups of {e} GPUs, which split replicas of {t}",
                        "its ParallelDims asks ep to be a multiple of tp at ETP = 1", None)
    return {"expert_parallel_degree": e, "expert_tensor_parallel_degree": et}


def torchtitan_config(plan: Plan, profile: Profile, *, module_map: str = "torchtitan-llama",
                      schedule_csv_path: str = "schedule.csv", approximate: bool = False) -> TorchtitanConfig:
    """The job config of ``plan`` (over ``profile``'s layers, named by
    ``module_map``: a name of ``MODULE_MAPS`` or a map file), its schedule
    CSV to be written at ``schedule_csv_path`` (the TOML names it so)."""
    shape = run_shape(plan, TARGET, approximate, writes_experts=True)
    rounding = Rounding(TARGET, approximate)
    experts = _expert_degrees(plan, profile, shape, rounding)
    if shape.recompute == "full":
        rounding.refuse("re-computation of whole stages", "its full activation checkpointing checkpoints each "
                        "block, keeping every block's input (more memory than planned)",
                        "full activation checkpointing (each block)")
    if shape.offload_optimizer:
        rounding.refuse("an optimizer offloaded alone", "its CPU offload (training.enable_cpu_offload, FSDP's "
                        "CPUOffload) moves weights and gradients to the host too, and steps there", None)
    if shape.recompute == "selective":
        rounding.refuse("selective re-computation of the attention core", "its selective activation checkpointing "
                        "picks operators by its own policy", "full activation checkpointing (each block)")
    parallelism = _data_parallel(shape, rounding) | {"tensor_parallel_degree": shape.tensor_parallel,
                                          "pipeline_parallel_degree": shape.stages} | experts
    if shape.context_parallel > 1:
        # torch's context_parallel: the sequence in 2c chunks, keys and
        # values passed around a ring (its round-robin load balancer).
        parallelism["context_parallel_degree"] = shape.context_parallel
    csv = None
    local_batch_size = shape.micro_batch_per_replica
    if shape.stages > 1:
        csv = schedule_csv(plan)
        local_batch_size *= shape.micro_batches
        parallelism |= {
            "pipeline_parallel_schedule": "PipelineScheduleSingle",
            "pipeline_parallel_schedule_csv": schedule_csv_path,
            "pipeline_parallel_microbatch_size": shape.micro_batch_per_replica,
            "module_fqns_per_model_part": modules_per_stage(shape.stage_ranges, profile, module_map),
        }
    sections = {
        # local_batch_size is one data-parallel rank's samples a step; with a
        # single stage, the global batch over it is torchtitan's gradient
        # accumulation (the plan's micro-batches).
        "training": {"local_batch_size": local_batch_size, "global_batch_size": shape.global_batch_size},
        "parallelism": parallelism,
        "activation_checkpoint": {"mode": "none" if shape.recompute == "none" else "full"},
    }
    header = [f"torchtitan job config from dapple plan {quoted(plan.path or '')}, model "
              f"{quoted(plan.data['inputs']['model'])}: {shape.describe()}",
              "dapple export --to torchtitan; docs/export.md. Merge into a job's TOML (--job.config_file) that names",
              "the model (model.name, model.flavor), training.seq_len, steps and data; torchtitan 0.3 and later take",
              "the same keys as --parallelism.<key> and --training.<key> arguments."]
    return TorchtitanConfig(toml=to_toml(header, sections), schedule_csv=csv, shape=shape,
                            changes=shape.changes + tuple(rounding.changes))


def to_toml(header: list[str], sections: dict[str, dict]) -> str:
    """TOML of comment lines and tables of integers, booleans, strings and
    (nested) lists of them; a list of lists one inner list a line."""
    lines = [f"# {line}" for line in header]
    for name, table in sections.items():
        lines += ["", f"[{name}]"]
        for key, value in table.items():
            if isinstance(value, list) and value and isinstance(value[0], list):
                lines += [f"{key} = ["] + [f"    {_toml_value(row)}," for row in value] + ["]"]
            else:
                lines.append(f"{key} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"


def quoted(text: str) -> str:
    """A TOML basic string (also safe in a comment: no line break): JSON's
    escapes, which TOML shares, and DEL, which JSON leaves as it is."""
    return json.dumps(text, ensure_ascii=False).replace("\x7f", "\\u007f")


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return quoted(value)
    return "[" + ", ".join(_toml_value(v) for v in value) + "]"
