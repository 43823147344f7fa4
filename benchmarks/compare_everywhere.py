"""`dapple compare` on every shipped profile, on three clusters, at three
global batches each: every run must exit 0 (issue 44).

    python benchmarks/compare_everywhere.py [--out benchmarks/results/compare_everywhere.json]

Profiles: the DAPPLE artifact's (``profiles/artifact``), Whale's
(``profiles/whale``, profiles only) and each shipped transformer config
profiled as a user profiled it before issue 45 (``dapple profile
transformer``, A100-80GB, sequence 2048, efficiency 0.5: the recorded
results are of those profiles). Clusters: ``2x8-nvlink``, ``16x1-25gbps`` and a typed one
of the same size class (V100-32GB machines for the artifact's and Whale's
V100 profiles, A100s for the transformers). Global batches: the command's
default (none given) and two others. Each run is the installed command in
its own process, as users run it; the script records its exit code, time
and any error line, and prints a line per failure.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from plan_speed import build_info, machine_info  # noqa: E402

BATCHES = (None, 64, 512)


def cases(folder: str) -> list[tuple[str, str, str]]:
    """(name, profile path, typed cluster) of every shipped profile."""
    found = []
    for path in sorted((ROOT / "profiles" / "artifact").glob("*.json")):
        found.append((path.stem, str(path), "2x8-v100-32gb-nvlink-25gbps"))
    for path in sorted((ROOT / "profiles" / "whale").glob("*.json")):
        if json.loads(path.read_text()).get("format") == "dapple.profile":
            found.append((path.stem, str(path), "4x8-v100-32gb-nvlink-50gbps"))
    from dapple import planner

    for config in planner.MODEL_CONFIGS:
        path = os.path.join(folder, f"{config}.json")
        planner.transformer_profile(config, gpu="A100-80GB", seq_len=2048, efficiency=0.5).save(path)
        found.append((config, path, "8x8-a100-80gb"))
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(HERE / "results" / "compare_everywhere.json"))
    args = ap.parse_args()
    rows = []
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory() as folder:
        for name, profile, typed in cases(folder):
            for cluster in ("2x8-nvlink", "16x1-25gbps", typed):
                for gbs in BATCHES:
                    argv = ["dapple", "compare", "--profile", profile, "--topology", cluster, "--json"]
                    argv += [] if gbs is None else ["--global-batch-size", str(gbs)]
                    t0 = time.perf_counter()
                    r = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT)
                    seconds = time.perf_counter() - t0
                    error = None if r.returncode == 0 else (r.stderr.strip().splitlines() or [""])[-1]
                    failed_rows = 0
                    if r.returncode == 0:
                        failed_rows = sum(1 for row in json.loads(r.stdout) if row["error"])
                    rows.append({"profile": name, "cluster": cluster, "global_batch_size": gbs,
                                 "exit": r.returncode, "seconds": round(seconds, 2), "error": error,
                                 "rows_with_errors": failed_rows})
                    if r.returncode != 0:
                        print(f"{name} {cluster} {gbs}: exit {r.returncode}: {error}", flush=True)
    failed = [r for r in rows if r["exit"] != 0]
    print(f"{len(rows)} runs, {len(failed)} not exit 0, slowest {max(r['seconds'] for r in rows):.1f} s")
    result = {
        "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "load_average_at_start": load_start, "load_average_at_end": os.getloadavg(),
        "machine": machine_info(), "build": build_info(), "rows": rows,
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
