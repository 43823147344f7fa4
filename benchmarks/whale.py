"""Whale's heterogeneous experiments (Whale section 5.3, Figure 18) in
dapple's simulator, on the shipped profiles and topologies.

- Data parallelism on 8 V100-32GB + 8 P100-16GB: equal slices (the
  `data-parallel` baseline) against Whale's hardware-aware slices
  (`whale-data-parallel`, Algorithm 1), and dapple's own search.
- A 4-stage pipeline with nested data parallelism (2 GPUs a stage) on
  4 V100-32GB + 4 P100-16GB: the model split evenly (the same number of the
  model's blocks a stage, the paper's baseline) against Whale's
  hardware-aware pipeline (`whale-pipeline`: layers balanced by work over
  each stage's speed, GPUs ordered by memory), and dapple's own search.

Every plan is costed the same way (the micro-batch size and warm-up depths
that simulate fastest and fit). Global batch sizes: the paper gives none;
each case uses a batch that leaves the slices room to be uneven (at least
twice the profile's measured batch per GPU). Writes
benchmarks/results/whale.json and prints markdown tables.

    python benchmarks/whale.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from dapple import planner  # noqa: E402

PROFILES = ROOT / "profiles" / "artifact"
TOPOLOGIES = ROOT / "profiles" / "topologies"
DATA_PARALLEL = [("BERT-48", "bert-48-pbs-2", 64), ("BERT-24", "bert-24-pbs-6", 192),
                 ("GNMT-16", "gnmt-16-pbs-64", 2048), ("VGG-19", "vgg-19-pbs-32", 2048)]
PIPELINE = [("BERT-48", "bert-48-pbs-2", 64), ("BERT-24", "bert-24-pbs-6", 192)]


def row(p: planner.Plan) -> dict:
    return {"shape": p.shape, "micro_batches": f"{p.micro_batches}x{p.micro_batch_size}",
            "simulated_ms": round(p.iteration_ms, 1),
            "slices": [s.get("slices") for s in p.stages]}


def even_pipeline(profile: planner.Profile, topology: planner.Topology, gbs: int, stages: int) -> planner.Plan:
    """The model's blocks split evenly over `stages` stages of equal GPU
    counts, GPUs in id order (the V100 machine first): Whale's baseline."""
    n = len(profile.layers)
    blocks = [i for i, layer in enumerate(profile.layers) if layer.get("kind") == "block"]
    per = len(blocks) / stages
    cuts = [0] + [blocks[round(k * per)] for k in range(1, stages)] + [n]
    gpus = topology.num_devices // stages
    layout = [(cuts[k], cuts[k + 1], list(range(k * gpus, (k + 1) * gpus))) for k in range(stages)]
    return planner.layout_plan(profile, topology, gbs, layout)


def main() -> None:
    out: dict = {"data_parallel": [], "pipeline": []}
    big = planner.Topology.load(TOPOLOGIES / "whale-8v100-8p100.json")
    print("| model | GBS | equal slices, ms | Whale's slices, ms | speedup | dapple's search, ms | dapple's plan |")
    print("|---|--:|--:|--:|--:|--:|---|")
    for model, name, gbs in DATA_PARALLEL:
        prof = planner.Profile.load(PROFILES / f"{name}.json")
        even = planner.baseline("data-parallel", prof, big, gbs)
        whale = planner.baseline("whale-data-parallel", prof, big, gbs)
        ours = planner.plan(prof, big, gbs)
        out["data_parallel"].append({"model": model, "gbs": gbs, "equal": row(even), "whale": row(whale),
                                     "dapple": row(ours), "dapple_source": ours.data["selection"]["source"]})
        print(f"| {model} | {gbs} | {even.iteration_ms:.1f} | {whale.iteration_ms:.1f} | "
              f"{even.iteration_ms / whale.iteration_ms:.2f}x | {ours.iteration_ms:.1f} | "
              f"{ours.shape}, {ours.micro_batches}x{ours.micro_batch_size} |")
    small = planner.Topology.load(TOPOLOGIES / "whale-4v100-4p100.json")
    print()
    print("| model | GBS | even split, ms | Whale's pipeline, ms | speedup | dapple's search, ms | dapple's plan |")
    print("|---|--:|--:|--:|--:|--:|---|")
    for model, name, gbs in PIPELINE:
        prof = planner.Profile.load(PROFILES / f"{name}.json")
        even = even_pipeline(prof, small, gbs, 4)
        whale = planner.baseline("whale-pipeline", prof, small, gbs)
        ours = planner.plan(prof, small, gbs)
        out["pipeline"].append({"model": model, "gbs": gbs, "even": row(even), "whale": row(whale),
                                "even_blocks": even.blocks_per_stage(prof), "whale_blocks": whale.blocks_per_stage(prof),
                                "dapple": row(ours), "dapple_source": ours.data["selection"]["source"]})
        print(f"| {model} | {gbs} | {even.iteration_ms:.1f} ({':'.join(map(str, even.blocks_per_stage(prof)))}) | "
              f"{whale.iteration_ms:.1f} ({':'.join(map(str, whale.blocks_per_stage(prof)))}) | "
              f"{even.iteration_ms / whale.iteration_ms:.2f}x | {ours.iteration_ms:.1f} | "
              f"{ours.shape}, {ours.micro_batches}x{ours.micro_batch_size} |")
    (HERE / "results" / "whale.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
