"""What each process of a run does, as the core lays it out from a plan
(``rust_core/core/src/layout.rs``, crossing the binding as
``planner._core.RunLayout``): no torch here, and no rule of its own.

One process (rank) per device the plan uses: rank r runs on the r-th used
device id in ascending order and holds one replica of one stage. A
micro-batch entering a stage of R replicas is split into R contiguous slices
(the split the cost model prices), replica j taking the j-th; between two
stages every sender sends each receiver exactly the samples their slices
share, and gradients go back the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import _core
from ..plan import Plan


@dataclass(frozen=True)
class Layout:
    """A plan as ranks: the core's own ``RunLayout`` (``core``), asked and
    never re-derived. Picklable, so launched workers get it as it is."""

    core: _core.RunLayout

    @classmethod
    def of(cls, plan: Plan) -> "Layout":
        """The layout of ``plan``; raises InvalidInputError naming the field
        when its stages cannot run."""
        return cls(plan.core.layout())

    @property
    def devices(self) -> tuple[int, ...]:
        return self.core.devices

    @property
    def micro_batch_size(self) -> int:
        return self.core.micro_batch_size

    @property
    def micro_batches(self) -> int:
        return self.core.micro_batches

    @property
    def stages(self) -> tuple[_core.StageLayout, ...]:
        return self.core.stages

    @property
    def world_size(self) -> int:
        return self.core.world_size

    @property
    def global_batch_size(self) -> int:
        return self.core.global_batch_size

    @property
    def stage_ranks(self) -> list[list[int]]:
        """Ranks of each stage, by replica index."""
        return [[r.rank for r in s.replicas] for s in self.stages]

    @property
    def layer_ranges(self) -> list[tuple[int, int]]:
        return [(s.layer_start, s.layer_end) for s in self.stages]

    @property
    def schedule(self) -> list[list[tuple[str, int]]]:
        """Each stage's forwards and backwards, ``(kind, micro-batch)``."""
        return [[(a.kind, a.micro_batch) for a in s.actions if a.micro_batch is not None] for s in self.stages]

    def where(self, rank: int) -> tuple[int, int]:
        """(stage, replica index) of ``rank``."""
        return self.core.where(rank)

    def replica(self, rank: int) -> _core.ReplicaLayout:
        stage, j = self.where(rank)
        return self.stages[stage].replicas[j]
