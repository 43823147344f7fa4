"""Learning curves of the asynchronous schedules against synchronous
training (issue 10; the XPipe paper's Table I and Figure 2, in miniature).

scikit-learn's handwritten digits (shipped inside the package: no
download), the model ``dapple.planner.runtime.models:digits`` (3 hidden layers of
64 and a head: 4 layers), a straight 4-stage pipeline on 4 local CPU
processes, global batch 32 in 4 micro-batches of 8. Every mode trains the
same epochs with the same seeds and hyper-parameters: by default momentum
SGD (0.9, the paper's optimizer, and the one SpecTrain's predictor needs)
at the paper's learning rate 0.01, no decay, 20 epochs. docs/xpipe.md also
reports ``--epochs 12 --lr 0.05`` and ``--epochs 12 --optimizer adam --lr
0.003`` (the paper's robustness study; SpecTrain, which needs momentum
SGD, sits out).

- synchronous: the plan's own schedule, DAPPLE's early backward (the same
  mathematics as GPipe's or one process's training);
- xpipe, pipedream (weight stashing), spectrain, async (no prediction):
  ``dapple run --schedule``, each twice: keeping the forward's activations
  for the backward ("xpipe"), and re-computing the forward in the
  backward ("xpipe rc", ``--recompute``: the XPipe paper's setting).

The validation split (359 digits) is scored after every epoch (44 steps of
32 of the 1,438 training digits). Writes
benchmarks/results/xpipe_learning-<optimizer>-lr<lr>.json and
docs/pictures/xpipe-curves-<optimizer>-lr<lr>.png, and prints the final
and best accuracy per mode (mean, lowest and highest over the seeds).

    python benchmarks/xpipe_learning.py [--epochs 20] [--seeds 3] [--optimizer momentum] [--lr 0.01]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from dapple import planner
from dapple.planner import pictures
from dapple.planner.profiler import profile_model
from dapple.planner.runtime import models
from dapple.planner.runtime.data import SeededBatches
from dapple.planner.runtime.launcher import run_plan
from dapple.planner.runtime.optimizers import check_optimizer

HERE = Path(__file__).resolve().parent
GBS, MICRO_BATCHES = 32, 4
STAGES = [(0, 1, [0]), (1, 2, [1]), (2, 3, [2]), (3, 4, [3])]


def pipeline_plan(profile: planner.Profile) -> planner.Plan:
    """The straight 4-stage pipeline with M micro-batches, early backward, K_i of policy A."""
    base = planner.layout_plan(profile, "1x4-pcie", GBS, STAGES, warmup_policy="A", min_micro_batch_size=1)
    d = base.core.to_dict()
    d.pop("estimate", None)
    d.pop("selection", None)
    d["micro_batch_size"], d["micro_batches"] = GBS // MICRO_BATCHES, MICRO_BATCHES
    for i, s in enumerate(d["stages"]):
        s["warmup_micro_batches"] = min(len(STAGES) - i, MICRO_BATCHES)
    return planner.Plan.from_dict(d)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--optimizer", default="momentum")
    ap.add_argument("--lr", type=float, default=0.01)
    args = ap.parse_args()
    optimizer, lr = args.optimizer, args.lr
    factory = functools.partial(models.load_model, "dapple.planner.runtime.models:digits")
    spec = factory()
    steps_per_epoch = spec.train_size // GBS
    steps = args.epochs * steps_per_epoch
    plan = pipeline_plan(profile_model(spec, "digits", [8], repeats=3, progress=False))
    modes: list[tuple[str | None, bool]] = [(None, False)]
    for kind in planner.ASYNCHRONOUS_SCHEDULES:
        try:
            check_optimizer(kind, optimizer)
            modes += [(kind, False), (kind, True)]
        except planner.IncompatibleInputsError:
            print(f"{kind} cannot predict for {optimizer}: left out", file=sys.stderr)
    runs: dict[str, list[dict]] = {}
    for seed in range(args.seeds):
        for mode, recompute in modes:
            torch.manual_seed(seed)
            batches = SeededBatches(factory, GBS, steps, seed)
            t0 = time.perf_counter()
            result = run_plan(plan, factory, spec.loss, batches, steps, lr, optimizer=optimizer, seed=seed,
                              schedule=mode, recompute=recompute, eval_every=steps_per_epoch,
                              start_method="fork")
            evaluations = result.metrics[0]["evaluations"]
            name = (mode or "synchronous") + (" rc" if recompute else "")
            runs.setdefault(name, []).append({
                "seed": seed, "schedule": mode, "recompute": recompute, "optimizer": optimizer,
                "evaluations": evaluations, "losses": result.losses, "wall_s": time.perf_counter() - t0,
            })
            print(f"seed {seed} {name}: final accuracy {evaluations[-1]['accuracy'] * 100:.2f}%, "
                  f"loss {evaluations[-1]['loss']:.4f}", file=sys.stderr, flush=True)
    print(f"digits, 4 stages, {MICRO_BATCHES} micro-batches of {GBS // MICRO_BATCHES}, {args.epochs} epochs of "
          f"{steps_per_epoch} steps, {optimizer} lr {lr}, seeds 0..{args.seeds - 1}")
    print()
    print("| mode | final accuracy, % (min-max) | best accuracy, % | final validation loss (min-max) | "
          "final accuracy - synchronous, points |")
    print("|---|--:|--:|--:|--:|")
    sync_final = statistics.mean(r["evaluations"][-1]["accuracy"] for r in runs["synchronous"]) * 100
    for name, rs in runs.items():
        final = [r["evaluations"][-1]["accuracy"] * 100 for r in rs]
        best = [max(e["accuracy"] for e in r["evaluations"]) * 100 for r in rs]
        loss = [r["evaluations"][-1]["loss"] for r in rs]
        print(f"| {name} | {statistics.mean(final):.2f} ({min(final):.2f}-{max(final):.2f}) | "
              f"{statistics.mean(best):.2f} | {statistics.mean(loss):.4f} ({min(loss):.4f}-{max(loss):.4f}) | "
              f"{statistics.mean(final) - sync_final:+.2f} |")
    (HERE / "results").mkdir(exist_ok=True)
    out = {"epochs": args.epochs, "steps_per_epoch": steps_per_epoch, "global_batch_size": GBS,
           "micro_batches": MICRO_BATCHES, "lr": lr, "optimizer": optimizer, "runs": runs}
    tag = f"{optimizer}-lr{lr:g}"
    (HERE / "results" / f"xpipe_learning-{tag}.json").write_text(json.dumps(out, indent=1) + "\n")
    picture = HERE.parent / "docs" / "pictures" / f"xpipe-curves-{tag}.png"
    pictures.curves([r for rs in runs.values() for r in rs], picture, steps_per_epoch)
    print(f"\nwrote {picture}", file=sys.stderr)


if __name__ == "__main__":
    main()
