"""Predictions against runs, on any machine with torch: one command.

    python benchmarks/fidelity.py --device cuda --out benchmarks/results/fidelity-cuda.json
    python benchmarks/fidelity.py --device cpu --out benchmarks/results/fidelity-cpu.json

For each GPT size, each dtype (fp32, bf16) and each micro-batch (1, 2, 4,
8, 16 and 32) it profiles the model with dapple's profiler at that
micro-batch; then, with and without re-computation, it plans one device at a
global batch of one micro-batch, predicts (the simulated iteration and the
peak memory of the plan's estimate), runs the plan with dapple's runtime
(``--steps`` steps with Adam, the median after the first) and compares.
It also runs a 2-stage pipelined plan (the straight 1:1 pipeline at a
global batch of 32, micro-batches of 8 or more) where the machine has a device for each stage: two
processes on the CPU; on CUDA, two GPUs (NCCL takes one GPU per rank, so
one GPU cannot hold both stages: the row records why it was left out).

Sizes: on CUDA the issue's models, GPT 12 x 768 (162.6M parameters) and
24 x 1024, sequence 512, GPT-2's vocabulary. A CPU thread would take
minutes a step on those, so ``--device cpu`` runs 4 x 192 and 8 x 256 at
sequence 128 with a vocabulary of 2048: the same layers, smaller.

Rows: ``model``, ``dtype``, ``micro_batch_size``, ``recompute``,
``stages``, ``predicted_ms``, ``measured_ms``, ``time_ratio`` (predicted
over measured), ``predicted_peak_bytes`` (the plan's allocated peak on its
busiest GPU), ``measured_peak_bytes`` (``torch.cuda.max_memory_allocated``
on CUDA, null on the CPU, where the resident set counts the interpreter),
``memory_ratio`` and ``device`` (the device's name). docs/fidelity.md
holds the table.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import planner
from planner.profiler import profile_model
from planner.runtime import links, models
from planner.runtime.launcher import FIRST_STEPS_LEFT_OUT, median_iteration_ms, run_plan

HERE = Path(__file__).resolve().parent
MICRO_BATCHES = [1, 2, 4, 8, 16, 32]
DTYPES = ["fp32", "bf16"]
SIZES = {
    "cuda": {
        "gpt-12x768": dict(n_layers=12, d_model=768, n_heads=12, seq=512, vocab=50257),
        "gpt-24x1024": dict(n_layers=24, d_model=1024, n_heads=16, seq=512, vocab=50257),
    },
    "cpu": {
        "gpt-4x192": dict(n_layers=4, d_model=192, n_heads=4, seq=128, vocab=2048),
        "gpt-8x256": dict(n_layers=8, d_model=256, n_heads=4, seq=128, vocab=2048),
    },
}
#: The pipelined row: a global batch of 4 micro-batches of 8 (or fewer,
#: larger ones, where the straight baseline runs them faster) over two stages.
PIPELINE_MICRO_BATCH, PIPELINE_MICRO_BATCHES = 8, 4
LR = 1e-4


def one_device_topology(device: str, torch) -> planner.Topology:
    """One device: on CUDA with the GPU's own memory; on the CPU the spec's."""
    topo = planner.Topology.from_spec("1x1")
    if device != "cuda":
        return topo
    data = topo.data
    data["machine_groups"][0]["gpu"]["memory_bytes"] = torch.cuda.get_device_properties(0).total_memory
    return planner.Topology.from_dict(data)


def predicted(plan: planner.Plan, profile: planner.Profile, recompute: bool) -> tuple[float, float]:
    """The simulated iteration (ms) and the busiest GPU's allocated peak (bytes)."""
    sim = planner.simulate(plan, profile, recompute=recompute)
    return sim.iteration_ms, max(st["peak_memory_bytes"] for st in sim.stages)


def measured(run, device: str) -> tuple[float, float | None]:
    """Rank 0's median step after the first, and the largest CUDA peak."""
    ms, _ = median_iteration_ms(run.metrics[0]["iteration_ms"])
    if device != "cuda":
        return ms, None
    return ms, max(m["peak_memory_bytes"] for m in run.metrics.values())


def run_row(plan, profile, factory, spec, gen, options: dict, recompute: bool, steps: int) -> dict:
    import torch

    gbs = plan.micro_batch_size * plan.micro_batches
    batches = [spec.make_batch(gbs, gen) for _ in range(2)]
    if options["device"] == "cuda":
        torch.cuda.empty_cache()
    run = run_plan(plan, factory, spec.loss, batches, steps, LR, optimizer="adam", start_method="fork",
                   recompute=recompute, **options)
    predicted_ms, predicted_peak = predicted(plan, profile, recompute)
    measured_ms, measured_peak = measured(run, options["device"])
    return {
        "recompute": recompute,
        "stages": len(plan.stages),
        "micro_batches": plan.micro_batches,
        "predicted_ms": round(predicted_ms, 4),
        "measured_ms": round(measured_ms, 4),
        "time_ratio": round(predicted_ms / measured_ms, 4),
        "predicted_peak_bytes": round(predicted_peak),
        "measured_peak_bytes": measured_peak,
        "memory_ratio": None if measured_peak is None else round(predicted_peak / measured_peak, 4),
    }


def model_rows(name: str, config: dict, dtype: str, args, torch) -> list[dict]:
    """Every row of one model in one dtype. Each micro-batch is profiled
    right before its runs: this VM's speed drifts by several percent over
    minutes (docs/fidelity.md), and a prediction should be compared with a
    run made under the same conditions as its profile."""
    factory = functools.partial(models.gpt, **config)
    spec = factory()
    options = dict(dtype=dtype, device=args.device, threads=1)
    gen = torch.Generator().manual_seed(0)
    topo = one_device_topology(args.device, torch)
    rows = []
    for mb in MICRO_BATCHES:
        profile = profiled(spec, name, [mb], dtype, args)
        # The whole model on the one device, one micro-batch of mb.
        plan = planner.layout_plan(profile, topo, mb, [(0, len(profile.layers), [0])], min_micro_batch_size=mb)
        for recompute in (False, True):
            print(f"  micro-batch {mb}, recompute {recompute}", file=sys.stderr)
            row = run_row(plan, profile, factory, spec, gen, options, recompute, args.steps)
            rows.append({"model": name, "dtype": dtype, "micro_batch_size": mb, **row,
                         "device": profile.data["device"]})
    rows.append(pipeline_row(name, factory, spec, gen, options, args, torch))
    return rows


def profiled(spec, name: str, sizes: list[int], dtype: str, args) -> planner.Profile:
    print(f"{name} {dtype}: profiling at {sizes}", file=sys.stderr)
    return profile_model(spec, name, sizes, device=args.device, dtype=dtype, warmup=2, repeats=args.repeats,
                         progress=False, threads=1)


def pipeline_row(name, factory, spec, gen, options, args, torch) -> dict:
    """The straight 2-stage pipeline on two devices of this machine, or why not."""
    row = {"model": name, "dtype": options["dtype"], "micro_batch_size": PIPELINE_MICRO_BATCH, "recompute": False,
           "stages": 2}
    if args.device == "cuda" and torch.cuda.device_count() < 2:
        return row | {"left_out": "NCCL runs one rank per GPU and this machine has one",
                      "device": torch.cuda.get_device_name(0)}
    profile = profiled(spec, name, [m for m in MICRO_BATCHES if m >= PIPELINE_MICRO_BATCH], options["dtype"], args)
    if args.device == "cuda":
        topo = planner.Topology.from_spec("1x2-nvlink")
    else:
        topo = links.topology_of(links.measure_links(2, repeats=20))
    gbs = PIPELINE_MICRO_BATCH * PIPELINE_MICRO_BATCHES
    plan = planner.baseline("straight", profile, topo, gbs, min_micro_batch_size=PIPELINE_MICRO_BATCH)
    print(f"  2 stages, {plan.micro_batches} x {plan.micro_batch_size}", file=sys.stderr)
    return row | run_row(plan, profile, factory, spec, gen, options, False, args.steps) | {
        "micro_batch_size": plan.micro_batch_size, "device": profile.data["device"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=12, help="steps per run (the first is left out)")
    ap.add_argument("--repeats", type=int, default=10, help="timed passes per profiled micro-batch")
    ap.add_argument("--models", default=None, help="comma-separated subset of the device's model names")
    args = ap.parse_args()
    import torch

    sizes = SIZES[args.device]
    names = args.models.split(",") if args.models else list(sizes)
    started = time.time()
    load_before = os.getloadavg()
    rows = [row for name in names for dtype in DTYPES for row in model_rows(name, sizes[name], dtype, args, torch)]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=HERE).stdout.strip()
    out = {
        "command": "python benchmarks/fidelity.py " + " ".join(sys.argv[1:]),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit,
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "wall_s": round(time.time() - started, 1),
        "steps": args.steps,
        "first_steps_left_out": FIRST_STEPS_LEFT_OUT,
        "optimizer": "adam",
        "models": {n: sizes[n] for n in names},
        "rows": rows,
    }
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(out, indent=2) + "\n")
    tmp.replace(args.out)
    print_table(rows)


def print_table(rows: list[dict]) -> None:
    print("| model | dtype | micro-batch | recompute | stages | predicted ms | measured ms | ratio | "
          "predicted peak MiB | measured peak MiB |")
    print("|---|---|--:|---|--:|--:|--:|--:|--:|--:|")
    for r in rows:
        if "left_out" in r:
            print(f"| {r['model']} | {r['dtype']} | {r['micro_batch_size']} | no | 2 | left out: {r['left_out']} "
                  "| | | | |")
            continue
        peak = "-" if r["measured_peak_bytes"] is None else f"{r['measured_peak_bytes'] / 2**20:.0f}"
        print(f"| {r['model']} | {r['dtype']} | {r['micro_batch_size']} | {'yes' if r['recompute'] else 'no'} | "
              f"{r['stages']} | {r['predicted_ms']:.2f} | {r['measured_ms']:.2f} | {r['time_ratio']:.3f} | "
              f"{r['predicted_peak_bytes'] / 2**20:.1f} | {peak} |")
    single = [r["time_ratio"] for r in rows if r.get("stages") == 1]
    if single:
        print(f"\nsingle-process rows: time ratio {min(single):.3f} .. {max(single):.3f}, "
              f"median {statistics.median(single):.3f}; within 10%: "
              f"{sum(0.9 <= x <= 1.1 for x in single)} of {len(single)}")


if __name__ == "__main__":
    main()
