"""Uneven chains: planning speed where layer times differ, as in real models.

    python benchmarks/uneven_chains.py [--seeds 5] [--repeats 3] [--out benchmarks/results/uneven_chains.json]
    python benchmarks/uneven_chains.py --write-profile 7 --out chain.json   # one chain as a profile file

Issue 44's cases: a 128-layer chain whose layer times vary about fourfold
(each layer's factor w drawn log-uniformly from 1 to 4: its forward, its
backward at twice that, its parameters and activations all scale with w,
as a wider layer has more of each), seeded, in two families:

* ``light``: 1.5 ms, 25 MB of parameters and 2 MB of activations a unit;
  the model state (about 27 GB with Adam) needs a few stages and memory
  rarely binds;
* ``heavy``: 3 ms, 150 MB and 15 MB a unit (about 160 GB of model state):
  memory binds every stage, as in the chain the issue reports (where every
  size's DP run stopped at its step limit);

each planned with the default options

* on ``128x8-nvlink`` at a global batch of 2048: target under 5 s (median
  of ``--repeats`` runs);
* on ``2048x8-nvlink`` at 32768: target under 60 s and 2 GiB peak RSS.

Each run is a fresh process (``plan_speed.py``'s child: the ``planner.plan``
call timed alone, peak RSS from ``os.wait4``). The script prints each
figure beside its target; it does not fail on a miss.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import random
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from plan_speed import build_info, machine_info, run_child  # noqa: E402

MB = 1 << 20
GIB = 1 << 30
# (topology, global batch size, repeats or None for --repeats, time target s, peak-RSS target bytes)
CASES = [
    ("128x8-nvlink", 2048, None, 5.0, None),
    ("2048x8-nvlink", 32768, 1, 60.0, 2 * GIB),
]
# family -> (forward ms, parameter MB, activation MB) of one unit of w
FAMILIES = {"light": (1.5, 25, 2), "heavy": (3.0, 150, 15)}


def uneven_chain(layers: int = 128, seed: int = 0, family: str = "light") -> dict:
    """A chain of ``layers`` layers measured at batch size 1 (time and
    memory scale linearly with the batch), each a factor w from 1 to 4
    (log-uniform) of the family's unit: a forward, a backward twice as
    long, parameters and activations. Optimizer: adam."""
    fwd_ms, param_mb, act_mb = FAMILIES[family]
    rng = random.Random(seed)
    out = []
    for i in range(layers):
        w = math.exp(rng.uniform(0.0, math.log(4.0)))
        out.append(
            {
                "name": f"layer{i}",
                "kind": "block",
                "param_bytes": round(w * param_mb * MB),
                "inputs": [i - 1] if i else [],
                "measurements": [
                    {
                        "batch_size": 1,
                        "fwd_ms": round(fwd_ms * w, 4),
                        "bwd_ms": round(2 * fwd_ms * w, 4),
                        "activation_bytes": round(w * act_mb * MB),
                    }
                ],
            }
        )
    return {
        "format": "dapple.profile",
        "schema_version": 1,
        "model": f"uneven-{layers}-{family}-seed{seed}",
        "source": f"benchmarks/uneven_chains.py, {family}, seed {seed}: layer times log-uniform over a factor of 4",
        "device": "V100-16GB",
        "optimizer": "adam",
        "layers": out,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(HERE / "results" / "uneven_chains.json"))
    ap.add_argument("--write-profile", type=int, metavar="SEED", help="write one chain and stop")
    ap.add_argument("--only", help="only this topology")
    ap.add_argument("--family", choices=FAMILIES, action="append", help="only these families (default: both)")
    args = ap.parse_args()
    if args.write_profile is not None:
        Path(args.out).write_text(json.dumps(uneven_chain(128, args.write_profile, (args.family or ["light"])[0])))
        return
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        cases = [(f, *c) for f in (args.family or list(FAMILIES)) for c in CASES]
        for family, topology, gbs, repeats, target_s, target_rss in cases:
            if args.only and topology != args.only:
                continue
            for seed in range(args.seeds):
                path = os.path.join(folder, f"uneven-{family}-{seed}.json")
                Path(path).write_text(json.dumps(uneven_chain(128, seed, family)))
                runs, error = [], None
                for _ in range(repeats or args.repeats):
                    try:
                        runs.append(run_child({"profile": path, "topology": topology, "gbs": gbs}))
                    except RuntimeError as e:  # the planner failed: its stderr's end
                        error = str(e).strip().splitlines()[-1]
                        break
                wall_s = statistics.median(r["plan_s"] for r in runs) if runs else None
                rss = max(r["peak_rss_mb"] for r in runs) * MB if runs else None
                row = {
                    "family": family,
                    "topology": topology,
                    "global_batch_size": gbs,
                    "seed": seed,
                    "runs": len(runs),
                    "median_s": None if wall_s is None else round(wall_s, 2),
                    "peak_rss_bytes": rss,
                    "iteration_ms": runs[0]["iteration_ms"] if runs else None,
                    "shape": runs[0]["shape"] if runs else None,
                    "error": error,
                    "time_target_s": target_s,
                    "rss_target_bytes": target_rss,
                    "met": error is None and wall_s < target_s and (target_rss is None or rss < target_rss),
                }
                rows.append(row)
                figures = f"{wall_s:7.2f} s (target {target_s}), {rss / GIB:5.2f} GiB, {row['iteration_ms']:.1f} ms" if runs else error
                print(f"{family:5} {topology:14} gbs {gbs:6} seed {seed}: {figures} {'met' if row['met'] else 'MISSED'}", flush=True)
    result = {
        "families": FAMILIES,
        "load_average_at_end": os.getloadavg(),
        "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "build": build_info(),
        "rows": rows,
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
