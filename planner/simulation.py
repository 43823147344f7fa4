"""Discrete-event simulation of one training iteration of a plan."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from . import _core
from .plan import Plan
from .profile import Profile


@dataclass(frozen=True)
class Simulation:
    """Every forward, backward, transfer, AllReduce and optimizer step of one
    iteration (``tasks``), with per-stage bubble share and memory over time."""

    text: str
    data: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "data", json.loads(self.text))

    @property
    def iteration_ms(self) -> float:
        return self.data["iteration_ms"]

    @property
    def stages(self) -> list[dict]:
        return self.data["stages"]

    @property
    def tasks(self) -> list[dict]:
        return self.data["tasks"]

    @property
    def peak_memory_bytes(self) -> float:
        return max(s["peak_memory_bytes"] for s in self.stages)


def simulate(
    plan: Plan | str | os.PathLike,
    profile: Profile | str | os.PathLike,
    *,
    schedule: str | None = None,
    recompute: bool = False,
    overlap_allreduce: bool = True,
) -> Simulation:
    """Simulate ``plan`` with the same stage costs as its estimate.

    ``schedule``: None for the plan's own, "early-backward-1f1b" (DAPPLE,
    warm-up depth from the plan's policy) or "gpipe" (all forwards, then
    all backwards). ``recompute``: keep only each stage's input and re-run
    the forward before the backward. ``overlap_allreduce``: whether a
    data-parallel plan hides its AllReduce behind the last backward."""
    p = plan if isinstance(plan, Plan) else Plan.load(plan)
    prof = profile if isinstance(profile, Profile) else Profile.load(profile)
    return Simulation(
        _core.plan_simulate(
            p.text,
            prof.text,
            schedule=schedule,
            recompute=recompute,
            overlap_allreduce=overlap_allreduce,
            plan_source=p.path,
        )
    )
