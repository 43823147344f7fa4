"""Reference plans from PipeDream's own planner, recorded as test data.

Runs ``optimizer/optimizer_graph_hierarchical.py`` of msr-fiddle/pipedream at
commit 7db6a1c on the DAPPLE artifact profiles (PipeDream's graph.txt format)
and writes ``tests/data/pipedream-reference.json``: every case's plan(s) in
PipeDream's state indices and in the layer indices of dapple's import of the
same file (``profiles/artifact/<name>.json``). CI cannot download PipeDream,
so this script is run by hand:

    git clone https://github.com/msr-fiddle/pipedream /tmp/pipedream-git
    mkdir -p /tmp/pipedream
    git -C /tmp/pipedream-git archive 7db6a1c optimizer graph | tar -x -C /tmp/pipedream
    python benchmarks/pipedream_reference.py --pipedream /tmp/pipedream

It takes about 20 minutes on 2 cores, 10 of them GNMT-16, which is
expected not to finish (``--gnmt-timeout 0`` skips it). Only the Python
standard library is used here; PipeDream's optimizer itself needs numpy
(it prints arrays).

Cases: VGG-19, BERT-24, BERT-48, XLNet-36, AmoebaNet-36 on
  A: 2 machines x 8 GPUs, ``-n 8 2 -b 1.3e11 3.125e9`` (NVLink inside a
     machine, 25 Gbps between machines), and
  B: 16 machines x 1 GPU, ``-n 16 -b 3.125e9`` (25 Gbps),
both with ``--activation_compression_ratio 1 --use_memory_constraint
-s 17179869184`` (16 GiB per GPU); GNMT-16 on A once, with a time limit.

How PipeDream is run, faithfully but for two harmless adaptations:
  * its graph reader only takes edge lines indented with a TAB, and some
    artifact files indent with spaces: ``-f`` gets a copy of the artifact
    file with each edge line's leading whitespace replaced by one TAB;
  * ``graph/graph.py`` imports graphviz unconditionally, for drawing only
    (``-o``, never passed here): a stub ``graphviz`` module sits on
    ``PYTHONPATH``.

Seeds and runs. PipeDream iterates over sets, so each run sets
``PYTHONHASHSEED``; every case runs under seeds 0..N-1 (``--seeds``, and
``--more-seeds`` when its plans differ), each ``--runs`` times, and the JSON
records for each distinct plan the seeds that gave it and how many runs did.
The seed turns out not to matter: ties are broken by iteration over sets of
Node / AntichainNode objects, which hash by address (``id``), so the plan
changes from one identical run to the next with address-space layout
randomisation (under ``setarch -R`` a run repeats exactly, whatever the
seed). All the plans of a case have the same pipeline time to within a few
ulps: they are ties.

Reading the output. For each level, top level first, the optimizer prints
``(Split start, split end) / compute time taken per stage / replication
factor per stage:`` and then one ``(start, end) time replication`` line per
stage, in state indices. With two levels (configuration A) level 2 splits
the model across machines (replication = machines) and level 1 splits each
level-2 stage across the GPUs of one machine (replication = GPUs per
machine, the same sub-plan on each of the stage's machines); main() prints
one level-1 block per level-2 stage, in order. A final stage is a level-1
stage: its GPU count is the product of the two replications, and its GPUs
are, with GPUs numbered machine-major, the sub-stage's consecutive GPUs
inside each machine of its level-2 stage (consecutive overall whenever the
level-2 stage is one machine or the level-1 block is one stage).
"Time per stage in pipeline" is recorded as ``pipeline_time_s``: seconds
per minibatch of the profile's batch size in the steady state, the slowest
stage (its time divided by its replication) or transfer.

States and dapple layers. PipeDream drops ``Input*`` source nodes and
``__getitem__*`` sinks, builds the DAG of antichains of what is left and
numbers its nodes ("states") in a topological order; state i stands for the
prefix of the model made of the antichain's nodes and all their
predecessors, and a stage (s, e) holds the prefix of state e-1 minus the
prefix of state s-1 (that is how it computes stage times). The removed Input
nodes go to stage 0. dapple's importer (rust_core/core/src/model/artifact.rs)
orders the nodes with Kahn's algorithm, taking the ready node earliest in
the file first; this script rebuilds that order by node id and checks it
against the layer names of ``profiles/artifact/<name>.json``. Then, per
case, ``state_prefix_end[i] = b`` when state i's prefix plus the Input nodes
is exactly dapple layers ``[0, b)`` (None otherwise), and
``state_to_layers[i] = [a, b]`` with ``a`` the previous state's ``b`` where
both are prefixes and state i-1's prefix is inside state i's (None
otherwise; for a chain, state i is then exactly layers [a, b)). A stage's
``layers`` is its own set of dapple layers as ``[a, b)``, or None with
``layer_indices`` listing them when they are not contiguous.

The states come from PipeDream's own code: one more run per seed executes
the same script through runpy with ``Graph.topological_sort`` wrapped to
keep the antichain states it returns (``antichain_dag_states``, each as
PipeDream stores it: augmented with the predecessors that still feed later
nodes). Every plain run's printed state count, and the antichain it names
after each split, are checked against them.
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_ARTIFACTS = ROOT.parent / "shared" / "profiles" / "dapple-artifact"
DEFAULT_PROFILES = ROOT / "profiles" / "artifact"
DEFAULT_OUT = ROOT / "tests" / "data" / "pipedream-reference.json"

REPOSITORY = "https://github.com/msr-fiddle/pipedream"
COMMIT = "7db6a1c3e64996d5b319faec6ca38cb31bfea1c4"
SCRIPT = "optimizer/optimizer_graph_hierarchical.py"

COMMON_ARGS = ["--activation_compression_ratio", "1", "--use_memory_constraint", "-s", "17179869184"]
CONFIGURATIONS = {
    # name: (description, -n values, -b values)
    "A": ("2 machines x 8 V100, NVLink inside (1.3e11 B/s), 25 Gbps between (3.125e9 B/s)", [8, 2], ["1.3e11", "3.125e9"]),
    "B": ("16 machines x 1 V100, 25 Gbps (3.125e9 B/s)", [16], ["3.125e9"]),
}
MODELS = [  # (model, artifact file)
    ("VGG-19", "vgg-19-pbs-32.txt"),
    ("BERT-24", "bert-24-pbs-6.txt"),
    ("BERT-48", "bert-48-pbs-2.txt"),
    ("XLNet-36", "xlnet-36-pbs-1.txt"),
    ("AmoebaNet-36", "amoeba-36-pbs-1.txt"),
]
SLOW_CASE = ("GNMT-16", "gnmt-16-pbs-64.txt", "A")

RANGE_LINE = re.compile(r"^\((\d+), (\d+)\) (\S+) (\d+)$")
LEVEL_LINE = re.compile(r"^Level (\d+)$")
BLOCK_HEADER = "(Split start, split end) / compute time taken per stage / replication factor per stage:"
PIPELINE_TIME = re.compile(r"^Time per stage in pipeline: (\S+)$")
STATES_MARK = "@@PIPEDREAM_REFERENCE_STATES@@"

# Runs the optimizer as __main__ with Graph.topological_sort wrapped to keep
# the antichain states; prints them as JSON after a marker line.
INSTRUMENTED = f"""
import json, runpy, sys
sys.path.append("..")
import graph
from graph.graph import AntichainNode
kept = []
_sort = graph.Graph.topological_sort
def topological_sort(self):
    out = _sort(self)
    if out and isinstance(out[0], AntichainNode):
        kept.append(out)
    return out
graph.Graph.topological_sort = topological_sort
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
print({STATES_MARK!r})
print(json.dumps([list(s.antichain) for s in kept[-1]]))
"""


# ----------------------------------------------------------------------------
# The artifact graph and dapple's layer order


def read_graph(path: Path) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(nodes as (id, description) in file order, edges as (from, to))."""
    nodes, edges = [], []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        if line[0].isspace():
            a, b = (x.strip() for x in line.strip().split(" -- "))
            edges.append((a, b))
        else:
            parts = line.strip().split(" -- ")
            nodes.append((parts[0].strip(), " ".join(" -- ".join(parts[1:-1]).split())))
    return nodes, edges


def tab_indented(text: str) -> str:
    """The graph text with every edge line indented by exactly one TAB."""
    return "\n".join(("\t" + ln.lstrip()) if ln[:1].isspace() and ln.strip() else ln for ln in text.splitlines()) + "\n"


def dapple_order(nodes, edges) -> list[str]:
    """Node ids in dapple's layer order: Kahn's algorithm, the ready node
    earliest in the file first (rust_core/core/src/model/artifact.rs)."""
    pos = {nid: i for i, (nid, _) in enumerate(nodes)}
    preds = [set() for _ in nodes]
    for a, b in edges:
        preds[pos[b]].add(pos[a])
    succ = [[] for _ in nodes]
    for to, fs in enumerate(preds):
        for f in fs:
            succ[f].append(to)
    unmet = [len(p) for p in preds]
    ready = [i for i in range(len(nodes)) if unmet[i] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        n = heapq.heappop(ready)
        order.append(n)
        for m in succ[n]:
            unmet[m] -= 1
            if unmet[m] == 0:
                heapq.heappush(ready, m)
    assert len(order) == len(nodes), "cycle in graph"
    return [nodes[i][0] for i in order]


def pipedream_graph(nodes, edges):
    """What PipeDream plans on: (in-edges, out-edges, removed Input ids,
    removed __getitem__ ids), following main()'s two removal passes."""
    desc = dict(nodes)
    ins = {n: [] for n, _ in nodes}
    outs = {n: [] for n, _ in nodes}
    for a, b in edges:
        ins[b].append(a)
        outs[a].append(b)

    def remove(n):
        for m in outs.pop(n):
            ins[m].remove(n)
        for m in ins.pop(n):
            outs[m].remove(n)

    inputs = [n for n in list(ins) if not ins[n] and desc[n].startswith("Input")]
    for n in inputs:
        remove(n)
    getitems = [n for n in list(ins) if not outs[n] and desc[n].startswith("__getitem__")]
    for n in getitems:
        remove(n)
    return ins, outs, inputs, getitems


def is_chain(ins, outs) -> bool:
    sources = [n for n in ins if not ins[n]]
    return len(sources) == 1 and all(len(v) <= 1 for v in ins.values()) and all(len(v) <= 1 for v in outs.values())


def prefix(ins, antichain) -> set[str]:
    """The antichain's nodes and all their predecessors."""
    seen, stack = set(), list(antichain)
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(ins[n])
    return seen


def state_mapping(states, ins, inputs, layer_of):
    """(state_prefix_end, state_to_layers, per-state layer sets) for one run's states."""
    covers = [{layer_of[n] for n in prefix(ins, s) | set(inputs)} for s in states]
    ends = [len(c) if c == set(range(len(c))) else None for c in covers]
    to_layers = []
    for i, c in enumerate(covers):
        a = 0 if i == 0 else ends[i - 1]
        ok = ends[i] is not None and a is not None and (i == 0 or covers[i - 1] <= c)
        to_layers.append([a, ends[i]] if ok else None)
    return ends, to_layers, covers


# ----------------------------------------------------------------------------
# Running PipeDream and reading its output


def run_optimizer(pipedream: Path, python: str, stub: Path, graph_file: Path, config: str, seed: int,
                  timeout: float, instrumented: bool = False, unbuffered: bool = False):
    _, n, b = CONFIGURATIONS[config]
    args = [SCRIPT.split("/")[1], "-f", str(graph_file), "-n", *map(str, n), "-b", *b, *COMMON_ARGS]
    env = dict(os.environ, PYTHONHASHSEED=str(seed), PYTHONPATH=str(stub))
    env.pop("PYTHONSTARTUP", None)
    if unbuffered:
        env["PYTHONUNBUFFERED"] = "1"
    cmd = [python, "-c", INSTRUMENTED, *args] if instrumented else [python, *args]
    start = time.monotonic()
    try:
        p = subprocess.run(cmd, cwd=pipedream / "optimizer", env=env, capture_output=True, text=True, timeout=timeout)
        out, rc, finished = p.stdout + p.stderr, p.returncode, True
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        rc, finished = None, False
    return {"output": out, "rc": rc, "finished": finished, "elapsed_s": round(time.monotonic() - start, 1)}


def parse_output(text: str):
    """{level: [block, ...]} with each block a list of (start, end, time, replication),
    and the printed pipeline time."""
    levels: dict[int, list] = {}
    level, block, pipeline_time = None, None, None
    for line in text.splitlines():
        line = line.strip()
        if m := LEVEL_LINE.match(line):
            level = int(m.group(1))
            levels[level] = []
        elif line == BLOCK_HEADER:
            block = []
            levels[level].append(block)
        elif block is not None and (m := RANGE_LINE.match(line)):
            block.append((int(m.group(1)), int(m.group(2)), float(m.group(3)), int(m.group(4))))
        elif not line:
            block = None
        elif m := PIPELINE_TIME.match(line):
            pipeline_time = float(m.group(1))
    return levels, pipeline_time


def compose(levels, config: str, num_states: int):
    """Final stages [(start, end, gpus, devices, time)] and level-2 machine
    stages, from the parsed levels."""
    _, n, _ = CONFIGURATIONS[config]
    top = max(levels)
    assert len(n) == top, (n, levels.keys())
    if top == 1:
        (block,) = levels[1]
        parents = [(0, num_states, None, 1)]
        machines_per_parent = [1]
        per_machine = n[0]
    else:
        assert top == 2, "only one or two levels are handled"
        (parent_block,) = levels[2]
        parents = parent_block
        machines_per_parent = [r for (_, _, _, r) in parent_block]
        per_machine = n[0]
        assert sum(machines_per_parent) == n[1], "level 2 does not use every machine"
    sub_blocks = levels[1]
    assert len(sub_blocks) == len(parents), "one level-1 block per level-2 stage expected"
    assert parents[0][0] == 0 and parents[-1][1] == num_states
    stages, machine_offset = [], 0
    for (ps, pe, _, _), machines, sub in zip(parents, machines_per_parent, sub_blocks):
        assert sub[0][0] == ps and sub[-1][1] == pe, "level-1 block does not tile its level-2 stage"
        assert sum(r for (*_, r) in sub) == per_machine, "level-1 block does not use every GPU of a machine"
        gpu_offset = 0
        for (s, e, t, r) in sub:
            devices = sorted(m * per_machine + gpu_offset + k
                             for m in range(machine_offset, machine_offset + machines) for k in range(r))
            stages.append((s, e, r * machines, devices, t))
            gpu_offset += r
        machine_offset += machines
    for (a, b) in zip(stages, stages[1:]):
        assert a[1] == b[0], "stages do not tile the states"
    machine_stages = None
    if top == 2:
        machine_stages = [{"states": [s, e], "machines": r, "compute_time_s": t} for (s, e, t, r) in levels[2][0]]
    return stages, machine_stages


def notation(stages) -> str:
    """Like the DAPPLE paper's Table VII: (start,end)@[G0-G7] in state indices."""
    def gpus(d):
        if d == list(range(d[0], d[-1] + 1)):
            return f"G{d[0]}" if len(d) == 1 else f"G{d[0]}-G{d[-1]}"
        return ",".join(f"G{x}" for x in d)
    return " ".join(f"({s},{e})@[{gpus(d)}]" for (s, e, _, d, _) in stages)


def layers_of(covers, s, e):
    """The dapple layers of stage (s, e): prefix of state e-1 minus prefix of state s-1."""
    own = covers[e - 1] - (covers[s - 1] if s > 0 else set())
    idx = sorted(own)
    contiguous = bool(idx) and idx == list(range(idx[0], idx[-1] + 1))
    return ([idx[0], idx[-1] + 1] if contiguous else None), idx


# ----------------------------------------------------------------------------


def check_states(output: str, states) -> None:
    """The plain run's own prints agree with the kept states: the number of
    states, and the antichain it names after each split."""
    m = re.search(r"^Total number of states: (\d+)$", output, re.M)
    assert m and int(m.group(1)) == len(states), "state count differs from the instrumented run"
    for k, named in re.findall(r"^Split between layers (\d+) and \d+\.\.\.\nSplit before antichain (\[.*\])\.\.\.$", output, re.M):
        named = set(re.findall(r"'([^']+)'", named))
        assert named == set(states[int(k) + 1]), f"state {int(k) + 1} differs from the instrumented run"


def run_case(args, stub, tmp, model, artifact_file, config) -> dict:
    src = args.artifacts / artifact_file
    name = artifact_file[: -len(".txt")]
    graph_file = tmp / artifact_file
    graph_file.write_text(tab_indented(src.read_text()))
    nodes, edges = read_graph(src)
    order = dapple_order(nodes, edges)
    layer_of = {nid: i for i, nid in enumerate(order)}
    profile = args.profiles / f"{name}.json"
    if profile.exists():
        names = [layer["name"] for layer in json.loads(profile.read_text())["layers"]]
        desc = dict(nodes)
        assert names == [desc[nid] for nid in order], f"{profile}: layer order differs from the rebuilt one"
    ins, outs, inputs, getitems = pipedream_graph(nodes, edges)
    _, n, b = CONFIGURATIONS[config]
    case = {
        "model": model,
        "artifact_file": artifact_file,
        "dapple_profile": f"profiles/artifact/{name}.json",
        "configuration": config,
        "command": " ".join(["python3", SCRIPT.split("/")[1], "-f", artifact_file, "-n", *map(str, n), "-b", *b, *COMMON_ARGS]),
        "dapple_layers": len(order),
        "removed_input_nodes": [{"node": x, "layer": layer_of[x]} for x in inputs],
        "removed_getitem_nodes": [{"node": x, "layer": layer_of[x]} for x in getitems],
        "graph_is_chain_after_removals": is_chain(ins, outs),
    }
    print(f"{model} {config}:", end=" ", flush=True)

    if (model, artifact_file, config) == SLOW_CASE:
        r = run_optimizer(args.pipedream, args.python, stub, graph_file, config, 0, args.gnmt_timeout, unbuffered=True)
        m = re.search(r"Total number of states: (\d+)", r["output"])
        case.update({
            "command": "PYTHONUNBUFFERED=1 " + case["command"],
            "finished": r["finished"], "timeout_s": args.gnmt_timeout, "elapsed_s": r["elapsed_s"],
            "hash_seeds_tried": [0], "num_states": int(m.group(1)) if m else None,
            "pipeline_time_s": None, "state_to_layers": None, "plans": [],
        })
        if r["finished"]:  # not expected; keep what it printed for a person to read
            levels, pt = parse_output(r["output"])
            case["pipeline_time_s"] = pt
            case["raw_levels"] = {str(k): v for k, v in levels.items()}
        print("finished" if r["finished"] else f"not finished in {args.gnmt_timeout} s", flush=True)
        return case

    plans: dict[str, dict] = {}
    mappings: dict[str, dict] = {}
    seeds = list(range(args.seeds))
    i = 0
    while i < len(seeds):
        seed = seeds[i]
        # The states, from a run that keeps them.
        inst = run_optimizer(args.pipedream, args.python, stub, graph_file, config, seed, args.timeout, instrumented=True)
        if not inst["finished"] or inst["rc"] != 0:
            raise SystemExit(f"{model} {config} seed {seed}: optimizer failed (rc {inst['rc']}):\n{inst['output'][-3000:]}")
        states = json.loads(inst["output"].partition(STATES_MARK)[2])
        ends, to_layers, covers = state_mapping(states, ins, inputs, layer_of)
        assert covers[-1] == set(range(len(order))) - {layer_of[x] for x in getitems}, "last state misses layers"
        key_states = json.dumps([sorted(s) for s in states])
        mappings.setdefault(key_states, {"hash_seeds": [], "antichains": states, "prefix_end": ends,
                                         "to_layers": to_layers})["hash_seeds"].append(seed)
        # The plans, from the plain command, run several times: PipeDream's
        # ties also depend on object addresses, which change from run to run.
        for _ in range(args.runs):
            r = run_optimizer(args.pipedream, args.python, stub, graph_file, config, seed, args.timeout)
            if not r["finished"] or r["rc"] != 0:
                raise SystemExit(f"{model} {config} seed {seed}: optimizer failed (rc {r['rc']}):\n{r['output'][-3000:]}")
            check_states(r["output"], states)
            levels, pipeline_time = parse_output(r["output"])
            stages, machine_stages = compose(levels, config, len(states))
            stage_rows = []
            for (s, e, g, d, t) in stages:
                rng, idx = layers_of(covers, s, e)
                row = {"states": [s, e], "layers": rng, "gpus": g, "devices": d, "compute_time_s": t}
                if rng is None:
                    row["layer_indices"] = idx
                stage_rows.append(row)
            key = json.dumps([(row["states"], row["layers"], row.get("layer_indices"), row["gpus"], row["devices"])
                              for row in stage_rows]
                             + [(ms["states"], ms["machines"]) for ms in machine_stages or []])
            plan = plans.get(key)
            if plan is None:
                plan = plans[key] = {"hash_seeds": [], "runs": 0, "pipeline_time_s": pipeline_time,
                                     "pipeline_time_max_s": pipeline_time, "notation": notation(stages)}
                if machine_stages is not None:
                    plan["machine_stages"] = machine_stages
                plan["stages"] = stage_rows
            if seed not in plan["hash_seeds"]:
                plan["hash_seeds"].append(seed)
            plan["runs"] += 1
            plan["pipeline_time_s"] = min(plan["pipeline_time_s"], pipeline_time)
            plan["pipeline_time_max_s"] = max(plan["pipeline_time_max_s"], pipeline_time)
        i += 1
        if i == len(seeds) and (len(plans) > 1 or len(mappings) > 1) and len(seeds) < args.more_seeds:
            seeds = list(range(args.more_seeds))  # plans vary: look at more seeds

    (first_mapping, *other_mappings) = mappings.values()
    best = min(p["pipeline_time_s"] for p in plans.values())
    worst = max(p["pipeline_time_max_s"] for p in plans.values())
    case.update({
        "finished": True,
        "hash_seeds_tried": seeds,
        "runs_per_seed": args.runs,
        "pipeline_time_s": best,
        "pipeline_time_relative_spread": (worst - best) / best,
        "num_states": len(first_mapping["antichains"]),
        "antichain_dag_states": first_mapping["antichains"],
        "state_prefix_end": first_mapping["prefix_end"],
        "state_to_layers": first_mapping["to_layers"],
    })
    if other_mappings:  # the states' order depends on the seed: keep every version
        case["state_orders_by_seed"] = [{"hash_seeds": m["hash_seeds"], "antichain_dag_states": m["antichains"],
                                         "state_prefix_end": m["prefix_end"], "state_to_layers": m["to_layers"]}
                                        for m in mappings.values()]
    for p in plans.values():
        p["hash_seeds"].sort()
        if p["pipeline_time_max_s"] == p["pipeline_time_s"]:
            del p["pipeline_time_max_s"]
    case["plans"] = sorted(plans.values(), key=lambda p: (-p["runs"], p["hash_seeds"][0]))
    print(f"{len(plans)} plan(s) in {len(seeds) * args.runs} runs; " + "; ".join(
        f"{p['runs']}x {p['notation']}" for p in case["plans"]), flush=True)
    return case


def to_json(value, indent: int = 0) -> str:
    """JSON with one line per stage, state or other flat record."""
    def flat(v):
        scalar = lambda x: not isinstance(x, (list, dict))  # noqa: E731
        if isinstance(v, list):
            return all(scalar(x) for x in v)
        if isinstance(v, dict):
            return all(scalar(x) or (isinstance(x, list) and all(scalar(y) for y in x)) for x in v.values())
        return True

    if flat(value) and len(json.dumps(value)) <= 160:
        return json.dumps(value)
    pad, inner = " " * indent, " " * (indent + 1)
    if isinstance(value, list):
        if not value:
            return "[]"
        return "[\n" + ",\n".join(inner + to_json(x, indent + 1) for x in value) + "\n" + pad + "]"
    if isinstance(value, dict):
        if not value:
            return "{}"
        return "{\n" + ",\n".join(f"{inner}{json.dumps(k)}: {to_json(v, indent + 1)}" for k, v in value.items()) + "\n" + pad + "}"
    return json.dumps(value)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pipedream", type=Path, required=True,
                    help="checkout or extracted archive of msr-fiddle/pipedream at 7db6a1c (needs optimizer/ and graph/)")
    ap.add_argument("--artifacts", type=Path, default=DEFAULT_ARTIFACTS,
                    help="folder of the DAPPLE artifact .txt profiles (default: %(default)s)")
    ap.add_argument("--profiles", type=Path, default=DEFAULT_PROFILES,
                    help="dapple's imports of them, to check the layer order against (default: %(default)s)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output JSON (default: %(default)s)")
    ap.add_argument("--python", default=sys.executable, help="interpreter for PipeDream's optimizer (needs numpy; default: this one)")
    ap.add_argument("--seeds", type=int, default=16, help="PYTHONHASHSEED values 0..N-1 per case (default %(default)s)")
    ap.add_argument("--runs", type=int, default=4, help="plain runs per seed (default %(default)s)")
    ap.add_argument("--more-seeds", type=int, default=32,
                    help="when a case's plans or states differ between seeds, run seeds 0..N-1 instead (default %(default)s)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per optimizer run (default %(default)s)")
    ap.add_argument("--gnmt-timeout", type=float, default=600,
                    help="seconds for GNMT-16 on A, expected not to finish; 0 skips it (default %(default)s)")
    args = ap.parse_args()
    for sub in ("optimizer/optimizer_graph_hierarchical.py", "graph/graph.py"):
        if not (args.pipedream / sub).exists():
            raise SystemExit(f"{args.pipedream / sub} not found; see this script's docstring for the git archive command")
    args.pipedream = args.pipedream.resolve()
    python_version = subprocess.run([args.python, "-c", "import platform; print(platform.python_version())"],
                                    capture_output=True, text=True, check=True).stdout.strip()
    numpy_version = subprocess.run([args.python, "-c", "import numpy; print(numpy.__version__)"],
                                   capture_output=True, text=True, check=True).stdout.strip()

    with tempfile.TemporaryDirectory(prefix="pipedream-reference-") as t:
        tmp = Path(t)
        stub = tmp / "stub"
        stub.mkdir()
        (stub / "graphviz.py").write_text("# Stub: PipeDream's graph.py imports graphviz only to draw graphs.\n")
        cases = []
        for config in ("A", "B"):
            for model, artifact_file in MODELS:
                cases.append(run_case(args, stub, tmp, model, artifact_file, config))
        if args.gnmt_timeout > 0:
            model, artifact_file, config = SLOW_CASE
            cases.append(run_case(args, stub, tmp, model, artifact_file, config))

    doc = {
        "format": "dapple-pipedream-reference",
        "schema_version": 1,
        "generated_by": "benchmarks/pipedream_reference.py",
        "pipedream": {"repository": REPOSITORY, "commit": COMMIT, "script": SCRIPT},
        "python": python_version,
        "numpy": numpy_version,
        "how_run": (
            "cd optimizer; PYTHONHASHSEED=<seed> PYTHONPATH=<dir with a stub graphviz.py> <command>, where -f names a copy "
            "of the artifact file with every edge line indented by one TAB (PipeDream's reader needs it)."),
        "configurations": {k: v[0] for k, v in CONFIGURATIONS.items()},
        "notes": [
            "States are PipeDream's antichain-DAG states in its topological order; a stage (s, e) holds the prefix of "
            "state e-1 minus the prefix of state s-1 (a prefix: the antichain's nodes and all their predecessors).",
            "antichain_dag_states[i] is state i's antichain as PipeDream stores it (augmented with the predecessors "
            "that still feed later nodes).",
            "Layers are indices into dapple_profile's layers; removed Input* nodes are in stage 0 (PipeDream puts them "
            "there); state_prefix_end[i] = b when state i's prefix plus the Input nodes is dapple layers [0, b), else null.",
            "gpus = level-1 replication x level-2 replication; devices number GPUs machine-major, 8 per machine in "
            "configuration A; a level-1 stage uses the same GPUs of every machine of its level-2 stage.",
            "pipeline_time_s is the printed 'Time per stage in pipeline': seconds per minibatch of the profile's batch "
            "size in the steady state, the slowest stage (its time divided by its replication) or transfer; the lowest "
            "over the case's runs (its plans tie to within pipeline_time_relative_spread).",
            "The plan varies between identical runs: PipeDream breaks ties by iterating over sets of objects hashed by "
            "address, so address-space layout randomisation decides; PYTHONHASHSEED does not. 'runs' counts the runs "
            "that gave a plan, out of len(hash_seeds_tried) x runs_per_seed.",
        ],
        "cases": cases,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(to_json(doc) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
