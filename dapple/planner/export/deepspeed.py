"""DeepSpeed's pipeline partition for a plan, as JSON: the ``parts``
boundaries its ``PipelineModule`` keeps (``parts[s]`` .. ``parts[s + 1]``
are stage s's layers, len = stages + 1), over a layer list with one entry
per profile layer, with the topology's axes, the activation checkpoint
interval and the config's batch keys.

DeepSpeed takes no ``parts`` argument (DeepSpeed issue 2974): a
``PipelineModule`` subclass sets them in ``_partition_layers``
(``docs/export.md``), unless they are DeepSpeed's own ``uniform``
partition, which ``partition_method`` then names. It runs 1F1B only
(``TrainSchedule``; ``shape.one_f_one_b``) and ZeRO stage 1 at most.

A mixture of experts (the profile's ``layers[i].experts``) is DeepSpeed's
``deepspeed.moe.layer.MoE`` in those layers: the JSON's ``moe`` holds its
arguments (``num_experts``, ``k``, ``ep_size``: expert groups of
consecutive data-parallel ranks, as dapple's are;
``enable_expert_tensor_parallelism`` where the stage splits, each expert
split t ways as dapple's et = t; ``drop_tokens`` false, since dapple
prices every routed token).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ..plan import Plan
from ..profile import Profile
from .shape import (Rounding, RunShape, expert_kind, one_f_one_b, refuse_deduplicated_dispatch,
                    refuse_experts_spread_on_some_stages, refuse_offload_without_zero, run_shape)

TARGET = "DeepSpeed"


@dataclass(frozen=True)
class DeepSpeedPartition:
    """The JSON text and its data, the shape, and what ``--approximate`` changed."""

    text: str
    data: dict
    shape: RunShape
    changes: tuple[str, ...]


def uniform_parts(num_layers: int, num_stages: int) -> list[int]:
    """DeepSpeed's ``partition_uniform`` (``deepspeed/runtime/utils.py``):
    each stage n // S layers and the first n mod S one more; with no more
    layers than stages, one layer a stage and the rest empty."""
    if num_layers <= num_stages:
        return [min(s, num_layers) for s in range(num_stages + 1)]
    chunk, residual = num_layers // num_stages, num_layers % num_stages
    return [s * chunk + min(s, residual) for s in range(num_stages + 1)]


def deepspeed_partition(plan: Plan, profile: Profile | None = None, *, approximate: bool = False) -> DeepSpeedPartition:
    """DeepSpeed's partition of ``plan``; with its layers' experts where
    ``profile`` is given (needed where the plan spreads experts)."""
    shape = run_shape(plan, TARGET, approximate, writes_experts=profile is not None)
    rounding = Rounding(TARGET, approximate)
    if shape.sequence_parallel:
        rounding.refuse("sequence parallelism", "its pipeline engine does not shard the sequence",
                        "the plan without it (more activation memory than planned)")
    if shape.context_parallel > 1:
        rounding.refuse(f"context parallelism (degree {shape.context_parallel})", "its pipeline engine does not "
                        "cut the sequence (Ulysses splits heads, not the ring dapple costs)", None)
    if shape.recompute == "selective":
        rounding.refuse("selective re-computation", "its activation checkpointing checkpoints whole layers",
                        "a checkpoint of each layer (interval 1)")
    if shape.hides_grad_reduce and shape.stages > 1:
        rounding.refuse("gradient reduction behind the backward of a pipeline's stages", "its pipeline engine "
                        "reduces gradients after the last micro-batch's backward",
                        "the reduction after the backward (slower than planned)")
    refuse_offload_without_zero(shape, rounding)
    stage = _zero_stage(shape, rounding)
    if shape.hides_param_gather and stage < 3:
        rounding.refuse("ZeRO-1's weight gather behind the next forward", "its ZeRO stage 1 gathers the weights "
                        "right after the optimizer's step", "the gather after the step (slower than planned)")
    moe = _moe_arguments(plan, profile, shape, rounding) if profile is not None else None
    changes = shape.changes + one_f_one_b(plan, TARGET, approximate) + tuple(rounding.changes)
    parts = [start for start, _ in shape.stage_ranges] + [shape.stage_ranges[-1][1]]
    num_layers = parts[-1]
    config = {
        "train_batch_size": shape.global_batch_size,
        "train_micro_batch_size_per_gpu": shape.micro_batch_per_replica,
        "gradient_accumulation_steps": shape.micro_batches,
    }
    if stage or shape.offload_optimizer:
        config["zero_optimization"] = {"stage": max(stage, 1)}
    if shape.offload_optimizer:
        # ZeRO-Offload: the optimizer's partitions in pinned host memory,
        # stepped by DeepSpeedCPUAdam.
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    data = {
        "about": f"DeepSpeed pipeline partition from dapple plan {plan.path or ''!r} (dapple export --to deepspeed): "
                 "build PipelineModule over one layer per profile layer, in order; docs/export.md",
        "model": plan.data["inputs"]["model"],
        "num_layers": num_layers,
        "num_stages": shape.stages,
        "parts": parts,
        "topology": {"num_pp": shape.stages, "num_mp": shape.tensor_parallel, "num_dp": shape.replicas},
        # DeepSpeed checkpoints every `interval` layers of a stage, the last
        # chunk shorter: one checkpoint over each stage's layers, or one a layer.
        "activation_checkpoint_interval": {"none": 0, "full": shape.most_layers_per_stage,
                                           "per-layer": 1, "selective": 1}[shape.recompute],
        "config": config,
    }
    if moe is not None:
        data["moe"] = moe
    if parts == uniform_parts(num_layers, shape.stages):
        # DeepSpeed's own method gives these parts; where none does,
        # _partition_layers must set them.
        data["partition_method"] = "uniform"
    return DeepSpeedPartition(text=json.dumps(data, indent=2) + "\n", data=data, shape=shape, changes=changes)


def _zero_stage(shape: RunShape, rounding: Rounding) -> int:
    """DeepSpeed's ZeRO stage for the plan's sharding level: the same
    number, but beside a pipeline at most 1 (its PipelineEngine asserts
    stage < 2), and level 3 always frees each module's gathered weights
    after its forward (no level 3 that keeps them)."""
    level = shape.shard_level
    if shape.stages > 1 and level > 1:
        rounding.refuse(f"{shape.shard_description} beside a pipeline", "its pipeline engine runs ZeRO stage 1 "
                        "at most", "stage 1 (more memory than planned)")
        return 1
    if level == 3 and not shape.reshard_after_forward:
        rounding.refuse(shape.shard_description, "its ZeRO-3 frees each module's gathered weights after the "
                        "forward", "stage 3 gathering them again for the backward (slower than planned)")
    return level


def _moe_arguments(plan: Plan, profile: Profile, shape: RunShape, rounding: Rounding) -> dict | None:
    """``deepspeed.moe.layer.MoE``'s arguments for the layers with experts
    (by profile layer index); None for a dense model."""
    kind = expert_kind(profile, rounding)
    if kind is None:
        return None
    refuse_experts_spread_on_some_stages(plan, profile, shape, rounding)
    refuse_deduplicated_dispatch(profile, shape, rounding)
    count, per_token = kind
    return {
        "layers": [i for i, layer in enumerate(profile.data["layers"]) if layer.get("experts")],
        "num_experts": count,
        "k": per_token,
        "ep_size": shape.expert_parallel,
        "enable_expert_tensor_parallelism": shape.tensor_parallel > 1,
        "drop_tokens": False,
    }
