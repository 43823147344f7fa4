"""Planning time of the ``pipedream-planner`` baseline.

    python benchmarks/pipedream_baseline_speed.py [--repeats 5]

For the cases of tests/data/pipedream-reference.json (five models on
configurations A and B, and GNMT-16 on A, where PipeDream's own optimizer
does not finish in ten minutes), times ``planner.baseline("pipedream-
planner", ...)`` in this process after a warm-up call: PipeDream's
hierarchical plan, then every micro-batch size it can run at costed and
simulated with its best warm-up depths (what ``dapple compare`` does for the
row). Global batch: the paper's (Table V/VII) where it has one, else 16 x
the profiled batch. Reports min and median wall time and writes
benchmarks/results/pipedream_baseline_speed.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

from dapple import planner

ROOT = Path(__file__).resolve().parent.parent
GLOBAL_BATCH = {"VGG-19": 2048, "BERT-24": 128, "BERT-48": 64, "XLNet-36": 128, "AmoebaNet-36": 128, "GNMT-16": 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    reference = json.loads((ROOT / "tests" / "data" / "pipedream-reference.json").read_text())
    rows = []
    for case in reference["cases"]:
        profile = planner.Profile.load(ROOT / case["dapple_profile"])
        gbs = GLOBAL_BATCH[case["model"]]
        call = lambda: planner.baseline("pipedream-planner", profile, case["configuration"], gbs)  # noqa: E731
        plan = call()  # warm-up
        walls = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            call()
            walls.append(time.perf_counter() - t0)
        rows.append({
            "model": case["model"], "configuration": case["configuration"], "global_batch_size": gbs,
            "shape": plan.shape,
            "wall_ms_min": round(min(walls) * 1e3, 1), "wall_ms_median": round(statistics.median(walls) * 1e3, 1),
        })
    out = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "load_average": os.getloadavg()},
        "repeats": args.repeats,
        "rows": rows,
    }
    path = ROOT / "benchmarks" / "results" / "pipedream_baseline_speed.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs; {args.repeats} repeats")
    print()
    print("| model | cfg | GBS | PipeDream's plan (GPUs per stage) | min ms | median ms |")
    print("|---|---|--:|---|--:|--:|")
    for r in rows:
        print(f"| {r['model']} | {r['configuration']} | {r['global_batch_size']} | {r['shape']} "
              f"| {r['wall_ms_min']} | {r['wall_ms_median']} |")


if __name__ == "__main__":
    main()
