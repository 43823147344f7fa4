"""How close the chosen warm-up depths K_i are to the fastest valid ones, on
the paper's Table V cases.

    python benchmarks/warmup_exactness.py

For each case of `profiles/regress/paper-table-v.json` it plans as
`dapple plan --schedule early-backward-1f1b` does, then simulates other
valid depth vectors on the same plan (same stages, micro-batches and
devices) that fit in memory:
- every valid vector (K_0 >= K_1 >= ... >= 1, each at most M) that fits,
  enumerated in the core (`_core.fastest_valid_warmups`), where there are
  at most EXHAUSTIVE of them;
- otherwise every vector that moves one, two or three stages' depths by one
  from the chosen ones (the valid ones).
It records the fastest found against the chosen. Writes
benchmarks/results/warmup_exactness.json and prints a markdown table
(docs/simulation.md).
"""

from __future__ import annotations

import copy
import itertools
import json
import math
import os
import sys
import time
from pathlib import Path

from dapple import planner

HERE = Path(__file__).resolve().parent
SUITE = HERE.parent / "profiles" / "regress" / "paper-table-v.json"
EXHAUSTIVE = 2_000_000


def valid_vectors(stages: int, micro_batches: int) -> int:
    """How many non-increasing vectors of `stages` depths in 1..M there are."""
    return math.comb(micro_batches + stages - 1, stages)


def near_vectors(chosen: list[int], micro_batches: int):
    """Vectors that move one to three stages' depths by one, valid ones only."""
    s = len(chosen)
    for n in (1, 2, 3):
        for stages in itertools.combinations(range(s), n):
            for signs in itertools.product((-1, 1), repeat=n):
                k = list(chosen)
                for i, d in zip(stages, signs):
                    k[i] += d
                if all(1 <= d <= micro_batches for d in k) and all(a >= b for a, b in zip(k, k[1:])):
                    yield k


def simulated(plan_data: dict, profile, depths: list[int]) -> float | None:
    """The plan with these depths, simulated; None where it does not fit."""
    data = copy.deepcopy(plan_data)
    for stage, k in zip(data["stages"], depths):
        stage["warmup_micro_batches"] = k
    sim = planner.simulate(planner.Plan.from_dict(data), profile)
    if any(st["peak_memory_bytes"] > st["memory_limit_bytes"] for st in sim.stages):
        return None
    return sim.iteration_ms


def check_case(case: dict) -> dict:
    profile = planner.Profile.from_json((SUITE.parent / case["profile"]).read_text())
    # Early backward, whose depths this checks.
    plan = planner.plan(profile, case["topology"], case["global_batch_size"], schedule="early-backward-1f1b")
    data = plan.data
    chosen = [st["warmup_micro_batches"] for st in data["stages"]]
    m = data["micro_batches"]
    chosen_ms = simulated(data, profile, chosen)
    count = valid_vectors(len(chosen), m)
    every = planner._core.fastest_valid_warmups(plan.core, profile.core, EXHAUSTIVE)
    if every is not None:
        best, best_ms, fitting = every
        return row(case, m, (chosen, chosen_ms), (best, best_ms), (count, "every valid vector", fitting, fitting))
    best_ms, best, tried, fitting = chosen_ms, chosen, 0, 0
    for k in near_vectors(chosen, m):
        tried += 1
        ms = simulated(data, profile, k)
        if ms is None:
            continue
        fitting += 1
        if ms < best_ms:
            best_ms, best = ms, k
    return row(case, m, (chosen, chosen_ms), (best, best_ms), (count, "one to three depths moved by one", tried, fitting))


def row(case: dict, m: int, chosen, fastest, checked) -> dict:
    """One case's result: the chosen depths and time, the fastest found,
    and what was checked (valid vectors, how, simulated, fitting)."""
    (k, k_ms), (best, best_ms), (count, how, tried, fitting) = chosen, fastest, checked
    return {
        "case": case["name"], "stages": len(k), "micro_batches": m, "valid_vectors": count,
        "checked": how, "vectors_tried": tried, "vectors_fitting": fitting, "chosen": k, "chosen_ms": round(k_ms, 3),
        "fastest": list(best), "fastest_ms": round(best_ms, 3), "gap": round(k_ms / best_ms - 1, 6),
    }


def main() -> None:
    cases = json.loads(SUITE.read_text())["cases"]
    started, load = time.time(), os.getloadavg()
    rows = []
    for case in cases:
        rows.append(check_case(case))
        print(f"{case['name']}: {rows[-1]['vectors_tried']} vectors", file=sys.stderr)
    out = {"command": "python benchmarks/warmup_exactness.py", "load_average_before": [round(x, 2) for x in load],
           "wall_s": round(time.time() - started, 1), "rows": rows}
    path = HERE / "results" / "warmup_exactness.json"
    path.write_text(json.dumps(out, indent=2) + "\n")
    print("| case | stages | M | checked | vectors (fitting) | chosen K_i | chosen ms | fastest found ms |")
    print("|---|--:|--:|---|--:|---|--:|--:|")
    for r in rows:
        print(f"| {r['case']} | {r['stages']} | {r['micro_batches']} | {r['checked']} | "
              f"{r['vectors_tried']} ({r['vectors_fitting']}) | {','.join(map(str, r['chosen']))} | "
              f"{r['chosen_ms']:.1f} | {r['fastest_ms']:.1f} |")


if __name__ == "__main__":
    main()
