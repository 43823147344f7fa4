"""What planning for a runtime costs: `dapple plan --for TARGET` against the
free plan, on every shipped transformer config on two clusters.

    python benchmarks/targets_cost.py [--out benchmarks/results/targets_cost.json]
    python benchmarks/targets_cost.py --table   # the markdown table of docs/export.md, from the results file

Each config is profiled as a user profiled it before issue 45
(``planner.transformer_profile`` at an efficiency of 0.5, the default then,
bf16, sequence 4096; GPT-3 at its 2048), planned
free and for each target (``planner.plan_for``) at a global batch of 512,
and the target's plan exported as ``dapple export`` writes it, without
``--approximate`` (a refusal is recorded as a failure). Since issue 45's
overlap each target's cost is against the free plan under the target's
own overlap (``targets.TARGET_OVERLAP``). The table in ``docs/export.md``
quotes the results file.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from plan_speed import build_info, machine_info  # noqa: E402

CLUSTERS = {"A100-80GB": "16x8-a100-80gb", "H100-80GB": "32x8-h100"}
GLOBAL_BATCH = 512


def table(results: dict) -> str:
    """One row a config and cluster: the free plan, then each target's time
    over the free plan's (or why it has none)."""
    from dapple import planner

    lines = ["| config | cluster | free plan (kind, shape), ms | " + " | ".join(planner.TARGETS) + " |",
             "|---|---|---|" + "---|" * len(planner.TARGETS)]
    by_case: dict = {}
    for row in results["rows"]:
        by_case.setdefault((row["config"], row["cluster"]), []).append(row)
    for (config, cluster), rows in by_case.items():
        free = next((r for r in rows if "free_ms" in r), None)
        if free is None:
            lines.append(f"| {config} | {cluster} | {rows[0]['error'][:80]} |" + " |" * len(planner.TARGETS))
            continue
        cells = []
        for target in planner.TARGETS:
            r = next(r for r in rows if r.get("target") == target)
            if "error" in r:
                cells.append("none: " + ("whole-stage re-computation" if "re-comput" in r["error"] else r["error"][:60]))
            else:
                cells.append(f"{r['cost']:.3f}x" + ("" if r["export_refusal"] is None else " (refused!)"))
        shape = free["free_shape"] if len(free["free_shape"]) <= 24 else free["free_shape"][:23].rstrip(" :") + "…"
        lines.append(f"| {config} | {cluster} | {free['free_kind']}, {shape}, "
                     f"{free['free_ms']:.1f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    from dapple import planner
    from dapple.planner.targets import TARGET_OVERLAP, refusal

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(HERE / "results" / "targets_cost.json"))
    ap.add_argument("--table", action="store_true", help="print the table of the results file and stop")
    args = ap.parse_args()
    if args.table:
        print(table(json.loads(Path(args.out).read_text())))
        return
    rows = []
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory() as folder:
        for config in planner.MODEL_CONFIGS:
            seq = 2048 if config.startswith("gpt3") else 4096
            for gpu, cluster in CLUSTERS.items():
                profile = planner.transformer_profile(config, gpu=gpu, seq_len=seq, efficiency=0.5)
                path = os.path.join(folder, f"{config}-{gpu}.json")
                profile.save(path)
                frees: dict = {}  # the free plan under each target's overlap (TARGET_OVERLAP)
                for target in planner.TARGETS:
                    overlap = TARGET_OVERLAP[target]
                    key = tuple(overlap.values())
                    if key not in frees:
                        t0 = time.perf_counter()
                        try:
                            frees[key] = (planner.plan(path, cluster, GLOBAL_BATCH, **overlap),
                                          time.perf_counter() - t0)
                        except planner.DappleError as e:
                            frees[key] = (e, 0.0)
                    free, free_s = frees[key]
                    if isinstance(free, planner.DappleError):
                        rows.append({"config": config, "cluster": cluster, "target": target, "error": str(free)})
                        print(f"{config:14} {cluster:15} {target:10} free: {free}", flush=True)
                        continue
                    t0 = time.perf_counter()
                    try:
                        made = planner.plan_for(target, path, cluster, GLOBAL_BATCH, free=free)
                    except planner.DappleError as e:
                        rows.append({"config": config, "cluster": cluster, "target": target, "error": str(e)})
                        print(f"{config:14} {cluster:15} {target:10}: {e}", flush=True)
                        continue
                    row = {
                        "config": config, "cluster": cluster, "target": target,
                        "free_ms": free.iteration_ms, "free_kind": free.data["schedule"]["kind"],
                        "free_shape": free.shape, "target_ms": made.plan.iteration_ms,
                        "target_kind": made.plan.data["schedule"]["kind"], "target_shape": made.plan.shape,
                        "cost": made.plan.iteration_ms / free.iteration_ms,
                        "free_refused": next((why for what, why in made.refused if what == "the free plan"), None),
                        "export_refusal": refusal(made.plan, profile, target),
                        "free_plan_s": round(free_s, 2), "plan_for_s": round(time.perf_counter() - t0, 2),
                    }
                    rows.append(row)
                    print(f"{config:14} {cluster:15} {target:10}: {row['target_ms']:9.1f} ms against "
                          f"{row['free_ms']:9.1f} ({row['cost']:.3f}x) exports: {row['export_refusal'] or 'yes'}",
                          flush=True)
    result = {
        "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "load_average_at_start": load_start, "load_average_at_end": os.getloadavg(),
        "machine": machine_info(), "build": build_info(), "global_batch_size": GLOBAL_BATCH, "rows": rows,
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
