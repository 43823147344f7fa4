"""GPT-3 175B on 128x8 A100-80GB at a global batch of 1,536: dapple's plan
against the Megatron-LM repository's own layout for it (t8 p16 d8, micro-batch
1, 1F1B; issue 45 asks dapple's plan to be at least 1.10 times faster, costed
the same way).

    python benchmarks/gpt3_layouts.py [--out benchmarks/results/gpt3_layouts.json]

The profile is the shipped config timed operator by operator at its default
FlashAttention (``dapple profile transformer --config gpt3-175b --gpu
a100-80gb --seq-len 2048 --micro-batch-sizes 1,2,4,8``); Megatron-LM's layout
is costed with and without sequence parallelism (no re-computation), and
dapple's plan is ``dapple plan`` at its defaults.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from plan_speed import build_info, machine_info  # noqa: E402

TOPOLOGY = "128x8-a100-80gb"
GLOBAL_BATCH = 1536


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=HERE / "results" / "gpt3_layouts.json")
    args = parser.parse_args()
    from dapple import planner

    with tempfile.TemporaryDirectory() as tmp:
        profile = planner.transformer_profile("gpt3-175b", gpu="A100-80GB", seq_len=2048,
                                              micro_batch_sizes=[1, 2, 4, 8])
        path = Path(tmp) / "gpt3.json"
        profile.save(path)
        megatron = {}
        for sequence_parallel in (False, True):
            plan = planner.megatron_plan(path, TOPOLOGY, GLOBAL_BATCH, tensor_parallel=8, pipeline_parallel=16,
                                         micro_batch_size=1, sequence_parallel=sequence_parallel)
            megatron["sp" if sequence_parallel else "no_sp"] = {
                "simulated_s": planner.simulate(plan, path).iteration_ms / 1e3,
                "fits_memory": plan.estimate["fits_memory"]}
        started = time.perf_counter()
        own = planner.plan(path, TOPOLOGY, GLOBAL_BATCH)
        plan_s = time.perf_counter() - started
        stage = own.stages[0]
        dapple = {"simulated_s": planner.simulate(own, path).iteration_ms / 1e3, "plan_s": plan_s,
                  "shape": own.shape, "schedule": own.data["schedule"]["kind"], "chunks": own.data["schedule"]["chunks"],
                  "micro_batch_size": own.micro_batch_size, "first_stage": {
                      k: stage.get(k) for k in ("tensor_parallel", "sequence_parallel", "shard_level", "recompute")}}
    faster = min(m["simulated_s"] for m in megatron.values()) / dapple["simulated_s"]
    results = {"when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "machine": machine_info(), "build": build_info(), "topology": TOPOLOGY, "global_batch": GLOBAL_BATCH,
               "megatron_t8_p16_d8": megatron, "dapple": dapple, "faster_than_the_faster_megatron": faster}
    tmp_out = args.out.with_suffix(".tmp")
    tmp_out.write_text(json.dumps(results, indent=1) + "\n")
    os.replace(tmp_out, args.out)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
