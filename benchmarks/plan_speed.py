"""Planning speed: wall time and peak memory of ``planner.plan``.

    python benchmarks/plan_speed.py [--quick] [--out benchmarks/results/plan_speed.json]

Cases:

* every shipped profile ``profiles/artifact/*.json`` on ``2x8-nvlink-25gbps``
  (the paper's config A) and on ``16x1-25gbps`` (config B). Global batch size:
  the paper's where it gives one (GNMT 1024, BERT-48 64, XLNet-36 128,
  AmoebaNet-36 128, VGG-19 2048), else 16 x the profile's largest measured
  batch size;
* a synthetic, deterministic 128-layer transformer-like profile (see
  :func:`synthetic_profile`) on ``4x8-nvlink-25gbps`` (GBS 256),
  ``32x8-nvlink-25gbps`` (GBS 2048) and ``128x8-nvlink-25gbps`` (GBS 8192;
  skipped by ``--quick``).

Each run is a fresh Python process (this script with ``--child``) that
imports planner, times the ``planner.plan`` call alone with
``time.perf_counter`` and prints JSON. The parent reaps it with ``os.wait4``,
whose rusage is that child's own: ``ru_maxrss`` is its peak resident set
(Python + planner import + the search), ``ru_utime + ru_stime`` its CPU time.
A "baseline" child that only imports planner gives the floor of that RSS.
Cases are repeated (3 times by default, the 128x8 case once) and min and
median wall time are reported.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAPER_GBS = {  # ../shared/reference/dapple-paper-results.json, Table V
    "gnmt-": 1024,
    "bert-48": 64,
    "xlnet-36": 128,
    "amoeba-36": 128,
    "vgg-19": 2048,
}
SHIPPED_TOPOLOGIES = ["2x8-nvlink-25gbps", "16x1-25gbps"]
SYNTHETIC_CASES = [  # (topology, global batch size, repeats)
    ("4x8-nvlink-25gbps", 256, 3),
    ("32x8-nvlink-25gbps", 2048, 3),
    ("128x8-nvlink-25gbps", 8192, 1),
]
SYNTHETIC_BATCH_SIZES = [1, 2, 4, 8]
MB = 2**20


def synthetic_profile(layers: int = 128, seed: int = 20240501) -> dict:
    """A transformer-like profile: ``layers`` uniform blocks, each with about
    50 MB of parameters, 3 ms forward and 6 ms backward and 4 MB of
    activations at batch size 1, every figure jittered by up to +-5 % with a
    fixed seed. Measured at batch sizes 1, 2, 4 and 8; time grows as
    ``t1 * (0.3 + 0.7 * b)`` (a small batch under-uses the GPU), activations
    linearly. Optimizer: adam."""
    rng = random.Random(seed)

    def jitter(x: float) -> float:
        return x * (1.0 + rng.uniform(-0.05, 0.05))

    out = []
    for i in range(layers):
        param = round(jitter(50 * MB))
        fwd1, bwd1, act1 = jitter(3.0), jitter(6.0), jitter(4 * MB)
        measurements = [
            {
                "batch_size": b,
                "fwd_ms": round(fwd1 * (0.3 + 0.7 * b), 4),
                "bwd_ms": round(bwd1 * (0.3 + 0.7 * b), 4),
                "activation_bytes": round(act1 * b),
            }
            for b in SYNTHETIC_BATCH_SIZES
        ]
        layer = {"name": f"layer{i}", "kind": "block", "param_bytes": param, "measurements": measurements}
        if i:
            layer["inputs"] = [i - 1]
        else:
            layer["inputs"] = []
        out.append(layer)
    return {
        "format": "dapple.profile",
        "schema_version": 1,
        "model": f"synthetic-{layers}",
        "source": f"benchmarks/plan_speed.py synthetic_profile(layers={layers}, seed={seed})",
        "device": "V100-16GB",
        "optimizer": "adam",
        "layers": out,
    }


def paper_gbs(name: str, largest_batch: int) -> tuple[int, str]:
    for prefix, gbs in PAPER_GBS.items():
        if name.startswith(prefix):
            return gbs, "paper"
    return 16 * largest_batch, "16 x profiled batch"


# ---------------------------------------------------------------- child


def child(spec: dict) -> None:
    t0 = time.perf_counter()
    import planner

    t_import = time.perf_counter() - t0
    if spec.get("baseline"):
        print(json.dumps({"import_s": t_import}))
        return
    t0 = time.perf_counter()
    p = planner.plan(spec["profile"], spec["topology"], spec["gbs"])
    wall = time.perf_counter() - t0
    stats = p.search_stats
    print(
        json.dumps(
            {
                "import_s": t_import,
                "plan_s": wall,
                "shape": p.shape,
                "kind": p.kind,
                "micro_batch_size": p.micro_batch_size,
                "micro_batches": p.micro_batches,
                "latency_ms": p.estimate["latency_ms"] if p.estimate else None,
                "search_space": p.data["inputs"]["options"].get("search_space"),
                "states": stats.states,
                "stages_costed": stats.stages_costed,
                "micro_batch_sizes_tried": len(stats.micro_batch_sizes),
            }
        )
    )


# ---------------------------------------------------------------- parent


def run_child(spec: dict, timeout_s: float = 900.0) -> dict:
    """Run one case in a fresh process; return its JSON plus its own rusage."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)]
    with tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, cwd=ROOT)
        out = proc.stdout.read()
        proc.stdout.close()
        _, status, ru = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        process_s = time.perf_counter() - t0
        if proc.returncode != 0:
            err.seek(0)
            raise RuntimeError(f"child failed ({proc.returncode}) for {spec}: {err.read().decode()[-2000:]}")
    res = json.loads(out)
    res["peak_rss_mb"] = ru.ru_maxrss / 1024  # Linux: kilobytes
    res["cpu_s"] = ru.ru_utime + ru.ru_stime
    res["process_s"] = process_s
    return res


def machine_info() -> dict:
    model = None
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = None
    try:
        with open("/proc/meminfo") as f:
            mem = round(int(f.readline().split()[1]) / 2**20, 1)
    except (OSError, ValueError, IndexError):
        pass
    import planner

    return {
        "nproc": len(os.sched_getaffinity(0)),
        "cpu_count": os.cpu_count(),
        "cpu_model": model,
        "mem_gib": mem,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "planner_version": planner.__version__,
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def cases(quick: bool, synthetic_path: str, repeats: int) -> list[dict]:
    import planner

    out = []
    for path in sorted(glob.glob(os.path.join(ROOT, "profiles", "artifact", "*.json"))):
        name = os.path.basename(path)[: -len(".json")]
        gbs, why = paper_gbs(name, max(planner.Profile.load(path).batch_sizes))
        for topo in SHIPPED_TOPOLOGIES:
            out.append(
                {
                    "profile": os.path.relpath(path, ROOT),
                    "name": name,
                    "topology": topo,
                    "gbs": gbs,
                    "gbs_from": why,
                    "repeats": repeats,
                }
            )
    for topo, gbs, n in SYNTHETIC_CASES:
        if quick and topo.startswith("128x"):
            continue
        out.append(
            {
                "profile": synthetic_path,
                "name": "synthetic-128",
                "topology": topo,
                "gbs": gbs,
                "gbs_from": "fixed",
                "repeats": min(n, repeats),
            }
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="skip the 128x8 case")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "plan_speed.json"))
    ap.add_argument("--repeats", type=int, default=3, help="runs per case (the 128x8 case runs once)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(json.loads(args.child))
        return

    with tempfile.TemporaryDirectory() as tmp:
        syn = synthetic_profile()
        syn_path = os.path.join(tmp, "synthetic-128.json")
        with open(syn_path, "w") as f:
            json.dump(syn, f)
        import planner

        syn_sha = planner.Profile.load(syn_path).sha256

        baseline = [run_child({"baseline": True}) for _ in range(3)]
        print(
            f"baseline (python + import planner): peak RSS {min(b['peak_rss_mb'] for b in baseline):.1f} MB, "
            f"import {statistics.median(b['import_s'] for b in baseline) * 1000:.0f} ms",
            flush=True,
        )
        results = []
        for case in cases(args.quick, syn_path, args.repeats):
            runs = [run_child(case) for _ in range(case["repeats"])]
            walls = [r["plan_s"] for r in runs]
            first = runs[0]
            for r in runs[1:]:  # the search is deterministic: every run must agree
                if (r["shape"], r["micro_batch_size"], r["states"]) != (
                    first["shape"],
                    first["micro_batch_size"],
                    first["states"],
                ):
                    print(f"WARNING: runs disagree for {case['name']} {case['topology']}", file=sys.stderr)
            row = {
                "profile": case["name"] if case["name"] == "synthetic-128" else case["profile"],
                "topology": case["topology"],
                "global_batch_size": case["gbs"],
                "gbs_from": case["gbs_from"],
                "runs": len(runs),
                **{k: first[k] for k in (
                    "shape", "kind", "micro_batch_size", "micro_batches", "latency_ms", "search_space",
                    "states", "stages_costed", "micro_batch_sizes_tried",
                )},
                "plan_ms_min": min(walls) * 1000,
                "plan_ms_median": statistics.median(walls) * 1000,
                "plan_ms_all": [w * 1000 for w in walls],
                "cpu_s_median": statistics.median(r["cpu_s"] for r in runs),
                "process_s_median": statistics.median(r["process_s"] for r in runs),
                "peak_rss_mb": max(r["peak_rss_mb"] for r in runs),
            }
            results.append(row)
            print(
                f"{row['profile']:<48} {row['topology']:<20} gbs {row['global_batch_size']:>5}  "
                f"{row['shape']:<14} mb {row['micro_batch_size']:>4}  {row['search_space']:<15} "
                f"states {row['states']:>9} costed {row['stages_costed']:>11}  "
                f"min {row['plan_ms_min']:9.1f} ms  med {row['plan_ms_median']:9.1f} ms  "
                f"rss {row['peak_rss_mb']:7.1f} MB",
                flush=True,
            )

    doc = {
        "benchmark": "plan_speed",
        "command": "python benchmarks/plan_speed.py" + (" --quick" if args.quick else ""),
        "machine": machine_info(),
        "what": "wall time of one planner.plan(profile_path, topology, gbs) call in a fresh process "
        "(time.perf_counter), and that process's peak RSS (os.wait4 ru_maxrss) and CPU time",
        "baseline": {
            "peak_rss_mb": min(b["peak_rss_mb"] for b in baseline),
            "import_ms_median": statistics.median(b["import_s"] for b in baseline) * 1000,
        },
        "synthetic_profile": {
            "generator": "benchmarks/plan_speed.py synthetic_profile()",
            "layers": len(syn["layers"]),
            "sha256": syn_sha,
        },
        "cases": results,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
