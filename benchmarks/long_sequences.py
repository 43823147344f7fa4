"""Issue 47's long-sequence cases, with and without context parallelism:
Llama-3-8B at 131,072 tokens on 2x8 H100 (global batch 16) and
Llama-3-70B at 32,768 on 8x8 H100 (global batch 64), each profiled by
``dapple profile transformer`` operator by operator and at the issue's
efficiency 0.5 of the bf16 peak (the compute model its figures, MFU 0.318
and 0.305, were measured under), and planned by ``dapple plan`` at its
defaults and with ``--max-context-parallel 1`` (today's space without it).
Writes benchmarks/results/long_sequences.json and prints the markdown
table docs/cost-model.md quotes.

    python benchmarks/long_sequences.py            # profiles and plans (about a minute)
    python benchmarks/long_sequences.py --table    # the table, from the results file
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from plan_speed import build_info, machine_info  # noqa: E402

OUT = HERE / "results" / "long_sequences.json"
#: (config, tokens a sample, cluster, global batch, the issue's MFU at filing).
CASES = [
    ("llama-3-8b", 131072, "2x8-h100-80gb", 16, 0.318),
    ("llama-3-70b", 32768, "8x8-h100-80gb", 64, 0.305),
]
#: How each profile times its layers: operator by operator, or FLOPs at 0.5 of the peak.
TIMINGS = {"operators": None, "efficiency 0.5": 0.5}


def planned(profile, cluster: str, gbs: int, **options) -> dict:
    from dapple import planner
    from dapple.planner.plan import shape_label

    started = time.perf_counter()
    plan = planner.plan(profile, cluster, gbs, **options)
    return {"plan_s": time.perf_counter() - started, "iteration_ms": plan.iteration_ms, "mfu": plan.estimate["mfu"],
            "peak_gib": plan.estimate["peak_memory_bytes"] / 2**30, "fits_memory": plan.estimate["fits_memory"],
            "layout": plan.shape, "schedule": plan.data["schedule"]["kind"],
            "shapes": sorted({shape_label(s) or "plain" for s in plan.stage_shapes})}


def rows() -> list[dict]:
    from dapple import planner

    out = []
    for config, seq_len, cluster, gbs, filed_mfu in CASES:
        for timing, efficiency in TIMINGS.items():
            profile = planner.transformer_profile(config, gpu="H100-80GB", seq_len=seq_len, efficiency=efficiency)
            row = {"model": config, "seq_len": seq_len, "cluster": cluster, "global_batch": gbs,
                   "timing": timing, "filed_mfu": filed_mfu,
                   "without": planned(profile, cluster, gbs, max_context_parallel=1),
                   "with": planned(profile, cluster, gbs)}
            out.append(row)
            print(json.dumps(row), file=sys.stderr)
    return out


def table(results: dict) -> str:
    lines = ["| model, tokens, cluster, batch | timing | MFU without c (layout) | MFU with c (layout) | gain | "
             "over the issue's | planned in s |", "|---|---|--:|--:|--:|--:|--:|"]
    for r in results["rows"]:
        w, c = r["without"], r["with"]
        lines.append(f"| {r['model']}, {r['seq_len']:,}, {r['cluster']}, {r['global_batch']} | {r['timing']} | "
                     f"{w['mfu']:.3f} ({', '.join(w['shapes'])}) | {c['mfu']:.3f} ({', '.join(c['shapes'])}) | "
                     f"{c['mfu'] / w['mfu']:.2f} | {c['mfu'] / r['filed_mfu']:.2f} | {w['plan_s']:.1f} / {c['plan_s']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    if "--table" in sys.argv:
        print(table(json.loads(OUT.read_text())))
        return
    started = time.perf_counter()
    results = {"about": __doc__.split("\n\n")[0], "build": build_info(), "machine": machine_info(),
               "load_average": os.getloadavg(), "rows": rows(), "wall_s": time.perf_counter() - started}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    tmp = OUT.with_suffix(".tmp")
    tmp.write_text(json.dumps(results, indent=1) + "\n")
    os.replace(tmp, OUT)
    print(table(results))


if __name__ == "__main__":
    main()
