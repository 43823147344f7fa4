"""The default search space against the full one, where the full one finishes.

    python benchmarks/space_gap.py 4x8-nvlink-25gbps [8x8-nvlink-25gbps ...] > rows.jsonl
    python benchmarks/space_gap.py --full-from old.jsonl 4x8-nvlink-25gbps > rows.jsonl
    python benchmarks/space_gap.py --timeout 240 8x8-nvlink-25gbps > rows.jsonl

For every shipped profile on each topology, plans in the machine-aligned
space (the default above 16 GPUs) and in the full space, both with the
default refinement, and prints one JSON row per profile as soon as both
finish: [profile, topology, GBS, then for each space: name, plan shape,
simulated ms, simulated ms of the space's own plan before refinement
(selection.refined_from_ms, null when refinement found nothing faster),
selection.optimal, planning seconds]. GBS keeps the samples per GPU of the
16-GPU cases (benchmarks/plan_speed.py). The full space's tables may take
``--max-search-gib`` GiB (default 8: its default of 1 stops it on GNMT-32);
it can take minutes on 8x8; stop the script when it has what you need.
``--full-from FILE`` takes the full space's columns from an earlier run's
rows instead of planning again (when only the default space changed).
``--timeout SECONDS`` plans each case in a child process and gives up on
it after that long (its columns then say so): the full space on 8x8.
Rows of the last run: benchmarks/results/space_default_vs_full.jsonl,
table in benchmarks/README.md.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from dapple import planner  # noqa: E402
from plan_speed import ROOT, paper_gbs  # noqa: E402


def plan_columns(prof: planner.Profile, topology: str, gbs: int, space: str, full_gib: float) -> list:
    """One space's columns: name, shape, simulated ms, ms before refinement, optimal, seconds."""
    start = time.perf_counter()
    p = planner.plan(prof, topology, gbs, search_space=space,
                     max_search_gib=full_gib if space == "full" else None)
    selection = p.data["selection"]
    before = selection.get("refined_from_ms")
    return [space, p.shape, round(p.iteration_ms, 1), None if before is None else round(before, 1),
            selection["optimal"], round(time.perf_counter() - start, 2)]


def main() -> None:
    args = sys.argv[1:]
    if args[:1] == ["--child"]:
        path, topology, gbs, space, full_gib = args[1:]
        print(json.dumps(plan_columns(planner.Profile.load(path), topology, int(gbs), space, float(full_gib))))
        return
    earlier: dict[tuple[str, str], list] = {}
    full_gib = 8.0
    timeout: float | None = None
    while args[:1] in (["--full-from"], ["--max-search-gib"], ["--timeout"]):
        if args[0] == "--full-from":
            for line in Path(args[1]).read_text().splitlines():
                row = json.loads(line)
                earlier[(row[0], row[1])] = row[9:]
        elif args[0] == "--timeout":
            timeout = float(args[1])
        else:
            full_gib = float(args[1])
        args = args[2:]
    for topology in args:
        gpus = planner.Topology.resolve(topology).num_devices
        for path in sorted((Path(ROOT) / "profiles" / "artifact").glob("*.json")):
            prof = planner.Profile.load(path)
            per_16, _ = paper_gbs(path.stem, max(prof.batch_sizes))
            gbs = per_16 * gpus // 16
            row: list = [path.name, topology, gbs]
            for space in ("machine-aligned", "full"):
                if space == "full" and (path.name, topology) in earlier:
                    row += earlier[(path.name, topology)]
                elif timeout is None:
                    row += plan_columns(prof, topology, gbs, space, full_gib)
                else:
                    command = [sys.executable, __file__, "--child", str(path), topology, str(gbs), space, str(full_gib)]
                    try:
                        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
                        row += json.loads(done.stdout) if done.returncode == 0 else [
                            space, "error: " + done.stderr.strip().splitlines()[-1][:200]]
                    except subprocess.TimeoutExpired:
                        row += [space, f"not finished in {timeout:g} s"]
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
