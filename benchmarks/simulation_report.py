"""Simulated against analytic time for every best plan, and the strategy
comparison, on the paper's models and configurations A, B, C.

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

import planner  # noqa: E402
from paper_plans import reference, table_v_cases  # noqa: E402


def main() -> None:
    results = []
    for model, path, gbs in table_v_cases(reference()):
        prof = planner.Profile.load(path)
        for config in "ABC":
            best = planner.plan(prof, config, gbs)
            sim = planner.simulate(best, prof)
            best_b = planner.plan(prof, config, gbs, warmup_policy="B")
            sim_b = planner.simulate(best_b, prof)
            rows = planner.compare(prof, config, gbs, searched=best)
            results.append({
                "model": model, "config": config, "gbs": gbs,
                "plan": best.shape, "micro_batches": best.micro_batches,
                "estimated_ms": best.estimate["latency_ms"], "simulated_ms": sim.iteration_ms,
                "policy_b": {"plan": best_b.shape, "estimated_ms": best_b.estimate["latency_ms"],
                             "simulated_ms": sim_b.iteration_ms},
                "bubble_fraction": [round(s["bubble_fraction"], 3) for s in sim.stages],
                "transfer_ms": [round(t["fwd_ms"], 2) for t in best.estimate["transfers"]],
                "stage_fwd_bwd_ms": [round(s["fwd_ms"] + s["bwd_ms"], 2) for s in best.estimate["stages"]],
                "compare": [r.as_dict() for r in rows],
            })
    out = HERE / "results" / "simulation.json"
    out.write_text(json.dumps(results, indent=1) + "\n")

    print("| model | cfg | plan | M | estimate ms | simulated ms | gap | largest transfer / stage F+B "
          "| policy B: plan, estimate, simulated |")
    print("|---|---|---|--:|--:|--:|--:|--:|---|")
    for r in results:
        gap = (r["simulated_ms"] / r["estimated_ms"] - 1) * 100
        ratio = max(r["transfer_ms"], default=0) / max(r["stage_fwd_bwd_ms"])
        b = r["policy_b"]
        print(f"| {r['model']} | {r['config']} | {r['plan']} | {r['micro_batches']} | {r['estimated_ms']:.1f} | "
              f"{r['simulated_ms']:.1f} | {gap:+.1f}% | {ratio:.2f} | {b['plan']}, {b['estimated_ms']:.1f}, "
              f"{b['simulated_ms']:.1f} |")
    print()
    names = ["dapple", "data-parallel (no overlap)", "data-parallel", "gpipe", "straight", "pipedream-planner"]
    print("| model | cfg | " + " | ".join(names) + " | DAPPLE vs best DP |")
    print("|---|---|" + "--:|" * (len(names) + 1))
    for r in results:
        by = {row["strategy"]: row for row in r["compare"]}
        cells = []
        for n in names:
            row = by[n]
            cells.append("does not fit" if row["error"] else f"{row['simulated_ms']:.0f} ({row['shape'] if len(row['shape']) < 10 else str(len(row['shape'].split(':'))) + ' stages'})")
        dps = [by[n]["simulated_ms"] for n in ("data-parallel", "data-parallel (no overlap)") if not by[n]["error"]]
        vs = f"{min(dps) / by['dapple']['simulated_ms']:.2f}x" if dps else "DP does not fit"
        vs_b = f"{min(dps) / r['policy_b']['simulated_ms']:.2f}x" if dps else "-"
        print(f"| {r['model']} | {r['config']} | " + " | ".join(cells) + f" | {vs} (policy B: {vs_b}) |")


if __name__ == "__main__":
    main()
