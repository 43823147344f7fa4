"""The planner's plan (simulated, against its bound and the fixed warm-up
policies), and the strategy comparison, on the paper's models and
configurations A, B, C.

    python benchmarks/simulation_report.py

Writes benchmarks/results/simulation.json and prints two markdown tables
(used in docs/simulation.md).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from dapple import planner  # noqa: E402
from paper_plans import reference, table_v_cases  # noqa: E402


def main() -> None:
    results = []
    for model, path, gbs in table_v_cases(reference()):
        prof = planner.Profile.load(path)
        for config in "ABC":
            # DAPPLE's schedule: this report studies its warm-up depths.
            eb = "early-backward-1f1b"
            best = planner.plan(prof, config, gbs, schedule=eb)
            sim = planner.simulate(best, prof)
            fixed = {policy: planner.plan(prof, config, gbs, warmup_policy=policy, schedule=eb)
                     for policy in ("A", "B")}
            rows = planner.compare(prof, config, gbs, searched=best)
            sel = best.data["selection"]
            results.append({
                "model": model, "config": config, "gbs": gbs,
                "plan": best.shape, "micro_batches": best.micro_batches,
                "warmup": [s["warmup_micro_batches"] for s in best.stages],
                "estimated_ms": best.estimate["latency_ms"], "simulated_ms": sim.iteration_ms,
                "lower_bound_ms": sel["lower_bound_ms"], "optimal": sel["optimal"],
                **{f"policy_{policy.lower()}": {"plan": p.shape, "estimated_ms": p.estimate["latency_ms"],
                                                "simulated_ms": p.iteration_ms}
                   for policy, p in fixed.items()},
                "bubble_fraction": [round(s["bubble_fraction"], 3) for s in sim.stages],
                "transfer_ms": [round(t["fwd_ms"], 2) for t in best.estimate["transfers"]],
                "stage_fwd_bwd_ms": [round(s["fwd_ms"] + s["bwd_ms"], 2) for s in best.estimate["stages"]],
                "compare": [r.as_dict() for r in rows],
            })
    out = HERE / "results" / "simulation.json"
    out.write_text(json.dumps(results, indent=1) + "\n")

    print("| model | cfg | plan | M | K_i | bound ms | simulated ms | gap | proven | policy A: plan, simulated "
          "| policy B: plan, simulated |")
    print("|---|---|---|--:|---|--:|--:|--:|---|---|---|")
    for r in results:
        gap = (r["simulated_ms"] / r["lower_bound_ms"] - 1) * 100
        a, b = r["policy_a"], r["policy_b"]
        k = ",".join(map(str, r["warmup"]))
        print(f"| {r['model']} | {r['config']} | {r['plan']} | {r['micro_batches']} | {k} | "
              f"{r['lower_bound_ms']:.1f} | {r['simulated_ms']:.1f} | {gap:+.1f}% | "
              f"{'yes' if r['optimal'] else 'no'} | {a['plan']}, {a['simulated_ms']:.1f} | "
              f"{b['plan']}, {b['simulated_ms']:.1f} |")
    print()
    names = ["dapple", "data-parallel (no overlap)", "data-parallel", "gpipe", "straight", "pipedream-planner"]
    print("| model | cfg | " + " | ".join(names) + " | best baseline over DAPPLE |")
    print("|---|---|" + "--:|" * (len(names) + 1))
    for r in results:
        by = {row["strategy"]: row for row in r["compare"]}
        cells = []
        for n in names:
            row = by[n]
            cells.append("does not fit" if row["error"] else f"{row['simulated_ms']:.0f} ({row['shape'] if len(row['shape']) < 10 else str(len(row['shape'].split(':'))) + ' stages'})")
        others = [by[n]["simulated_ms"] for n in names[1:] if not by[n]["error"]]
        vs = f"{min(others) / by['dapple']['simulated_ms']:.2f}x" if others else "-"
        print(f"| {r['model']} | {r['config']} | " + " | ".join(cells) + f" | {vs} |")


if __name__ == "__main__":
    main()
