"""What each process of a run does, as the core lays it out from a plan
(``rust_core/core/src/plan/layout.rs``, crossing the binding as
``dapple.planner._core.RunLayout``): no torch here, and no rule of its own.

One process (rank) per device the plan uses: rank r runs on the r-th used
device id in ascending order and holds one replica of one stage (of each
of its pipeline rank's chunks, under a chunked kind), or one shard of a
replica when the stage splits (``tensor_parallel`` t: each
replica's t ranks are its split group, the ranks of one shard over all
replicas a replica group), at one context rank of the replica when the
stage cuts its sequences (``context_parallel`` c: a replica is c split
groups, the same shard of each a context group; context rank k of one
stage feeds context rank k of the next). A micro-batch entering a stage of R replicas is
split into R contiguous slices (the split the cost model prices), replica j
taking the j-th; between two stages every sender sends each receiver
exactly the samples their slices share, and gradients go back the same way
(each shard of a split sender gets its output's gradient once).
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import _core
from ..errors import IncompatibleInputsError
from ..plan import Plan
from .schedule import Pair, pairs


def _asked(name: str, doc: str | None = None) -> property:
    """A property that asks the core's layout."""
    return property(lambda self: getattr(self.core, name), doc=doc)


def _backward_splits_or_moves(plan: Plan, core: _core.RunLayout) -> bool:
    """Whether some backward of ``plan`` (laid out as ``core``) splits into
    I and W, or runs on other weights than its forward (an asynchronous
    schedule)."""
    if plan.core.schedule_kind in _core.ASYNCHRONOUS_SCHEDULES:
        return True
    return any(a.kind in ("I", "W") for s in core.stages for a in s.actions)


@dataclass(frozen=True)
class Layout:
    """A plan as ranks: the core's own ``RunLayout`` (``core``), asked and
    never re-derived. Picklable, so launched workers get it as it is."""

    core: _core.RunLayout

    @classmethod
    def of(cls, plan: Plan) -> "Layout":
        """The layout of ``plan``; raises InvalidInputError naming the field
        when its stages cannot run, and IncompatibleInputsError where they
        need what this runtime does not run (sequence parallelism, selective
        re-computation: its shards split heads and columns, and it
        checkpoints whole layers or stages; experts spread over a split
        stage, or under a schedule whose backward splits into
        I and W or runs on other weights than its forward: what it runs of
        expert parallelism is Whale's, experts over the replicas)."""
        kind = plan.core.schedule_kind
        shapes = plan.stage_shapes
        # Laid out once, where spread experts or sharded stages need its action lists.
        core = (plan.core.layout() if any(shape.expert_parallel > 1 or shape.shard_level > 1 for shape in shapes)
                else None)
        for i, shape in enumerate(shapes):
            spread = shape.expert_parallel > 1
            refused = (("sequence_parallel", "sequence parallelism") if shape.sequence_parallel else
                       ("shard_level", f"sharding level {shape.shard_level} (FSDP) beside tensor parallelism, "
                        "experts, an offloaded optimizer, or a backward that splits or runs on other weights")
                       if shape.shard_level > 1 and (shape.tensor_parallel > 1 or shape.expert_parallel > 1
                                                     or shape.offload != "none"
                                                     or _backward_splits_or_moves(plan, core)) else
                       ("recompute", "selective re-computation") if shape.recompute == "selective" else
                       ("expert_parallel", "experts spread over a split stage") if spread and shape.tensor_parallel > 1 else
                       ("expert_parallel", f"experts spread under {kind}, whose backward splits or runs on other "
                        "weights") if spread and _backward_splits_or_moves(plan, core) else
                       ("offload", f"an offloaded optimizer under {kind}, whose weight prediction reads the "
                        "optimizer's state") if shape.offload != "none" and kind in _core.ASYNCHRONOUS_SCHEDULES
                       else None)
            if refused:
                raise IncompatibleInputsError(
                    f"field stages[{i}].{refused[0]}: dapple's runtime does not run {refused[1]}; export the plan "
                    "to Megatron-LM, or plan for this runtime with --for torch")
        if (plan.core.hides_grad_reduce and len(plan.stages) > 1) or plan.core.hides_param_gather:
            grad_reduce, param_gather = plan.overlap
            raise IncompatibleInputsError(
                f"field schedule.overlap: value grad_reduce {grad_reduce!r}, param_gather {param_gather}: dapple's "
                "runtime reduces a pipeline's gradients after its backward and gathers nothing behind the forward; "
                "plan for this runtime with --for torch")
        return cls(core if core is not None else plan.core.layout())

    devices = _asked("devices", "Used device ids, ascending: rank r runs on ``devices[r]``.")
    micro_batch_size = _asked("micro_batch_size")
    micro_batches = _asked("micro_batches")
    stages = _asked("stages", "Each stage's layers, replicas and action list (``_core.StageLayout``).")
    world_size = _asked("world_size", "Processes of the run: one per used device.")
    global_batch_size = _asked("global_batch_size")

    @property
    def stage_ranks(self) -> list[list[int]]:
        """Ranks of each stage, in the order of its devices (replica j's
        shards together)."""
        return [[r.rank for r in s.replicas] for s in self.stages]

    @property
    def layer_ranges(self) -> list[tuple[int, int]]:
        return [(s.layer_start, s.layer_end) for s in self.stages]

    @property
    def schedule(self) -> list[list[Pair]]:
        """Each stage's forwards and backwards, ``(kind, micro-batch)``."""
        return pairs(s.actions for s in self.stages)

    def where(self, rank: int) -> tuple[int, int]:
        """(stage, replica index) of ``rank`` (its first stage)."""
        return self.core.where(rank)

    def positions(self, rank: int) -> list[tuple[int, int]]:
        """(stage, replica index) of each stage ``rank`` runs: one, or a
        chunked plan's chunks of its rank, in stage order."""
        return self.core.positions(rank)

    def replica(self, rank: int) -> _core.ReplicaLayout:
        stage, j = self.where(rank)
        return self.stages[stage].replicas[j]
