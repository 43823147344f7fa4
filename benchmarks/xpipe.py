"""XPipe against GPipe in dapple's simulator (XPipe paper, Figure 6's
trend): 2 and 4 stages, 2, 4 and 8 micro-batches per mini-batch, on the
shipped V100 profiles, with the memory of each schedule beside it.

Each case takes GPipe's baseline layout for the cluster (layers in blocks
of balanced time, one GPU a stage) and fixes the number of micro-batches M,
so every schedule runs the same partition and micro-batches, as the paper
does. Throughput is samples per second: the global batch over the time of
one iteration (GPipe) or of one mini-batch in the steady state
(asynchronous schedules). GPipe and the asynchronous schedules are each
simulated without and with re-computation (every method in the paper
re-computed; docs/xpipe.md), so each asynchronous figure reads against
GPipe's with the same re-computation. Writes
benchmarks/results/xpipe.json and prints markdown tables.

    python benchmarks/xpipe.py
"""

from __future__ import annotations

import json
from pathlib import Path

from dapple import planner

HERE = Path(__file__).resolve().parent
PROFILES = HERE.parent / "profiles" / "artifact"
CASES = [("VGG-19", "vgg-19-pbs-32", 128), ("BERT-24", "bert-24-pbs-6", 48)]
GIB = 2**30


def with_micro_batches(base: planner.Plan, m: int) -> planner.Plan:
    """``base``'s stages with M micro-batches of GBS / M samples (GPipe's K_i = M)."""
    d = base.core.to_dict()
    gbs = d["inputs"]["global_batch_size"]
    d.pop("estimate", None)
    d.pop("selection", None)
    d["inputs"]["options"]["min_micro_batch_size"] = 1
    d["micro_batch_size"], d["micro_batches"] = gbs // m, m
    for s in d["stages"]:
        s["warmup_micro_batches"] = m
    return planner.Plan.from_dict(d)


def main() -> None:
    out = []
    print("| model | stages | M | GPipe, samples/s | GPipe re-computing | XPipe | XPipe re-computing | "
          "XPipe over GPipe | XPipe over GPipe, both re-computing |")
    print("|---|--:|--:|--:|--:|--:|--:|--:|--:|")
    memory_lines = []
    for model, name, gbs in CASES:
        profile = planner.Profile.load(PROFILES / f"{name}.json")
        for stages in (2, 4):
            topology = f"1x{stages}-nvlink"
            base = planner.baseline("gpipe", profile, topology, gbs)
            for m in (2, 4, 8):
                plan = with_micro_batches(base, m)
                sims = {
                    "gpipe": planner.simulate(plan, profile),
                    "gpipe-recompute": planner.simulate(plan, profile, recompute=True),
                    "early-backward-1f1b": planner.simulate(plan, profile, schedule="early-backward-1f1b"),
                }
                for kind in planner.ASYNCHRONOUS_SCHEDULES:
                    sims[kind] = planner.simulate(plan, profile, schedule=kind)
                    sims[f"{kind}-recompute"] = planner.simulate(plan, profile, schedule=kind, recompute=True)
                rate = {k: gbs / s.iteration_ms * 1e3 for k, s in sims.items()}
                peak = {k: s.peak_memory_bytes for k, s in sims.items()}
                copies = {k: [st["peak_weight_copies"] for st in s.stages] for k, s in sims.items()}
                out.append({"model": model, "gbs": gbs, "stages": stages, "micro_batches": m,
                            "shape": plan.shape, "samples_per_s": rate, "peak_memory_bytes": peak,
                            "weight_copies": copies, "mini_batches_simulated": sims["xpipe"].mini_batches})
                print(f"| {model} | {stages} | {m} | {rate['gpipe']:.1f} | {rate['gpipe-recompute']:.1f} | "
                      f"{rate['xpipe']:.1f} | {rate['xpipe-recompute']:.1f} | {rate['xpipe'] / rate['gpipe']:.2f}x | "
                      f"{rate['xpipe-recompute'] / rate['gpipe-recompute']:.2f}x |")
                if m == 4:
                    both = [f"{peak[k] / GIB:.2f}, {peak[k + '-recompute'] / GIB:.2f} ({copies[k][0]})"
                            for k in ("xpipe", "pipedream")]
                    memory_lines.append(
                        f"| {model} | {stages} | {peak['gpipe'] / GIB:.2f} | {peak['gpipe-recompute'] / GIB:.2f} | "
                        f"{peak['early-backward-1f1b'] / GIB:.2f} | {both[0]} | {both[1]} | "
                        f"{peak['async'] / GIB:.2f}, {peak['async-recompute'] / GIB:.2f} |")
    print()
    print("Peak memory of the busiest stage, GiB, M = 4; asynchronous kinds without, then with re-computation "
          "(stage 0's weight copies in brackets):")
    print()
    print("| model | stages | GPipe | GPipe re-computing | DAPPLE early backward | XPipe | PipeDream stashing | "
          "async |")
    print("|---|--:|--:|--:|--:|--:|--:|--:|")
    print("\n".join(memory_lines))
    (HERE / "results").mkdir(exist_ok=True)
    (HERE / "results" / "xpipe.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
