"""Planning at scale: today's models on today's clusters, against issue 26's targets.

    python benchmarks/plan_scale.py [--out benchmarks/results/plan_scale.json] [--only NAME]

Cases (each planned once, in a fresh process: ``plan_speed.py``'s child,
which times the ``planner.plan`` call alone and reports the process's peak
RSS from ``os.wait4``):

* Llama-2-70B, ``64x8-a100-80gb``, GBS 512, sequence 4096: plans in under
  10 s, MFU at least 0.40;
* GPT-3 175B, ``128x8-a100-80gb``, GBS 1536, sequence 2048: recorded (its
  target, no slower than Megatron-LM's configuration, is checked in
  ``docs/paper-comparison.md`` with ``dapple estimate``);
* Llama-3-405B, ``2048x8-h100``, GBS 2048, sequence 8192: plans in under
  60 s and under 2 GiB;
* the 128-layer transformer-like chain of ``plan_speed.py``
  (``synthetic_profile()``, no split patterns) on ``128x8-nvlink-25gbps``,
  GBS 2048: plans in under 5 s.

The transformer profiles are made as a user makes them,
``planner.transformer_profile(NAME, gpu=..., seq_len=..., efficiency=0.5)``
(``dapple profile transformer``), into a temporary folder. The script
prints each figure beside its target; it does not fail on a miss.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from plan_speed import ROOT, build_info, machine_info, run_child, synthetic_profile  # noqa: E402

GIB = 2**30
# (name, profile source, topology, global batch size, plan-time target s, peak-RSS target bytes, MFU target)
CASES = [
    ("llama-2-70b", ("llama-2-70b", "A100-80GB", 4096), "64x8-a100-80gb", 512, 10.0, None, 0.40),
    ("gpt3-175b", ("gpt3-175b", "A100-80GB", 2048), "128x8-a100-80gb", 1536, None, None, None),
    ("llama-3-405b", ("llama-3-405b", "H100-80GB", 8192), "2048x8-h100", 2048, 60.0, 2 * GIB, None),
    ("synthetic-128", None, "128x8-nvlink-25gbps", 2048, 5.0, None, None),
]


def make_profile(source: tuple[str, str, int] | None, folder: str, name: str) -> str:
    from dapple import planner

    path = os.path.join(folder, name + ".json")
    if source is None:
        with open(path, "w") as f:
            json.dump(synthetic_profile(), f)
    else:
        config, gpu, seq_len = source
        planner.transformer_profile(config, gpu=gpu, seq_len=seq_len, efficiency=0.5).save(path)
    return path


def verdict(value: float | None, target: float | None, below: bool = True) -> str:
    if target is None or value is None:
        return ""
    met = value < target if below else value >= target
    return "met" if met else "MISSED"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="benchmarks/results/plan_scale.json", help="results JSON, relative to the repository root (default: %(default)s)")
    ap.add_argument("--only", choices=[c[0] for c in CASES], help="run one case")
    args = ap.parse_args()
    load_start = os.getloadavg()
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for name, source, topology, gbs, time_target, rss_target, mfu_target in CASES:
            if args.only and name != args.only:
                continue
            profile = make_profile(source, folder, name)
            res = run_child({"profile": profile, "topology": topology, "gbs": gbs})
            rss_bytes = res["peak_rss_mb"] * 2**20
            row = {
                "case": name,
                "topology": topology,
                "global_batch_size": gbs,
                "plan_s": res["plan_s"],
                "plan_s_target": time_target,
                "peak_rss_bytes": round(rss_bytes),
                "peak_rss_bytes_target": rss_target,
                "shape": res["shape"],
                "micro_batch_size": res["micro_batch_size"],
                "iteration_ms": res["iteration_ms"],
                "mfu": res["mfu"],
                "mfu_target": mfu_target,
                "states": res["states"],
                "stages_costed": res["stages_costed"],
                "verdicts": {
                    figure: v
                    for figure, v in (
                        ("plan_s", verdict(res["plan_s"], time_target)),
                        ("peak_rss_bytes", verdict(rss_bytes, rss_target)),
                        ("mfu", verdict(res["mfu"], mfu_target, below=False)),
                    )
                    if v
                },
            }
            rows.append(row)
            mfu = f"{row['mfu']:.3f}" if row["mfu"] is not None else "-"
            print(
                f"{name:<14} {topology:<20} gbs {gbs:>5}: {row['plan_s']:6.2f} s"
                f"{f' (target < {time_target:g} s)' if time_target else ''}, "
                f"peak RSS {rss_bytes / 2**20:7.1f} MiB{f' (target < {rss_target / GIB:g} GiB)' if rss_target else ''}, "
                f"{row['iteration_ms']:,.1f} ms, MFU {mfu}{f' (target >= {mfu_target})' if mfu_target else ''} "
                f"{' '.join(f'{k} {v}' for k, v in row['verdicts'].items())}",
                flush=True,
            )
    doc = {
        "benchmark": "plan_scale",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "build": build_info(),
        "machine": {**machine_info(), "loadavg_1_5_15_at_start": load_start, "loadavg_1_5_15_at_end": os.getloadavg()},
        "what": "one planner.plan call per case in a fresh process: its wall time (time.perf_counter) "
        "and the process's peak RSS (os.wait4 ru_maxrss, Python and the import included)",
        "cases": rows,
    }
    out = Path(ROOT) / args.out
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(out)  # whole or not at all
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
