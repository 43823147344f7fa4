"""Mixed speeds measured on this machine (issue 9): two gloo processes, one
made slower on purpose (`dapple run --slowdown 1=FACTOR`, experiment only),
stand for two GPUs of unequal speed.

1. Profile a small GPT (`planner.profiler.profile_model`) at batch sizes
   1..16 on this machine.
2. Measure the two processes' speeds: run data parallelism with equal
   slices and compare each rank's compute time per step.
3. Make a topology from the measured speeds (one "GPU" per machine group,
   the link measured by `topology measure`), and plan on it: equal slices
   (`data-parallel`) and Whale's balanced slices (`whale-data-parallel`).
4. Run both, slowed the same way, and compare the measured iteration with
   each other and with the simulation.

Writes benchmarks/results/whale_measured.json and prints a table.

    python benchmarks/whale_measured.py [--slowdown 2.0] [--steps 20]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

from dapple import planner  # noqa: E402
from dapple.planner.profiler import profile_model  # noqa: E402
from dapple.planner.runtime import links, models  # noqa: E402
from dapple.planner.runtime.data import SeededBatches  # noqa: E402
from dapple.planner.runtime.launcher import run_plan  # noqa: E402

CONFIG = dict(n_layers=4, d_model=128, n_heads=4, seq=64, vocab=256)
GBS = 32
SKIP = 3  # warm-up steps left out of the medians


def median_after_warmup(values: list[float]) -> float:
    return statistics.median(values[SKIP:])


def run(plan: planner.Plan, factory, spec, steps: int, slowdown: float):
    batches = SeededBatches(factory, GBS, steps, seed=0)
    return run_plan(plan, factory, spec.loss, batches, steps, 0.05, start_method="fork", slowdown={1: slowdown})


def two_speed_topology(link: planner.Topology, speed: float) -> planner.Topology:
    """Two one-"GPU" machine groups on the measured link: rank 0 at speed 1,
    rank 1 at `speed`."""
    data = link.data
    group = data["machine_groups"][0]
    one = lambda name, s: {**group, "machines": 1, "gpus_per_machine": 1,  # noqa: E731
                           "gpu": {**group["gpu"], "type": name, "relative_speed": s}}
    return planner.Topology.from_dict({
        "name": f"local 2 processes, rank 1 at {speed:.3f} of rank 0 (measured)",
        "machine_groups": [one("process", 1.0), one("slowed process", speed)],
        "inter_machine": group["intra_machine"],
    })


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--slowdown", type=float, default=2.0)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    factory = functools.partial(models.gpt, **CONFIG)
    spec = factory()
    print("profiling ...", file=sys.stderr)
    profile = profile_model(spec, "gpt", [1, 2, 4, 8, 16], repeats=5, progress=False)
    print("measuring the link ...", file=sys.stderr)
    link = links.topology_of(links.measure_links(2, repeats=20))
    # Speeds: equal slices, each rank's compute per step.
    even_on_link = planner.baseline("data-parallel", profile, link, GBS)
    measured = run(even_on_link, factory, spec, args.steps, args.slowdown)
    compute = {r: median_after_warmup(m["phase_ms"]["compute"]) for r, m in measured.metrics.items()}
    speed = compute[0] / compute[1]
    topology = two_speed_topology(link, speed)
    rows = {}
    for name in ("data-parallel", "whale-data-parallel"):
        plan = planner.baseline(name, profile, topology, GBS)
        result = run(plan, factory, spec, args.steps, args.slowdown)
        rows[name] = {
            "slices": plan.stages[0].get("slices"),
            "micro_batches": f"{plan.micro_batches}x{plan.micro_batch_size}",
            "simulated_ms": plan.iteration_ms,
            "measured_ms": median_after_warmup(result.metrics[0]["iteration_ms"]),
            "compute_ms": {r: median_after_warmup(m["phase_ms"]["compute"]) for r, m in result.metrics.items()},
        }
    out = {
        "machine": {"cpus": os.cpu_count(), "load_average_at_start": os.getloadavg()[0]},
        "model": CONFIG, "global_batch_size": GBS, "steps": args.steps, "slowdown_rank_1": args.slowdown,
        "measured_compute_ms_equal_slices": compute, "measured_relative_speed": speed, "rows": rows,
    }
    (HERE / "results" / "whale_measured.json").write_text(json.dumps(out, indent=1) + "\n")
    print(f"rank 1 measured at {speed:.3f} of rank 0's speed (slowdown {args.slowdown})")
    print("| slices | plan | simulated ms | measured ms | rank 0 compute ms | rank 1 compute ms |")
    print("|---|---|--:|--:|--:|--:|")
    for name, r in rows.items():
        print(f"| {name} {r['slices']} | {r['micro_batches']} | {r['simulated_ms']:.1f} | {r['measured_ms']:.1f} | "
              f"{r['compute_ms'][0]:.1f} | {r['compute_ms'][1]:.1f} |")
    gain = rows["data-parallel"]["measured_ms"] / rows["whale-data-parallel"]["measured_ms"]
    predicted = rows["data-parallel"]["simulated_ms"] / rows["whale-data-parallel"]["simulated_ms"]
    print(f"balanced over equal: measured {gain:.2f}x, simulated {predicted:.2f}x")


if __name__ == "__main__":
    main()
