"""Table V of the paper (planning results, configurations A, B, C) against ours.

For every row: our plan, the paper's plan rebuilt from its shape and split and
simulated with our model and the warm-up depths our planner would give it
(benchmarks/paper_plans.py), and our plan with the
micro-batch floor lowered to one sample (how the paper's planner could scale
profiles). Writes benchmarks/results/table_v.json and prints a markdown table.

    python benchmarks/table_v.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from dapple import planner  # noqa: E402
from paper_plans import paper_plan, reference, shipped_profiles  # noqa: E402

def describe(plan: planner.Plan | None, profile: planner.Profile) -> dict | None:
    if plan is None:
        return None
    e = plan.estimate
    return {
        "shape": plan.shape,
        "kind": plan.kind,
        "schedule": plan.core.schedule_kind,
        "split": ":".join(map(str, plan.blocks_per_stage(profile))),
        "micro_batch_size": plan.micro_batch_size,
        "micro_batches": plan.micro_batches,
        "simulated_ms": round(plan.iteration_ms, 1),
        "latency_ms": round(e["latency_ms"], 1),
        "warmup": [st["warmup_micro_batches"] for st in plan.stages],
        "warmup_ms": round(e["warmup_ms"], 1),
        "steady_ms": round(e["steady_ms"], 1),
        "ending_ms": round(e["ending_ms"], 1),
        "peak_memory_gib": round(e["peak_memory_bytes"] / 2**30, 2),
        "stages": [
            {k: round(s[k], 1) for k in ("fwd_ms", "bwd_ms", "exposed_allreduce_ms")} for s in e["stages"]
        ],
        "transfer_ms": [round(t["fwd_ms"], 1) for t in e["transfers"]],
    }


def main() -> None:
    ref = reference()
    loaded = {model: planner.Profile.load(path) for model, path in shipped_profiles(ref).items()}
    rows = []
    for row in ref["table_V_planning_results"]:
        if row["model"] not in loaded:
            continue
        prof = loaded[row["model"]]
        topo = planner.Topology.resolve(row["config"])
        # DAPPLE's schedule, as the paper plans; `--schedule auto` beside it.
        eb = "early-backward-1f1b"
        ours = planner.plan(prof, topo, row["gbs"], schedule=eb)
        ours_min1 = planner.plan(prof, topo, row["gbs"], min_micro_batch_size=1, schedule=eb)
        ours_auto = planner.plan(prof, topo, row["gbs"])
        theirs = paper_plan(prof, topo, row["gbs"], row)
        rows.append({
            "model": row["model"], "config": row["config"], "gbs": row["gbs"],
            "paper": {"plan": row["plan"], "split": row.get("split")},
            "ours": describe(ours, prof),
            "ours_min_slice_1": describe(ours_min1, prof),
            "ours_schedule_auto": describe(ours_auto, prof),
            "paper_plan_in_our_model": describe(theirs, prof),
        })
    out = HERE / "results" / "table_v.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(rows, indent=1) + "\n")
    print("| model | cfg | paper | ours | ours, simulated ms | paper's plan, our model, simulated ms "
          "| ours with 1-sample slices, simulated ms | ours, --schedule auto, simulated ms |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        p = r["paper"]
        paper = p["plan"] + (f" ({p['split']})" if p["split"] else "")
        o = r["ours"]
        ours = f"{o['shape']} ({o['split']}), {o['micro_batches']}x{o['micro_batch_size']}"
        t = r["paper_plan_in_our_model"]
        tl = f"{t['simulated_ms']} ({t['micro_batches']}x{t['micro_batch_size']})" if t else "does not fit"
        m = r["ours_min_slice_1"]
        m1 = f"{m['shape']} ({m['split']}), {m['micro_batches']}x{m['micro_batch_size']}, {m['simulated_ms']}"
        a = r["ours_schedule_auto"]
        auto = f"{a['simulated_ms']} ({a['schedule']}{', ' + a['shape'] if a['shape'] != o['shape'] else ''})"
        print(f"| {r['model']} | {r['config']} | {paper} | {ours} | {o['simulated_ms']} | {tl} | {m1} | {auto} |")


if __name__ == "__main__":
    main()
