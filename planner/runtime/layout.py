"""What each process of a run does, as the core lays it out from a plan
(``rust_core/core/src/layout.rs``): no torch here, and no rule of its own.

One process (rank) per device the plan uses: rank r runs on the r-th used
device id in ascending order and holds one replica of one stage. A
micro-batch entering a stage of R replicas is split into R contiguous slices
(the split the cost model prices), replica j taking the j-th; between two
stages every sender sends each receiver exactly the samples their slices
share, and gradients go back the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..plan import Plan

#: A forward ("F", m) or backward ("B", m) of micro-batch m.
Action = tuple[str, int]


@dataclass(frozen=True)
class Peer:
    """Samples ``[start, end)`` of each micro-batch exchanged with ``rank``."""

    rank: int
    start: int
    end: int


@dataclass(frozen=True)
class Replica:
    rank: int
    #: Samples ``[start, end)`` of every micro-batch this replica computes.
    start: int
    end: int
    receives_from: tuple[Peer, ...]
    sends_to: tuple[Peer, ...]


@dataclass(frozen=True)
class StageLayout:
    layer_start: int
    layer_end: int
    replicas: tuple[Replica, ...]
    #: The stage's forwards and backwards in order (the AllReduce and the
    #: optimizer step that end every list are the worker's to run).
    actions: tuple[Action, ...]


@dataclass(frozen=True)
class Layout:
    """A plan as ranks: picklable, so launched workers get it as it is."""

    devices: tuple[int, ...]
    micro_batch_size: int
    micro_batches: int
    stages: tuple[StageLayout, ...]

    @classmethod
    def of(cls, plan: Plan) -> "Layout":
        """The layout of ``plan``; raises InvalidInputError naming the field
        when its stages cannot run."""
        data = plan.core.layout()
        stages = tuple(
            StageLayout(
                layer_start=s["layer_start"],
                layer_end=s["layer_end"],
                replicas=tuple(
                    Replica(
                        rank=r["rank"],
                        start=r["start"],
                        end=r["end"],
                        receives_from=tuple(Peer(**p) for p in r["receives_from"]),
                        sends_to=tuple(Peer(**p) for p in r["sends_to"]),
                    )
                    for r in s["replicas"]
                ),
                actions=tuple((t[0], int(t[1:])) for t in s["actions"] if t[0] in "FB"),
            )
            for s in data["stages"]
        )
        return cls(tuple(data["devices"]), data["micro_batch_size"], data["micro_batches"], stages)

    @property
    def world_size(self) -> int:
        return len(self.devices)

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.micro_batches

    @property
    def stage_ranks(self) -> list[list[int]]:
        """Ranks of each stage, by replica index."""
        return [[r.rank for r in s.replicas] for s in self.stages]

    @property
    def layer_ranges(self) -> list[tuple[int, int]]:
        return [(s.layer_start, s.layer_end) for s in self.stages]

    @property
    def schedule(self) -> list[list[Action]]:
        """Each stage's forwards and backwards."""
        return [list(s.actions) for s in self.stages]

    def where(self, rank: int) -> tuple[int, int]:
        """(stage, replica index) of ``rank``."""
        for s, stage in enumerate(self.stages):
            for j, r in enumerate(stage.replicas):
                if r.rank == rank:
                    return s, j
        raise ValueError(f"rank {rank} is not in the plan")

    def replica(self, rank: int) -> Replica:
        stage, j = self.where(rank)
        return self.stages[stage].replicas[j]
