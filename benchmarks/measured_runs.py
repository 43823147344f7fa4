"""The shipped measured runs (``../shared/reference/vtrain-single-node/``:
1,440 Megatron-DeepSpeed iteration times of GPT models on 2-8 A100s in one
machine, from VIA-Research/vTrain at f8dda84) costed by dapple as they ran
(``dapple.planner.measured_runs``: Megatron's layout, the unfused attention,
per-layer re-computation, the run's micro-batch, fp32 gradients):

- uncalibrated, with the shipped figures;
- calibrated under k-fold cross-validation: each fold costed with the
  runtime's figures fitted on the other folds (``dapple calibrate --runs``);
  and the figures fitted on every run, which a default taken from these
  runs cites.

Each is scored by MAPE, and per group of the same model, GPUs and batch by
Spearman's rank correlation and regret (the measured time of the layout
dapple ranks fastest over the best measured). Writes
benchmarks/results/measured_runs.json (with the machine and its load) and a
log-log scatter of predicted against measured, docs/pictures/measured-runs.png,
which docs/fidelity.md quotes.

    python benchmarks/measured_runs.py                 # about 5 minutes on 2 cores
    python benchmarks/measured_runs.py --folds 0       # uncalibrated only
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import json
import os
import platform
import statistics
import time
from pathlib import Path

from dapple.planner import HOST_US_PER_KERNEL
from dapple.planner import measured_runs as runs_api
from dapple.planner.files import write_atomic

HERE = Path(__file__).resolve().parent
RUNS = HERE.parent.parent / "shared" / "reference" / "vtrain-single-node" / "ground_truth_single.csv"


def by(runs, predicted, key) -> dict:
    """The median ratio of predicted over measured per value of ``key``."""
    ratios = collections.defaultdict(list)
    for run, p in zip(runs, predicted):
        ratios[getattr(run, key)].append(p / run.iteration_ms)
    return {str(k): round(statistics.median(v), 3) for k, v in sorted(ratios.items())}


def scatter(runs, series: dict[str, list[float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = [r.iteration_ms for r in runs]
    fig, ax = plt.subplots(figsize=(5.5, 5.5))
    for label, predicted in series.items():
        ax.scatter(measured, predicted, s=5, alpha=0.5, label=label)
    low, high = min(measured) * 0.5, max(measured) * 2
    ax.plot([low, high], [low, high], color="black", linewidth=0.8)
    for band in (0.9, 1.1):
        ax.plot([low, high], [low * band, high * band], color="grey", linewidth=0.5, linestyle="--")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured iteration time (ms)")
    ax.set_ylabel("dapple's simulated iteration time (ms)")
    ax.set_title(f"{len(runs)} Megatron-DeepSpeed runs on 2-8 A100s (vTrain)")
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=Path, default=RUNS)
    parser.add_argument("--folds", type=int, default=5, help="0: uncalibrated only")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "measured_runs.json")
    parser.add_argument("--picture", type=Path, default=HERE.parent / "docs" / "pictures" / "measured-runs.png")
    args = parser.parse_args()
    runs = runs_api.read_runs(args.runs)
    costing = runs_api.RunCosting()
    load = os.getloadavg()
    started = time.perf_counter()
    uncalibrated = runs_api.cost_runs(runs, costing, {})
    results = {
        "date": datetime.date.today().isoformat(),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "load_average_at_start": load},
        "runs": str(args.runs.name),
        "costing": dataclasses.asdict(costing),
        "defaults": {"host_us_per_kernel": HOST_US_PER_KERNEL},
        "uncalibrated": {**runs_api.score(runs, uncalibrated),
                         "median_ratio_by": {k: by(runs, uncalibrated, k)
                                             for k in ("tensor", "pipeline", "data", "micro_batch", "hidden")}},
    }
    series = {"uncalibrated": uncalibrated}
    if args.folds:
        # The figures fitted to every run: what a shipped default taken from
        # these runs cites (model/transformer.rs, HOST_US_PER_KERNEL).
        whole = runs_api.fit(runs, costing)
        results["fitted_on_every_run"] = {"figures": whole.figures, "mape_percent": whole.mape_percent,
                                          "converged": whole.converged}
        validated = runs_api.cross_validate(runs, costing, args.folds)
        held = validated.pop("predicted_ms")
        validated["held_out"]["median_ratio_by"] = {k: by(runs, held, k)
                                                    for k in ("tensor", "pipeline", "data", "micro_batch", "hidden")}
        results["calibrated"] = validated
        series[f"calibrated, {args.folds}-fold (held out)"] = held
    results["seconds"] = time.perf_counter() - started
    write_atomic(args.out, json.dumps(results, indent=1) + "\n")
    scatter(runs, series, args.picture)
    for label in ("uncalibrated", "calibrated"):
        s = results.get(label)
        if s is None:
            continue
        s = s.get("held_out", s)
        print(f"{label}: MAPE {s['mape_percent']:.1f}%, median ratio {s['median_ratio']:.3f}, "
              f"{s['within_10_percent']}/{s['runs']} within 10%, median Spearman {s['median_spearman']:.3f} "
              f"over {s['groups']} groups, worst regret {s['worst_regret']:.3f}")
    if "calibrated" in results:
        print("fitted on every run:", results["fitted_on_every_run"]["figures"])
        print("fold figures:", results["calibrated"]["fold_figures"])


if __name__ == "__main__":
    main()
