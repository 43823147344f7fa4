"""A simulated iteration as a Chrome trace (the trace-event JSON format
torch.profiler writes), for Perfetto (ui.perfetto.dev) and chrome://tracing.

One process a GPU group (a stage, or under a chunked kind a rank with its
chunks), with two threads: ``compute`` (F, B, I, W, AR, OPT as complete
events, ``ph: "X"``) and ``send`` (the transfers the group sends); a flow
event (``ph: "s"`` then ``"f"``) from each transfer to the pass that
consumes it on the receiving group; the group's memory as a counter
(``ph: "C"``). Times are the simulation's, in microseconds as the format
has them (``ts``, ``dur``); ``displayTimeUnit`` asks viewers to show ms."""

from __future__ import annotations

import json
import os

from .plan import Plan
from .simulation import Simulation

#: The name of each task kind's slice, as the core spells actions (`F3`,
#: `AR`); a transfer is named by what it carries.
SLICE_NAMES = {
    "forward": "F",
    "backward": "B",
    "input_gradient": "I",
    "weight_gradient": "W",
    "all_reduce": "AR",
    "optimizer_step": "OPT",
    "send_forward": "send F",
    "send_backward": "send B",
}
#: A transfer's (from, to) stages relative to its task's stage (its link's
#: first), and the passes of the receiver that consume it.
TRANSFERS = {"send_forward": ((0, 1), ("forward",)), "send_backward": ((1, 0), ("backward", "input_gradient"))}
COMPUTE_THREAD, SEND_THREAD = 1, 2
US_PER_MS = 1000.0


def chrome_trace(plan: Plan, sim: Simulation) -> dict:
    """The trace of ``sim`` (a simulation of ``plan``) as a JSON object."""
    ranks = sim.stage_ranks or list(range(len(plan.data["stages"])))
    groups = len(sim.stages)
    events = _names(plan, ranks, groups)
    consumers = _consumers(sim.tasks)
    flow_id = 0
    for task in sim.tasks:
        kind, stage, mb = task["kind"], task["stage"], task.get("micro_batch")
        name = SLICE_NAMES[kind] + ("" if mb is None or kind in TRANSFERS else str(mb))
        args = {"stage": stage, "kind": kind}
        if mb is not None:
            args["micro_batch"] = mb
        if kind not in TRANSFERS:
            events.append(_slice(name, ranks[stage], COMPUTE_THREAD, task["start_ms"], task["end_ms"], args))
            continue
        # A transfer's stage is its link's, between stages s and s + 1:
        # forward from s, backward from s + 1.
        (from_stage, to_stage), consuming = TRANSFERS[kind]
        from_stage, to_stage = stage + from_stage, stage + to_stage
        args["to_stage"] = to_stage
        sender = ranks[from_stage]
        events.append(_slice(name, sender, SEND_THREAD, task["start_ms"], task["end_ms"], args))
        # The flow ends at the receiver's first consuming pass once the data is in.
        starts = [s for s in consumers.get((to_stage, consuming, mb), []) if s >= task["end_ms"] - 1e-9]
        arrive_ms = min(starts) if starts else task["end_ms"]
        flow_id += 1
        common = {"name": name, "cat": "transfer", "id": flow_id}
        events.append({**common, "ph": "s", "pid": sender, "tid": SEND_THREAD, "ts": task["start_ms"] * US_PER_MS})
        events.append(
            {**common, "ph": "f", "bp": "e", "pid": ranks[to_stage], "tid": COMPUTE_THREAD, "ts": arrive_ms * US_PER_MS}
        )
    for group, timeline in enumerate(sim.stages):
        for ms, held in timeline["memory"]:
            events.append(
                {"name": "memory", "ph": "C", "pid": group, "tid": COMPUTE_THREAD, "ts": ms * US_PER_MS,
                 "args": {"bytes": held}}
            )
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "model": plan.data["inputs"]["model"],
            "shape": plan.shape,
            "schedule": sim.schedule,
            "recompute": sim.recompute,
            "micro_batches": plan.micro_batches,
            "micro_batch_size": plan.micro_batch_size,
            "iteration_ms": sim.iteration_ms,
        },
    }


def write_trace(plan: Plan, sim: Simulation, path: str | os.PathLike) -> None:
    """Write the trace of ``sim`` to ``path`` (a new file: callers write it
    beside its target and rename it, as every output is written)."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(chrome_trace(plan, sim), f, separators=(",", ":"))


def _slice(name: str, pid: int, tid: int, start_ms: float, end_ms: float, args: dict) -> dict:
    return {
        "name": name, "cat": args["kind"], "ph": "X", "pid": pid, "tid": tid,
        "ts": start_ms * US_PER_MS, "dur": (end_ms - start_ms) * US_PER_MS, "args": args,
    }


def _consumers(tasks: list[dict]) -> dict[tuple[int, tuple[str, ...], int], list[float]]:
    """(stage, the kinds a transfer feeds, micro-batch) -> start times of
    that stage's passes of those kinds for that micro-batch."""
    found: dict = {}
    for _, kinds in TRANSFERS.values():
        for task in tasks:
            if task["kind"] in kinds:
                found.setdefault((task["stage"], kinds, task.get("micro_batch")), []).append(task["start_ms"])
    return found


def _names(plan: Plan, ranks: list[int], groups: int) -> list[dict]:
    """Metadata events: each group's process name (its stages and GPUs),
    in pipeline order, and its two threads' names."""
    stages = plan.data["stages"]
    events = []
    for group in range(groups):
        own = [s for s, r in enumerate(ranks) if r == group]
        devices = stages[own[0]]["devices"]
        gpus = _gpus(devices)
        label = f"stage {group}" if len(own) == 1 and own[0] == group else f"rank {group} (stages {', '.join(map(str, own))})"
        events += [
            {"name": "process_name", "ph": "M", "pid": group, "tid": 0, "ts": 0, "args": {"name": f"{label}, {gpus}"}},
            {"name": "process_sort_index", "ph": "M", "pid": group, "tid": 0, "ts": 0, "args": {"sort_index": group}},
            {"name": "thread_name", "ph": "M", "pid": group, "tid": COMPUTE_THREAD, "ts": 0, "args": {"name": "compute"}},
            {"name": "thread_name", "ph": "M", "pid": group, "tid": SEND_THREAD, "ts": 0, "args": {"name": "send"}},
        ]
    return events


def _gpus(devices: list[int]) -> str:
    """`GPU 3`, `GPUs 0-7` for a run, else `GPUs 0,2,5`."""
    if len(devices) == 1:
        return f"GPU {devices[0]}"
    if devices == list(range(devices[0], devices[-1] + 1)):
        return f"GPUs {devices[0]}-{devices[-1]}"
    return "GPUs " + ",".join(map(str, devices))
