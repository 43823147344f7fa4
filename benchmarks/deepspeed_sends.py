"""What DeepSpeed's blocking sends cost BLOOM's pipeline, which dapple's
simulator does not model (docs/published-runs.md).

BLOOM trained under DeepSpeed's pipeline engine, whose sends and receives
block until both sides meet (``deepspeed/runtime/pipe/p2p.py``: ``send``
and ``recv`` assert ``async_op == False`` and call ``dist.send`` /
``dist.recv``), in the order of its ``TrainSchedule``
(``deepspeed/runtime/pipe/schedule.py``; both read at microsoft/DeepSpeed
56c5223, 2022-04-19, during BLOOM's training). dapple's simulator lets a
transfer overlap the computation after it. This replays that schedule on
the stage times and transfers dapple costs for BLOOM's published layout
(``published_runs.published_plan``), once with every transfer blocking both
sides and once with sends that do not block the sender, and writes both
times beside the simulator's to benchmarks/results/deepspeed_sends.json
(``beyond_simulated_s``: what DeepSpeed's order and blocking add to the
simulated pipeline).

    python benchmarks/deepspeed_sends.py    # a few seconds
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from plan_speed import build_info, machine_info  # noqa: E402
from published_runs import DEFAULT_RUNS, published_plan  # noqa: E402

OUT = HERE / "results" / "deepspeed_sends.json"
RUN_ID = "bloom-176b"


def train_schedule(stage: int, stages: int, micro_batches: int) -> list[tuple]:
    """One stage's instructions under DeepSpeed's TrainSchedule, in order:
    ("send" | "recv", peer stage, (what, micro-batch)) and ("F" | "B",
    micro-batch). Even stages run a forward on even steps, odd stages on
    odd steps; a step first exchanges what the previous step made."""

    def micro_batch_of(step: int) -> tuple[int, bool]:
        if step % 2 == stage % 2:  # a forward step
            return (step - stage % 2) // 2 - stage // 2, True
        if step % 2 == 0:
            return step // 2 - stages + (stage + 1) // 2, False
        return (step - 1) // 2 - stages + 1 + stage // 2, False

    def valid(m: int) -> bool:
        return 0 <= m < micro_batches

    commands, previous = [], -1
    for step in range(2 * (micro_batches + stages - 1)):
        m, forward = micro_batch_of(step)
        if forward and stage > 0:
            if valid(m):
                commands.append(("recv", stage - 1, ("activation", m)))
            if valid(previous):
                commands.append(("send", stage - 1, ("gradient", previous)))
        elif not forward and stage < stages - 1:
            if valid(previous):
                commands.append(("send", stage + 1, ("activation", previous)))
            if valid(m):
                commands.append(("recv", stage + 1, ("gradient", m)))
        if valid(m):
            commands.append(("F" if forward else "B", m))
        previous = m
    return commands


def replay(fwd_ms: list[float], bwd_ms: list[float], transfer_ms: list[tuple[float, float]], micro_batches: int,
           blocking: bool) -> float:
    """The iteration's milliseconds: every stage runs its instructions in
    order; a transfer over boundary i (activations forward, gradients
    back) takes ``transfer_ms[i]``. Blocking: both sides wait until both
    have reached it, then for the transfer. Otherwise the sender goes on
    and the receiver waits for the data only."""
    stages = len(fwd_ms)
    programs = [train_schedule(s, stages, micro_batches) for s in range(stages)]
    at, clock = [0] * stages, [0.0] * stages
    posted: dict[tuple, tuple[float, int]] = {}  # a transfer one side reached: (its clock, that side)
    moved = True
    while moved:
        moved = False
        for s in range(stages):
            while at[s] < len(programs[s]):
                command = programs[s][at[s]]
                if command[0] in ("F", "B"):
                    clock[s] += (fwd_ms if command[0] == "F" else bwd_ms)[s]
                    at[s] += 1
                    moved = True
                    continue
                kind, peer, (what, m) = command
                sender, receiver = (s, peer) if kind == "send" else (peer, s)
                key = (what, m, sender, receiver)
                ms = transfer_ms[min(sender, receiver)][0 if what == "activation" else 1]
                if not blocking and kind == "send":
                    posted[key] = (clock[s], s)  # handed to the network; the sender goes on
                    at[s] += 1
                    moved = True
                    continue
                if key not in posted or posted[key][1] == s:
                    posted.setdefault(key, (clock[s], s))
                    break  # waits for the other side
                other_clock, other = posted.pop(key)
                done = max(other_clock, clock[s]) + ms
                clock[s], at[s] = done, at[s] + 1
                if blocking:
                    clock[other], at[other] = done, at[other] + 1
                moved = True
    assert all(at[s] == len(programs[s]) for s in range(stages)), "the schedule deadlocked"
    return max(clock)


def main() -> None:
    from dapple import planner

    runs = json.loads(DEFAULT_RUNS.read_text())["runs"]
    run = next(r for r in runs if r["id"] == RUN_ID)
    with tempfile.TemporaryDirectory() as tmp:
        published = published_plan(run, Path(tmp))
    plan, profile = published.plan, published.profile
    estimate = plan.estimate
    stages = estimate["stages"]
    fwd_ms = [s["fwd_ms"] for s in stages]
    bwd_ms = [s["bwd_ms"] for s in stages]
    transfer_ms = [(t["fwd_ms"], t["bwd_ms"]) for t in estimate["transfers"]]
    micro_batches = plan.micro_batches  # a pipeline's, of the iteration
    results = {
        "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(), "build": build_info(), "run": RUN_ID, "micro_batches": micro_batches,
        "simulated_s": planner.simulate(plan, profile).iteration_ms / 1e3,
        "exposed_gradient_reduction_s": max(s["exposed_allreduce_ms"] for s in stages) / 1e3,
        "replayed_blocking_s": replay(fwd_ms, bwd_ms, transfer_ms, micro_batches, blocking=True) / 1e3,
        "replayed_overlapped_s": replay(fwd_ms, bwd_ms, transfer_ms, micro_batches, blocking=False) / 1e3,
    }
    results["blocking_costs_s"] = results["replayed_blocking_s"] - results["replayed_overlapped_s"]
    # DeepSpeed's order and its blocking, against the simulator's schedule
    # (its iteration less the gradient reduction after the last backward).
    results["beyond_simulated_s"] = results["replayed_blocking_s"] - (
        results["simulated_s"] - results["exposed_gradient_reduction_s"])
    OUT.parent.mkdir(parents=True, exist_ok=True)
    tmp_out = OUT.with_suffix(".tmp")
    tmp_out.write_text(json.dumps(results, indent=1) + "\n")
    os.replace(tmp_out, OUT)
    print(json.dumps({k: v for k, v in results.items() if k not in ("machine", "build")}, indent=1))


if __name__ == "__main__":
    main()
