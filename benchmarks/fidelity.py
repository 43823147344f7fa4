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

On CUDA the single-process rows run their one rank in this process, as
torchrun starts a rank (``launched_by_torchrun``), not in a spawned worker:
a spawned process pays for importing torch and starting CUDA, seconds a row
over 48 rows. Before each profile and each run the GPU's cache is emptied
and the profiled model is moved back to the host, so a run's peak counts
its own tensors; ``allocated_before_bytes`` records what was still
allocated when the run began (0 when nothing leaked).

The file is rewritten after every row (``"complete": false`` until the last
one), so a run stopped early still leaves its rows. Each single-process row
keeps the profile it was predicted from, so that a later cost model can
predict it again without the machine:

    python benchmarks/fidelity.py --repredict benchmarks/results/fidelity-cuda.json [--out new.json]

prints the table with the current model's predictions (and writes them).

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
import contextlib
import datetime
import functools
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from dapple import planner
from dapple.planner.profiler import profile_model
from dapple.planner.runtime import links, models
from dapple.planner.runtime.launcher import FIRST_STEPS_LEFT_OUT, free_port, median_iteration_ms, run_plan

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


def device_memory_bytes(device: str, torch) -> int:
    """The memory of the one device: on CUDA the GPU's own; on the CPU the
    spec's."""
    if device == "cuda":
        return torch.cuda.get_device_properties(0).total_memory
    return planner.Topology.from_spec("1x1").data["machine_groups"][0]["gpu"]["memory_bytes"]


def whole_model_plan(profile: planner.Profile, memory_bytes: int, mb: int) -> planner.Plan:
    """The whole model on one device of ``memory_bytes``, one micro-batch of ``mb``."""
    data = planner.Topology.from_spec("1x1").data
    data["machine_groups"][0]["gpu"]["memory_bytes"] = memory_bytes
    topo = planner.Topology.from_dict(data)
    return planner.layout_plan(profile, topo, mb, [(0, len(profile.layers), [0])], min_micro_batch_size=mb)


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


def release_device_memory(device: str, torch) -> int:
    """Free what the last profile or run left cached on the GPU; the bytes
    still allocated afterwards (0 on the CPU)."""
    gc.collect()
    if device != "cuda":
        return 0
    torch.cuda.empty_cache()
    return int(torch.cuda.memory_allocated())


@contextlib.contextmanager
def rank_in_this_process():
    """A world of one rank in this process, as torchrun would describe it."""
    saved = {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def run_row(plan, profile, factory, spec, gen, options: dict, recompute: bool, steps: int) -> dict:
    import torch

    gbs = plan.micro_batch_size * plan.micro_batches
    batches = [spec.make_batch(gbs, gen) for _ in range(2)]
    allocated_before = release_device_memory(options["device"], torch)
    in_process = options["device"] == "cuda" and len(plan.stages) == 1
    with rank_in_this_process() if in_process else contextlib.nullcontext():
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
        "allocated_before_bytes": allocated_before,
        "in_process": in_process,
        # What explains a ratio: the run's median phases (rank 0, first step
        # left out) and the profile's sums they are predicted from.
        "measured_phase_ms": median_phases(run.metrics[0]),
        "profile_ms": profile_sums(profile, plan.micro_batch_size),
    }


def median_phases(metrics: dict) -> dict[str, float]:
    phases = {}
    for phase, times in metrics.get("phase_ms", {}).items():
        if times:
            phases[phase] = round(median_iteration_ms(times)[0], 4)
    return phases


def profile_sums(profile: planner.Profile, batch_size: int) -> dict[str, float]:
    """The profile's forward and backward summed over the layers at
    ``batch_size`` (where it was measured), and the optimizer's step."""
    sums = {"fwd_ms": 0.0, "bwd_ms": 0.0}
    for layer in profile.data["layers"]:
        for m in layer["measurements"]:
            if m["batch_size"] == batch_size:
                sums["fwd_ms"] += m["fwd_ms"]
                sums["bwd_ms"] += m["bwd_ms"]
    return {k: round(v, 4) for k, v in sums.items()} | {"optimizer_step_ms": profile.data.get("optimizer_step_ms")}


def model_rows(name: str, config: dict, dtype: str, args, torch, emit) -> None:
    """Every row of one model in one dtype. Each micro-batch is profiled
    right before its runs: this VM's speed drifts by several percent over
    minutes (docs/fidelity.md), and a prediction should be compared with a
    run made under the same conditions as its profile."""
    factory = functools.partial(models.gpt, **config)
    spec = factory()
    options = dict(dtype=dtype, device=args.device, threads=1)
    gen = torch.Generator().manual_seed(0)
    memory_bytes = device_memory_bytes(args.device, torch)
    for mb in args.micro_batches:
        profile = profiled(spec, name, [mb], dtype, args)
        plan = whole_model_plan(profile, memory_bytes, mb)
        for recompute in (False, True):
            print(f"  micro-batch {mb}, recompute {recompute}", file=sys.stderr)
            row = run_row(plan, profile, factory, spec, gen, options, recompute, args.steps)
            emit({"model": name, "dtype": dtype, "micro_batch_size": mb, **row, "device": profile.data["device"],
                  "device_memory_bytes": memory_bytes,
                  "profile": profile.data})
    if not args.no_pipeline:
        emit(pipeline_row(name, factory, spec, gen, options, args, torch))


def profiled(spec, name: str, sizes: list[int], dtype: str, args) -> planner.Profile:
    """The profile of ``spec`` at ``sizes``; the model goes back to the host
    afterwards, so that runs find the GPU empty."""
    import torch

    print(f"{name} {dtype}: profiling at {sizes}", file=sys.stderr)
    release_device_memory(args.device, torch)
    try:
        return profile_model(spec, name, sizes, device=args.device, dtype=dtype, warmup=2, repeats=args.repeats,
                             progress=False, threads=1)
    finally:
        spec.to("cpu")
        for p in spec.parameters():
            p.grad = None


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
    ap.add_argument("--device", choices=["cpu", "cuda"])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--repredict", type=Path, metavar="RESULTS",
                    help="predict the rows of a results file again with this cost model (no torch, no runs)")
    ap.add_argument("--steps", type=int, default=12, help="steps per run (the first is left out)")
    ap.add_argument("--repeats", type=int, default=10, help="timed passes per profiled micro-batch")
    ap.add_argument("--models", default=None, help="comma-separated subset of the device's model names")
    ap.add_argument("--dtypes", type=_names(DTYPES), default=DTYPES, help="comma-separated subset of fp32,bf16")
    ap.add_argument("--micro-batches", type=_counts, default=MICRO_BATCHES,
                    help="comma-separated micro-batch sizes (default 1,2,4,8,16,32)")
    ap.add_argument("--no-pipeline", action="store_true", help="leave the 2-stage rows out")
    args = ap.parse_args()
    if args.repredict:
        repredict(args.repredict, args.out)
        return
    if args.device is None or args.out is None:
        ap.error("--device and --out are needed, or --repredict")
    import torch

    sizes = SIZES[args.device]
    names = args.models.split(",") if args.models else list(sizes)
    unknown = sorted(set(names) - set(sizes))
    if unknown:
        ap.error(f"--models: {', '.join(unknown)} not among {', '.join(sizes)}")
    started = time.time()
    load_before = os.getloadavg()
    # A copy of the tree without its history (a lent GPU machine's) names
    # its commit in DAPPLE_COMMIT.
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=HERE).stdout.strip() or os.environ.get("DAPPLE_COMMIT", "")
    rows: list[dict] = []

    def write(complete: bool) -> None:
        out = {
            "command": "python benchmarks/fidelity.py " + " ".join(sys.argv[1:]),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "commit": commit,
            "torch": torch.__version__,
            "cpus": os.cpu_count(),
            "load_average_before": [round(x, 2) for x in load_before],
            "load_average_after": [round(x, 2) for x in os.getloadavg()],
            "wall_s": round(time.time() - started, 1),
            "complete": complete,
            "steps": args.steps,
            "repeats": args.repeats,
            "first_steps_left_out": FIRST_STEPS_LEFT_OUT,
            "optimizer": "adam",
            "models": {n: sizes[n] for n in names},
            "rows": rows,
        }
        tmp = args.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(out, indent=2) + "\n")
        tmp.replace(args.out)

    def emit(row: dict) -> None:
        rows.append(row)
        write(complete=False)

    for name in names:
        for dtype in args.dtypes:
            model_rows(name, sizes[name], dtype, args, torch, emit)
    write(complete=True)
    print_table(rows)


def _counts(text: str) -> list[int]:
    try:
        counts = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of counts: {text!r}") from None
    if any(c < 1 for c in counts):
        raise argparse.ArgumentTypeError(f"counts must be positive: {text!r}")
    return counts


def _names(allowed: list[str]):
    def parse(text: str) -> list[str]:
        names = text.split(",")
        if not set(names) <= set(allowed):
            raise argparse.ArgumentTypeError(f"{text!r}: each must be one of {', '.join(allowed)}")
        return names
    return parse


def repredict(path: Path, out: Path | None) -> None:
    """The rows of ``path`` predicted again from their own profiles, with the
    measured columns kept; the table printed, and written to ``out``."""
    results = json.loads(path.read_text())
    for row in results["rows"]:
        if "profile" not in row:
            continue  # a row left out, or one from before profiles were kept
        profile = planner.Profile.from_dict(row["profile"])
        plan = whole_model_plan(profile, row["device_memory_bytes"], row["micro_batch_size"])
        predicted_ms, predicted_peak = predicted(plan, profile, row["recompute"])
        row["predicted_ms"] = round(predicted_ms, 4)
        row["time_ratio"] = round(predicted_ms / row["measured_ms"], 4)
        row["predicted_peak_bytes"] = round(predicted_peak)
        if row["measured_peak_bytes"]:
            row["memory_ratio"] = round(predicted_peak / row["measured_peak_bytes"], 4)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=HERE).stdout.strip()
    results["repredicted"] = {"commit": commit, "from": str(path)}
    if out is not None:
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(results, indent=2) + "\n")
        tmp.replace(out)
    print_table(results["rows"])


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
