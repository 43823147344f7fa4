"""DAPPLE's plan against the usual alternatives, all run in the simulator."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

from . import _core
from .errors import DappleError
from .plan import Plan, plan
from .profile import Profile
from .simulation import simulate
from .topology import Topology

BASELINES = ("data-parallel", "gpipe", "straight", "pipedream-planner")


def baseline(
    kind: str,
    profile: Profile | str | os.PathLike,
    topology: Topology | str,
    global_batch_size: int,
    *,
    min_micro_batch_size: int | None = None,
    warmup_policy: str = "A",
) -> Plan:
    """The plan of a baseline strategy (one of ``BASELINES``) at its fastest
    micro-batch size that fits: data parallelism on every GPU; GPipe and
    straight pipelines with balanced blocks of layers, one GPU per stage;
    PipeDream's planner (its asynchronous objective), run synchronously."""
    prof = profile if isinstance(profile, Profile) else Profile.load(profile)
    topo = Topology.resolve(topology)
    return Plan(
        _core.plan_baseline(
            kind,
            prof.text,
            topo.text,
            int(global_batch_size),
            min_micro_batch_size=min_micro_batch_size,
            warmup_policy=warmup_policy,
        )
    )


@dataclass(frozen=True)
class Row:
    strategy: str
    shape: str | None
    micro_batches: int | None
    micro_batch_size: int | None
    schedule: str | None
    simulated_ms: float | None
    estimated_ms: float | None
    speedup: float | None
    peak_memory_bytes: float | None
    error: str | None = None

    def as_dict(self) -> dict:
        return asdict(self)


def compare(
    profile: Profile | str | os.PathLike,
    topology: Topology | str,
    global_batch_size: int,
    *,
    min_micro_batch_size: int | None = None,
) -> list[Row]:
    """One row per strategy: DAPPLE's searched plan, data parallelism
    without and with AllReduce overlap, GPipe, a straight pipeline and
    PipeDream's planner. Times are simulated iterations; speedups are over
    one GPU running every micro-batch in turn."""
    prof = profile if isinstance(profile, Profile) else Profile.load(profile)
    topo = Topology.resolve(topology)
    candidates: list[tuple[str, callable, bool]] = [
        ("dapple", lambda: plan(prof, topo, global_batch_size, min_micro_batch_size=min_micro_batch_size), True),
        ("data-parallel (no overlap)", lambda: baseline("data-parallel", prof, topo, global_batch_size,
                                                        min_micro_batch_size=min_micro_batch_size), False),
    ] + [
        (kind, (lambda k=kind: baseline(k, prof, topo, global_batch_size, min_micro_batch_size=min_micro_batch_size)),
         True)
        for kind in BASELINES
    ]
    rows = []
    for name, make, overlap in candidates:
        try:
            p = make()
        except DappleError as e:
            rows.append(Row(name, None, None, None, None, None, None, None, None, error=str(e)))
            continue
        sim = simulate(p, prof, overlap_allreduce=overlap)
        single = p.estimate["single_device_ms"]
        rows.append(
            Row(
                strategy=name,
                shape=p.shape,
                micro_batches=p.micro_batches,
                micro_batch_size=p.micro_batch_size,
                schedule=p.data["schedule"]["kind"],
                simulated_ms=sim.iteration_ms,
                estimated_ms=p.estimate["latency_ms"],
                speedup=single / sim.iteration_ms,
                peak_memory_bytes=sim.peak_memory_bytes,
            )
        )
    return rows
