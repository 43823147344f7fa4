"""Adam parameters updated per second per CPU core, with torch's own CPU Adam.

    python benchmarks/cpu_adam.py [--params 50000000] [--tensors 20] [--warmup 3] [--steps 10]
        [--out benchmarks/results/cpu_adam.json]

The planner prices an optimizer step offloaded to host memory (ZeRO-Offload
style: fp32 master weights and both Adam moments live in CPU memory and the
CPU runs Adam), so it needs a measured rate. This times ``torch.optim.Adam``
(lr 1e-3, default betas and eps, no weight decay) on fp32 parameters and
gradients: one flat buffer of ``--params`` elements split into ``--tensors``
equal views, as a model's layers would be. Three implementations: ``fused``
(the CPU fused kernel, torch >= 2.4; if it raises, the error text is kept),
``foreach`` and the plain for-loop, each at 1 thread and at every CPU
(``torch.set_num_threads``). Each variant gets fresh parameters and a fresh
optimizer, ``--warmup`` untimed steps (the first one allocates the moments),
then ``--steps`` steps timed one by one with ``time.perf_counter``; the median
and the minimum are reported. The rate is parameters / median seconds.

Adam reads and writes the parameter and both moments and reads the gradient:
28 bytes per fp32 parameter per step. ``implied_gb_per_s`` is that traffic
over the median time; set it beside the machine's memory bandwidth to see
whether the step is memory-bound.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
BYTES_PER_PARAM = {"param": 4 + 4, "grad": 4, "exp_avg": 4 + 4, "exp_avg_sq": 4 + 4}  # read + write, fp32
IMPLEMENTATIONS = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for_loop": {"foreach": False, "fused": False}}


def machine_info() -> dict:
    """The CPU as /proc/cpuinfo and lscpu name it, and how many there are."""
    model = None
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        pass
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        fields = dict(line.split(":", 1) for line in lscpu.splitlines() if ":" in line)
        lscpu = {k: fields[k].strip() for k in ("Model name", "CPU family", "Model", "Hypervisor vendor", "L2 cache", "L3 cache") if k in fields}
    except (OSError, subprocess.CalledProcessError, ValueError):
        lscpu = None
    return {
        "cpu_model": model,
        "lscpu": lscpu,
        "logical_cpus": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)),
        "mem_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }


def time_variant(name: str, threads: int, args: argparse.Namespace) -> dict:
    """Median and minimum seconds per Adam step of one implementation."""
    row = {"variant": name, "threads": threads, "params": args.params, "tensors": args.tensors}
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    flat = torch.randn(args.params, generator=gen) * 0.02
    flat_grad = torch.randn(args.params, generator=gen) * 1e-3
    params = list(flat.chunk(args.tensors))
    for p, g in zip(params, flat_grad.chunk(args.tensors)):
        p.grad = g
    try:
        opt = torch.optim.Adam(params, lr=1e-3, weight_decay=0, **IMPLEMENTATIONS[name])
        for _ in range(args.warmup):
            opt.step()
    except Exception as e:  # noqa: BLE001 - recorded, not hidden
        return {**row, "error": f"{type(e).__name__}: {e}"}
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    median = statistics.median(times)
    rate = args.params / median
    return {
        **row,
        "steps": args.steps,
        "median_s": median,
        "min_s": min(times),
        "params_per_s": rate,
        "params_per_s_per_thread": rate / threads,
        "implied_gb_per_s": rate * sum(BYTES_PER_PARAM.values()) / 1e9,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=int, default=50_000_000, help="fp32 parameters in all (default %(default)s)")
    ap.add_argument("--tensors", type=int, default=20, help="equal tensors the parameters are split into (default %(default)s)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per variant (default %(default)s)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per variant (default %(default)s)")
    ap.add_argument("--out", default="benchmarks/results/cpu_adam.json", help="results JSON, relative to the repository root (default: %(default)s)")
    args = ap.parse_args()
    cpus = os.cpu_count() or 1
    load_start = os.getloadavg()
    rows = []
    for name in IMPLEMENTATIONS:
        for threads in sorted({1, cpus}):
            row = time_variant(name, threads, args)
            rows.append(row)
            if "error" in row:
                print(f"{name:8} {threads} thread(s): {row['error']}", flush=True)
            else:
                print(
                    f"{name:8} {threads} thread(s): median {row['median_s'] * 1000:.1f} ms (min {row['min_s'] * 1000:.1f}), "
                    f"{row['params_per_s_per_thread'] / 1e6:.1f} M params/s per thread, {row['implied_gb_per_s']:.1f} GB/s",
                    flush=True,
                )
    doc = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "dtype": "float32",
        "adam": {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0},
        "bytes_per_param_per_step": sum(BYTES_PER_PARAM.values()),
        "bytes_per_param_per_step_parts": BYTES_PER_PARAM,
        "warmup_steps": args.warmup,
        "load_average_start": load_start,
        "load_average_end": os.getloadavg(),
        "rows": rows,
    }
    out = ROOT / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, out)  # whole or not at all


if __name__ == "__main__":
    main()
