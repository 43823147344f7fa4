"""What the chunked kinds give the planner's plans (issue 28: "Llama-2-70B
on 512 A100s gains from interleaving or zero-bubble in the simulator; report
by how much"). For each case the planner's fastest plan of one stage a rank
(early backward or ZB-H1) is simulated as is, then its ranks (its stages) run interleaved 1F1B and
interleaved zero bubble with v = 1 to 8 chunks each, and ZB-V with 2
(`planner.chunked`: the layers cut again into ranks x v chunks of balanced
time, each on its rank's devices and shape); and the search is run for
each chunked kind (`planner.plan(schedule=kind)`: the ranked layouts cut
into the fastest count of chunks); `--schedule auto` chooses among all five
kinds at once (benchmarks/schedule_kinds.py). Cases: Llama-2-70B on 64x8 A100-80GB at a
global batch of 512 (`benchmarks/plan_scale.py`'s), and every Table V case
whose plan is a pipeline. Writes benchmarks/results/interleaving_gain.json
and prints a markdown table; docs/schedules.md reports it.

    python benchmarks/interleaving_gain.py
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from dapple import planner

HERE = Path(__file__).resolve().parent
SUITE = HERE.parent / "profiles" / "regress" / "paper-table-v.json"
CHUNKS = range(1, 9)
ORDERS = {"interleaved-1f1b": CHUNKS, "interleaved-zero-bubble": CHUNKS, "zb-v": [2]}
ONE_STAGE_A_RANK = ("early-backward-1f1b", "zb-h1")


def cases() -> list[tuple[str, planner.Profile, str, int]]:
    llama = planner.transformer_profile("llama-2-70b", gpu="A100-80GB", seq_len=4096, efficiency=0.5)
    out = [("Llama-2-70B", llama, "64x8-a100-80gb", 512)]
    for case in json.loads(SUITE.read_text())["cases"]:
        out.append((f"Table V {case['name']}", planner.Profile.load(SUITE.parent / case["profile"]),
                    case["topology"], case["global_batch_size"]))
    return out


def measure(name: str, profile: planner.Profile, topology: str, gbs: int) -> dict:
    # The fastest plan of one stage a rank (early backward or ZB-H1, as
    # --schedule auto chose before the chunked kinds): its ranks are cut into chunks.
    plan = min((planner.plan(profile, topology, gbs, schedule=k) for k in ONE_STAGE_A_RANK),
               key=lambda p: p.iteration_ms)
    row = {"case": name, "topology": topology, "global_batch_size": gbs, "plan_ms": plan.iteration_ms,
           "plan_kind": plan.core.schedule_kind, "shape": plan.shape, "ranks": len(plan.stages),
           "micro_batches": plan.micro_batches, "mfu": plan.estimate.get("mfu"), "interleaved": {}}
    row["searched"] = {}
    fastest = plan
    for kind in ORDERS:
        try:
            found = planner.plan(profile, topology, gbs, schedule=kind)
            row["searched"][kind] = {"ms": found.iteration_ms, "shape": found.shape}
            fastest = min(fastest, found, key=lambda p: p.iteration_ms)
        except planner.DappleError as e:
            row["searched"][kind] = {"error": str(e)}
    row["fastest"] = {"ms": fastest.iteration_ms, "kind": fastest.core.schedule_kind, "shape": fastest.shape,
                      "mfu": fastest.estimate.get("mfu")}
    if len(plan.stages) == 1:
        return row  # data parallel: nothing to interleave
    for order, chunks in ORDERS.items():
        row["interleaved"][order] = {}
        for v in chunks:
            try:
                run = planner.chunked(plan, profile, order, v)
            except planner.DappleError as e:
                row["interleaved"][order][v] = {"error": str(e)}
                continue
            row["interleaved"][order][v] = {"ms": run.iteration_ms, "fits_memory": run.estimate["fits_memory"],
                                            "chunk_layers": [[s["layer_start"], s["layer_end"]] for s in run.stages]}
        # The cut of the fastest v that fits only: the others' make the file large.
        fastest = best(row, order)
        for v, r in row["interleaved"][order].items():
            if fastest is None or v != fastest[0]:
                r.pop("chunk_layers", None)
    return row


def best(row: dict, order: str) -> tuple[int, float] | None:
    runs = row["interleaved"].get(order, {})
    fitting = [(v, r["ms"]) for v, r in runs.items() if r.get("fits_memory")]
    return min(fitting, key=lambda vr: vr[1]) if fitting else None


def main() -> None:
    started, load = time.time(), os.getloadavg()
    rows = []
    for case in cases():
        rows.append(measure(*case))
        print(case[0], rows[-1]["plan_ms"], {o: best(rows[-1], o) for o in ORDERS}, file=sys.stderr)
    out = {"command": "python benchmarks/interleaving_gain.py", "load_average_before": [round(x, 2) for x in load],
           "wall_s": round(time.time() - started, 1), "rows": rows}
    (HERE / "results" / "interleaving_gain.json").write_text(json.dumps(out, indent=1) + "\n")
    print("| case | plan | plan ms | " + " | ".join(f"{o}: best v, ms, over the plan" for o in ORDERS) + " |")
    print("|---|---|--:|" + "--:|" * len(ORDERS))
    for r in rows:
        cells = []
        for order in ORDERS:
            b = best(r, order)
            cells.append("-" if b is None else f"{b[0]}, {b[1]:.1f}, {r['plan_ms'] / b[1]:.3f}x")
        print(f"| {r['case']} | {r['shape']} | {r['plan_ms']:.1f} | " + " | ".join(cells) + " |")
    print()
    print("| case | plan ms | " + " | ".join(f"--schedule {o}: shape, ms, over the plan" for o in ORDERS)
          + " | fastest kind: kind, shape, ms, over the plan |")
    print("|---|--:|" + "--:|" * (len(ORDERS) + 1))
    for r in rows:
        cells = []
        for order in ORDERS:
            f = r["searched"][order]
            cells.append("-" if "ms" not in f else f"{f['shape']}, {f['ms']:.1f}, {r['plan_ms'] / f['ms']:.3f}x")
        a = r["fastest"]
        cells.append(f"{a['kind']}, {a['shape']}, {a['ms']:.1f}, {r['plan_ms'] / a['ms']:.3f}x")
        print(f"| {r['case']} | {r['plan_ms']:.1f} | " + " | ".join(cells) + " |")

if __name__ == "__main__":
    main()
