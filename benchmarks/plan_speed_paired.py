"""Planning time of two builds, paired: this checkout's planner against another.

    python benchmarks/plan_speed_paired.py --before /path/to/other/venv/bin/python \\
        [--suite profiles/regress/paper-table-v.json] [--pairs 5] [--out results/plan_speed_paired.json]

For every case of a regress suite (by default the paper's Table V cases,
which are also the regress suite CI runs), a fresh process of each build
plans the case (``plan_speed.py``'s child: ``planner.plan`` timed alone
with ``time.perf_counter``), in turn A B A B ..., after one warm-up pair.
A is this interpreter (the build installed beside it), B is ``--before``;
which of the two runs first alternates from pair to pair (A B, B A, ...),
so an order effect does not lean every ratio one way. The ratio A/B is
taken pair by pair, so it holds when the machine's speed drifts; the median
ratio is reported with its minimum and maximum. Both builds must choose the
same plan in every pair: a difference is printed as a warning. The results
record each build's planner (its path and when its core was built).

With ``--instructions`` each build instead plans each case once under
valgrind's callgrind on one thread (``RAYON_NUM_THREADS=1``), and the
instructions one ``planner.plan`` call executes are reported (a run that
imports and plans, less one that only imports): on a shared 2-core machine
wall times of sub-second cases swing 0.5-2.5 times from pair to pair, the
instruction counts by well under 1%. Counts say nothing of cache misses or
of the two threads' balance; read them beside the timed pairs. Needs
valgrind (``apt install valgrind``).

How to make the "before" interpreter: ``git worktree add /tmp/before REV``,
``python -m venv /tmp/venv-before``, ``/tmp/venv-before/bin/pip install
/tmp/before``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from plan_speed import ROOT, build_info, machine_info, run_child  # noqa: E402


def suite_cases(suite_path: Path) -> list[dict]:
    """The suite's cases as ``plan_speed`` child specs (profiles resolved
    against the suite's folder, as ``dapple regress`` does)."""
    suite = json.loads(suite_path.read_text())
    return [
        {
            "name": case["name"],
            "profile": str((suite_path.parent / case["profile"]).resolve()),
            "topology": case["topology"],
            "gbs": case["global_batch_size"],
            "min_micro_batch_size": case.get("min_micro_batch_size"),
        }
        for case in suite["cases"]
    ]


#: Imports the planner of either layout (before the one `dapple` package it
#: was `planner` at the top) and plans a case N times.
PLAN_N_TIMES = (
    "import sys\n"
    "try:\n    from dapple import planner\nexcept ImportError:\n    import planner\n"
    "for _ in range(int(sys.argv[4])):\n    planner.plan(sys.argv[1], sys.argv[2], int(sys.argv[3]))\n"
)


def instructions(case: dict, python: str) -> int:
    """Instructions one ``planner.plan`` of ``case`` executes under ``python``,
    on one thread (callgrind: a run that plans once, less one that plans
    none)."""
    def collected(times: int) -> int:
        env = {**os.environ, "RAYON_NUM_THREADS": "1"}
        done = subprocess.run(
            ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", python, "-c", PLAN_N_TIMES,
             case["profile"], case["topology"], str(case["gbs"]), str(times)],
            capture_output=True, text=True, check=True, env=env, cwd="/")
        line = next(x for x in done.stderr.splitlines() if "Collected :" in x)
        return int(line.split("Collected :")[1])
    return collected(1) - collected(0)


def counted(case: dict, before: str) -> dict:
    now, then = instructions(case, sys.executable), instructions(case, before)
    return {"case": case["name"], "instructions": now, "before_instructions": then, "ratio": now / then}


def instructions_table(doc: dict) -> str:
    lines = ["| case | instructions now | before | ratio now/before |", "|---|--:|--:|--:|"]
    for r in doc["rows"]:
        lines.append(f"| {r['case']} | {r['instructions'] / 1e6:,.1f} M | {r['before_instructions'] / 1e6:,.1f} M | "
                     f"{r['ratio']:.3f} |")
    return "\n".join(lines) + "\n"


def plan_of(run: dict) -> tuple:
    return run["shape"], run["micro_batch_size"], run["iteration_ms"]


def paired(case: dict, before: str, pairs: int) -> dict:
    runs_a, runs_b = [], []
    for i in range(pairs + 1):  # the first pair warms the file cache and is not counted
        if i % 2:
            b, a = run_child(case, python=before), run_child(case)
        else:
            a, b = run_child(case), run_child(case, python=before)
        if i:
            runs_a.append(a)
            runs_b.append(b)
    plans = {plan_of(r) for r in runs_a + runs_b}
    if len(plans) > 1:
        print(f"WARNING: {case['name']}: the runs plan differently: {sorted(plans)}", file=sys.stderr)
    ratios = [x["plan_s"] / y["plan_s"] for x, y in zip(runs_a, runs_b)]
    return {
        "case": case["name"],
        "pairs": pairs,
        "plan_s_median": statistics.median(r["plan_s"] for r in runs_a),
        "before_plan_s_median": statistics.median(r["plan_s"] for r in runs_b),
        "ratio_median": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "peak_rss_mb_max": max(r["peak_rss_mb"] for r in runs_a),
        "before_peak_rss_mb_max": max(r["peak_rss_mb"] for r in runs_b),
        "same_plan": len(plans) == 1,
        "shape": a["shape"],
        "iteration_ms": a["iteration_ms"],
    }


def build_of(python: str) -> dict:
    """Which planner ``python`` imports, and when its core was built."""
    # Builds before the one `dapple` package installed `planner` at the top.
    code = (
        "import datetime, os\n"
        "try:\n    import dapple.planner as p, dapple.planner._core as c\n"
        "except ImportError:\n    import planner as p, planner._core as c\n"
        "print(p.__file__)\n"
        "print(datetime.datetime.fromtimestamp(os.path.getmtime(c.__file__), datetime.timezone.utc).isoformat())"
    )
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True, cwd="/").stdout.split()
    return {"python": python, "planner": out[0], "core_module_built_utc": out[1]}


def markdown_table(doc: dict) -> str:
    lines = [
        "| case | now (median) | before (median) | ratio now/before: median (min-max) | peak RSS now / before | same plan |",
        "|---|---|---|---|---|---|",
    ]
    for r in doc["rows"]:
        lines.append(
            f"| {r['case']} | {r['plan_s_median'] * 1000:.1f} ms | {r['before_plan_s_median'] * 1000:.1f} ms | "
            f"{r['ratio_median']:.3f} ({r['ratio_min']:.3f}-{r['ratio_max']:.3f}) | "
            f"{r['peak_rss_mb_max']:.0f} / {r['before_peak_rss_mb_max']:.0f} MB | {'yes' if r['same_plan'] else 'NO'} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", help="python of the other build (B)")
    ap.add_argument("--suite", default="profiles/regress/paper-table-v.json", help="regress suite whose cases to time (default: %(default)s)")
    ap.add_argument("--pairs", type=int, default=5, help="counted pairs per case (default %(default)s)")
    ap.add_argument("--out", default="benchmarks/results/plan_speed_paired.json", help="results JSON, relative to the repository root (default: %(default)s)")
    ap.add_argument("--case", action="append", metavar="NAME",
                    help="only the suite's case of this name (repeatable; default: every case)")
    ap.add_argument("--instructions", action="store_true",
                    help="count each build's instructions a plan (callgrind, one thread) instead of timing pairs")
    ap.add_argument("--table", metavar="RESULTS_JSON", help="print the markdown table of a results file and exit")
    args = ap.parse_args()
    if args.table:
        doc = json.loads(Path(args.table).read_text())
        print((instructions_table if doc.get("what") == "instructions" else markdown_table)(doc), end="")
        return
    if not args.before:
        ap.error("--before PYTHON is required")
    load_start = os.getloadavg()
    rows = []
    cases = suite_cases(Path(ROOT) / args.suite)
    unknown = set(args.case or ()) - {c["name"] for c in cases}
    if unknown:
        ap.error(f"--case {sorted(unknown)[0]!r}: no such case in {args.suite}")
    for case in cases:
        if args.case and case["name"] not in args.case:
            continue
        if args.instructions:
            row = counted(case, args.before)
            print(f"{row['case']}: {row['instructions']:,} instructions against {row['before_instructions']:,}, "
                  f"ratio {row['ratio']:.3f}", flush=True)
        else:
            row = paired(case, args.before, args.pairs)
            print(
                f"{row['case']}: {row['plan_s_median'] * 1000:.1f} ms against {row['before_plan_s_median'] * 1000:.1f} ms, "
                f"ratio {row['ratio_median']:.3f} ({row['ratio_min']:.3f}-{row['ratio_max']:.3f})",
                flush=True,
            )
        rows.append(row)
    doc = {
        "what": "instructions" if args.instructions else "wall time",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "build": build_info(),
        "before": build_of(args.before),
        "now": build_of(sys.executable),
        "suite": args.suite,
        "load_average_start": load_start,
        "load_average_end": os.getloadavg(),
        "rows": rows,
    }
    out = Path(ROOT) / args.out
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(out)  # whole or not at all
    print((instructions_table if args.instructions else markdown_table)(doc), end="")


if __name__ == "__main__":
    main()
