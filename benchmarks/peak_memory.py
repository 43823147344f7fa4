"""Peak memory of the heaviest commands dapple runs on the shipped profiles
(issue 12): each either stays under 2 GiB or ends with its documented limit
error (exit 9). One run each, with /usr/bin/time -v; writes
benchmarks/results/peak_memory.json and prints a markdown table.

    python benchmarks/peak_memory.py

The 1,600-layer profile case takes about 7 minutes; ``--quick`` leaves it out.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from dapple import planner  # noqa: E402

PROFILES = ROOT / "profiles" / "artifact"
BERT48 = PROFILES / "bert-48-pbs-2.json"
LIMIT_BYTES = 2 * 2**30


def measure(args: list[str]) -> dict:
    """Run `python -m dapple.cli.main ARGS` under /usr/bin/time -v: exit code,
    wall seconds, peak resident bytes, the last stderr line."""
    start = time.monotonic()
    # From outside the checkout, so that the installed package runs.
    done = subprocess.run(["/usr/bin/time", "-v", sys.executable, "-m", "dapple.cli.main", *map(str, args)],
                          capture_output=True, text=True, cwd=tempfile.gettempdir())
    wall = time.monotonic() - start
    peak_kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", done.stderr).group(1))
    lines = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    return {"exit": done.returncode, "wall_s": round(wall, 1), "peak_bytes": peak_kb * 1024,
            "error": lines[-1] if lines else None}


def long_profile(path: Path, layers: int) -> Path:
    """BERT-48's encoder block repeated `layers` times."""
    data = json.loads(BERT48.read_text())
    block = next(layer for layer in data["layers"] if layer.get("kind") == "block")
    data["layers"] = [dict(block, name=f"block{i}") for i in range(layers)]
    for layer in data["layers"]:
        layer.pop("inputs", None)
    path.write_text(json.dumps(data))
    return path


def main() -> None:
    quick = "--quick" in sys.argv
    tmp = Path(tempfile.mkdtemp())
    plan_16 = tmp / "plan16.json"
    # A 16-stage plan at the simulation limit: 16 x 16,384 micro-batch passes.
    planner.layout_plan(BERT48, "16x1-25gbps", 2**15, [(3 * i, 3 * i + 3, [i]) for i in range(16)][:-1]
                        + [(45, 53, [15])], warmup_policy="A").save(plan_16)
    data = json.loads(plan_16.read_text())
    data.pop("estimate", None)
    data.pop("selection", None)
    data["micro_batch_size"], data["micro_batches"] = 2, 2**14
    data["stages"] = [dict(s, warmup_micro_batches=min(16 - i, 2**14)) for i, s in enumerate(data["stages"])]
    plan_16.write_text(json.dumps(data))
    cases = [
        ("plan BERT-48, 128x8 (default space)",
         ["plan", "--profile", BERT48, "--topology", "128x8-nvlink", "--global-batch-size", 2048]),
        ("plan BERT-48, 32x8, full space",
         ["plan", "--profile", BERT48, "--topology", "32x8-nvlink", "--global-batch-size", 256,
          "--search-space", "full"]),
        ("plan VGG-19 on A, GBS 2^27",
         ["plan", "--profile", PROFILES / "vgg-19-pbs-32.json", "--topology", "A", "--global-batch-size", 2**27]),
        ("plan BERT-48 on A, GBS 2^21",
         ["plan", "--profile", BERT48, "--topology", "A", "--global-batch-size", 2**21]),
        ("compare BERT-48 on B", ["compare", "--profile", BERT48, "--topology", "B", "--global-batch-size", 128]),
        ("simulate a plan at the pass limit (16 x 16,384)", ["simulate", "--plan", plan_16, "--profile", BERT48]),
        ("the same, --json", ["simulate", "--plan", plan_16, "--profile", BERT48, "--json"]),
        ("show --gantt of it (over the task limit)",
         ["show", "--plan", plan_16, "--profile", BERT48, "--gantt", tmp / "g.png"]),
    ]
    if not quick:
        cases.append(("plan a 1,600-layer profile on 2x8",
                      ["plan", "--profile", long_profile(tmp / "long.json", 1600), "--topology", "2x8-nvlink",
                       "--global-batch-size", 64]))
    rows = []
    for name, args in cases:
        row = {"case": name, **measure(args)}
        rows.append(row)
        ok = row["exit"] in (0, 9) and (row["peak_bytes"] < LIMIT_BYTES or row["exit"] == 9)
        print(f"| {name} | {row['exit']} | {row['wall_s']} | {row['peak_bytes'] / 2**20:.0f} | "
              f"{'yes' if ok else 'NO'} |", flush=True)
    out = HERE / "results" / "peak_memory.json"
    out.write_text(json.dumps({"load_average": os.getloadavg(), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
