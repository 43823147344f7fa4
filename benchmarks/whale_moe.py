"""Whale's M6-MoE (whale.txt 5.3.2) in dapple: the shipped stand-ins at 100B,
1T and 10T parameters (`profiles/models/m6-moe-*.json`; the seeds give
M6-MoE's scale and clusters, not its configuration) on the V100-32GB
clusters Whale trained them on, each planned by dapple and costed in
Whale's own layout: one stage over every GPU, the experts under
`split(total_gpus)`, the rest under `replicate` (expert degree = GPUs),
optimizer offloaded where its state does not fit.

Whale's figures: M6-MoE-100B trained on 100 million samples in 1.5 days on
128 V100 (771.6 samples/s, derived); 1T on 480 V100 and 10T on 512 with
CPU offloading, without a throughput. Global batch sizes and sequence
length are not given: 512 tokens a sample and about 8 samples a GPU
here. dapple plans at four times the default steps a micro-batch size
(``--max-search-steps 40000000``), and at the default beside it: the
stand-ins' blocks hold 256 to 24,064 experts, and spreading them shrinks
a block's passes up to fiftyfold, so the search's bounds prune little and
it stops at its limit at most sizes, returning the best plan found by then.
Writes benchmarks/results/whale_moe.json and prints the markdown table
docs/paper-comparison.md quotes.

    python benchmarks/whale_moe.py            # plans and costs (under a minute)
    python benchmarks/whale_moe.py --table    # the table, from the results file
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

from dapple import planner
from dapple.planner.errors import DappleError
from dapple.planner.plan import shape_label

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from plan_speed import build_info, machine_info  # noqa: E402

OUT = HERE / "results" / "whale_moe.json"
SEQ_LEN = 512
GPU = "V100-32GB"
#: Steps a micro-batch size's search may take (`dapple plan --max-search-steps`).
MAX_SEARCH_STEPS = 40_000_000
#: (config, cluster, global batch, Whale's samples a second where it gives them).
ROWS = [
    ("m6-moe-100b", "16x8-v100-32gb", 1024, 100e6 / (1.5 * 86400)),
    ("m6-moe-1t", "60x8-v100-32gb", 960, None),
    ("m6-moe-10t", "64x8-v100-32gb", 1024, None),
]
#: Mixed-precision Adam's bytes a parameter: bf16 weights and gradients,
#: fp32 master weights and two moments (ZeRO's 2 + 2 + 12).
STATE_BYTES_PER_PARAM = 16


def costed(plan) -> dict:
    est = plan.estimate
    shapes = {shape_label(s) or "plain" for s in plan.stage_shapes}
    return {
        "stages": len(plan.stages),
        "schedule": plan.data["schedule"]["kind"],
        "shapes": sorted(shapes),
        "micro_batch_size": plan.data["micro_batch_size"],
        "iteration_ms": plan.iteration_ms,
        "samples_per_s": plan.data["inputs"]["global_batch_size"] / plan.iteration_ms * 1e3,
        "mfu": est.get("mfu"),
        "peak_gib": max(s["memory_bytes"] for s in est["stages"]) / 2**30,
        "host_gib": max(s.get("host_memory_bytes", 0.0) for s in est["stages"]) / 2**30,
        "offloaded_step_ms": max(s.get("offloaded_step_ms", 0.0) for s in est["stages"]),
    }


def whale_layout(profile, cluster: str, gbs: int, gpus: int):
    """Whale's M6-MoE layout: experts over every GPU, the rest replicated,
    the optimizer offloaded where it does not fit on the GPUs."""
    for offload in ("none", "optimizer"):
        try:
            p = planner.megatron_plan(profile, cluster, gbs, tensor_parallel=1, pipeline_parallel=1,
                                      micro_batch_size=gbs // gpus, expert_parallel=gpus, offload=offload,
                                      shard_level=int(offload != "none"))
        except DappleError as e:
            last = str(e)
            continue
        if p.estimate["fits_memory"]:
            return costed(p), None
        last = "does not fit"
    return None, last


def row(config: str, cluster: str, gbs: int, whale_samples_per_s: float | None) -> dict:
    profile = planner.transformer_profile(config, gpu=GPU, seq_len=SEQ_LEN)
    params = sum(layer["param_bytes"] for layer in profile.layers) / 2
    topology = planner.Topology.resolve(cluster)
    gpus = topology.num_devices
    out = {"config": config, "cluster": cluster, "global_batch_size": gbs, "parameters": params, "gpus": gpus,
           "whale_samples_per_s": whale_samples_per_s}
    # The whole model's state over every GPU, against all their memory and their hosts'.
    out["state_gib_per_gpu"] = params * STATE_BYTES_PER_PARAM / gpus / 2**30
    t0 = time.perf_counter()
    try:
        out["dapple"] = costed(planner.plan(profile, topology, gbs, max_search_steps=MAX_SEARCH_STEPS))
    except DappleError as e:
        out["dapple"] = {"error": str(e)}
    out["plan_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    try:
        out["dapple_default_steps"] = costed(planner.plan(profile, topology, gbs))
    except DappleError as e:
        out["dapple_default_steps"] = {"error": str(e)}
    out["plan_default_steps_s"] = time.perf_counter() - t0
    out["whale_layout"], why = whale_layout(profile, cluster, gbs, gpus)
    if why:
        out["whale_layout_error"] = why
    return out


def table(results: list[dict]) -> str:
    lines = ["| model (stand-in) | cluster | global batch | state a GPU, GiB | dapple's plan | s an iteration "
             "| samples/s | MFU | GPU / host GiB | at the default steps: s | Whale's layout: s | samples/s "
             "| Whale's samples/s |",
             "|---|---|--:|--:|---|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for r in results:
        d, w = r["dapple"], r["whale_layout"]
        if "error" in d:
            plan = ("no plan fits", "-", "-", "-", "-")
        else:
            plan = (f"{d['stages']} stage(s), {d['schedule']}, {', '.join(d['shapes'])}",
                    f"{d['iteration_ms'] / 1e3:.2f}", f"{d['samples_per_s']:.0f}", f"{d['mfu']:.3f}",
                    f"{d['peak_gib']:.1f} / {d['host_gib']:.1f}")
        default = r["dapple_default_steps"]
        plan += ("-" if "error" in default else f"{default['iteration_ms'] / 1e3:.2f}",)
        whale = ((f"{w['iteration_ms'] / 1e3:.2f}", f"{w['samples_per_s']:.0f}") if w else ("does not fit", "-"))
        given = f"{r['whale_samples_per_s']:.0f}" if r["whale_samples_per_s"] else "not given"
        lines.append(f"| {r['config']} ({r['parameters'] / 1e12:.2f}T) | {r['cluster']} | {r['global_batch_size']} "
                     f"| {r['state_gib_per_gpu']:.0f} | " + " | ".join(plan) + " | " + " | ".join(whale)
                     + f" | {given} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--table", action="store_true", help="print the table of the results file and stop")
    args = parser.parse_args()
    if args.table:
        print(table(json.loads(args.out.read_text())["rows"]))
        return
    rows = [row(*r) for r in ROWS]
    results = {"when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "machine": machine_info(), "build": build_info(), "seq_len": SEQ_LEN, "gpu": GPU, "rows": rows}
    # Whole or not at all.
    tmp_out = args.out.with_suffix(".tmp")
    tmp_out.write_text(json.dumps(results, indent=2) + "\n")
    os.replace(tmp_out, args.out)
    print(table(rows))


if __name__ == "__main__":
    main()
