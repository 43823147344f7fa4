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
  ``8x8-nvlink-25gbps`` (GBS 512),
  ``32x8-nvlink-25gbps`` (GBS 2048) and ``128x8-nvlink-25gbps`` (GBS 8192),
  and a variant whose time per sample falls with the batch
  (``synthetic-128-sublinear``) on 4x8 and 32x8. ``--quick`` skips the cases
  that run once (128x8 and the sublinear variant).

Each run is a fresh Python process (this script with ``--child``) that
imports planner, times the ``planner.plan`` call alone with
``time.perf_counter`` and prints JSON. The parent reaps it with ``os.wait4``,
whose rusage is that child's own: ``ru_maxrss`` is its peak resident set
(Python + planner import + the search), ``ru_utime + ru_stime`` its CPU time.
A "baseline" child that only imports planner gives the floor of that RSS.
Cases are repeated (3 times by default, the slow ones once) and min and
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
SYNTHETIC_CASES = [  # (profile, topology, global batch size, repeats); repeats 1 = slow, skipped by --quick
    ("synthetic-128", "4x8-nvlink-25gbps", 256, 3),
    ("synthetic-128", "8x8-nvlink-25gbps", 512, 3),
    ("synthetic-128", "32x8-nvlink-25gbps", 2048, 3),
    ("synthetic-128", "128x8-nvlink-25gbps", 8192, 1),
    ("synthetic-128-sublinear", "4x8-nvlink-25gbps", 256, 1),
    ("synthetic-128-sublinear", "32x8-nvlink-25gbps", 2048, 1),
]
MB = 2**20


def synthetic_profile(layers: int = 128, seed: int = 20240501, sublinear: bool = False) -> dict:
    """A transformer-like profile: ``layers`` uniform blocks, each with about
    50 MB of parameters, 3 ms forward, 6 ms backward and 4 MB of activations
    at batch size 1, every figure jittered by up to +-5 % with a fixed seed.
    Optimizer: adam (the whole model's state, ~25 GB, needs a pipeline).

    Default: measured at batch size 1 only, so time and memory scale
    linearly with the batch. ``sublinear``: also measured at 2, 4 and 8 with
    time ``t1 * (0.3 + 0.7 * b)`` (small batches under-use the GPU), which
    makes bigger micro-batches cheaper per sample."""
    rng = random.Random(seed)

    def jitter(x: float) -> float:
        return x * (1.0 + rng.uniform(-0.05, 0.05))

    batch_sizes = [1, 2, 4, 8] if sublinear else [1]
    out = []
    for i in range(layers):
        param = round(jitter(50 * MB))
        fwd1, bwd1, act1 = jitter(3.0), jitter(6.0), jitter(4 * MB)
        scale = (lambda b: 0.3 + 0.7 * b) if sublinear else (lambda b: b)
        measurements = [
            {
                "batch_size": b,
                "fwd_ms": round(fwd1 * scale(b), 4),
                "bwd_ms": round(bwd1 * scale(b), 4),
                "activation_bytes": round(act1 * b),
            }
            for b in batch_sizes
        ]
        out.append(
            {
                "name": f"layer{i}",
                "kind": "block",
                "param_bytes": param,
                "inputs": [i - 1] if i else [],
                "measurements": measurements,
            }
        )
    name = f"synthetic-{layers}" + ("-sublinear" if sublinear else "")
    return {
        "format": "dapple.profile",
        "schema_version": 1,
        "model": name,
        "source": f"benchmarks/plan_speed.py synthetic_profile(layers={layers}, seed={seed}, sublinear={sublinear})",
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
    try:
        from dapple import planner
    except ImportError:  # a build from before the one `dapple` package (plan_speed_paired.py)
        import planner

    t_import = time.perf_counter() - t0
    if spec.get("baseline"):
        print(json.dumps({"import_s": t_import}))
        return
    options = {"min_micro_batch_size": spec["min_micro_batch_size"]} if spec.get("min_micro_batch_size") else {}
    t0 = time.perf_counter()
    p = planner.plan(spec["profile"], spec["topology"], spec["gbs"], **options)
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
                "iteration_ms": p.iteration_ms,
                "mfu": p.estimate.get("mfu") if p.estimate else None,
                "search_space": p.data["inputs"]["options"].get("search_space"),
                "states": stats.states,
                "stages_costed": stats.stages_costed,
                "micro_batch_sizes_tried": len(stats.micro_batch_sizes),
            }
        )
    )


# ---------------------------------------------------------------- parent

CLI_CASE = [
    "dapple", "plan", "--profile", "profiles/artifact/bert-48-pbs-2.json",
    "--topology", "A", "--global-batch-size", "64", "--json",
]


def run_reaped(cmd: list[str], stdout=subprocess.DEVNULL) -> tuple[bytes, float, "os.struct_rusage"]:
    """Run ``cmd`` from the repository root and reap it with ``os.wait4``, so
    its own resource usage is known: (its stdout if piped, wall seconds,
    rusage). Raises RuntimeError, with the end of its stderr, when it fails."""
    with tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=stdout, stderr=err, cwd=ROOT)
        out = proc.stdout.read() if proc.stdout else b""
        if proc.stdout:
            proc.stdout.close()
        _, status, ru = os.wait4(proc.pid, 0)
        wall_s = time.perf_counter() - t0
        code = os.waitstatus_to_exitcode(status)
        if code != 0:
            err.seek(0)
            raise RuntimeError(f"{' '.join(cmd)} exited {code}: {err.read().decode()[-2000:]}")
    return out, wall_s, ru


def run_cli(cmd: list[str], runs: int = 5) -> dict:
    """Whole-process time of the CLI (interpreter start-up, imports, profile
    load, search, JSON output), reaped with os.wait4 like the cases."""
    walls, cpus, rss = [], [], []
    for _ in range(runs + 1):  # the first run warms the file cache and is not counted
        _, wall, ru = run_reaped(cmd)
        walls.append(wall * 1000)
        cpus.append((ru.ru_utime + ru.ru_stime) * 1000)
        rss.append(ru.ru_maxrss / 1024)
    walls, cpus, rss = walls[1:], cpus[1:], rss[1:]
    return {
        "command": " ".join(cmd),
        "runs": runs,
        "wall_ms_min": min(walls),
        "wall_ms_median": statistics.median(walls),
        "wall_ms_max": max(walls),
        "cpu_ms_median": statistics.median(cpus),
        "peak_rss_mb_max": max(rss),
    }


def run_child(spec: dict, python: str = sys.executable) -> dict:
    """Run one case in a fresh process of ``python`` (an interpreter with
    planner installed; another build's for a paired comparison); return its
    JSON plus its own rusage."""
    cmd = [python, os.path.abspath(__file__), "--child", json.dumps(spec)]
    out, process_s, ru = run_reaped(cmd, stdout=subprocess.PIPE)
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
    from dapple import planner

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


def build_info() -> dict:
    """Which planner was timed: the commit, Rust sources changed since it and
    when the extension module was built."""
    import dapple.planner._core as core

    def git(*a: str) -> str | None:
        try:
            return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return None

    dirty = git("status", "--porcelain", "--", "rust_core", "dapple")
    return {
        "git_head": git("rev-parse", "--short", "HEAD"),
        "uncommitted_core_changes": [line.split(maxsplit=1)[-1] for line in dirty.splitlines()] if dirty else [],
        "core_module_built_utc": datetime.datetime.fromtimestamp(
            os.path.getmtime(core.__file__), datetime.timezone.utc
        ).strftime("%Y-%m-%d %H:%M:%S UTC"),
    }


def cases(quick: bool, synthetic_paths: dict, repeats: int) -> list[dict]:
    from dapple import planner

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
    for name, topo, gbs, n in SYNTHETIC_CASES:
        if quick and n == 1:
            continue
        out.append(
            {
                "profile": synthetic_paths[name],
                "name": name,
                "topology": topo,
                "gbs": gbs,
                "gbs_from": "fixed",
                "repeats": min(n, repeats),
            }
        )
    return out


def markdown_table(doc: dict) -> str:
    """The per-case table of benchmarks/README.md, from a results JSON."""
    head = (
        "| profile | topology | GBS | search space | plan shape | micro-batch | states | stages costed "
        "| min ms | median ms | CPU s (process) | peak RSS MB |\n"
        "|---|---|--:|---|---|--:|--:|--:|--:|--:|--:|--:|\n"
    )
    rows = []
    for c in doc["cases"]:
        name = os.path.basename(c["profile"]).removesuffix(".json")
        gbs = f"{c['global_batch_size']}" + ("" if c["gbs_from"] in ("paper", "fixed") else "*")
        runs = "" if c["runs"] > 1 else " (1 run)"
        rows.append(
            f"| {name} | {c['topology']} | {gbs} | {c['search_space']} | {c['shape']} | {c['micro_batch_size']} "
            f"| {c['states']:,} | {c['stages_costed']:,} | {c['plan_ms_min']:,.0f} | {c['plan_ms_median']:,.0f}{runs} "
            f"| {c['cpu_s_median']:.2f} | {c['peak_rss_mb']:.0f} |"
        )
    return head + "\n".join(rows) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="skip the slow cases that run once (128x8, synthetic-128-sublinear)")
    ap.add_argument("--out", default="benchmarks/results/plan_speed.json", help="results JSON, relative to the repository root (default: %(default)s)")
    ap.add_argument("--repeats", type=int, default=3, help="runs per case (default 3; the slow cases run once)")
    ap.add_argument("--table", metavar="RESULTS_JSON", help="print the markdown table of a results file and exit")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.table:
        with open(args.table) as f:
            print(markdown_table(json.load(f)), end="")
        return
    if args.child:
        child(json.loads(args.child))
        return

    load_start = os.getloadavg()
    if load_start[0] > 0.5:
        print(
            f"note: load average {load_start[0]:.2f} at start: other processes compete for the "
            f"{len(os.sched_getaffinity(0))} cores, times will be high (compare cpu_s with the wall time)",
            file=sys.stderr,
        )
    with tempfile.TemporaryDirectory() as tmp:
        from dapple import planner

        syn_paths, syn_info = {}, {}
        for sublinear in (False, True):
            syn = synthetic_profile(sublinear=sublinear)
            path = os.path.join(tmp, syn["model"] + ".json")
            with open(path, "w") as f:
                json.dump(syn, f)
            syn_paths[syn["model"]] = path
            syn_info[syn["model"]] = {
                "generator": f"benchmarks/plan_speed.py synthetic_profile(sublinear={sublinear})",
                "layers": len(syn["layers"]),
                "measured_batch_sizes": [m["batch_size"] for m in syn["layers"][0]["measurements"]],
                "sha256": planner.Profile.load(path).sha256,
            }

        baseline = [run_child({"baseline": True}) for _ in range(3)]
        print(
            f"baseline (python + import planner): peak RSS {min(b['peak_rss_mb'] for b in baseline):.1f} MB, "
            f"import {statistics.median(b['import_s'] for b in baseline) * 1000:.0f} ms",
            flush=True,
        )
        import shutil

        # The console script beside this interpreter: a version manager's shim
        # found first on PATH (pyenv) would add its own start-up to the figure.
        exe = os.path.join(os.path.dirname(sys.executable), CLI_CASE[0])
        exe = exe if os.access(exe, os.X_OK) else shutil.which(CLI_CASE[0])
        cli = run_cli([exe] + CLI_CASE[1:]) if exe else None
        if cli:
            print(
                f"CLI end to end: {cli['command']}: median {cli['wall_ms_median']:.0f} ms wall "
                f"(min {cli['wall_ms_min']:.0f}, max {cli['wall_ms_max']:.0f}), "
                f"{cli['cpu_ms_median']:.0f} ms CPU, peak RSS {cli['peak_rss_mb_max']:.1f} MB",
                flush=True,
            )
        results = []
        for case in cases(args.quick, syn_paths, args.repeats):
            runs = [run_child(case) for _ in range(case["repeats"])]
            walls = [r["plan_s"] for r in runs]
            first = runs[0]
            # The plan is deterministic; the state and stage counts are not quite:
            # threads share the best latency found so far, and how early they see
            # it decides how much is pruned.
            for r in runs[1:]:
                if (r["shape"], r["micro_batch_size"], r["latency_ms"]) != (
                    first["shape"],
                    first["micro_batch_size"],
                    first["latency_ms"],
                ):
                    print(f"WARNING: runs disagree for {case['name']} {case['topology']}", file=sys.stderr)
            row = {
                "profile": case["name"] if case["name"].startswith("synthetic-") else case["profile"],
                "topology": case["topology"],
                "global_batch_size": case["gbs"],
                "gbs_from": case["gbs_from"],
                "runs": len(runs),
                **{k: first[k] for k in (
                    "shape", "kind", "micro_batch_size", "micro_batches", "latency_ms", "search_space",
                    "micro_batch_sizes_tried",
                )},
                "states": round(statistics.median(r["states"] for r in runs)),
                "states_all": [r["states"] for r in runs],
                "stages_costed": round(statistics.median(r["stages_costed"] for r in runs)),
                "stages_costed_all": [r["stages_costed"] for r in runs],
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
        "build": build_info(),
        "machine": {**machine_info(), "loadavg_1_5_15_at_start": load_start, "loadavg_1_5_15_at_end": os.getloadavg()},
        "what": "wall time of one planner.plan(profile_path, topology, gbs) call in a fresh process "
        "(time.perf_counter), and that process's peak RSS (os.wait4 ru_maxrss) and CPU time",
        "baseline": {
            "peak_rss_mb": min(b["peak_rss_mb"] for b in baseline),
            "import_ms_median": statistics.median(b["import_s"] for b in baseline) * 1000,
        },
        "synthetic_profiles": syn_info,
        "cli_end_to_end": cli,
        "cases": results,
    }
    out = os.path.join(ROOT, args.out)  # an absolute --out stays as it is
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
