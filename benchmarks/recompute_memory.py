"""Measured peak memory of `dapple run`'s stages against the simulator's, for
GPipe and early-backward 1F1B, with and without re-computation.

    python benchmarks/recompute_memory.py

The shipped GPT-style model (4 blocks, d_model 128, sequence 128), split 3:3
layers over 2 processes, 4 micro-batches of 8. Each configuration trains 3
steps with freed memory returned to the system at once (--exact-memory), so
a stage's measured peak is the growth of its resident set during training.
The simulator's figure is the stage's peak activation bytes (its peak minus
weights, gradients and optimizer state) from a profile of the same model,
measured here first. Writes benchmarks/results/recompute_memory.json and
prints the markdown table used in docs/runtime.md.
"""

from __future__ import annotations

import functools
import json
import platform
import sys
from pathlib import Path

from dapple import planner
from dapple.planner.profiler import profile_model
from dapple.planner.runtime.launcher import median_iteration_ms, run_plan
from dapple.planner.runtime import models

HERE = Path(__file__).resolve().parent
CONFIG = dict(n_layers=4, d_model=128, n_heads=4, seq=128, vocab=256)
MBS, M, STEPS, SPLIT = 8, 4, 3, 3


def plan_for(profile: planner.Profile, kind: str) -> planner.Plan:
    """The 3:3 plan on 1x2 in schedule ``kind``, with its estimate."""
    base = planner.plan(profile, "1x2-pcie", global_batch_size=MBS * M).core.to_dict()
    base.pop("estimate", None)
    base["micro_batch_size"], base["micro_batches"] = MBS, M
    base["schedule"]["kind"] = kind
    n = len(profile.data["layers"])
    depth = [M, M] if kind == "gpipe" else [2, 1]  # K_i of policy A on 2 stages
    base["stages"] = [
        {"layer_start": 0, "layer_end": SPLIT, "devices": [0], "warmup_micro_batches": depth[0]},
        {"layer_start": SPLIT, "layer_end": n, "devices": [1], "warmup_micro_batches": depth[1]},
    ]
    return planner.evaluate(planner.Plan.from_dict(base), profile)


def main() -> None:
    factory = functools.partial(models.gpt, **CONFIG)
    spec = factory()
    print("profiling ...", file=sys.stderr)
    profile = profile_model(spec, "gpt", [MBS], repeats=5, progress=False)
    import torch

    gen = torch.Generator().manual_seed(0)
    batches = [spec.make_batch(MBS * M, gen) for _ in range(STEPS)]
    rows = []
    for kind in ("gpipe", "early-backward-1f1b"):
        plan = plan_for(profile, kind)
        for recompute in (False, True):
            print(f"{kind}{' + recompute' if recompute else ''} ...", file=sys.stderr)
            sim = planner.simulate(plan, profile, recompute=recompute)
            run = run_plan(plan, factory, spec.loss, batches, STEPS, 0.1, recompute=recompute,
                              exact_memory=True, start_method="fork")
            for stage in (0, 1):
                m = run.metrics[stage]  # rank s holds stage s here
                timeline = sim.stages[stage]["memory"]
                model_state = timeline[0][1]
                rows.append({
                    "schedule": kind,
                    "recompute": recompute,
                    "stage": stage,
                    "measured_training_peak_bytes": m["peak_memory_bytes"] - m["memory_before_bytes"],
                    "simulated_activation_peak_bytes": sim.stages[stage]["peak_memory_bytes"] - model_state,
                    "measured_iteration_ms": median_iteration_ms(m["iteration_ms"])[0],
                    "simulated_iteration_ms": sim.iteration_ms,
                })
    param_bytes = [sum(layer["param_bytes"] for layer in profile.data["layers"][a:b])
                   for a, b in ((0, SPLIT), (SPLIT, len(profile.data["layers"])))]
    out = {
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads in the parent, 1 per worker",
        "torch": torch.__version__,
        "model": {"factory": "dapple.planner.runtime.models:gpt", **CONFIG},
        "micro_batch_size": MBS,
        "micro_batches": M,
        "stage_param_bytes": param_bytes,
        "rows": rows,
    }
    (HERE / "results" / "recompute_memory.json").write_text(json.dumps(out, indent=2) + "\n")
    mib = 2**20
    print("| schedule | re-computation | stage | measured peak growth | simulated activations | "
          "measured iteration | simulated iteration |")
    print("|---|---|--:|--:|--:|--:|--:|")
    for r in rows:
        print(f"| {r['schedule']} | {'yes' if r['recompute'] else 'no'} | {r['stage']} | "
              f"{r['measured_training_peak_bytes'] / mib:.1f} MiB | {r['simulated_activation_peak_bytes'] / mib:.1f} MiB | "
              f"{r['measured_iteration_ms']:.0f} ms | {r['simulated_iteration_ms']:.0f} ms |")
    print(f"stage parameters: {param_bytes[0] / mib:.2f} MiB, {param_bytes[1] / mib:.2f} MiB "
          f"(their gradients are part of the measured growth)")


if __name__ == "__main__":
    main()
