"""Plans (format ``dapple.plan``): search, evaluate, load and save."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from . import _core
from .files import read_text, write_atomic
from .limits import check_count
from .profile import Profile
from .topology import Topology


#: Warm-up policies, the default first: "auto" (K_i searched per stage), "A", "B".
WARMUP_POLICIES: tuple[str, ...] = tuple(_core.warmup_policies())


@dataclass(frozen=True)
class SearchStats:
    micro_batch_sizes: list[int]
    states: int
    stages_costed: int


@dataclass(frozen=True)
class Plan:
    text: str
    search_stats: SearchStats | None = None
    path: str | None = None
    data: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "data", json.loads(self.text))

    @classmethod
    def from_json(cls, text: str, source: str | None = None) -> "Plan":
        return cls(_core.plan_canonical(text, source), path=source)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Plan":
        return cls.from_json(read_text(path), str(path))

    def save(self, path: str | os.PathLike) -> None:
        write_atomic(path, self.text)

    @property
    def stages(self) -> list[dict]:
        return self.data["stages"]

    @property
    def estimate(self) -> dict | None:
        return self.data.get("estimate")

    @property
    def iteration_ms(self) -> float | None:
        """Simulated time of one iteration: the plan's headline and what the
        planner minimises (formula (2), ``estimate["latency_ms"]``, is its
        lower bound). None for a plan without an estimate; version 1 plans,
        which were not simulated, give their formula value."""
        est = self.estimate
        if est is None:
            return None
        return est.get("iteration_ms", est["latency_ms"])

    @property
    def micro_batch_size(self) -> int:
        return self.data["micro_batch_size"]

    @property
    def micro_batches(self) -> int:
        return self.data["micro_batches"]

    @property
    def shape(self) -> str:
        """Replication per stage, e.g. ``"8:8"``; ``"16"`` is data parallelism."""
        return ":".join(str(len(s["devices"])) for s in self.stages)

    @property
    def kind(self) -> str:
        """``"data parallel"``, ``"straight"`` or ``"hybrid"``."""
        if len(self.stages) == 1:
            return "data parallel"
        if all(len(s["devices"]) == 1 for s in self.stages):
            return "straight"
        return "hybrid"

    def blocks_per_stage(self, profile: Profile) -> list[int]:
        """The model's own layers (profile layers of kind "block") per stage."""
        return _core.plan_blocks_per_stage(self.text, profile.text)


def device_ranges(ids: list[int]) -> str:
    """Compact device list: [0, 1, 2, 5] -> "0-2,5"."""
    parts, start = [], None
    for i, d in enumerate(ids):
        if start is None:
            start = d
        if i + 1 == len(ids) or ids[i + 1] != d + 1:
            parts.append(str(start) if start == d else f"{start}-{d}")
            start = None
    return ",".join(parts)


def plan(
    profile: Profile | str | os.PathLike,
    topology: Topology | str,
    global_batch_size: int,
    *,
    warmup_policy: str = "auto",
    min_micro_batch_size: int | None = None,
    micro_batch_sizes: list[int] | None = None,
    search_space: str = "auto",
) -> Plan:
    """Search the plan with the shortest simulated iteration that fits in memory.

    ``profile``: a Profile or a profile JSON path. ``topology``: a Topology,
    a spec such as ``"2x8-nvlink"``, a preset ``"A"``/``"B"``/``"C"`` or a
    topology JSON path. Raises :class:`planner.errors.InfeasibleError` when no
    plan fits in memory, with the smallest memory need found.
    ``warmup_policy``: "auto" (each stage's warm-up depth K_i searched), or
    the fixed "A" (K_i = S - i) or "B" (K_i = 2(S - i) - 1).
    ``search_space``: "full" (every replication and placement), "machine-
    aligned" (stages of a divisor of a machine or whole machines) or "auto"
    (full up to 16 GPUs). The plan's ``selection`` says how it was chosen:
    its simulated time, the smallest bound of the space and whether the
    search proved it optimal (``docs/cost-model.md``).
    """
    gbs = check_count("global_batch_size", global_batch_size)
    if min_micro_batch_size is not None:
        min_micro_batch_size = check_count("min_micro_batch_size", min_micro_batch_size)
    if micro_batch_sizes is not None:
        micro_batch_sizes = [check_count(f"micro_batch_sizes[{i}]", b) for i, b in enumerate(micro_batch_sizes)]
    prof = profile if isinstance(profile, Profile) else Profile.load(profile)
    topo = Topology.resolve(topology)
    text, (sizes, states, costed) = _core.plan_search(
        prof.text,
        topo.text,
        gbs,
        warmup_policy=warmup_policy,
        min_micro_batch_size=min_micro_batch_size,
        micro_batch_sizes=micro_batch_sizes,
        search_space=search_space,
        profile_path=prof.path,
    )
    return Plan(text, SearchStats(list(sizes), states, costed))


def evaluate(plan: Plan | str | os.PathLike, profile: Profile | str | os.PathLike) -> Plan:
    """Cost any plan (hand-written or from another planner) with the same
    model the search uses; returns the plan with a fresh estimate."""
    p = plan if isinstance(plan, Plan) else Plan.load(plan)
    prof = profile if isinstance(profile, Profile) else Profile.load(profile)
    return Plan(_core.plan_evaluate(p.text, prof.text, p.path), path=p.path)


def choose_warmups(plan: Plan | str | os.PathLike, profile: Profile | str | os.PathLike) -> Plan | None:
    """``plan`` (any early-backward or GPipe layout) run as early backward
    under warm-up policy ``auto``, with the K_i per stage that simulate
    fastest within memory, costed; None when no depths fit in memory."""
    p = plan if isinstance(plan, Plan) else Plan.load(plan)
    prof = profile if isinstance(profile, Profile) else Profile.load(profile)
    text = _core.plan_choose_warmups(p.text, prof.text, p.path)
    return None if text is None else Plan(text, path=p.path)
