"""What every export target takes: one pipeline, one tensor-parallel degree,
one data-parallel degree, one sharding level and one re-computation on
every stage, even micro-batch slices, synchronous steps.

A plan that differs is refused with one line naming the feature
(``IncompatibleInputsError``, exit 4, as ``dapple export --to torch-csv``),
or with ``approximate`` rounded to the most common value among the stages,
each change said in :attr:`RunShape.changes`: nothing is approximated
silently. Ties go to the value the first stages have.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from .. import _core
from ..errors import IncompatibleInputsError
from ..plan import Plan, counted
from ..runtime.schedule import EARLY_BACKWARD


@dataclass(frozen=True)
class RunShape:
    """A plan as one degree of each kind; ``changes``: what ``--approximate``
    changed to get there (empty when the plan is exactly this)."""

    stage_ranges: tuple[tuple[int, int], ...]
    tensor_parallel: int
    replicas: int
    #: ZeRO's level over the replicas (0 where there is one replica):
    #: ``cost/sharding.rs`` in the core, ``docs/cost-model.md`` "Sharding".
    shard_level: int
    #: "none", "full" (one checkpoint a stage), "per-layer" (one a layer) or
    #: "selective" (the attention core re-run, the rest kept).
    recompute: str
    #: Samples each replica takes of a micro-batch (the targets' micro-batch size).
    micro_batch_per_replica: int
    micro_batches: int
    changes: tuple[str, ...] = ()
    #: Sequence parallelism in the split layers (t > 1).
    sequence_parallel: bool = False
    #: Some stage reduces its gradients behind its backward, and some sharded
    #: stage gathers its weights behind its forward, as the plan was
    #: costed (``schedule.overlap``; ``docs/cost-model.md``, "Overlap").
    hides_grad_reduce: bool = False
    hides_param_gather: bool = False
    #: The routed experts over groups of this many consecutive replicas,
    #: on the stages that have experts (1: not spread).
    expert_parallel: int = 1
    #: The GPUs each routed expert's columns are split over (Megatron-LM's
    #: expert tensor degree; the tensor degree where experts are not spread).
    expert_tensor_parallel: int = 1
    #: The master weights and optimizer state in host memory, stepped by
    #: its CPU (``stages[i].offload`` "optimizer").
    offload_optimizer: bool = False
    #: Level 3: the weights freed after each forward and gathered again for
    #: the backward (FSDP's ``reshard_after_forward``).
    reshard_after_forward: bool = False
    #: Each sample's sequence cut over this many split groups of a replica
    #: (context parallelism; ``replicas`` counts the data replicas).
    context_parallel: int = 1

    @property
    def weight_replicas(self) -> int:
        """The GPUs that hold the same weights: the data replicas' context
        ranks, over which gradients are reduced and state is sharded."""
        return self.replicas * self.context_parallel

    @property
    def shard_optimizer(self) -> bool:
        """Sharded at level 1 or above: the optimizer state over the replicas."""
        return self.shard_level >= 1

    @property
    def shard_description(self) -> str:
        """The level in words, as refusals name it."""
        if self.shard_level == 0:
            return "sharding level 0 (none)"
        kept = "" if self.shard_level < 3 or self.reshard_after_forward else " keeping the weights after the forward"
        return f"sharding level {self.shard_level} (ZeRO-{self.shard_level}{kept})"

    @property
    def stages(self) -> int:
        return len(self.stage_ranges)

    @property
    def gpus(self) -> int:
        return self.stages * self.tensor_parallel * self.context_parallel * self.replicas

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_per_replica * self.replicas * self.micro_batches

    @property
    def most_layers_per_stage(self) -> int:
        return max(end - start for start, end in self.stage_ranges)

    def micro_batching(self) -> str:
        """``4 micro-batches of 2 a replica``: what the runtime's
        micro-batch size and count are."""
        return f"{counted(self.micro_batches, 'micro-batch')} of {self.micro_batch_per_replica} a replica"

    def describe(self) -> str:
        """``4 stages x tensor parallel 4 x data parallel 2 = 32 GPUs``
        (``x context parallel 2`` where the sequence is cut)."""
        context = f" x context parallel {self.context_parallel}" if self.context_parallel > 1 else ""
        return (f"{counted(self.stages, 'stage')} x tensor parallel {self.tensor_parallel}{context} x data parallel "
                f"{self.replicas} = {self.gpus} GPUs")


class Rounding:
    """One value for every stage, or the refusal naming the feature; under
    ``approximate`` the most common value, with the change recorded."""

    def __init__(self, target: str, approximate: bool):
        self.target, self.approximate, self.changes = target, approximate, []

    def refuse(self, what: str, why: str, instead: str | None) -> None:
        """Refuse ``what`` (one line: the target, the feature, why, and what
        --approximate would write), or under approximate record that it
        becomes ``instead`` (None: no approximation exists)."""
        if instead is None or not self.approximate:
            hint = f"; --approximate writes {instead}" if instead else ""
            raise IncompatibleInputsError(f"{self.target} cannot express {what}: {why}{hint}")
        self.changes.append(f"{what} -> {instead}")

    def one(self, values: list, feature: str, unit: str):
        if len(set(values)) == 1:
            return values[0]
        chosen = Counter(values).most_common(1)[0][0]
        listed = ", ".join(map(_word, values))
        self.refuse(f"{feature} ({unit} {listed} by stage)", "it takes one for every stage",
                    f"the most common, {_word(chosen)}, on every stage")
        return chosen


def _level_word(shape: _core.StageShape) -> str:
    return f"{shape.shard_level}{' kept' if shape.shard_level == 3 and not shape.reshard_after_forward else ''}"


def _word(value) -> str:
    return ("yes" if value else "no") if isinstance(value, bool) else str(value)


def run_shape(plan: Plan, target: str, approximate: bool = False, *, writes_experts: bool = False) -> RunShape:
    """The plan as ``target`` runs it: one degree of each kind on every
    stage. Raises ``IncompatibleInputsError`` naming what ``target`` cannot
    express (spread experts unless ``writes_experts``: the caller has the
    profile that names them); ``approximate``
    rounds instead and says so in ``changes``."""
    rounding = Rounding(target, approximate)
    kind = plan.core.schedule_kind
    if kind in _core.ASYNCHRONOUS_SCHEDULES:
        rounding.refuse(f"schedule {kind}", f"it is asynchronous, and {target} runs synchronous steps, each ending "
                        "in one optimizer step; plan with a synchronous --schedule", None)
    if kind in _core.CHUNKED_SCHEDULES:
        rounding.refuse(f"schedule {kind}", f"its ranks hold several stages each, which dapple does not write for "
                        f"{target} yet; export it with --to torch-csv", None)
    shapes = plan.stage_shapes
    spread = [i for i, s in enumerate(shapes) if s.expert_parallel > 1]
    if spread and not writes_experts:
        rounding.refuse(f"expert parallelism (stages[{spread[0]}].expert_parallel "
                        f"{shapes[spread[0]].expert_parallel}) without the profile that names the experts",
                        "pass the profile (--profile)", None)
    # Stages without experts to spread keep 1 (`plan::check`), whatever the run's degree.
    degrees = sorted({shapes[i].expert_parallel for i in spread})
    if len(degrees) > 1:
        rounding.refuse(f"per-stage expert parallelism (expert degrees {', '.join(map(str, degrees))} by stage)",
                        "it takes one for every stage", None)
    expert_parallel = degrees[0] if degrees else 1
    expert_tensor = sorted({shapes[i].expert_tensor_parallel for i in spread})
    if len(expert_tensor) > 1:
        rounding.refuse(f"per-stage expert tensor degrees ({', '.join(map(str, expert_tensor))} by stage)",
                        "it takes one for every stage", None)
    tensor_parallel = rounding.one([s.tensor_parallel for s in shapes], "per-stage tensor parallelism",
                                   "split degrees")
    replicas = rounding.one([s.replicas for s in shapes], "stages replicated unevenly", "replicas")
    context = rounding.one([s.context_parallel for s in shapes], "context parallelism that differs by stage",
                           "context degrees")
    # "3 kept": level 3 keeping the weights from the forward to the backward.
    level = rounding.one([_level_word(s) if s.weight_replicas > 1 else "0" for s in shapes],
                         "sharding levels that differ by stage", "sharding levels")
    shard = (int(level[0]), level == "3")
    recompute = rounding.one([s.recompute for s in shapes], "re-computation on some stages only, or of "
                             "two kinds", "re-computation")
    sequence_parallel = rounding.one([s.sequence_parallel for s in shapes], "sequence parallelism on some "
                                     "stages only", "sequence parallelism")
    offload = rounding.one([s.offload != "none" for s in shapes], "an optimizer offloaded on some stages only",
                           "offloading")
    per_replica = _samples_per_replica(plan, replicas, rounding)
    sharded = replicas * context > 1
    return RunShape(stage_ranges=tuple((s["layer_start"], s["layer_end"]) for s in plan.stages),
                    tensor_parallel=tensor_parallel, replicas=replicas,
                    shard_level=shard[0] if sharded else 0,
                    reshard_after_forward=shard[1] and sharded,
                    recompute=recompute, micro_batch_per_replica=per_replica, micro_batches=plan.micro_batches,
                    changes=tuple(rounding.changes), sequence_parallel=sequence_parallel,
                    hides_grad_reduce=plan.core.hides_grad_reduce, expert_parallel=expert_parallel,
                    expert_tensor_parallel=expert_tensor[0] if expert_tensor else tensor_parallel,
                    hides_param_gather=plan.core.hides_param_gather and shard[0] >= 1 and sharded,
                    offload_optimizer=offload, context_parallel=context)


def _samples_per_replica(plan: Plan, replicas: int, rounding: Rounding) -> int:
    """What each replica takes of a micro-batch, the same on every stage
    (the targets split a micro-batch evenly): the core's slices, or under
    approximate the even share over ``replicas``."""
    even = max(1, round(plan.micro_batch_size / replicas))
    sizes = set()
    for i, stage in enumerate(plan.core.layout().stages):
        slices = [r.end - r.start for r in stage.replicas if r.shard == 0]
        sizes |= set(slices)
        if len(set(slices)) > 1:
            listed = ", ".join(map(str, slices))
            what = ("uneven slices on mixed GPUs" if plan.stages[i].get("slices")
                    else f"a micro-batch of {plan.micro_batch_size} samples split unevenly")
            rounding.refuse(f"{what} (stage {i}: {listed} samples)", "it splits a micro-batch evenly",
                            f"{even} samples for each of {replicas} replicas (a global batch of "
                            f"{even * replicas * plan.micro_batches})")
            return even
    return sizes.pop() if len(sizes) == 1 else even


def one_f_one_b(plan: Plan, target: str, approximate: bool = False) -> tuple[str, ...]:
    """Check that the plan runs 1F1B as Megatron-LM and DeepSpeed do (their
    only schedule): early backward, stage i running min(S - i, M) forwards
    before its first backward (Megatron's ``forward_backward_pipelining_
    without_interleaving``, DeepSpeed's ``TrainSchedule``). Raises
    ``IncompatibleInputsError`` naming the difference; under ``approximate``
    returns it as changes."""
    rounding = Rounding(target, approximate)
    kind = plan.core.schedule_kind
    stages, micro_batches = len(plan.stages), plan.micro_batches
    theirs = [min(stages - i, micro_batches) for i in range(stages)]
    if kind != EARLY_BACKWARD:
        rounding.refuse(f"schedule {kind}", f"it runs 1F1B ({EARLY_BACKWARD}) only",
                        f"its 1F1B, K_i = {', '.join(map(str, theirs))}")
        return tuple(rounding.changes)
    ours = [s["warmup_micro_batches"] for s in plan.stages]
    if ours != theirs:
        rounding.refuse(f"warm-up depths K_i {', '.join(map(str, ours))} by stage",
                        "its 1F1B runs K_i = min(S - i, M)", f"its 1F1B, K_i = {', '.join(map(str, theirs))}")
    return tuple(rounding.changes)


def refuse_offload_without_zero(shape: RunShape, rounding: Rounding) -> None:
    """Refuse an offloaded optimizer that is not sharded over the replicas:
    DeepSpeed's ``offload_optimizer`` offloads ZeRO's partitions, and
    Megatron-LM's ``--optimizer-cpu-offload`` needs its distributed
    optimizer, so each replica's host would step a share, not all."""
    if shape.offload_optimizer and shape.weight_replicas > 1 and not shape.shard_optimizer:
        rounding.refuse("an offloaded optimizer without ZeRO-1", f"its offloaded optimizer is sharded over the "
                        f"{shape.weight_replicas} replicas", "ZeRO-1 with it (less host memory and a shorter step than "
                        "planned)")


def expert_kind(profile, rounding: Rounding) -> tuple[int, int] | None:
    """The routed experts of ``profile``'s layers that have some: (count,
    experts per token), one kind for every such layer (the targets take one
    count); None for a dense model."""
    kinds = {(e["count"], e["per_token"]) for e in (layer.get("experts") for layer in profile.data["layers"]) if e}
    if len(kinds) > 1:
        listed = ", ".join(f"{count} experts, {k} a token" for count, k in sorted(kinds))
        rounding.refuse(f"layers with experts of several counts (layers[i].experts: {listed})",
                        "it takes one count for every layer", None)
    return kinds.pop() if kinds else None


def refuse_deduplicated_dispatch(profile, shape: RunShape, rounding: Rounding) -> None:
    """Refuse spread experts whose profile priced DeepEP's deduplicated
    exchange (``layers[i].experts.dispatcher``) for a target that exchanges
    a copy an expert (NCCL's all-to-all)."""
    dispatchers = {e.get("dispatcher", "all-to-all") for e in (layer.get("experts") for layer in
                                                                 profile.data["layers"]) if e}
    if shape.expert_parallel > 1 and "deepep" in dispatchers:
        rounding.refuse("DeepEP's deduplicated token exchange (the profile's layers[i].experts.dispatcher "
                        "deepep)", "its experts exchange a copy an expert with NCCL's all-to-all",
                        "NCCL's all-to-all (more bytes across machines than planned)")


def refuse_experts_spread_on_some_stages(plan: Plan, profile, shape: RunShape, rounding: Rounding) -> None:
    """Refuse a plan whose stages with experts (the profile's
    ``layers[i].experts``) do not all spread them at the run's degree:
    the targets take one expert degree for every stage that has experts."""
    experts = [layer.get("experts") for layer in profile.data["layers"]]
    for i, stage in enumerate(plan.stages):
        if any(experts[stage["layer_start"]:stage["layer_end"]]) and \
                stage.get("expert_parallel", 1) != shape.expert_parallel:
            rounding.refuse(f"expert parallelism on some stages only (stages[{i}].expert_parallel "
                            f"{stage.get('expert_parallel', 1)}, the run's {shape.expert_parallel})",
                            "it takes one expert degree for every stage", None)
