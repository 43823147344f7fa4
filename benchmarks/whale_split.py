"""Whale's `split` experiment (Whale, section 5.1.3 and Figure 16), in the
simulator: ResNet-50 with a 100K-class (and a 1M-class) FC classifier,
data parallelism against dapple's plan on 8, 16 and 32 V100-32GB.

    python benchmarks/whale_split.py [--write-profiles] [--out benchmarks/results/whale_split.json]

The profiles are analytic (`--write-profiles` writes them to
``profiles/whale/``), built here from public figures, not measured:

* ResNet-50's backbone by stage (stem, conv2_x .. conv5_x, pool), with the
  multiply-adds of He et al. 2016 (Table 1, 3.8e9 in all; per stage as
  torchvision's model counts them: 0.118, 0.680, 1.030, 1.470, 0.811 GMACs
  at 224 x 224) and the parameters of torchvision's resnet50 (23.5M without
  its FC, 89.7 MiB in fp32, Whale's "90 MB");
* the FC layer: 2048 features to C classes, 2048 C weights and C biases
  (C = 100,000: 781.6 MiB, Whale's "782 MB");
* time: FLOPs (2 per multiply-add; backward twice the forward) over the
  V100's fp32 peak of 15.7 TFLOP/s (the dapple catalog's) times 0.5;
* memory: fp32 with Adam (16 bytes a parameter; Whale does not say which
  optimizer), each stage keeping 10 times its output for its backward, the
  FC its input and its fp32 logits;
* split patterns of the FC: by classes with a distributed softmax (SP1:
  two numbers per sample forward, the features' gradient backward) and by
  features (SP2: the whole logits forward).

Each GPU takes 32 samples (global batch 32 x GPUs), on `Nx8-v100-32gb-
nvlink-50gbps`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from dapple import planner

ROOT = Path(__file__).resolve().parent.parent
OUT_DIR = ROOT / "profiles" / "whale"
FP32 = 4
FEATURES = 2048
PER_GPU = 32
EFFICIENCY = 0.5
# (name, GMACs per image at 224x224, parameters, output elements per image)
BACKBONE = [
    ("stem", 0.118, 9_408 + 128, 64 * 56 * 56),
    ("conv2_x", 0.680, 215_808, 256 * 56 * 56),
    ("conv3_x", 1.030, 1_219_584, 512 * 28 * 28),
    ("conv4_x", 1.470, 7_098_368, 1024 * 14 * 14),
    ("conv5_x", 0.811, 14_964_736, 2048 * 7 * 7),
    ("avgpool", 0.0001, 0, FEATURES),
]
STORED_PER_OUTPUT = 10


def ms_of(flops: float) -> float:
    v100 = planner.GPU_TYPES["V100-32GB"]
    return flops / (v100["fp32_tflops"] * 1e12 * EFFICIENCY) * 1e3


def measurement(batch: int, fwd_flops: float, activation: float, stored: float) -> dict:
    fwd = ms_of(fwd_flops) * batch
    return {
        "batch_size": batch,
        "fwd_ms": fwd,
        "bwd_ms": 2 * fwd,
        "activation_bytes": int(activation * batch),
        "stored_activation_bytes": int(stored * batch),
    }


def profile(classes: int) -> dict:
    layers = [
        {
            "name": name,
            "kind": "block",
            "param_bytes": params * FP32,
            "measurements": [measurement(b, 2 * gmacs * 1e9, out * FP32, STORED_PER_OUTPUT * out * FP32) for b in (8, 32)],
        }
        for name, gmacs, params, out in BACKBONE
    ]
    features_bytes = FEATURES * FP32
    logits_bytes = classes * FP32
    stored = features_bytes + logits_bytes
    layers.append({
        "name": f"fc{classes}",
        "param_bytes": (FEATURES + 1) * classes * FP32,
        "measurements": [measurement(b, 2 * FEATURES * classes, FP32, stored) for b in (8, 32)],
        "split": [
            {
                "name": "SP1: by classes, distributed softmax",
                "divides": [{"what": "classes", "count": classes}],
                "fwd_allreduce_bytes_per_sample": 2 * FP32,
                "bwd_allreduce_bytes_per_sample": features_bytes,
                "replicated_stored_fraction": features_bytes / stored,
            },
            {
                "name": "SP2: by features, logits reduced",
                "divides": [{"what": "features", "count": FEATURES}],
                "fwd_allreduce_bytes_per_sample": logits_bytes,
                "bwd_allreduce_bytes_per_sample": 0,
                "replicated_stored_fraction": logits_bytes / stored,
            },
        ],
    })
    return {
        "format": "dapple.profile",
        "schema_version": 1,
        "model": f"ResNet-50 + FC {classes:,}",
        "source": "analytic, not measured: benchmarks/whale_split.py (public FLOP and parameter counts, "
        f"{EFFICIENCY} of the V100's fp32 peak)",
        "device": "V100-32GB",
        "optimizer": "adam",
        "layers": layers,
        "model_flops_per_sample": 3 * (sum(2 * g * 1e9 for _, g, _, _ in BACKBONE) + 2 * FEATURES * classes),
    }


def stage_summary(plan: planner.Plan) -> str:
    parts = []
    for s in plan.stages:
        t = s.get("tensor_parallel", 1)
        parts.append(f"{len(s['devices'])} GPUs" + (f" split {t} ways" if t > 1 else ""))
    return "; ".join(parts)


def run_case(path: Path, machines: int) -> dict:
    topology = f"{machines}x8-v100-32gb-nvlink-50gbps"
    gbs = PER_GPU * 8 * machines
    row: dict = {"profile": path.name, "topology": topology, "global_batch_size": gbs}
    try:
        dp = planner.baseline("data-parallel", str(path), topology, gbs)
        row["data_parallel_ms"] = dp.iteration_ms
        row["data_parallel_peak_gib"] = dp.estimate["peak_memory_bytes"] / 2**30
        row["data_parallel_micro_batch_per_gpu"] = dp.micro_batch_size // len(dp.stages[0]["devices"])
    except planner.InfeasibleError as e:
        row["data_parallel_ms"] = None
        row["data_parallel_error"] = str(e)
    start = time.perf_counter()
    plan = planner.plan(str(path), topology, gbs)
    row["plan_seconds"] = round(time.perf_counter() - start, 2)
    row["plan_ms"] = plan.iteration_ms
    row["plan"] = stage_summary(plan)
    row["plan_source"] = plan.data["selection"]["source"]
    row["plan_peak_gib"] = plan.estimate["peak_memory_bytes"] / 2**30
    if row["data_parallel_ms"]:
        row["speedup"] = row["data_parallel_ms"] / row["plan_ms"]
    return row


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write-profiles", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    paths = {classes: OUT_DIR / f"resnet50-fc{classes // 1000}k.json" for classes in (100_000, 1_000_000)}
    if args.write_profiles:
        OUT_DIR.mkdir(parents=True, exist_ok=True)
        for classes, path in paths.items():
            path.write_text(json.dumps(profile(classes), indent=1) + "\n")
            planner.Profile.load(str(path))  # checks it
    rows = [run_case(path, machines) for path in paths.values() for machines in (1, 2, 4)]
    for r in rows:
        dp = (f"{r['data_parallel_ms']:.1f} ms ({r['data_parallel_peak_gib']:.1f} GiB, "
              f"{r['data_parallel_micro_batch_per_gpu']} a GPU)" if r["data_parallel_ms"] else "does not fit")
        speedup = f"{r['speedup']:.2f}x" if "speedup" in r else "-"
        print(f"{r['profile']:24} {r['topology']:28} DP {dp:>32}  plan {r['plan_ms']:8.1f} ms ({speedup:>6}) "
              f"{r['plan']} [{r['plan_source']}], {r['plan_peak_gib']:.1f} GiB, planned in {r['plan_seconds']} s")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
