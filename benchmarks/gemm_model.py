"""The cost model's matrix products against measured ones (`model/kernels.rs`).

    python benchmarks/gemm_model.py [--measurements FILE] [--out benchmarks/results/gemm_model.json]

Every record of the shared hardware measurements that times one bf16
product on H100 by its shape (G8-*: square, G9-*: few tokens or a short
reduction, b = 1; XLA's table, median CUPTI kernel time) is compared with
``_core.gemm_ms`` of the same shape on H100-80GB. One constant of the rule
is chosen on these records: the intensity at which a tile is fed
(``FED_TILE_INTENSITY``), the value of ``FED_CANDIDATES`` with the least
mean |log(model / measured)| over them (``fed_tile_intensity`` in the
results: each candidate's error). Its ceiling is G3 (the maximum
achievable matmul FLOPS, another method and source) times the share the
published runs' products reached on a lent H200 (``SUSTAINED_SHARE``,
``results/gpu_kernels-h200.json``), its tiles CUTLASS's, its floor
G8-floor (derived from G8-256 alone). No product on A100 was measured by
shape (the file's ``not_found``), so the rule is not checked there.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from plan_speed import build_info, machine_info  # noqa: E402

DEFAULT_MEASUREMENTS = HERE.parent.parent / "shared" / "reference" / "hardware-measurements.json"
#: The fed intensities ``FED_TILE_INTENSITY`` was chosen among.
FED_CANDIDATES = (30, 35, 40, 45, 50, 55, 60, 65, 70)


def shape_of(record: dict) -> tuple[int, int, int] | None:
    """(m, n, k) of a record that times one product, from its conditions."""
    text = record["conditions"]
    if m := re.search(r"m=n=k=(\d+)", text):
        return (int(m[1]),) * 3
    if m := re.search(r"\bm=(\d+), n=(\d+), k=(\d+)", text):
        return int(m[1]), int(m[2]), int(m[3])
    if m := re.search(r"m=n=(\d+), k=(\d+)", text):
        return int(m[1]), int(m[1]), int(m[2])
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--measurements", type=Path, default=DEFAULT_MEASUREMENTS)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "gemm_model.json")
    args = parser.parse_args()
    from dapple.planner import _core

    records = json.loads(args.measurements.read_text())["records"]
    rows = []
    for r in records:
        if not re.fullmatch(r"G[89]-[a-z0-9]+", r["id"]) or "b=1" not in r["conditions"]:
            continue
        shape = shape_of(r)
        if shape is None:
            continue
        m, n, k = shape
        ms = _core.gemm_ms("H100-80GB", m, n, k)
        model_tflops = 2 * m * n * k / ms / 1e9
        rows.append({"id": r["id"], "m": m, "n": n, "k": k, "measured_tflops": r["value"],
                     "model_tflops": round(model_tflops, 1), "ratio": round(model_tflops / r["value"], 3),
                     "sets_the_floor": r["id"] == "G8-256"})
    checked = [row["ratio"] for row in rows if not row["sets_the_floor"]]
    shapes = [(row["m"], row["n"], row["k"], row["measured_tflops"]) for row in rows]

    def mean_log_error(fed):
        return statistics.fmean(
            abs(math.log(2 * m * n * k / _core.gemm_ms("H100-80GB", m, n, k, fed_tile_intensity=fed) / 1e9 / tflops))
            for m, n, k, tflops in shapes)

    fed = {str(candidate): round(mean_log_error(candidate), 4) for candidate in FED_CANDIDATES}
    results = {"when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "machine": machine_info(), "build": build_info(), "measurements": str(args.measurements),
               "rows": rows, "median_ratio": statistics.median(checked),
               "fed_tile_intensity": {"mean_abs_log_error": fed, "least": min(fed, key=fed.get)}}
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(results, indent=1) + "\n")
    os.replace(tmp, args.out)
    print("| record | m x n x k | measured TFLOP/s | model TFLOP/s | model / measured |")
    print("|---|---|--:|--:|--:|")
    for row in rows:
        note = " (sets the floor)" if row["sets_the_floor"] else ""
        print(f"| {row['id']}{note} | {row['m']} x {row['n']} x {row['k']} | {row['measured_tflops']} | "
              f"{row['model_tflops']} | {row['ratio']:.2f} |")
    print(f"\nmedian model / measured over the {len(checked)} checked: {results['median_ratio']:.2f}")
    print(f"mean |log error| by fed intensity: {fed} (least: {results['fed_tile_intensity']['least']})")


if __name__ == "__main__":
    main()
