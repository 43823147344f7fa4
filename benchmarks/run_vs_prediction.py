"""`dapple run`'s measured iteration time against the prediction for the same
plan, on this machine, with the shipped spec topology and a measured one.

    python benchmarks/run_vs_prediction.py [--cycles 3] [--steps 60]

This VM's speed drifts by tens of percent from minute to minute, and single
iterations vary 2x, so one profile and one run say little. The benchmark runs
``--cycles`` cycles, each of which:

1. profiles the shipped GPT-style model (4 blocks, d_model 64, sequence 32)
   at batch sizes 1, 2, 4, 8 (median of 10, one thread);
2. measures the link between two local gloo processes, as
   `dapple topology measure` does;
3. plans global batch 16 on 2 processes with the spec `1x2-pcie` and with
   the measured topology, and builds the straight 1:1 pipeline baseline on
   each, and simulates every plan on both topologies;
4. runs every distinct plan once for ``--steps`` steps. The measured time is
   the median of rank 0's iteration times after the first 10 steps.

A cycle's error pairs its own profile with its own runs. The table gives the
median over cycles of the measured time, of each prediction and of each error
(with the smallest and largest error), and where the time went (the
runtime's phases, medians over all steady steps, both ranks). Results are
written to benchmarks/results/run_vs_prediction.json.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
from pathlib import Path

from dapple import planner
from dapple.planner.profiler import profile_model
from dapple.planner.runtime.launcher import run_plan
from dapple.planner.runtime import links, models

HERE = Path(__file__).resolve().parent
GBS = 16
SKIP = 10
PHASES = ("compute", "recv_wait", "send_wait", "allreduce", "optimizer", "end_sync")


def one_cycle(spec, factory, batches, steps: int) -> dict:
    profile = profile_model(spec, "gpt", [1, 2, 4, 8], repeats=10, progress=False)
    measured = links.measure_links(2, repeats=30)
    topologies = {
        "1x2-pcie": planner.Topology.from_spec("1x2-pcie"),
        "measured": links.topology_of(measured),
    }
    plans: dict[tuple, dict] = {}  # the same plan may be chosen on both topologies
    for tname, topo in topologies.items():
        for how in ("planner", "straight"):
            if how == "planner":
                p = planner.plan(profile, topo, GBS)
            else:
                p = planner.baseline("straight", profile, topo, GBS)
            key = (p.shape, p.micro_batches, p.micro_batch_size)
            entry = plans.setdefault(key, {"plan": p, "chosen_as": []})
            entry["chosen_as"].append(f"{how} on {tname}")
    rows = {}
    for key, entry in plans.items():
        p = entry["plan"]
        print(f"  running {p.shape}, {p.micro_batches} x {p.micro_batch_size} ...", file=sys.stderr)
        run = run_plan(p, factory, spec.loss, batches, steps, 0.1, start_method="fork")
        simulated = {}
        for tname, topo in topologies.items():
            on = planner.Plan.from_dict({**p.data, "inputs": {**p.data["inputs"], "topology": topo.data}})
            simulated[tname] = planner.simulate(planner.evaluate(on, profile), profile).iteration_ms
        rows[f"{p.shape} {p.micro_batches}x{p.micro_batch_size}"] = {
            "chosen_as": entry["chosen_as"],
            "measured_ms": statistics.median(run.metrics[0]["iteration_ms"][SKIP:]),
            "simulated_ms": simulated,
            "phase_ms": {r: {k: m["phase_ms"][k][SKIP:] for k in PHASES} for r, m in run.metrics.items()},
        }
    return {"link": {k: measured[k] for k in ("latency_us", "bandwidth_gbps", "sizes")}, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cycles", type=int, default=3)
    ap.add_argument("--steps", type=int, default=60)
    args = ap.parse_args()
    import torch

    factory = functools.partial(models.gpt)
    spec = factory()
    gen = torch.Generator().manual_seed(0)
    batches = [spec.make_batch(GBS, gen) for _ in range(4)]
    cycles = []
    for c in range(args.cycles):
        print(f"cycle {c + 1}/{args.cycles}", file=sys.stderr)
        cycles.append(one_cycle(spec, factory, batches, args.steps))

    keys = sorted({k for cy in cycles for k in cy["rows"]})
    summary = []
    for key in keys:
        seen = [cy["rows"][key] for cy in cycles if key in cy["rows"]]
        row = {
            "plan": key,
            "chosen_as": sorted({a for r in seen for a in r["chosen_as"]}),
            "cycles": len(seen),
            "measured_ms": statistics.median(r["measured_ms"] for r in seen),
        }
        for tname in ("1x2-pcie", "measured"):
            errors = [(r["measured_ms"] - r["simulated_ms"][tname]) / r["simulated_ms"][tname] * 100 for r in seen]
            row[tname] = {
                "simulated_ms": statistics.median(r["simulated_ms"][tname] for r in seen),
                "error_percent": statistics.median(errors),
                "error_percent_min": min(errors),
                "error_percent_max": max(errors),
            }
        row["phase_median_ms"] = {
            rank: {k: statistics.median(x for r in seen for x in r["phase_ms"][rank][k]) for k in PHASES}
            for rank in seen[0]["phase_ms"]
        }
        summary.append(row)
    links_seen = [cy["link"] for cy in cycles]
    out = {
        "torch": torch.__version__,
        "model": "dapple.planner.runtime.models:gpt (defaults)",
        "global_batch_size": GBS,
        "cycles": args.cycles,
        "steps": args.steps,
        "skipped_steps_per_run": SKIP,
        "summary": summary,
        "per_cycle": cycles,
    }
    (HERE / "results" / "run_vs_prediction.json").write_text(json.dumps(out, indent=2) + "\n")

    print("measured links: " + ", ".join(f"{lk['latency_us']:.0f} us {lk['bandwidth_gbps']:.1f} Gbit/s"
                                         for lk in links_seen))
    print("| plan | chosen as | measured | 1x2-pcie: simulated, error (range) | measured link: simulated, error (range) |")
    print("|---|---|--:|--:|--:|")
    for r in summary:
        cells = [f"{r[t]['simulated_ms']:.1f} ms, {r[t]['error_percent']:+.0f}% "
                 f"({r[t]['error_percent_min']:+.0f} to {r[t]['error_percent_max']:+.0f}%)" for t in ("1x2-pcie", "measured")]
        print(f"| {r['plan']} | {', '.join(r['chosen_as'])} | {r['measured_ms']:.1f} ms | {cells[0]} | {cells[1]} |")
    print()
    print("| plan | rank | " + " | ".join(PHASES) + " |")
    print("|---|--:|" + "--:|" * len(PHASES))
    for r in summary:
        for rank, ph in r["phase_median_ms"].items():
            print(f"| {r['plan']} | {rank} | " + " | ".join(f"{ph[k]:.1f}" for k in PHASES) + " |")


if __name__ == "__main__":
    main()
