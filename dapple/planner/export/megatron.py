"""Megatron-LM's arguments for a plan (``pretrain_gpt.py``), as a bash
array to source: the pipeline layout string, the tensor and pipeline sizes,
the micro-batch and global batch, the distributed optimizer (ZeRO-1),
full re-computation and, for a mixture of experts, its experts and their
expert and tensor degrees, where the plan has them.

Megatron takes the data-parallel size as the world size over tensor x
pipeline, so it is said in a comment: launch that many processes. It runs
1F1B only (``shape.one_f_one_b``).
"""

from __future__ import annotations

import itertools
import math
import shlex
from dataclasses import dataclass

from ..megatron_layout import layer_tokens, plan_layout
from ..plan import Plan
from ..profile import Profile
from .shape import (Rounding, RunShape, expert_kind, one_f_one_b, refuse_experts_spread_on_some_stages,
                    refuse_offload_without_zero, run_shape)

TARGET = "Megatron-LM"
#: The bash array the file sets.
ARRAY = "DAPPLE_MEGATRON_ARGS"


@dataclass(frozen=True)
class MegatronArguments:
    """The file's text, its arguments (one a word), the layout string, the
    shape, and what ``--approximate`` changed."""

    text: str
    arguments: tuple[str, ...]
    layout: str
    shape: RunShape
    changes: tuple[str, ...]


def _recompute_chunk(blocks_per_stage: list[int], rounding: Rounding) -> tuple[int, tuple[str, ...]]:
    """Megatron's ``--recompute-num-layers`` N for a plan whose stages each
    re-compute as one checkpoint, and what ``--approximate`` changed.

    Megatron-core checkpoints a stage's transformer layers in chunks of N
    from its first (``TransformerBlock._checkpointed_forward``, method
    ``uniform``), and indexes past its last layer where N does not divide
    the stage's count: one chunk a stage needs every stage with
    transformer layers to hold the same number. Otherwise the greatest
    common divisor of the counts runs (smaller chunks, each keeping its
    input), under ``approximate`` only."""
    counts = [count for count in blocks_per_stage if count > 0]
    if len(set(counts)) <= 1:
        return (counts[0] if counts else 1), ()
    chunk = math.gcd(*counts)
    rounding.refuse(f"one re-computed checkpoint a stage over unequal transformer layers "
                    f"({', '.join(map(str, blocks_per_stage))} by stage)",
                    "it checkpoints chunks of --recompute-num-layers layers, which must divide every stage's",
                    f"--recompute-num-layers {chunk}, the greatest common divisor (more checkpoints, more memory)")
    return chunk, tuple(rounding.changes)


def _overlap_options(shape: RunShape, rounding: Rounding) -> list[tuple[str, ...]]:
    """Megatron-LM's switches for what the plan hides behind computation:
    ``--overlap-grad-reduce`` where a stage reduces its gradients behind its
    backward (without it Megatron-LM reduces after the last one), and
    ``--overlap-param-gather`` where the distributed optimizer gathers its
    weights behind the next forward, which Megatron-LM runs only together
    with the first (``validate_args``)."""
    grad_reduce = shape.hides_grad_reduce
    if shape.hides_param_gather and not grad_reduce:
        rounding.refuse("the weights' gather behind the forward without the gradients' reduction behind the "
                        "backward", "it asserts --overlap-grad-reduce with --overlap-param-gather",
                        "both overlapped (faster than planned)")
        grad_reduce = True
    return ([("--overlap-grad-reduce",)] if grad_reduce else []) + (
        [("--overlap-param-gather",)] if shape.hides_param_gather else [])


def _gradient_options(profile: Profile) -> list[tuple[str, ...]]:
    """``--grad-reduce-in-bf16`` where the profile priced bf16 gradients
    beside bf16 weights (``dapple profile transformer``'s default): under
    ``--bf16`` Megatron-LM otherwise accumulates and reduces them in fp32
    (its ``validate_args``), 2 bytes a parameter more than planned. fp32
    gradients (``--gradients fp32``) are its default, and need nothing."""
    state = profile.data.get("parameter_state") or {}
    bf16 = state.get("weight_bytes") == 2 and state.get("gradient_bytes") == 2
    return [("--grad-reduce-in-bf16",)] if bf16 else []


def _sharding_options(shape: RunShape, rounding: Rounding) -> list[tuple[str, ...]]:
    """Megatron-LM's switches for the plan's sharding level. Its distributed
    optimizer shards the optimizer state and the fp32 master weights over
    the data-parallel ranks: level 1 (and what its CPU offload needs).
    Levels 2 and 3 are Megatron-FSDP's sharding strategies ``optim_grads``
    and ``optim_grads_params``, with the flags its guide asks beside them;
    its guide names tensor, expert and context parallelism beside it, not
    a pipeline, and no level 3 that keeps the weights after the forward."""
    level = shape.shard_level
    if level > 1 and shape.stages > 1:
        rounding.refuse(f"{shape.shard_description} beside a pipeline", "its FSDP runs beside tensor, expert and "
                        "context parallelism", "its distributed optimizer, level 1 (more memory than planned)")
        level = 1
    if level == 3 and not shape.reshard_after_forward:
        rounding.refuse(shape.shard_description, "dapple writes its FSDP's level 3 re-sharded after the forward "
                        "only", "level 3 gathering the weights again for the backward (slower than planned)")
    if level <= 1:
        return [("--use-distributed-optimizer",)] if level or shape.offload_optimizer else []
    strategy = {2: "optim_grads", 3: "optim_grads_params"}[level]
    return [("--use-megatron-fsdp",), ("--data-parallel-sharding-strategy", strategy),
            ("--no-gradient-accumulation-fusion",), ("--use-distributed-optimizer",)]


def _expert_options(plan: Plan, profile: Profile, shape: RunShape, rounding: Rounding) -> list[tuple[str, ...]]:
    """Megatron-LM's mixture-of-experts arguments where the profile's
    blocks have experts: their count and experts per token, which blocks
    have them (``--moe-layer-freq`` where some do not), their routing
    groups, the dispatcher the profile priced where the experts are spread,
    the expert degree and the experts' tensor degree (the GPUs each
    expert's columns are split over). Every stage with experts spreads them
    alike."""
    kind = expert_kind(profile, rounding)
    if kind is None:
        return []
    experts = [layer.get("experts") for layer in profile.data["layers"]]
    if shape.tensor_parallel > 1 and not shape.sequence_parallel:
        rounding.refuse(f"a mixture of experts split {shape.tensor_parallel} ways without sequence parallelism",
                        "its validate_args asserts sequence parallelism with experts and tensor parallelism",
                        "--sequence-parallel (less activation memory and other collectives than planned)")
    count, per_token = kind
    refuse_experts_spread_on_some_stages(plan, profile, shape, rounding)
    options = [("--num-experts", str(count)), ("--moe-router-topk", str(per_token))]
    if shape.tensor_parallel > 1 and not shape.sequence_parallel:
        options.append(("--sequence-parallel",))  # approximated, as said above
    blocks = [1 if e else 0 for e, token in zip(experts, layer_tokens(profile)) if token == "t"]
    if not all(blocks):
        # Megatron-LM's list form, e.g. DeepSeek-V3's three dense first blocks: ([0]*3+[1]*58).
        runs = [(flag, len(list(group))) for flag, group in itertools.groupby(blocks)]
        options.append(("--moe-layer-freq", "(" + "+".join(f"[{flag}]*{n}" for flag, n in runs) + ")"))
    pattern = next(e for e in experts if e)
    if "routing_groups" in pattern:
        groups = pattern["routing_groups"]
        options += [("--moe-router-num-groups", str(groups["groups"])),
                    ("--moe-router-group-topk", str(groups["per_token"]))]
    if shape.expert_parallel > 1:
        # The exchange the profile priced (its default is the allgather dispatcher).
        options += ([("--moe-token-dispatcher-type", "flex"), ("--moe-flex-dispatcher-backend", "deepep")]
                    if pattern.get("dispatcher") == "deepep" else [("--moe-token-dispatcher-type", "alltoall")])
    return options + [("--expert-model-parallel-size", str(shape.expert_parallel)),
                      ("--expert-tensor-parallel-size", str(shape.expert_tensor_parallel))]


def _launch_line(plan, gpus: int) -> str:
    """torchrun on as many machines as the plan's GPUs fill, a process per
    GPU of a machine (machines of mixed sizes: written as one node of every
    process, for the user to divide)."""
    groups = plan.data["inputs"]["topology"]["machine_groups"]
    per_machine = groups[0]["gpus_per_machine"] if len({g["gpus_per_machine"] for g in groups}) == 1 else gpus
    nodes = -(-gpus // per_machine)
    return (f"torchrun --nnodes {nodes} --nproc-per-node {min(per_machine, gpus)} --node-rank $NODE_RANK "
            f'--master-addr $MASTER_ADDR pretrain_gpt.py "${{{ARRAY}[@]}}"')


def megatron_arguments(plan: Plan, profile: Profile, *, approximate: bool = False) -> MegatronArguments:
    """Megatron-LM's arguments for ``plan`` over ``profile``'s layers (a
    transformer: embedding, blocks, head; ``megatron_layout.layer_tokens``)."""
    # The profile first: one that is no transformer has no layout at all.
    layout = plan_layout([(s["layer_start"], s["layer_end"]) for s in plan.stages], profile)
    tokens = layer_tokens(profile)
    shape = run_shape(plan, TARGET, approximate, writes_experts=True)
    blocks_per_stage = [tokens[start:end].count("t") for start, end in shape.stage_ranges]
    chunk = None
    if shape.recompute == "full":
        chunk = _recompute_chunk(blocks_per_stage, Rounding(TARGET, approximate))
    elif shape.recompute == "per-layer":
        chunk = (1, ())  # a checkpoint of each transformer layer, its input kept
    changes = shape.changes + one_f_one_b(plan, TARGET, approximate) + (chunk[1] if chunk else ())
    options: list[tuple[str, ...]] = [
        ("--tensor-model-parallel-size", str(shape.tensor_parallel)),
        ("--pipeline-model-parallel-size", str(shape.stages)),
    ]
    if shape.context_parallel > 1:
        # TransformerEngine's ring attention over 2c chunks (cp_comm_type p2p, its default).
        options.append(("--context-parallel-size", str(shape.context_parallel)))
    if shape.stages > 1:
        options.append(("--pipeline-model-parallel-layout", layout))
    options += [
        ("--num-layers", str(sum(blocks_per_stage))),
        ("--micro-batch-size", str(shape.micro_batch_per_replica)),
        ("--global-batch-size", str(shape.global_batch_size)),
    ]
    offload_rounding = Rounding(TARGET, approximate)
    refuse_offload_without_zero(shape, offload_rounding)
    changes += tuple(offload_rounding.changes)
    sharding_rounding = Rounding(TARGET, approximate)
    options += _sharding_options(shape, sharding_rounding)
    changes += tuple(sharding_rounding.changes)
    options += _gradient_options(profile)
    if shape.offload_optimizer:
        # All of it on the host, stepped by torch's fused CPU Adam (its
        # HybridDeviceOptimizer), which validate_args allows only beside
        # the precision-aware optimizer.
        options += [("--optimizer-cpu-offload",), ("--optimizer-offload-fraction", "1.0"),
                    ("--use-precision-aware-optimizer",)]
    if shape.sequence_parallel:
        options.append(("--sequence-parallel",))
    expert_rounding = Rounding(TARGET, approximate)
    options += _expert_options(plan, profile, shape, expert_rounding)
    changes += tuple(expert_rounding.changes)
    overlap_rounding = Rounding(TARGET, approximate)
    options += _overlap_options(shape, overlap_rounding)
    changes += tuple(overlap_rounding.changes)
    if chunk:
        options += [("--recompute-granularity", "full"), ("--recompute-method", "uniform"),
                    ("--recompute-num-layers", str(chunk[0]))]
    elif shape.recompute == "selective":
        # The attention core of each layer re-run in its backward (Korthikanti et al.).
        options.append(("--recompute-granularity", "selective"))
    context = "context x " if shape.context_parallel > 1 else ""
    header = [
        f"Megatron-LM arguments from dapple plan {plan.path or ''!r}, model {plan.data['inputs']['model']!r}:",
        f"{shape.describe()}. Megatron's data-parallel size is the world size over tensor x {context}pipeline,",
        f"{shape.gpus} / {shape.tensor_parallel * shape.context_parallel * shape.stages} = {shape.replicas}: "
        f"launch {shape.gpus} processes.",
        f"dapple export --to megatron; docs/export.md. Use: source this file, then on each machine",
        f"{_launch_line(plan, shape.gpus)}",
        "followed by the model's own arguments (--hidden-size, --num-attention-heads, --seq-length, ...).",
    ]
    text = "\n".join([*(f"# {line}" for line in header), f"{ARRAY}=("]
                     + [f"    {' '.join(shlex.quote(word) for word in option)}" for option in options] + [")"]) + "\n"
    return MegatronArguments(text=text, arguments=tuple(word for option in options for word in option),
                             layout=layout, shape=shape, changes=changes)
