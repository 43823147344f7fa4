"""Discrete-event simulation of one training iteration of a plan."""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cached_property

from . import _core
from .fileobject import FileObject
from .plan import Plan
from .profile import Profile


@dataclass(frozen=True)
class Simulation(FileObject):
    """Every forward, backward, transfer, AllReduce and optimizer step of one
    iteration (``tasks``), with per-stage bubble share and memory over time:
    the core's own object (``core``, format ``dapple.simulation``). An
    asynchronous schedule runs ``mini_batches`` without a flush, and its
    ``iteration_ms`` is the steady-state time of one mini-batch."""

    core_class = _core.Simulation
    core: _core.Simulation

    @property
    def iteration_ms(self) -> float:
        return self.core.iteration_ms

    @property
    def schedule(self) -> str:
        return self.core.schedule

    @property
    def recompute(self) -> bool:
        return self.core.recompute

    @property
    def mini_batches(self) -> int:
        return self.core.mini_batches

    @property
    def span_ms(self) -> float | None:
        return self.core.span_ms

    @cached_property
    def stages(self) -> list[dict]:
        """Each stage's timeline: bubbles and memory over time (under a
        chunked kind, each rank's, its chunks together)."""
        return self.core.stages

    @property
    def stage_ranks(self) -> list[int]:
        """Under a chunked kind, the rank of each stage (a task's
        ``stage``); empty: stage s is rank s."""
        return self.core.stage_ranks

    @cached_property
    def tasks(self) -> list[dict]:
        """Every forward, backward, transfer, AllReduce and optimizer step."""
        return self.core.tasks

    @property
    def peak_memory_bytes(self) -> float:
        return self.core.peak_memory_bytes

    @property
    def fits_memory(self) -> bool:
        """Every stage's peak within its GPUs' memory."""
        return self.core.fits_memory


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
    warm-up depth from the plan's policy), "gpipe" (all forwards, then
    all backwards), or an asynchronous kind (``ASYNCHRONOUS_SCHEDULES``:
    "xpipe", "pipedream", "spectrain", "async"). ``recompute``: every stage
    keeps only its input and re-runs the forward before the backward
    (torch's checkpoint; under an asynchronous kind the whole forward, on
    the backward's weights); without it, only the stages whose plan says
    ``recompute: full`` do. ``overlap_allreduce``: whether a
    data-parallel plan hides its AllReduce behind the last backward."""
    p = plan if isinstance(plan, Plan) else Plan.load(plan)
    prof = profile if isinstance(profile, Profile) else Profile.load(profile)
    return Simulation(
        _core.simulate(p.core, prof.core, schedule=schedule, recompute=recompute, overlap_allreduce=overlap_allreduce)
    )
