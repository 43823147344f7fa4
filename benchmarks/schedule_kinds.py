"""The schedule kind chosen by the search (`dapple plan --schedule auto`)
against each kind alone (issue 28's "never slower"), on every Table V case
(`profiles/regress/paper-table-v.json`), every shipped profile on 2x8 and
16x1 (the profile's largest batch x 16 samples, as `tests/test_compare.py`
plans them), and Llama-2-70B on 512 A100s (`benchmarks/plan_scale.py`'s
case). Writes benchmarks/results/schedule_kinds.json and prints a markdown
table; docs/schedules.md's tables and figures are written from it (cog).

Llama-2-70B's search is planned RUNS times for each kind, all recorded
(`runs`): on its space of 512 GPUs the plan a search returns can differ
from one run to the next (the threads' timing); its row's figures are the
first run's.

    python benchmarks/schedule_kinds.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dapple import planner

HERE = Path(__file__).resolve().parent
PROFILES = HERE.parent / "profiles" / "artifact"
SUITE = HERE.parent / "profiles" / "regress" / "paper-table-v.json"
KINDS = planner._core.SEARCHED_SCHEDULES
#: How many times the Llama-2-70B case is planned for each kind.
RUNS = 3


def outcome(profile: planner.Profile, topology: str, gbs: int, kind: str) -> dict:
    """The plan of ``kind`` (or why none): its time, kind, shape and MFU,
    its layout, micro-batches and each stage's warm-up depth K_i."""
    try:
        p = planner.plan(profile, topology, gbs, schedule=kind)
    except planner.InfeasibleError as e:
        return {"error": str(e)}
    return {"ms": p.iteration_ms, "kind": p.core.schedule_kind, "shape": p.shape, "mfu": p.estimate.get("mfu"),
            "layout": p.layout, "micro_batches": p.micro_batches, "micro_batch_size": p.micro_batch_size,
            "warmups": [s["warmup_micro_batches"] for s in p.stages]}


def cases(llama: Path) -> list[tuple[str, planner.Profile, str, int]]:
    out = []
    for case in json.loads(SUITE.read_text())["cases"]:
        profile = planner.Profile.load(SUITE.parent / case["profile"])
        out.append((f"Table V {case['name']}", profile, case["topology"], case["global_batch_size"]))
    for path in sorted(PROFILES.glob("*.json")):
        profile = planner.Profile.load(path)
        gbs = max(profile.batch_sizes) * 16
        out += [(f"{path.stem}", profile, topology, gbs) for topology in ("2x8-nvlink", "16x1-25gbps")]
    out.append(("llama-2-70b", planner.Profile.load(llama), "64x8-a100-80gb", 512))
    return out


def main() -> None:
    started, load = time.time(), os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        llama = Path(tmp) / "llama-2-70b.json"
        subprocess.run(["dapple", "profile", "transformer", "--config", "llama-2-70b", "--gpu", "A100-80GB",
                        "--seq-len", "4096", "--out", str(llama)], check=True, capture_output=True)
        rows = []
        for name, profile, topology, gbs in cases(llama):
            row = {"case": name, "topology": topology, "global_batch_size": gbs}
            runs = RUNS if name == "llama-2-70b" else 1
            outcomes = [{kind: outcome(profile, topology, gbs, kind) for kind in ("auto", *KINDS)}
                        for _ in range(runs)]
            row.update(outcomes[0])
            if runs > 1:
                row["runs"] = {kind: [o[kind] for o in outcomes] for kind in ("auto", *KINDS)}
            rows.append(row)
            print(name, topology, {k: row[k].get("ms") for k in ("auto", *KINDS)}, file=sys.stderr)
    out = {"command": "python benchmarks/schedule_kinds.py", "load_average_before": [round(x, 2) for x in load],
           "cpus": os.cpu_count(), "wall_s": round(time.time() - started, 1), "rows": rows}
    (HERE / "results" / "schedule_kinds.json").write_text(json.dumps(out, indent=1) + "\n")
    print("| case | topology | auto ms (kind) | " + " | ".join(f"{k} ms" for k in KINDS) + " | auto over early backward |")
    print("|---|---|--:|" + "--:|" * len(KINDS) + "--:|")
    slower = 0
    for r in rows:
        auto = r["auto"]
        alone = [r[k].get("ms") for k in KINDS]
        cells = " | ".join("-" if ms is None else f"{ms:.1f}" for ms in alone)
        if "ms" not in auto:
            print(f"| {r['case']} | {r['topology']} | does not fit | {cells} | - |")
            continue
        slower += any(ms is not None and auto["ms"] > ms * (1 + 1e-9) for ms in alone)
        eb = r[KINDS[0]].get("ms")
        gain = f"{eb / auto['ms']:.3f}x" if eb else "-"
        print(f"| {r['case']} | {r['topology']} | {auto['ms']:.1f} ({auto['kind']}) | {cells} | {gain} |")
    print(f"\ncases where auto is slower than a kind alone: {slower} of {len(rows)}", file=sys.stderr)


if __name__ == "__main__":
    main()
