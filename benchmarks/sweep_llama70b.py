"""``dapple sweep`` at issue 68's size: Llama-3-70B on 8x8 to 256x8 H100 at
2M tokens a batch, which is to answer within 5 minutes on a 2-core machine.

    python benchmarks/sweep_llama70b.py [--tokens-per-batch 2M] [--train-tokens 15T] [--price H100-80GB=USD]
        [--out benchmarks/results/sweep_llama70b.json] [--plot benchmarks/results/sweep_llama70b.png]

Runs the installed ``dapple sweep --config llama-3-70b --gpu H100-80GB
--seq-len 4096 --machines 8..256`` as a user does (its own process, the
profile made by the command, the sizes planned with its default --jobs),
times it from start to exit, and records its rows (``--json``), the wall
time against the 300 s target, and the machine's load before and after.
A price is this script's input, recorded with the rows; none is assumed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from plan_speed import build_info, machine_info  # noqa: E402

ROOT = HERE.parent
TARGET_S = 300.0
DAPPLE = Path(sys.executable).parent / "dapple"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens-per-batch", default="2M", help="the issue's batch (default: %(default)s)")
    ap.add_argument("--train-tokens", default="15T", help="the budget (default: %(default)s, Llama 3's)")
    ap.add_argument("--price", action="append", default=[], metavar="TYPE=USD",
                    help="a price a GPU-hour to pass on (repeatable; default: none)")
    ap.add_argument("--out", default="benchmarks/results/sweep_llama70b.json",
                    help="results JSON, relative to the repository root (default: %(default)s)")
    ap.add_argument("--plot", default="benchmarks/results/sweep_llama70b.png",
                    help="the sweep's picture, relative to the repository root (default: %(default)s)")
    args = ap.parse_args()
    command = [str(DAPPLE), "sweep", "--config", "llama-3-70b", "--gpu", "H100-80GB", "--seq-len", "4096",
               "--machines", "8..256", "--tokens-per-batch", args.tokens_per_batch,
               "--train-tokens", args.train_tokens, "--plot", str(ROOT / args.plot), "--json", "--quiet",
               *[a for price in args.price for a in ("--price", price)]]
    load_start = os.getloadavg()
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    wall_s = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(f"dapple sweep failed ({done.returncode}): {done.stderr}")
    sweep = json.loads(done.stdout)
    doc = {
        "benchmark": "sweep_llama70b",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "build": build_info(),
        "machine": {**machine_info(), "loadavg_1_5_15_at_start": load_start, "loadavg_1_5_15_at_end": os.getloadavg()},
        "what": "one `dapple sweep` process, wall time from start to exit (time.perf_counter), its rows from --json",
        "command": ["dapple", *command[1:]],
        "wall_s": round(wall_s, 2),
        "wall_s_target": TARGET_S,
        "verdict": "met" if wall_s < TARGET_S else "MISSED",
        "stderr": done.stderr.splitlines(),
        "sweep": sweep,
    }
    for p in sweep["points"]:
        figures = (f"{p['layout']}, {p['iteration_ms']:,.1f} ms, MFU {p['mfu']:.3f}, "
                   f"{p['train_hours'] / 24:,.1f} days, {p['gpu_hours']:,.0f} GPU-hours"
                   if p["why_not"] is None else f"no plan: {p['why_not']}")
        print(f"{p['gpus']:>5} GPUs: {figures} {' '.join(p['notes'])}")
    print(f"wall {wall_s:.1f} s (target < {TARGET_S:g} s): {doc['verdict']}")
    out = ROOT / args.out
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(out)  # whole or not at all
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
