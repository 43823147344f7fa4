#!/usr/bin/env python3
"""A seeded fuzz campaign of the installed ``dapple`` command (issue 29).

    python benchmarks/cli_fuzz_campaign.py --seed 20261126 --runs 3000 \\
        --out benchmarks/results/cli_fuzz_campaign.json --jobs 2

Every command and subcommand (``dapple --help`` lists them), with their
options, runs as users run it: a subprocess of the installed ``dapple``
(``shutil.which("dapple")``) in a fresh temporary working directory, with a
wall-clock limit of 30 s. Each run's command line is drawn from
``random.Random`` seeded by a number drawn in order from ``--seed``, so a
seed gives the same command lines whatever ``--jobs`` is.

Inputs: the shipped profiles, topologies, model configs and suites, small
valid ones made first by the installed command (profiles, plans, run
metrics, a measured topology), the same mutated (wrong types, missing or
duplicated fields, huge numbers, NaN, truncated, other formats' files), and
hostile files: empty, binary, directories, missing, /dev/zero, a FIFO, a
socket, a sparse file of several GiB, names that are not UTF-8 or hold
spaces and newlines. Outputs: new names, existing files, links, dangling
links, names ending in a slash, directories, FIFOs, devices, sockets,
/dev/null, missing and read-only folders.

A violation is: an exit code of 1 or one outside the documented table, a
signal (an abort), "Traceback" or "internal error" on stderr, more than one
non-empty stderr line (progress lines aside) when the exit code is not 0, a
run over 20 s, processes left behind, a special output place (directory,
FIFO, device, socket, dangling link, a name with a trailing slash) changed
or created, an existing file changed or a new file left by a run that
failed, a temporary file left, a written file that does not read back
(JSON strictly and by dapple's own reader; pictures, TOML, CSV), a new
file whose mode is not the umask's (0644 under 022), a plan file whose
stage rows and memory breakdown give a stage two peak memories, and
``--json`` output that does not parse. Each is written in full to the
results file; one record a run goes to the ``.runs.jsonl`` file beside it.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import copy
import datetime
import hashlib
import json
import math
import os
import platform
import random
import re
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import threading
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ARTIFACT = ROOT / "profiles" / "artifact"
MODELS = ROOT / "profiles" / "models"
TOPOLOGIES = ROOT / "profiles" / "topologies"
WHALE = ROOT / "profiles" / "whale"
SUITE = ROOT / "profiles" / "regress" / "paper-table-v.json"
GRAPHS = ROOT.parent / "shared" / "profiles" / "dapple-artifact"

#: The README's exit codes (1 is an internal error: a bug).
DOCUMENTED = {0, 2, 3, 4, 5, 6, 7, 8, 9}
TIMEOUT_S = 30.0
SLOW_S = 20.0
#: Address space of a run that does not start torch: a guard for this
#: 23 GiB machine running two at once, not a limit of the contract.
ADDRESS_SPACE_CAP = 8 << 30
TORCH_COMMANDS = {"run", "profile model", "topology measure"}
#: stdout kept for checking --json output; the rest is read and dropped.
STDOUT_KEEP = 64 << 20

GPT = "dapple.planner.runtime.models:gpt"
DIGITS = "dapple.planner.runtime.models:digits"
GPT_ARGS = ["--model-arg", "n_layers=2", "--model-arg", "d_model=16"]
DIGITS_ARGS = ["--model-arg", "n_layers=2", "--model-arg", "hidden=16"]

# Lines on stderr that are progress or a library's chatter, not the error:
# allowed beside the one error line of a failed run.
PROGRESS = [re.compile(p) for p in (
    r"^\[Gloo\] ",                        # torch's gloo connecting (dapple run, topology measure)
    r"is connected to \d+ peer ranks",     # the same, two processes' lines interleaved
    r"^step \d+/\d+ loss ",               # dapple run: one line a step
    r"^eval after step \d+: ",            # dapple run --eval-every
    r"^profiling ",                       # dapple profile model's bar
    r"^link: latency ",                   # dapple topology measure's table
    r"^\s+KiB\s+p2p ms",
    r"^\s*\d+\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+[\d.]+\s*$",
    r"^approximated: ",                   # dapple export --approximate
)]

# Numbers at and past the edges of ranges, and text that is no number.
EDGE_INTS = ["0", "-1", "1", "2", "3", "4294967295", "4294967296", "2147483647", "2147483648", "16777216",
             "16777217", "1000000000", "99999999999999999999", "9" * 5000, "1e3", "0.5", "nan", "inf", "-inf",
             "1e308", "", " ", "abc", "0x10", "+8", " 8", "8 ", "٣", "-0", "1_000", "262144", "262145"]
EDGE_FLOATS = ["0", "-1", "1", "0.5", "1e-308", "5e-324", "1e308", "1.8e308", "nan", "-nan", "inf", "-inf",
               "1024", "1024.0", "1025", "abc", "", "0x1p3", "1e", "99999999999999999999", "9" * 5000, "-0.0"]

# JSON values to put where another value was.
HOSTILE_VALUES = [None, True, False, "", "x", "NaN", "1e3", -1, 0, 1, 2**31, 2**32, 2**53 + 1, 2**63, 2**64,
                  10**30, -(2**63), 1e308, -1e308, 1e-320, 0.5, -0.0, math.nan, math.inf, -math.inf, [], {},
                  [1, 2], {"a": 1}, "\u0000", "é" * 10]
FORMAT_NAMES = ["dapple.profile", "dapple.topology", "dapple.plan", "dapple.simulation", "dapple.regress-suite",
                "dapple.run-metrics", "dapple.nothing", "", None, 1]

SPECS_VALID = ["A", "B", "C", "1x1", "1x2", "1x4-nvlink", "2x2-nvlink", "2x8-nvlink", "16x1-25gbps",
               "64x8-a100-80gb", "32x8", "4x8", "3x8", "8x4", "1x8-a100-80gb", "2x4-h100", "1x2-v100-32gb",
               "2x8-nvlink-25gbps", "4x2-pcie", "1x8-b200"]
SPECS_INVALID = ["0x8", "1x0", "x8", "8x", "2x8-nvlinkk", "99999x99999", "4294967295x1", "65536x65536-nvlink",
                 "-1x8", "1x8-unknowngpu", "", " ", "a" * 300, "2x8-nvlink-nvlink", "1e3x8", "２x８", "2x8\n",
                 "2X8", "2*8", "D", "abc", "2x8-0gbps", "2x8--nvlink", "1x99999999999999999999",
                 "4294967296x1", "1x4294967296", "16777216x1", "2x8-a100-80gb-v100", "../etc/passwd"]
#: 3 to 4 machines of 8 GPUs (and 8x4): there the full space is a legitimate
#: search of 15 s to minutes, not a defect; never sampled with full.
NO_FULL = {"4x8", "3x8", "8x4"}

PLACE_EXTS = ["json", "png", "svg", "toml", "sh", "csv"]


# --------------------------------------------------------------------------
# Text of command lines


def arg_text(a) -> str:
    """A command-line word as text: the bytes of names that are not UTF-8
    escaped as \\xff."""
    return os.fsencode(a if isinstance(a, (str, bytes, os.PathLike)) else str(a)).decode("utf-8", "backslashreplace")


def argv_text(argv) -> str:
    return " ".join(shlex.quote(arg_text(a)) for a in argv)


# --------------------------------------------------------------------------
# JSON mutation


class Raw:
    """Text written as is into a JSON document (numbers no parser keeps)."""

    def __init__(self, text: str):
        self.text = text


RAW_NUMBERS = ["1" + "0" * 5000, "1e999", "-1e999", "1E400", "0." + "0" * 400 + "1", "-0", "123456789012345678901234567890",
               "18446744073709551616", "-9223372036854775809", "4294967296", "1.7976931348623157e309"]


def dumps(node, dup=None, path=()) -> str:
    """JSON text of ``node``; ``dup`` = (path, key, value) writes ``key``
    twice in the object at ``path``, the second time with ``value``."""
    if isinstance(node, Raw):
        return node.text
    if isinstance(node, dict):
        parts = [f"{json.dumps(k)}: {dumps(v, dup, path + (k,))}" for k, v in node.items()]
        if dup is not None and dup[0] == path:
            parts.append(f"{json.dumps(dup[1])}: {dumps(dup[2])}")
        return "{" + ", ".join(parts) + "}"
    if isinstance(node, list):
        return "[" + ", ".join(dumps(v, dup, path + (i,)) for i, v in enumerate(node)) + "]"
    return json.dumps(node)


def all_paths(node, path=()):
    yield path, node
    if isinstance(node, dict):
        for k, v in node.items():
            yield from all_paths(v, path + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from all_paths(v, path + (i,))


def set_at(root, path, value):
    if not path:
        return value
    node = root
    for p in path[:-1]:
        node = node[p]
    node[path[-1]] = value
    return root


def hostile_value(rng: random.Random):
    if rng.random() < 0.2:
        return Raw(rng.choice(RAW_NUMBERS))
    return copy.deepcopy(rng.choice(HOSTILE_VALUES))


def mutate_json(rng: random.Random, data, size_cap: int = 8 << 20) -> tuple[bytes, str]:
    """A mutated copy of ``data`` as bytes, and the name of what was done."""
    data = json.loads(json.dumps(data))
    ops = []
    dup = None
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        op = rng.choice(["value", "value", "value", "delete", "delete", "dup-key", "unknown-key", "format",
                         "schema", "grow-list", "shuffle-list", "empty-list", "negate", "scale", "type-of-root"])
        paths = list(all_paths(data))
        dicts = [(p, n) for p, n in paths if isinstance(n, dict) and n]
        lists = [(p, n) for p, n in paths if isinstance(n, list) and n]
        nums = [(p, n) for p, n in paths if isinstance(n, (int, float)) and not isinstance(n, bool)]
        if op == "value" and len(paths) > 1:
            p, _ = rng.choice(paths[1:])
            data = set_at(data, p, hostile_value(rng))
        elif op == "delete" and dicts:
            p, n = rng.choice(dicts)
            del n[rng.choice(list(n))]
        elif op == "dup-key" and dicts:
            p, n = rng.choice(dicts)
            k = rng.choice(list(n))
            dup = (p, k, hostile_value(rng) if rng.random() < 0.7 else n[k])
        elif op == "unknown-key" and dicts:
            p, n = rng.choice(dicts)
            n[rng.choice(["extra", "x", "", "layers", "format", "é"])] = hostile_value(rng)
        elif op == "format" and isinstance(data, dict):
            data["format"] = rng.choice(FORMAT_NAMES)
        elif op == "schema" and isinstance(data, dict):
            data["schema_version"] = rng.choice([0, -1, 2, 5, 999, "1", 1.5, None, 2**64])
        elif op == "grow-list" and lists:
            p, n = rng.choice(lists)
            times = rng.choice([2, 10, 100, 1000, 10000])
            item_bytes = max(1, len(json.dumps(n[0], default=str)))
            times = max(2, min(times, size_cap // (item_bytes * len(n))))
            n.extend(json.loads(json.dumps(n, default=str)) * (times - 1))
        elif op == "shuffle-list" and lists:
            p, n = rng.choice(lists)
            rng.shuffle(n)
        elif op == "empty-list" and lists:
            p, n = rng.choice(lists)
            n.clear()
        elif op in ("negate", "scale") and nums:
            p, n = rng.choice(nums)
            data = set_at(data, p, -n if op == "negate" else n * rng.choice([1e9, 1e300, 1e-9, 0, 1e6]))
        elif op == "type-of-root":
            data = rng.choice([[data], "text", 1, None, []])
        else:
            continue
        ops.append(op)
    try:
        text = dumps(data, dup)
    except (TypeError, ValueError):
        text = json.dumps(data, default=str)
    raw = text.encode("utf-8", "surrogatepass")
    tail = rng.random()
    if tail < 0.06:
        raw = raw[: rng.randrange(0, max(1, len(raw)))]
        ops.append("truncated")
    elif tail < 0.09:
        raw = b"\xef\xbb\xbf" + raw
        ops.append("bom")
    elif tail < 0.11:
        raw = raw + b"\n// trailing\n{}"
        ops.append("trailing-garbage")
    elif tail < 0.13:
        i = rng.randrange(0, max(1, len(raw)))
        raw = raw[:i] + bytes([rng.choice([0x00, 0xff, 0xc3, 0x80])]) + raw[i:]
        ops.append("bad-byte")
    return raw, "+".join(ops) or "unchanged"


def mutate_graph(rng: random.Random, text: str) -> tuple[bytes, str]:
    """A mutated artifact graph.txt."""
    lines = text.splitlines()
    ops = []
    for _ in range(rng.choice([1, 1, 2, 3])):
        op = rng.choice(["number", "number", "delete", "duplicate", "edge", "cycle", "garbage", "node-id", "swap",
                         "grow"])
        if not lines:
            break
        i = rng.randrange(len(lines))
        if op == "number":
            nums = list(re.finditer(r"-?\d+(\.\d+)?", lines[i]))
            if nums:
                m = rng.choice(nums)
                lines[i] = lines[i][: m.start()] + rng.choice(
                    ["nan", "-1", "1e308", "inf", "9" * 400, "", "x", "-0", "1e-400", "4294967296"]) + lines[i][m.end():]
        elif op == "delete":
            del lines[i]
        elif op == "duplicate":
            lines.insert(i, lines[i])
        elif op == "edge":
            lines.append(f"  node{rng.choice([0, 1, 99999, 2**40])} -- node{rng.choice([1, 2, 3, 10**6])}")
        elif op == "cycle":
            lines.append("  node3 -- node1")
            lines.append("  node2 -- node2")
        elif op == "garbage":
            lines.insert(i, rng.choice(["garbage", "node -- -- --", "nodeX -- y -- forward_compute_time=",
                                        "\t", "node1 -- a -- b=1, c=2", "é" * 5]))
        elif op == "node-id":
            lines[i] = re.sub(r"node\d+", f"node{rng.choice(['-1', '0', '99999999999999999999', 'x'])}", lines[i], 1)
        elif op == "swap" and len(lines) > 1:
            j = rng.randrange(len(lines))
            lines[i], lines[j] = lines[j], lines[i]
        elif op == "grow":
            lines = lines * rng.choice([10, 100])
        ops.append(op)
    return ("\n".join(lines) + "\n").encode(), "+".join(ops)


# --------------------------------------------------------------------------
# Fixtures: inputs made once, before the campaign, by the installed dapple


@dataclass
class ProfileInfo:
    path: str
    layers: int
    names: list[str]
    kinds: list[str]
    batch: list[int]
    transformer: bool = False  # layers named embedding, block_<i>, lm_head


class Fixtures:
    def __init__(self, root: Path, dapple: str, log):
        self.root = root
        self.dir = root / "fx"
        self.dapple = dapple
        self.log = log
        self.profiles: dict[str, ProfileInfo] = {}
        self.plans: dict[str, str] = {}
        self.plan_data: dict[str, dict] = {}
        self.json_docs: dict[str, tuple[str, dict]] = {}  # name -> (kind, data) to mutate
        self.graphs: list[str] = []
        self.configs: list[str] = []
        self.topology_files: list[str] = []
        self.metrics: dict[str, str] = {}
        self.maps: list[str] = []
        self.hostile: list[str | bytes] = []
        self.findings: list[dict] = []  # what building the fixtures found

    def sh(self, *args, cwd=None, check=True):
        r = subprocess.run([self.dapple, *map(str, args)], capture_output=True, cwd=cwd or self.dir, timeout=300,
                           stdin=subprocess.DEVNULL)
        if check and r.returncode != 0:
            raise SystemExit(f"fixture failed: dapple {' '.join(map(str, args))}: exit {r.returncode}\n"
                             f"{r.stderr.decode(errors='replace')}")
        return r

    def add_profile(self, name: str, path: Path | str):
        data = json.loads(Path(path).read_text())
        layers = data["layers"]
        names = [layer["name"] for layer in layers]
        self.profiles[name] = ProfileInfo(
            str(path), len(layers), names, [layer.get("kind", "") for layer in layers],
            sorted({m["batch_size"] for layer in layers for m in layer["measurements"]}),
            transformer=names[0] == "embedding" and names[-1] == "lm_head")
        self.json_docs[f"profile:{name}"] = ("profile", data)

    def add_plan(self, name: str, *args) -> bool:
        """A plan made by dapple plan; False (and a finding) where dapple
        estimate cannot read it back."""
        out = self.dir / f"plan-{name}.json"
        self.sh("plan", *args, "--out", out, "--quiet")
        self.plans[name] = str(out)
        self.plan_data[name] = json.loads(out.read_text())
        self.json_docs[f"plan:{name}"] = ("plan", self.plan_data[name])
        if "profile_path" not in self.plan_data[name]["inputs"]:
            self.findings.append({
                "what": "a plan written by dapple plan records no inputs.profile_path, so estimate, simulate, show "
                        "and export without --profile refuse it (exit 3)",
                "made_by": argv_text(["dapple", "plan", *args, "--out", out.name, "--quiet"])})
        profile = args[list(args).index("--profile") + 1]
        r = self.sh("estimate", "--plan", out, "--profile", profile, check=False)
        if r.returncode != 0:
            self.findings.append({
                "what": "a plan written by dapple plan is refused by dapple estimate",
                "made_by": argv_text(["dapple", "plan", *args, "--out", out.name, "--quiet"]),
                "estimate_exit": r.returncode, "stderr": r.stderr.decode(errors="replace").strip()})
            return False
        return True

    def build(self):
        t0 = time.time()
        fx = self.dir
        fx.mkdir(parents=True)
        for p in sorted(ARTIFACT.glob("*.json")):
            self.add_profile(p.stem, p)
        tiny = {"format": "dapple.profile", "schema_version": 1, "model": "tiny", "optimizer": "adam",
                "layers": [{"name": f"l{i}", "param_bytes": 1_000_000,
                            "measurements": [{"batch_size": 1, "fwd_ms": 1.0, "bwd_ms": 2.0,
                                              "activation_bytes": 1000}]} for i in range(4)]}
        (fx / "tiny.json").write_text(json.dumps(tiny))
        self.add_profile("tiny", fx / "tiny.json")
        small = {"model_type": "llama", "hidden_act": "silu", "hidden_size": 256, "intermediate_size": 688,
                 "num_attention_heads": 8, "num_key_value_heads": 4, "num_hidden_layers": 4, "vocab_size": 1000}
        gpt2 = {"model_type": "gpt2", "n_embd": 128, "n_head": 4, "n_layer": 3, "vocab_size": 500, "n_positions": 256}
        (fx / "config-small.json").write_text(json.dumps(small))
        (fx / "config-gpt2.json").write_text(json.dumps(gpt2))
        self.configs = [str(p) for p in sorted(MODELS.glob("*.json"))] + [
            str(WHALE / "m6-10b-config.json"), str(fx / "config-small.json"), str(fx / "config-gpt2.json")]
        for c in self.configs:
            self.json_docs[f"config:{Path(c).stem}"] = ("config", json.loads(Path(c).read_text()))
        self.sh("profile", "transformer", "--config", fx / "config-small.json", "--gpu", "a100", "--seq-len", 128,
                "--out", fx / "llama-small.json")
        self.add_profile("llama-small", fx / "llama-small.json")
        self.sh("profile", "transformer", "--config", fx / "config-small.json", "--gpu", "h100", "--seq-len", 128,
                "--out", fx / "llama-small-h100.json")
        self.add_profile("llama-small-h100", fx / "llama-small-h100.json")
        self.sh("profile", "transformer", "--config", "llama-3-8b", "--gpu", "h100", "--seq-len", 2048,
                "--out", fx / "llama-3-8b.json")
        self.add_profile("llama-3-8b", fx / "llama-3-8b.json")
        self.sh("profile", "model", "--model", GPT, *GPT_ARGS, "--batch-sizes", "1,2", "--repeats", 1, "--warmup", 0,
                "--out", fx / "gpt.json", "--quiet")
        self.add_profile("gpt", fx / "gpt.json")
        self.sh("profile", "model", "--model", DIGITS, *DIGITS_ARGS, "--batch-sizes", "1,2,4", "--repeats", 1,
                "--warmup", 0, "--out", fx / "digits.json", "--quiet")
        self.add_profile("digits", fx / "digits.json")
        # The same profile under names that are hard to pass around.
        for name in (os.fsdecode(b"tiny\xff.json"), "tiny profile.json", "tiny\nnewline.json", "-tiny.json"):
            shutil.copy(fx / "tiny.json", fx / name)
        bert24 = str(ARTIFACT / "bert-24-pbs-6.json")
        self.add_plan("bert24", "--profile", bert24, "--topology", "2x2-nvlink", "--global-batch-size", 24)
        self.add_plan("bert48-A", "--profile", ARTIFACT / "bert-48-pbs-2.json", "--topology", "A",
                      "--global-batch-size", 64)
        self.add_plan("tiny", "--profile", fx / "tiny.json", "--topology", "1x2", "--global-batch-size", 8)
        self.add_plan("gpt", "--profile", fx / "gpt.json", "--topology", "1x2", "--global-batch-size", 4)
        self.add_plan("gpt-2stages", "--profile", fx / "gpt.json", "--topology", "1x2", "--global-batch-size", 4,
                      "--stages", 2)
        # digits at a batch of 8 (and 2, 4, 6) wrote a plan that estimate refused
        # (other_bytes -1.8e-12): kept as an input, and one at 16 for the runs.
        self.add_plan("digits-8", "--profile", fx / "digits.json", "--topology", "1x2", "--global-batch-size", 8)
        for gbs in (16, 32, 64):
            if self.add_plan("digits", "--profile", fx / "digits.json", "--topology", "1x2",
                             "--global-batch-size", gbs):
                break
        self.add_plan("llama", "--profile", fx / "llama-small.json", "--topology", "1x8-a100-80gb",
                      "--global-batch-size", 64)
        self.add_plan("llama-split", "--profile", fx / "llama-small.json", "--topology", "1x8-a100-80gb",
                      "--global-batch-size", 64, "--split", "1..5:2")
        self.add_plan("llama-2stages", "--profile", fx / "llama-small.json", "--topology", "2x4-h100",
                      "--global-batch-size", 64, "--stages", 2)
        self.add_plan("xpipe", "--profile", bert24, "--topology", "2x2-nvlink", "--global-batch-size", 24,
                      "--schedule", "xpipe")
        self.add_plan("gpipe", "--profile", bert24, "--topology", "2x2-nvlink", "--global-batch-size", 24,
                      "--schedule", "gpipe")
        self.add_plan("whale", "--profile", ARTIFACT / "gnmt-16-pbs-64.json", "--topology",
                      TOPOLOGIES / "whale-4v100-4p100.json", "--global-batch-size", 256)
        # A plan whose recorded profile path is relative (beside the plan).
        rel = json.loads(Path(self.plans["tiny"]).read_text())
        rel["inputs"]["profile_path"] = "tiny.json"
        (fx / "plan-relative.json").write_text(json.dumps(rel))
        self.plans["relative"] = str(fx / "plan-relative.json")
        # Run metrics of the GPT plan, and of digits with validation scores.
        self.sh("run", "--plan", self.plans["gpt"], "--model", GPT, *GPT_ARGS, "--steps", 2, "--metrics",
                fx / "metrics-gpt.json", "--profile", fx / "gpt.json")
        self.sh("run", "--plan", self.plans["digits"], "--model", DIGITS, *DIGITS_ARGS, "--steps", 2,
                "--eval-every", 1, "--metrics", fx / "metrics-digits.json")
        for m in ("gpt", "digits"):
            self.metrics[m] = str(fx / f"metrics-{m}.json")
            self.json_docs[f"metrics:{m}"] = ("metrics", json.loads(Path(self.metrics[m]).read_text()))
        # Topologies as files.
        r = self.sh("topology", "show", "B", "--json")
        (fx / "topology-B.json").write_bytes(r.stdout)
        for attempt in range(3):  # the fit needs times that grow with size; a loaded machine may not give them
            r = self.sh("topology", "measure", "--processes", 2, "--sizes-kib", "4,1024,4096", "--repeats", 3,
                        "--out", fx / "topology-measured.json", check=attempt == 2)
            if r.returncode == 0:
                break
        self.topology_files = [str(fx / "topology-B.json"), str(fx / "topology-measured.json")] + [
            str(p) for p in sorted(TOPOLOGIES.glob("*.json"))]
        for t in self.topology_files:
            self.json_docs[f"topology:{Path(t).stem}"] = ("topology", json.loads(Path(t).read_text()))
        suite = json.loads(SUITE.read_text())
        for case in suite["cases"]:
            case["profile"] = str((SUITE.parent / case["profile"]).resolve())
        self.suite = suite
        self.json_docs["suite:table-v"] = ("suite", suite)
        # Module maps.
        maps = {"map-llama.json": {"about": "torchtitan's Llama 3", "modules": {
                    "embedding": ["tok_embeddings"], "block_{i}": ["layers.{i}"], "lm_head": ["norm", "output"]}},
                "map-gpt.json": {"modules": {"embedding": ["embedding"], "block{i}": ["blocks.{i}"],
                                             "block_{i}": ["blocks.{i}"], "lm_head": ["head"]}}}
        for name, data in maps.items():
            (fx / name).write_text(json.dumps(data))
            self.maps.append(str(fx / name))
            self.json_docs[f"map:{name}"] = ("map", data)
        # Artifact graphs: the shipped ones where the checkout has them, and a small one.
        self.graphs = [str(p) for p in sorted(GRAPHS.glob("*.txt"))]
        small_graph = "\n".join(
            [f"node{i} -- layer_{i} -- forward_compute_time={i + 1}.5, backward_compute_time={2 * i + 1}.0, "
             f"activation_size={1000 * (i + 1)}, parameter_size={4096 * i}" for i in range(1, 6)]
            + [f"  node{i} -- node{i + 1}" for i in range(1, 5)]) + "\n"
        (fx / "graph-small.txt").write_text(small_graph)
        self.graphs.append(str(fx / "graph-small.txt"))
        # Hostile inputs.
        (fx / "empty.json").write_bytes(b"")
        (fx / "junk.bin").write_bytes(random.Random(29).randbytes(4096))
        (fx / "text.txt").write_text("hello, not json\n")
        (fx / "bom.json").write_bytes(b"\xef\xbb\xbf" + (fx / "tiny.json").read_bytes())
        (fx / "latin1.json").write_bytes((fx / "tiny.json").read_bytes().replace(b'"tiny"', b'"caf\xe9"'))
        (fx / "null.json").write_text("null")
        (fx / "array.json").write_text("[]")
        (fx / "deep.json").write_text("[" * 100000 + "]" * 100000)
        (fx / "adir").mkdir()
        os.mkfifo(fx / "fifo")
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(fx / "sock"))
        s.close()
        os.symlink(fx / "gone" / "x.json", fx / "dangling.json")
        with open(fx / "sparse-4g.bin", "wb") as f:
            f.truncate(4 << 30)
        with open(fx / "sparse-300m.json", "wb") as f:  # just past the 256 MiB input limit
            f.truncate(300 << 20)
        self.hostile = [str(fx / n) for n in ("empty.json", "junk.bin", "text.txt", "bom.json", "latin1.json",
                                               "null.json", "array.json", "deep.json", "adir", "fifo", "sock",
                                               "dangling.json", "sparse-4g.bin", "sparse-300m.json", "missing.json")]
        self.hostile += ["/dev/zero", "/dev/urandom", "/dev/null", "/proc/self/status", "/proc/self/mem", "/",
                         ".", "-", os.fsencode(fx) + b"/missing\xff.json", os.fsencode(fx) + b"/tiny\xff.json",
                         str(fx / "tiny profile.json"), str(fx / "tiny\nnewline.json"), str(fx / "-tiny.json"),
                         str(fx / "adir") + "/"]
        # Matplotlib's font cache, built once here rather than in a timed run.
        self.sh("show", "--plan", self.plans["tiny"], "--gantt", fx / "warm.png")
        (fx / "warm.png").unlink()
        self.built_s = time.time() - t0
        self.log(f"fixtures built in {self.built_s:.1f} s in {fx}")


# --------------------------------------------------------------------------
# Generating one command line


@dataclass
class Spec:
    command: str
    argv: list = field(default_factory=list)
    files: dict = field(default_factory=dict)      # name in the run's folder -> bytes
    outputs: dict = field(default_factory=dict)    # output as given (bytes) -> format
    ckpt: bytes | None = None                      # --checkpoint-dir as given
    tags: list = field(default_factory=list)       # what kinds of inputs and outputs were drawn
    stdout_json: bool = False


class Gen:
    def __init__(self, rng: random.Random, fx: Fixtures):
        self.r = rng
        self.fx = fx
        self.counter = 0
        # A clean run draws only valid inputs, names and values, to reach
        # deep into the command; the others draw the hostile ones too.
        self.clean = rng.random() < 0.4
        self.wild = 0.0 if self.clean else 1.0

    # -- small helpers
    def p(self, prob: float) -> bool:
        return self.r.random() < prob

    def choice(self, xs):
        return self.r.choice(xs)

    def num(self, valid, edge=EDGE_INTS, p_edge=0.2) -> str:
        return self.choice(edge) if self.p(p_edge * self.wild) else str(self.choice(valid))

    def pick(self, valid, bad, p_bad=0.08):
        """One of ``valid``, or now and then (never in a clean run) one of ``bad``."""
        return self.choice(bad) if self.p(p_bad * self.wild) else self.choice(valid)

    def fresh(self, stem: str, ext: str) -> str:
        self.counter += 1
        return f"{stem}{self.counter}.{ext}"

    def new_file(self, spec: Spec, ext: str, data: bytes, stem="in") -> str:
        name = self.fresh(stem, ext)
        if self.p(0.05):
            name = os.fsdecode(b"in\xfd" + name.encode())
        spec.files[name] = data
        return name

    # -- inputs
    def hostile(self, spec: Spec, what: str):
        h = self.choice(self.fx.hostile)
        spec.tags.append(f"{what}:hostile:{arg_text(os.path.basename(os.fsencode(h)) or h)}")
        return h

    def other_format(self, spec: Spec, what: str):
        pool = ([self.choice(list(self.fx.plans.values())), self.choice(self.fx.topology_files),
                 self.choice(self.fx.configs), self.choice(self.fx.graphs), self.choice(list(self.fx.metrics.values())),
                 str(SUITE), self.choice(self.fx.maps), self.choice([p.path for p in self.fx.profiles.values()])])
        path = self.choice(pool)
        spec.tags.append(f"{what}:other-format")
        return path

    def mutated(self, spec: Spec, what: str, kind: str):
        keys = [k for k, (kd, _) in self.fx.json_docs.items() if kd == kind]
        key = self.choice(keys)
        raw, ops = mutate_json(self.r, self.fx.json_docs[key][1])
        spec.tags.append(f"{what}:mutated:{ops}")
        return self.new_file(spec, "json", raw)

    def profile_info(self, transformer=None) -> ProfileInfo:
        infos = list(self.fx.profiles.values())
        if transformer is not None:
            infos = [i for i in infos if i.transformer == transformer] or infos
        return self.choice(infos)

    def profile_arg(self, spec: Spec, info: ProfileInfo | None = None, p_valid=0.75):
        u = -1.0 if self.clean else self.r.random()
        if u < p_valid:
            info = info or self.profile_info()
            spec.tags.append("profile:valid")
            if info.path.endswith("tiny.json") and self.p(0.3):
                return self.choice([os.fsencode(self.fx.dir) + b"/tiny\xff.json", str(self.fx.dir / "tiny profile.json"),
                                    str(self.fx.dir / "tiny\nnewline.json")])
            return info.path
        if u < p_valid + 0.12:
            return self.mutated(spec, "profile", "profile")
        if u < p_valid + 0.17:
            return self.other_format(spec, "profile")
        return self.hostile(spec, "profile")

    def topology_arg(self, spec: Spec, full=False):
        u = self.r.random() * (0.75 if self.clean else 1.0)
        if u < 0.62:
            specs = [s for s in SPECS_VALID if not (full and s in NO_FULL)]
            spec.tags.append("topology:spec")
            return self.choice(specs)
        if u < 0.75:
            spec.tags.append("topology:file")
            return self.choice(self.fx.topology_files)
        if u < 0.83:
            return self.mutated(spec, "topology", "topology")
        if u < 0.95:
            spec.tags.append("topology:invalid-spec")
            return self.choice(SPECS_INVALID)
        return self.hostile(spec, "topology")

    def plan_arg(self, spec: Spec, names=None, p_valid=0.75):
        u = -1.0 if self.clean else self.r.random()
        if u < p_valid:
            spec.tags.append("plan:valid")
            return self.fx.plans[self.choice(names or list(self.fx.plans))]
        if u < p_valid + 0.13:
            return self.mutated(spec, "plan", "plan")
        if u < p_valid + 0.17:
            return self.other_format(spec, "plan")
        return self.hostile(spec, "plan")

    # -- outputs
    def out_arg(self, spec: Spec, fmt: str, ext: str):
        """An output path (as given on the command line) and its format."""
        u = self.r.random()
        if self.clean:  # names that work: new, existing, a link to a file, not UTF-8, with spaces
            u = self.choice([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.41, 0.46, 0.83, 0.86])
        table = [
            (0.40, lambda: self.fresh("out", ext)),
            (0.08, lambda: f"old.{ext}"),
            (0.05, lambda: f"link.{ext}"),
            (0.06, lambda: f"dangling.{ext}"),
            (0.04, lambda: "adir"),
            (0.03, lambda: "adir/"),
            (0.04, lambda: f"newdir{self.counter}/"),
            (0.03, lambda: f"out.{ext}/"),
            (0.04, lambda: "fifo"),
            (0.03, lambda: "dev"),
            (0.02, lambda: "sock"),
            (0.02, lambda: "/dev/null"),
            (0.04, lambda: f"missing/sub/out.{ext}"),
            (0.02, lambda: f"/sys/dapple-fuzz.{ext}"),
            (0.01, lambda: f"/proc/dapple-fuzz.{ext}"),
            (0.02, lambda: f"ro/out.{ext}"),
            (0.03, lambda: os.fsdecode(b"out\xfe." + ext.encode())),
            (0.015, lambda: f"o u t.{ext}"),
            (0.015, lambda: f"new\nline.{ext}"),
            (0.01, lambda: ""),
            (0.01, lambda: "."),
            (0.01, lambda: "-"),
            (0.01, lambda: f"adir/inside.{ext}"),
        ]
        acc = 0.0
        path = table[0][1]()
        for prob, make in table:
            acc += prob
            if u < acc:
                path = make()
                break
        spec.outputs[os.fsencode(path)] = fmt
        spec.tags.append(f"out:{re.sub(r'[0-9]+', '', arg_text(path))[:24]}")
        return path

    def picture_ext(self):
        return self.pick(["png", "svg", "PNG"], ["pdf", "txt", "jpg", "svgz"], 0.25)

    def common_tail(self, spec: Spec):
        """Now and then something odd at the end: an unknown option, a
        repeated one, a stray word."""
        u = self.r.random()
        if self.clean:
            return
        if u < 0.02:
            spec.argv.append(self.choice(["--nope", "-x", "--", "extra", "--json=1", "--help"]))
        elif u < 0.03 and spec.argv:
            spec.argv.extend(spec.argv[-2:])

    def max_passes(self, spec: Spec, p=0.15):
        if self.p(p):
            spec.argv += ["--max-passes", self.num(["1", "100", "1000", "262144", "16777216"], p_edge=0.4)]

    # -- commands
    def gen(self) -> Spec:
        weights = [("plan", 17), ("compare", 7), ("estimate", 7), ("simulate", 7), ("show", 7), ("export", 9),
                   ("calibrate", 6), ("regress", 3), ("run", 5), ("topology show", 6), ("topology gpus", 2),
                   ("topology measure", 2), ("profile import-artifact", 5), ("profile merge", 4),
                   ("profile model", 3), ("profile transformer", 6), ("misc", 4)]
        names, ws = zip(*weights)
        command = self.r.choices(names, ws)[0]
        spec = Spec(command)
        getattr(self, "g_" + command.replace(" ", "_").replace("-", "_"))(spec)
        if command != "misc":
            self.common_tail(spec)
        return spec

    def hints(self, spec: Spec, info: ProfileInfo | None):
        n = info.layers if info else 8
        names = info.names if info else ["l0"]

        def layer():
            u = self.r.random()
            if u < 0.6 or self.clean:
                return str(self.r.randint(0, n - 1))
            if u < 0.8:
                return self.choice(names)
            return self.choice(EDGE_INTS + ["nope", "l", "-3", str(n + 1)])

        def rng_text(t=None):
            if self.p(0.15 * self.wild):
                return self.choice(["", "..", "1..", "..2", "a..b", "3..1", "0..0", "1..2:0", "0..2:-1", "1...3",
                                    "0..99999999999999999999", "0.." + "9" * 5000, "0..2:x", "0..2:1:1", "é..ü"])
            a = self.r.randint(0, max(0, n - 1))
            b = self.r.randint(a + 1, n) if self.clean or self.p(0.9) else self.r.randint(0, n + 2)
            ta = self.choice(names) if self.p(0.15) and a < len(names) else str(a)
            text = f"{ta}..{b}"
            if t is not None:
                text += f":{t}"
            return text

        if self.p(0.15):
            spec.argv += ["--stages", self.num(range(1, 9), p_edge=0.25)]
        if self.p(0.12):
            spec.argv += ["--micro-batches", self.num([1, 2, 3, 4, 8, 16, 64], p_edge=0.25)]
        for _ in range(self.choice([0] * 8 + [1, 2])):
            spec.argv += ["--pin-cut", layer()]
        for _ in range(self.choice([0] * 9 + [1, 2])):
            spec.argv += ["--replicate", rng_text(self.choice([None, 1, 2, 4, 8]))]
        for _ in range(self.choice([0] * 9 + [1])):
            spec.argv += ["--split", rng_text(self.choice([1, 2, 4, 8, 3]))]
        if self.p(0.07):
            spec.argv += ["--from-layout", self.layout_text(info)]

    def layout_text(self, info: ProfileInfo | None) -> str:
        if info is not None and (self.clean or self.p(0.5)):
            # A layout from the profile's own layers: E, t for each block, L.
            blocks = sum(1 for k in info.kinds if k == "block")
            cut = sorted(self.r.sample(range(1, max(2, blocks)), k=min(self.r.randint(0, 3), max(0, blocks - 1))))
            parts, prev = [], 0
            for c in cut + [blocks]:
                parts.append(f"t*{c - prev}" if c - prev > 0 else "")
                prev = c
            return "E" + "|".join(parts) + "L"
        return self.choice(["Et*15|t*17L", "Et*3|(tt|)*29,m|L", "E||tL", "", "|", "|||", "E|L", "t*-1",
                            "t*99999999999", "t*" + "9" * 5000, "(t*999)*999", "(tt|)*9999999", "Ex", "E(t|)*2L",
                            "((t|)*2)*2", "ET*3L", "E,t,t,L", "é", "E t L", "Et*0L", "Et*1.5L", "E\nL"])

    def g_plan(self, spec: Spec):
        info = self.profile_info() if self.p(0.85) else None
        prof = self.profile_arg(spec, info) if info else self.profile_arg(spec, p_valid=0.0)
        space = self.pick(["auto", "auto", "machine-aligned", "full"], ["none", "FULL"]) if self.p(0.35) else None
        topo = self.topology_arg(spec, full=space == "full")
        spec.argv = ["plan", "--profile", prof, "--topology", topo]
        if self.p(0.85):
            spec.argv += ["--global-batch-size", self.num([1, 2, 4, 8, 16, 24, 32, 64, 96, 128, 256, 512, 1024,
                                                           2048, 4096], p_edge=0.25)]
        if space:
            spec.argv += ["--search-space", space]
        if self.p(0.15):
            spec.argv += ["--warmup-policy", self.pick(["auto", "a", "b", "A"], ["c"])]
        if self.p(0.15):
            spec.argv += ["--min-micro-batch-size", self.num([1, 2, 4, 8, 64])]
        if self.p(0.2):
            spec.argv += ["--stage-shapes", self.pick(["auto", "all", "plain"], ["some"])]
        if self.p(0.12):
            spec.argv += ["--max-search-gib", self.num(["0.01", "0.1", "1", "2", "1024"], EDGE_FLOATS, 0.4)]
        if self.p(0.15):
            spec.argv += [self.choice(["--refine", "--no-refine"])]
        if self.p(0.25):
            spec.argv += ["--schedule", self.pick(["auto", "early-backward-1f1b", "gpipe", "zb-h1", "zb-h2", "xpipe",
                                                    "pipedream", "spectrain", "async", "interleaved-1f1b",
                                                    "interleaved-zero-bubble", "zb-v", "dualpipev"], ["1f1b"])]
        if self.p(0.1):
            spec.argv += ["--chunks", self.pick(["1", "2", "3"], ["0", "x", "4294967296"])]
        self.hints(spec, info)
        if self.p(0.12):
            spec.argv += ["--for", self.pick(["megatron", "deepspeed", "torchtitan", "torch"], ["alpa", "torch-csv"])]
        if self.p(0.05):
            spec.argv += ["--max-search-machines", self.pick(["1", "2", "16", "16384"], ["0", "-1", "x"])]
        if self.p(0.35):
            spec.argv += ["--out", self.out_arg(spec, "json", "json")]
        if self.p(0.3):
            spec.argv += ["--json"]
            spec.stdout_json = True
        if self.p(0.5):
            spec.argv += ["--quiet"]
        self.max_passes(spec)

    def g_compare(self, spec: Spec):
        spec.argv = ["compare", "--profile", self.profile_arg(spec), "--topology", self.topology_arg(spec)]
        if self.p(0.85):
            spec.argv += ["--global-batch-size", self.num([1, 8, 16, 32, 64, 128, 256, 1024, 2048], p_edge=0.25)]
        if self.p(0.15):
            spec.argv += ["--min-micro-batch-size", self.num([1, 2, 4, 8])]
        if self.p(0.15):
            spec.argv += ["--warmup-policy", self.pick(["auto", "a", "b"], ["x"])]
        if self.p(0.3):
            spec.argv += ["--json"]
            spec.stdout_json = True
        if self.p(0.5):
            spec.argv += ["--quiet"]
        self.max_passes(spec)

    def plan_and_profile(self, spec: Spec, names=None, p_profile=0.3):
        plan = self.plan_arg(spec, names)
        args = ["--plan", plan]
        if self.p(p_profile):
            args += ["--profile", self.profile_arg(spec, p_valid=0.6)]
        return args

    def g_estimate(self, spec: Spec):
        spec.argv = ["estimate", *self.plan_and_profile(spec)]
        if self.p(0.3):
            spec.argv += ["--json"]
            spec.stdout_json = True
        self.max_passes(spec, 0.25)

    def g_simulate(self, spec: Spec):
        spec.argv = ["simulate", *self.plan_and_profile(spec)]
        if self.p(0.3):
            spec.argv += ["--schedule", self.pick(["early-backward-1f1b", "gpipe", "zb-h1", "zb-h2", "xpipe", "pipedream",
                                                    "spectrain", "async", "interleaved-1f1b",
                                                    "interleaved-zero-bubble", "zb-v", "dualpipev"], ["auto"])]
        if self.p(0.2):
            spec.argv += ["--recompute"]
        if self.p(0.2):
            spec.argv += ["--actions"]
        if self.p(0.15):
            spec.argv += ["--chunks", self.pick(["1", "2", "3", "8"], ["0", "-1", "x", "99999", "4294967296"])]
        if self.p(0.15):
            spec.argv += ["--trace", self.out_arg(spec, "json", "json")]
        if self.p(0.3):
            spec.argv += ["--json"]
            spec.stdout_json = "--actions" not in spec.argv
        self.max_passes(spec, 0.25)

    def g_show(self, spec: Spec):
        spec.argv = ["show"]
        if self.p(0.8):
            spec.argv += self.plan_and_profile(spec, p_profile=0.2)
        if self.p(0.2):
            spec.argv += ["--schedule", self.pick(["early-backward-1f1b", "gpipe", "zb-h1", "zb-h2", "xpipe", "async"], ["x"])]
        if self.p(0.15):
            spec.argv += ["--recompute"]
        for opt, p in (("--gantt", 0.5), ("--memory", 0.35), ("--diagram", 0.35)):
            if self.p(p):
                ext = self.picture_ext()
                spec.argv += [opt, self.out_arg(spec, "picture", ext)]
        if self.p(0.2):
            spec.argv += ["--trace", self.out_arg(spec, "json", "json")]
        if self.p(0.25):
            for _ in range(self.choice([1, 1, 2, 3])):
                u = self.r.random() * (0.7 if self.clean else 1.0)
                if u < 0.7:
                    m = self.choice(list(self.fx.metrics.values()))
                    spec.tags.append("metrics:valid")
                elif u < 0.88:
                    m = self.mutated(spec, "metrics", "metrics")
                else:
                    m = self.hostile(spec, "metrics")
                spec.argv += ["--metrics", m]
            if self.p(0.8):
                spec.argv += ["--curves", self.out_arg(spec, "picture", self.picture_ext())]
            if self.p(0.3):
                spec.argv += ["--steps-per-epoch", self.num(["1", "0.5", "10", "100"], EDGE_FLOATS, 0.4)]
        if self.p(0.15):
            spec.argv += ["--max-tasks-drawn", self.num(["1", "10", "20000", "1000000"], p_edge=0.4)]
        self.max_passes(spec, 0.1)

    def g_export(self, spec: Spec):
        target = self.pick(["torch-csv", "torchtitan", "megatron", "deepspeed"], ["onnx"], 0.04)
        fmt, ext = {"torch-csv": ("csv", "csv"), "torchtitan": ("toml", "toml"), "megatron": ("sh", "sh"),
                    "deepspeed": ("json", "json")}.get(target, ("json", "json"))
        plans = list(self.fx.plans)
        if target in ("torchtitan", "megatron") and self.p(0.6):
            plans = ["llama", "llama-split", "llama-2stages", "gpt", "gpt-2stages"]
        spec.argv = ["export", "--plan", self.plan_arg(spec, plans), "--to", target,
                     "--out", self.out_arg(spec, fmt, ext if self.clean or self.p(0.85) else "txt")]
        if self.p(0.25 if target in ("torchtitan", "megatron") else 0.08):
            spec.argv += ["--profile", self.profile_arg(spec, p_valid=0.7)]
        if self.p(0.4 if target == "torchtitan" else 0.05):
            u = self.r.random() * (0.65 if self.clean else 1.0)
            if u < 0.4:
                m = self.pick(["torchtitan-llama", "dapple-gpt"], ["nope", "", "TORCHTITAN-LLAMA"], 0.3)
            elif u < 0.65:
                m = self.choice(self.fx.maps)
            elif u < 0.85:
                m = self.mutated(spec, "module-map", "map")
            else:
                m = self.hostile(spec, "module-map")
            spec.argv += ["--module-map", m]
        if self.p(0.35):
            spec.argv += ["--approximate"]

    def g_calibrate(self, spec: Spec):
        spec.argv = ["calibrate", *self.plan_and_profile(spec, ["gpt", "gpt", "gpt", "digits", "tiny", "bert24"],
                                                         p_profile=0.25)]
        u = self.r.random() * (0.6 if self.clean else 1.0)
        if u < 0.6:
            m = self.choice([self.fx.metrics["gpt"]] * 3 + [self.fx.metrics["digits"]])
            spec.tags.append("metrics:valid")
        elif u < 0.85:
            m = self.mutated(spec, "metrics", "metrics")
        elif u < 0.9:
            m = self.other_format(spec, "metrics")
        else:
            m = self.hostile(spec, "metrics")
        spec.argv += ["--metrics", m, "--out", self.out_arg(spec, "json", "json")]

    def g_regress(self, spec: Spec):
        suite = json.loads(json.dumps(self.fx.suite))
        u = self.r.random() * (0.7 if self.clean else 1.0)
        small = [{"name": "tiny 1x2", "profile": self.fx.profiles["tiny"].path, "topology": "1x2",
                  "global_batch_size": 8},
                 {"name": "bert24 2x2", "profile": self.fx.profiles["bert-24-pbs-6"].path, "topology": "2x2-nvlink",
                  "global_batch_size": 24, "expected_ms": 1.0, "expected_shape": "4"},
                 {"name": "gpt 1x2", "profile": self.fx.profiles["gpt"].path, "topology": "1x2",
                  "global_batch_size": 4, "expected_ms": 1e9}]
        suite["cases"] = self.r.sample(suite["cases"], self.choice([1, 1, 2])) if self.p(0.5) else \
            self.r.sample(small, self.choice([1, 2, 3]))
        if u < 0.7:
            raw = json.dumps(suite).encode()
            spec.tags.append("suite:valid")
            path = self.new_file(spec, "json", raw, "suite")
        elif u < 0.9:
            raw, ops = mutate_json(self.r, suite)
            spec.tags.append(f"suite:mutated:{ops}")
            path = self.new_file(spec, "json", raw, "suite")
        elif u < 0.95:
            path = self.other_format(spec, "suite")
        else:
            path = self.hostile(spec, "suite")
        spec.argv = ["regress", path]
        if self.p(0.3):
            spec.argv += ["--update"]
            if os.fsencode(path) in {os.fsencode(n) for n in spec.files}:
                spec.outputs[os.fsencode(path)] = "json"
        self.max_passes(spec, 0.15)

    def model_spec(self, spec: Spec, kind: str):
        """--model and --model-args for the GPT or digits factory, small, or bad."""
        u = self.r.random() * (0.8 if self.clean else 1.0)
        if u < 0.8:
            model, args = (GPT, list(GPT_ARGS)) if kind == "gpt" else (DIGITS, list(DIGITS_ARGS))
            if self.p(0.15 * self.wild):
                args += ["--model-arg", self.choice(["seed=1", "seed=-1", "n_layers=0", "n_layers=-1",
                                                     "n_layers='x'", "d_model=[1]", "nope=1", "=1", "x", "seed=1e309",
                                                     "n_layers=3", "hidden=None", "seq=0", "vocab=1", "n_heads=3"])]
            return ["--model", model, *args]
        spec.tags.append("model:bad")
        return ["--model", self.choice(["no_such_module_xyz:f", "dapple.planner.runtime.models",
                                        "dapple.planner.runtime.models:", ":gpt", "", "builtins:dict",
                                        "json:dumps", "math:nope", "dapple.planner.runtime.models:nothing",
                                        "dapple.planner.runtime.models:bert", "a:b:c", "é:é"]),
                *(GPT_ARGS if self.p(0.5) else [])]

    def g_run(self, spec: Spec):
        name = self.choice(["gpt", "gpt", "gpt-2stages", "digits", "digits", "digits-8", "tiny", "bert24", "xpipe",
                            "llama"])
        kind = "digits" if name.startswith("digits") else "gpt"
        plan = self.plan_arg(spec, [name], p_valid=0.85)
        spec.argv = ["run", "--plan", plan, *self.model_spec(spec, kind),
                     "--steps", self.num([1, 1, 2], ["0", "-1", "abc", "1e3", "", "nan", "99999999999999999999"],
                                         0.15)]
        if self.p(0.15):
            spec.argv += ["--lr", self.num(["0.1", "0.01", "1"], EDGE_FLOATS, 0.5)]
        if self.p(0.2):
            spec.argv += ["--optimizer", self.pick(["sgd", "momentum", "rmsprop", "adam"], ["lbfgs"])]
        if self.p(0.15):
            spec.argv += ["--schedule", self.pick(["xpipe", "pipedream", "spectrain", "async"], ["gpipe"])]
        if self.p(0.12):
            spec.argv += ["--seed", self.num([0, 1, 42], ["-1", "99999999999999999999", "18446744073709551615",
                                                          "18446744073709551616", "abc", "1.5", "-9223372036854775809"],
                                             0.6)]
        if self.p(0.15):
            spec.argv += ["--eval-every", self.num([1, 2], ["0", "-1", "x", "4294967296"], 0.3)]
        if self.p(0.25):
            spec.argv += ["--metrics", self.out_arg(spec, "json", "json")]
        if self.p(0.12):
            spec.argv += ["--profile", self.profile_arg(spec, self.fx.profiles[kind],
                                                        p_valid=0.6)]
        if self.p(0.12):
            ckpt = self.pick(["ckpt", "missing/deep/ckpt", os.fsdecode(b"ck\xff"), "adir"],
                             ["fifo", "old.json", "/sys/ckpt", "", "dangling.json"], 0.4)
            spec.argv += ["--checkpoint-dir", ckpt]
            spec.ckpt = os.fsencode(ckpt)
            spec.tags.append(f"ckpt:{arg_text(ckpt)}")
        if self.p(0.1):
            spec.argv += ["--checkpoint-every", self.num([1, 2], ["0", "-1", "x"], 0.3)]
        if self.p(0.08):
            spec.argv += ["--resume"]
        if self.p(0.1):
            spec.argv += ["--threads", self.num([1, 2], ["0", "-1", "x", "64"], 0.4)]
        if self.p(0.06):
            spec.argv += ["--device", self.pick(["cpu", "cuda"], ["tpu"])]
        if self.p(0.12):
            spec.argv += ["--dtype", self.pick(["fp32", "bf16", "fp16"], ["int8"])]
        if self.p(0.1):
            spec.argv += ["--recompute"]
        if self.p(0.06):
            spec.argv += ["--exact-memory"]
        if self.p(0.1):
            spec.argv += ["--slowdown", self.pick(["0=1", "1=2", "0=1.5"], ["0=0.5", "x", "-1=2", "0=nan", "0=1001",
                                                                            "99=2", "0=", "=2", "0=inf"], 0.5)]
        self.max_passes(spec, 0.06)

    def g_topology_show(self, spec: Spec):
        spec.argv = ["topology", "show", self.topology_arg(spec)]
        if self.p(0.4):
            spec.argv += ["--json"]
            spec.stdout_json = True

    def g_topology_gpus(self, spec: Spec):
        spec.argv = ["topology", "gpus"]
        if self.p(0.5):
            spec.argv += ["--json"]
            spec.stdout_json = True

    def g_topology_measure(self, spec: Spec):
        spec.argv = ["topology", "measure", "--processes", self.num([2, 2, 3], ["1", "0", "-1", "129", "x", ""], 0.2),
                     "--sizes-kib", self.num(["4", "4,64", "1,2,3", "64,4,4"],
                                             ["0", "-4", "", "a", "1048577", "4,,64", "4;64", "1e3", ","], 0.2),
                     "--repeats", self.num([1, 2, 3], ["0", "-1", "10001", "x"], 0.15)]
        if self.p(0.2):
            spec.argv += ["--name", self.pick(["local", "é", "x" * 1000], ["", "a\nb"], 0.4)]
        if self.p(0.6):
            spec.argv += ["--out", self.out_arg(spec, "json", "json")]
        else:
            spec.stdout_json = True

    def g_profile_import_artifact(self, spec: Spec):
        u = self.r.random() * (0.55 if self.clean else 1.0)
        if u < 0.55:
            graph = self.choice(self.fx.graphs)
            spec.tags.append("graph:valid")
        elif u < 0.8:
            src = self.choice(self.fx.graphs)
            raw, ops = mutate_graph(self.r, Path(src).read_text())
            spec.tags.append(f"graph:mutated:{ops}")
            graph = self.new_file(spec, "txt", raw, "graph")
        elif u < 0.88:
            graph = self.other_format(spec, "graph")
        else:
            graph = self.hostile(spec, "graph")
        spec.argv = ["profile", "import-artifact", graph]
        if self.p(0.95):
            spec.argv += ["--model", self.pick(["BERT-48", "m", "é", "x" * 500], ["", "a\nb"], 0.3)]
        if self.p(0.95):
            spec.argv += ["--batch-size", self.num([1, 2, 6, 32, 64])]
        if self.p(0.4):
            spec.argv += ["--block-pattern", self.pick([r"^layer_\d+$", "LSTM|RecurrentAttention", ".*", "layer_",
                                                        r"\p{L}"], ["(", "[z-a]", "", "a{99999999}", "(a+)+$"], 0.4)]
        if self.p(0.2):
            spec.argv += ["--param-bytes-scale", self.num(["1.0", "1.048576", "2"], EDGE_FLOATS, 0.5)]
        if self.p(0.2):
            spec.argv += ["--optimizer", self.pick(["adam", "sgd", "rmsprop-momentum", "momentum"], ["foo", ""], 0.3)]
        if self.p(0.2):
            spec.argv += ["--device", self.pick(["V100-16GB", "a100"], ["x", ""], 0.4)]
        if self.p(0.15):
            spec.argv += ["--origin", self.pick(["somewhere", "é" * 100], [""], 0.3)]
        if self.p(0.2):
            spec.argv += ["--measured-peak-memory-gib", self.num(["11.4", "1", "100"], EDGE_FLOATS, 0.5)]
        if self.p(0.95):
            spec.argv += ["--out", self.out_arg(spec, "json", "json")]

    def g_profile_merge(self, spec: Spec):
        inputs = []
        for _ in range(self.choice([1, 2, 2, 2, 3])):
            u = self.r.random()
            if u < 0.55:
                inputs.append(self.choice([self.fx.profiles["llama-small"].path,
                                           self.fx.profiles["llama-small-h100"].path]))
                spec.tags.append("profile:mergeable")
            else:
                inputs.append(self.profile_arg(spec, p_valid=0.4))
        spec.argv = ["profile", "merge", *inputs]
        if self.p(0.95):
            spec.argv += ["--out", self.out_arg(spec, "json", "json")]

    def g_profile_model(self, spec: Spec):
        kind = self.choice(["gpt", "digits"])
        spec.argv = ["profile", "model", *self.model_spec(spec, kind),
                     "--batch-sizes", self.num(["1", "1,2", "2,1,1", "4"],
                                               ["0", "-1", "", "1,,2", "abc", "4294967296", "1;2", ","], 0.2),
                     "--repeats", self.num([1, 2], ["0", "-1", "x"], 0.1),
                     "--warmup", self.num([0, 1], ["-1", "x"], 0.1)]
        if self.p(0.1):
            spec.argv += ["--device", self.pick(["cpu", "cuda", "cuda:0"], ["cuda:99", "tpu", "", "cpu:0"], 0.5)]
        if self.p(0.15):
            spec.argv += ["--dtype", self.pick(["fp32", "bf16", "fp16"], ["fp64"])]
        if self.p(0.1):
            spec.argv += ["--threads", self.num([1, 2], ["0", "-1", "x"], 0.4)]
        if self.p(0.15):
            spec.argv += ["--name", self.pick(["m", "é", "x" * 300], [""], 0.3)]
        if self.p(0.95):
            spec.argv += ["--out", self.out_arg(spec, "json", "json")]
        if self.p(0.5):
            spec.argv += ["--quiet"]

    def g_profile_transformer(self, spec: Spec):
        u = self.r.random() * (0.6 if self.clean else 1.0)
        if u < 0.35:
            config = self.choice(["gpt3-175b", "llama-2-7b", "llama-2-13b", "llama-2-70b", "llama-3-8b",
                                  "llama-3-70b", "llama-3-405b"])
            spec.tags.append("config:name")
        elif u < 0.6:
            config = self.choice(self.fx.configs)
            spec.tags.append("config:file")
        elif u < 0.85:
            config = self.mutated(spec, "config", "config")
        elif u < 0.9:
            config = self.choice(["llama-4", "", "LLAMA-2-7B", "gpt3"])
            spec.tags.append("config:bad-name")
        elif u < 0.94:
            config = self.other_format(spec, "config")
        else:
            config = self.hostile(spec, "config")
        spec.argv = ["profile", "transformer", "--config", config,
                     "--gpu", self.pick(["a100", "h100", "v100", "b200", "h200", "A100-80GB"], ["tpu", "", "a100 "]),
                     "--seq-len", self.num([128, 512, 2048, 4096, 8192])]
        if self.p(0.3):
            spec.argv += ["--micro-batch-sizes", self.num(["1", "1,2,4,8", "16", "3,5"],
                                                          ["0", "", "-1", "4294967296", "a", "4294967295"], 0.4)]
        if self.p(0.3):
            spec.argv += ["--efficiency", self.num(["0.5", "1", "0.3", "0.01"], EDGE_FLOATS + ["1.5", "1.0000001"],
                                                   0.5)]
        if self.p(0.15):
            spec.argv += ["--name", self.pick(["m", "é", "x" * 300], [""], 0.3)]
        if self.p(0.95):
            spec.argv += ["--out", self.out_arg(spec, "json", "json")]

    def g_misc(self, spec: Spec):
        spec.argv = self.choice([[], ["--help"], ["-h"], ["--version"], ["nosuch"], ["topology"], ["profile"],
                                 ["topology", "nosuch"], ["profile", "nosuch"], [self.choice(
                                     ["plan", "estimate", "simulate", "show", "compare", "regress", "export",
                                      "calibrate", "run"]), "--help"],
                                 ["topology", self.choice(["show", "gpus", "measure"]), "--help"],
                                 ["profile", self.choice(["import-artifact", "merge", "model", "transformer"]), "-h"],
                                 ["plan"], ["plan", "--unknown"], ["--version", "--help"], ["PLAN"], ["plan", "-"]])


# --------------------------------------------------------------------------
# The run's folder: places that outputs may name


def make_places(cwd: Path) -> dict:
    for ext in PLACE_EXTS:
        (cwd / f"old.{ext}").write_text("old\n")
        (cwd / f"target.{ext}").write_text("old\n")
        os.symlink(f"target.{ext}", cwd / f"link.{ext}")
        os.symlink(f"gone/x.{ext}", cwd / f"dangling.{ext}")
    (cwd / "adir").mkdir()
    (cwd / "adir" / "keep.txt").write_text("keep\n")
    os.mkfifo(cwd / "fifo")
    try:
        os.mknod(cwd / "dev", 0o666 | stat.S_IFCHR, os.makedev(1, 3))  # a null device of our own
    except OSError:
        pass
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(cwd / "sock"))
    s.close()
    (cwd / "ro").mkdir()
    os.chmod(cwd / "ro", 0o555)
    return {}


def snapshot(top: bytes) -> dict:
    """Every entry under ``top``: relative path -> (kind, detail)."""
    out = {}

    def walk(d: bytes, rel: bytes):
        try:
            entries = list(os.scandir(d))
        except OSError:
            return
        for e in entries:
            r = rel + e.name if not rel else rel + b"/" + e.name
            try:
                st = os.lstat(e.path)
            except OSError:
                continue
            m = st.st_mode
            if stat.S_ISLNK(m):
                out[r] = ("link", os.readlink(e.path))
            elif stat.S_ISDIR(m):
                out[r] = ("dir", None)
                walk(e.path, r)
            elif stat.S_ISREG(m):
                h = hashlib.sha1()
                try:
                    with open(e.path, "rb") as f:
                        for chunk in iter(lambda: f.read(1 << 20), b""):
                            h.update(chunk)
                except OSError:
                    pass
                out[r] = ("file", (st.st_size, h.hexdigest()))
            elif stat.S_ISFIFO(m):
                out[r] = ("fifo", None)
            elif stat.S_ISCHR(m):
                out[r] = ("chr", st.st_rdev)
            elif stat.S_ISSOCK(m):
                out[r] = ("sock", None)
            else:
                out[r] = ("other", m)

    walk(top, b"")
    return out


SPECIAL_PLACES = {b"adir", b"fifo", b"dev", b"sock"} | {f"dangling.{e}".encode() for e in PLACE_EXTS}
EXISTING = {f"old.{e}".encode() for e in PLACE_EXTS} | {f"target.{e}".encode() for e in PLACE_EXTS}


# --------------------------------------------------------------------------
# Checking what a run wrote


def core_reader():
    try:
        import dapple.planner._core as core
    except Exception:  # noqa: BLE001 - the campaign still checks JSON without it
        return None
    return core


CORE = core_reader()
READERS = {"dapple.profile": "Profile", "dapple.topology": "Topology", "dapple.plan": "Plan",
           "dapple.simulation": "Simulation", "dapple.regress-suite": "RegressSuite", "dapple.run-metrics": "RunMetrics"}


def strict_json(data: bytes):
    def no_constant(name):
        raise ValueError(f"{name} is not JSON")
    return json.loads(data.decode("utf-8"), parse_constant=no_constant)


def check_file(data: bytes, fmt: str, name: str) -> str | None:
    """Why a written file is damaged, or None."""
    try:
        if fmt == "json":
            doc = strict_json(data)
            if isinstance(doc, dict) and doc.get("format") in READERS and CORE is not None:
                getattr(CORE, READERS[doc["format"]]).from_json(data.decode(), name)
            if isinstance(doc, dict) and doc.get("format") == "dapple.plan":
                return plan_disagrees(doc)
        elif fmt == "picture":
            if data.startswith(b"\x89PNG\r\n\x1a\n"):
                if not data.endswith(b"IEND\xaeB`\x82"):
                    return "PNG without its end"
            elif b"<svg" in data[:4096]:
                if not data.rstrip().endswith(b"</svg>"):
                    return "SVG without its end"
            elif not data.startswith(b"%PDF") and not data.startswith(b"\xff\xd8"):
                return "picture neither PNG, SVG, PDF nor JPEG"
        elif fmt == "toml":
            tomllib.loads(data.decode("utf-8"))
        elif fmt in ("csv", "sh"):
            text = data.decode("utf-8")
            if not text.strip():
                return "empty"
        else:
            return f"unexpected file (format {fmt})"
    except Exception as e:  # noqa: BLE001 - anything that does not read back is the finding
        return f"does not read back as {fmt}: {type(e).__name__}: {str(e)[:300]}"
    return None


def plan_disagrees(plan: dict) -> str | None:
    """Where a plan file says two things of one stage (issue 67): its stage
    row's peak memory (``estimate.stages[i].memory_bytes``) against its
    memory breakdown's (``estimate.memory[i].peak_bytes``)."""
    estimate = plan.get("estimate") or {}
    for i, (stage, memory) in enumerate(zip(estimate.get("stages", []), estimate.get("memory", []))):
        a, b = stage.get("memory_bytes"), memory.get("peak_bytes")
        if a is not None and b is not None and abs(a - b) > 1e-6 * max(a, b, 1.0):
            return f"two peak memories for stage {i}: stages[{i}].memory_bytes {a:.0f}, memory[{i}].peak_bytes {b:.0f}"
    return None


#: The mode every output is written with: what a plain open() gives a new
#: file under the campaign's umask (issue 67: some were 0600).
UMASK = os.umask(0)
os.umask(UMASK)
OUTPUT_MODE = 0o666 & ~UMASK


def check_outputs(spec: Spec, code: int, before: dict, after: dict, cwd: bytes) -> tuple[list[str], int]:
    """What the run damaged, and how many written files read back."""
    problems = []
    read_back = 0
    ckpt = spec.ckpt.rstrip(b"/") if spec.ckpt else None

    def under_ckpt(p: bytes) -> bool:
        """In --checkpoint-dir, or a folder on the way to it."""
        return ckpt is not None and not os.path.isabs(ckpt) and (
            p == ckpt or p.startswith(ckpt + b"/") or ckpt.startswith(p + b"/"))

    outputs = {}
    for given, fmt in spec.outputs.items():
        if os.path.isabs(given):
            continue
        g = os.path.normpath(given)
        outputs[g] = fmt
        if before.get(g, ("",))[0] == "link":
            outputs[os.path.normpath(os.path.join(os.path.dirname(g), before[g][1]))] = fmt
    new = [p for p in after if p not in before]
    changed = [p for p in after if p in before and after[p] != before[p]]
    removed = [p for p in before if p not in after]
    for p in removed:
        if not under_ckpt(p):
            problems.append(f"removed {arg_text(p)!r} ({before[p][0]})")
    for p in changed + new:
        if under_ckpt(p):
            continue
        top = p.split(b"/")[0]
        name = p.rsplit(b"/", 1)[-1]
        if name.startswith(b".") and b".tmp" in name:
            problems.append(f"temporary file left: {arg_text(p)!r}")
            continue
        if p in SPECIAL_PLACES or p.startswith(b"gone") or (top == b"adir" and p not in outputs):
            problems.append(f"special output place changed or created: {arg_text(p)!r} "
                            f"({before.get(p, ('absent',))[0]} -> {after[p][0]})")
            continue
        if code != 0:
            what = "existing file changed" if p in before else "new file left"
            problems.append(f"{what} by a failed run (exit {code}): {arg_text(p)!r}")
            continue
        if after[p][0] == "dir":
            if p not in outputs and not any(o.startswith(p + b"/") for o in outputs):
                problems.append(f"unexpected folder created: {arg_text(p)!r}")
            continue
        if after[p][0] != "file":
            problems.append(f"output is a {after[p][0]}: {arg_text(p)!r}")
            continue
        fmt = outputs.get(p)
        if fmt is None and p.endswith(b".schedule.csv"):
            fmt = "csv"  # export --to torchtitan writes it beside the TOML
        if fmt is None:
            problems.append(f"unexpected file written: {arg_text(p)!r}")
            continue
        with open(os.path.join(cwd, p), "rb") as f:
            data = f.read()
            mode = stat.S_IMODE(os.fstat(f.fileno()).st_mode)
        if p not in before and mode != OUTPUT_MODE:
            problems.append(f"written file {arg_text(p)!r} has mode {mode:o}, not the umask's {OUTPUT_MODE:o}")
        why = check_file(data, fmt, arg_text(p))
        if why:
            problems.append(f"written file {arg_text(p)!r} is damaged: {why}")
        else:
            read_back += 1
    # A name ending in a slash must be refused, not written without it.
    asked_help = any(a in ("--help", "-h") for a in spec.argv)  # click prints help and writes nothing
    for given in spec.outputs:
        if given.endswith(b"/") and code == 0 and not asked_help:
            problems.append(f"output {arg_text(given)!r} ends with a slash and the run succeeded")
    return problems, read_back


# --------------------------------------------------------------------------
# Running one command


@dataclass
class Result:
    index: int
    command: str
    argv: str
    exit: int
    wall_s: float
    stderr_lines: int
    stderr_first: str
    maxrss_mib: float
    files_read_back: int
    tags: list
    violations: list
    stderr_tail: str = ""


def drain(pipe, keep: int, sink: list):
    total = 0
    while True:
        chunk = pipe.read(1 << 16)
        if not chunk:
            break
        if total < keep:
            sink.append(chunk[: keep - total])
        total += len(chunk)
    sink.append(None if total > keep else b"")  # None: truncated
    pipe.close()


def execute(index: int, sub_seed: int, fx: Fixtures, dapple: str, work: Path) -> Result:
    rng = random.Random(sub_seed)
    spec = Gen(rng, fx).gen()
    cwd = work / f"run{index:05d}"
    cwd.mkdir()
    try:
        make_places(cwd)
        for name, data in spec.files.items():
            with open(os.path.join(os.fsencode(cwd), os.fsencode(name)), "wb") as f:
                f.write(data)
        bcwd = os.fsencode(cwd)
        before = snapshot(bcwd)
        devnull_before = os.lstat("/dev/null")
        cmd = [dapple, *spec.argv]
        if spec.command not in TORCH_COMMANDS:
            cmd = ["prlimit", f"--as={ADDRESS_SPACE_CAP}", "--", *cmd]
        env = {k: v for k, v in os.environ.items() if k != "DAPPLE_DEBUG"}
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True, env=env)
        out, err = [], []
        threads = [threading.Thread(target=drain, args=(proc.stdout, STDOUT_KEEP, out), daemon=True),
                   threading.Thread(target=drain, args=(proc.stderr, 1 << 20, err), daemon=True)]
        for t in threads:
            t.start()
        timed_out = False
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() - t0 > TIMEOUT_S:
                timed_out = True
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                pid, status, usage = os.wait4(proc.pid, 0)
                break
            time.sleep(0.01)
        wall = time.monotonic() - t0
        code = os.waitstatus_to_exitcode(status)
        proc.returncode = code
        left_behind = False
        try:
            if timed_out:  # killed with its group just now: what is left is being reaped
                raise ProcessLookupError
            os.killpg(proc.pid, 0)
            left_behind = True
        except (ProcessLookupError, PermissionError):
            pass
        if left_behind:
            time.sleep(0.5)  # a worker still exiting is not one left behind
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                left_behind = False
        for t in threads:
            t.join(timeout=10)
        stdout_truncated = out and out[-1] is None
        stdout = b"".join(c for c in out if c)
        stderr = b"".join(c for c in err if c).decode("utf-8", "backslashreplace")
        after = snapshot(bcwd)
        lines = [line for line in stderr.splitlines() if line.strip()]
        errors = [line for line in lines if not any(p.search(line) for p in PROGRESS)]
        v = []
        if timed_out:
            v.append(f"timed out: killed after {TIMEOUT_S:.0f} s")
        elif wall > SLOW_S:
            v.append(f"slow: {wall:.1f} s (over {SLOW_S:.0f} s)")
        if code < 0:
            if not timed_out:
                try:
                    name = signal.Signals(-code).name
                except ValueError:
                    name = str(-code)
                v.append(f"killed by signal {name} (an abort)")
        elif code not in DOCUMENTED:
            v.append(f"exit code {code}" + (" (internal error)" if code == 1 else " (not in the documented table)"))
        if "Traceback" in stderr:
            v.append("Traceback on stderr")
        if "internal error: " in stderr and code != 1:  # what options.reports_errors prints
            v.append("'internal error' on stderr")
        # `dapple`, `dapple topology` and `dapple profile` alone print their
        # help and exit 2 (main.py: NoArgsIsHelpError): help, not an error.
        bare_group = spec.argv in ([], ["topology"], ["profile"]) and stderr.startswith("Usage:")
        if code != 0 and not timed_out and len(errors) > 1 and not bare_group:
            v.append(f"{len(errors)} stderr lines on failure (one expected): {errors[:4]}")
        if left_behind:
            v.append("processes of the run left running after it ended (killed)")
        asked_help = any(a in ("--help", "-h") for a in spec.argv)
        if spec.stdout_json and code == 0 and not stdout_truncated and not asked_help:
            try:
                strict_json(stdout)
            except Exception as e:  # noqa: BLE001
                v.append(f"--json stdout does not parse: {type(e).__name__}: {str(e)[:200]}")
        dn = os.lstat("/dev/null")
        if not stat.S_ISCHR(dn.st_mode) or dn.st_rdev != devnull_before.st_rdev:
            v.append("/dev/null is no longer the null device")
        damaged, read_back = check_outputs(spec, code, before, after, bcwd)
        v += damaged
        rss = usage.ru_maxrss / 1024
        if v and spec.command not in TORCH_COMMANDS and rss > ADDRESS_SPACE_CAP / 2**20 * 0.5:
            v.append(f"note: peak RSS {rss:.0f} MiB near the campaign's {ADDRESS_SPACE_CAP >> 30} GiB address-space cap")
        return Result(index, spec.command, argv_text(["dapple", *spec.argv]), code, round(wall, 3), len(lines),
                      lines[0][:500] if lines else "", round(rss, 1), read_back, spec.tags, v,
                      stderr[-2000:] if v else "")
    finally:
        os.chmod(cwd / "ro", 0o755) if (cwd / "ro").exists() else None
        shutil.rmtree(cwd, ignore_errors=True)


# --------------------------------------------------------------------------
# Coverage: each command's options from its --help


COMMANDS = ["plan", "estimate", "simulate", "show", "compare", "regress", "export", "calibrate", "run",
            "topology show", "topology gpus", "topology measure", "profile import-artifact", "profile merge",
            "profile model", "profile transformer"]


def help_options(dapple: str) -> dict[str, set[str]]:
    out = {}
    top = subprocess.run([dapple, "--help"], capture_output=True, text=True).stdout
    listed = set(re.findall(r"^  ([a-z][a-z-]+)\s", top.split("Commands:")[1], re.M))
    for group in ("topology", "profile"):
        text = subprocess.run([dapple, group, "--help"], capture_output=True, text=True).stdout
        listed |= {f"{group} {c}" for c in re.findall(r"^  ([a-z][a-z-]+)\s", text.split("Commands:")[1], re.M)}
    listed -= {"topology", "profile"}
    for c in sorted(listed):
        text = subprocess.run([dapple, *c.split(), "--help"], capture_output=True, text=True).stdout
        heads = [line.strip().split("  ")[0] for line in text.split("Options:")[1].splitlines()
                 if line.startswith("  -")]
        out[c] = {o for h in heads for o in re.findall(r"(--[a-z][a-z0-9-]*)", h)} - {"--help"}
    return out


# --------------------------------------------------------------------------


def installed_build(dapple: str) -> dict:
    """What is installed: the package's folder, where pip installed it from,
    and a hash of its compiled core (to see whether it changed mid-campaign)."""
    code = ("import dapple, glob, hashlib, json, os, importlib.metadata as m; "
            "d = os.path.dirname(dapple.__file__); so = glob.glob(d + '/planner/_core*.so'); "
            "dist = m.distribution('dapple'); url = dist.read_text('direct_url.json'); "
            "print(json.dumps({'package': d, 'installed_from': json.loads(url).get('url') if url else None, "
            "'core_sha256': hashlib.sha256(open(so[0], 'rb').read()).hexdigest() if so else None, "
            "'core_mtime': os.path.getmtime(so[0]) if so else None}))")
    python = Path(dapple).parent / "python3"
    r = subprocess.run([str(python), "-c", code], capture_output=True, text=True, cwd="/")
    try:
        info = json.loads(r.stdout)
    except ValueError:
        return {"error": r.stderr.strip()[-300:]}
    info["core_mtime"] = datetime.datetime.fromtimestamp(info["core_mtime"], datetime.timezone.utc).isoformat(
        timespec="seconds") if info.get("core_mtime") else None
    return info


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--runs", type=int, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--jobs", type=int, default=1, choices=(1, 2))
    ap.add_argument("--log", type=Path, default=None, help="progress log (default: OUT with .log)")
    args = ap.parse_args()
    dapple = shutil.which("dapple")
    if dapple is None:
        raise SystemExit("no dapple on PATH")
    dapple = os.path.realpath(subprocess.run(["pyenv", "which", "dapple"], capture_output=True, text=True).stdout.strip()
                              ) if "/shims/" in dapple and shutil.which("pyenv") else dapple
    log_path = args.log or args.out.with_suffix(".log")
    records_path = args.out.with_suffix(".runs.jsonl")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    log_file = open(log_path, "w")

    def log(msg: str):
        line = f"{datetime.datetime.now(datetime.timezone.utc):%H:%M:%S} {msg}"
        print(line, flush=True)
        log_file.write(line + "\n")
        log_file.flush()

    work_root = Path(f"/tmp/dapple-cli-fuzz-{args.seed}")
    if work_root.exists():
        subprocess.run(["chmod", "-R", "u+w", str(work_root)], check=False)
        shutil.rmtree(work_root)
    work_root.mkdir()
    started = datetime.datetime.now(datetime.timezone.utc)
    load_before = os.getloadavg()
    version = subprocess.run([dapple, "--version"], capture_output=True, text=True).stdout.strip()
    build_before = installed_build(dapple)
    log(f"{version} at {dapple}; seed {args.seed}, {args.runs} runs, {args.jobs} at a time; load {load_before}")
    try:
        fx = Fixtures(work_root, dapple, log)
        fx.build()
        fx_before = snapshot(os.fsencode(fx.dir))
        options = help_options(dapple)
        seeder = random.Random(args.seed)
        seeds = [seeder.getrandbits(64) for _ in range(args.runs)]
        runs_dir = work_root / "runs"
        runs_dir.mkdir()
        results: list[Result | None] = [None] * args.runs
        t0 = time.monotonic()
        done = 0
        n_viol = 0
        core_so = Path(build_before.get("package", "/nonexistent")) / "planner"
        core_files = sorted(core_so.glob("_core*.so"))

        def core_mtime():
            return os.path.getmtime(core_files[0]) if core_files and core_files[0].exists() else None

        mtime0 = core_mtime()
        build_changes = []
        with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool, open(records_path, "w") as rec:
            futures = {pool.submit(execute, i, s, fx, dapple, runs_dir): i for i, s in enumerate(seeds)}
            for fut in concurrent.futures.as_completed(futures):
                r = fut.result()
                results[r.index] = r
                done += 1
                n_viol += bool(r.violations)
                rec.write(json.dumps({k: v for k, v in r.__dict__.items() if k != "stderr_tail"},
                                     ensure_ascii=False) + "\n")
                rec.flush()
                if r.violations:
                    log(f"run {r.index}: VIOLATION {r.violations[0][:200]} :: {r.argv[:300]}")
                if done % 100 == 0 or done == args.runs:
                    if core_mtime() != mtime0:
                        build_changes.append({"noticed_after_runs": done, "core_mtime": core_mtime()})
                        log(f"the installed dapple changed (core mtime {core_mtime()}) after {done} runs")
                        mtime0 = core_mtime()
                    log(f"{done}/{args.runs} runs, {time.monotonic() - t0:.0f} s, {n_viol} with violations, "
                        f"load {os.getloadavg()[0]:.2f}")
        with open(records_path, "w") as rec:
            for r in results:
                rec.write(json.dumps({k: v for k, v in r.__dict__.items() if k != "stderr_tail"},
                                     ensure_ascii=False) + "\n")
        wall = time.monotonic() - t0
        fx_after = snapshot(os.fsencode(fx.dir))
        fixture_changes = sorted(arg_text(p) for p in set(fx_before) | set(fx_after)
                                 if fx_before.get(p) != fx_after.get(p))
    finally:
        subprocess.run(["chmod", "-R", "u+w", str(work_root)], check=False)
        shutil.rmtree(work_root, ignore_errors=True)  # the sparse files go with it
    load_after = os.getloadavg()
    by_command = collections.Counter(r.command for r in results)
    by_exit = collections.Counter(str(r.exit) for r in results)
    by_command_exit = {c: dict(sorted(collections.Counter(str(r.exit) for r in results if r.command == c).items()))
                       for c in sorted(by_command)}
    seen = collections.defaultdict(set)
    for r in results:
        words = shlex.split(r.argv)[1:]
        cmd = " ".join(words[:2]) if words[:1] in (["topology"], ["profile"]) else (words[0] if words else "")
        seen[cmd] |= {w.split("=")[0] for w in words if w.startswith("--")}
    not_covered = {c: sorted(opts - seen.get(c, set())) for c, opts in options.items() if opts - seen.get(c, set())}
    tags = collections.Counter(t.split(":")[0] + ":" + t.split(":")[1] if t.count(":") else t
                               for r in results for t in r.tags)
    violations = [r.__dict__ for r in results if r.violations]
    kinds: dict[str, dict] = {}
    for r in results:
        for text in r.violations:
            if text.startswith("note:"):
                continue
            kind = re.sub(r"\d+(\.\d+)?", "N", re.split(r"[:(]", text)[0]).strip()
            k = kinds.setdefault(kind, {"count": 0, "commands": collections.Counter(), "first": r.argv})
            k["count"] += 1
            k["commands"][r.command] += 1
    slowest = sorted(results, key=lambda r: -r.wall_s)[:10]
    doc = {
        "script": "benchmarks/cli_fuzz_campaign.py",
        "command": f"python benchmarks/cli_fuzz_campaign.py --seed {args.seed} --runs {args.runs} --out {args.out} "
                   f"--jobs {args.jobs}",
        "seed": args.seed,
        "runs": args.runs,
        "jobs": args.jobs,
        "dapple": {"version": version, "path": dapple, "build_before": build_before,
                   "build_after": installed_build(dapple)},
        "machine": {"cpu_count": os.cpu_count(), "load_average_before": [round(x, 2) for x in load_before],
                    "load_average_after": [round(x, 2) for x in load_after], "platform": platform.platform(),
                    "python": platform.python_version(), "user_is_root": os.geteuid() == 0},
        "date": {"started_utc": started.isoformat(timespec="seconds"),
                 "ended_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")},
        "installed_build_changes": build_changes,
        "fixtures_s": round(fx.built_s, 1),
        "wall_s": round(wall, 1),
        "limits": {"timeout_s": TIMEOUT_S, "slow_s": SLOW_S,
                   "address_space_cap_gib_without_torch": ADDRESS_SPACE_CAP >> 30},
        "counts_by_command": dict(sorted(by_command.items())),
        "counts_by_exit_code": dict(sorted(by_exit.items(), key=lambda kv: int(kv[0]))),
        "counts_by_command_and_exit_code": by_command_exit,
        "input_and_output_kinds": dict(sorted(tags.items())),
        "options_never_drawn": not_covered,
        "fixture_files_changed": fixture_changes,
        "fixture_findings": fx.findings,
        "written_files_read_back": sum(r.files_read_back for r in results),
        "slowest": [{"index": r.index, "wall_s": r.wall_s, "exit": r.exit, "argv": r.argv} for r in slowest],
        "violation_count": len(violations),
        "violation_kinds": {k: {**v, "commands": dict(v["commands"])} for k, v in sorted(kinds.items())},
        "violations": violations,
        "records": str(records_path),
        "notes": NOTES,
    }
    args.out.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
    log(f"done: {args.runs} runs in {wall:.0f} s, {len(violations)} with violations; results in {args.out}")


NOTES = [
    "Each run: the installed dapple as a subprocess, in a fresh folder (removed after), 30 s wall-clock limit; "
    "a violation is exit 1 or outside README's table, a signal, a Traceback or 'internal error', more than one "
    "non-empty stderr line on failure (progress lines aside: gloo's, dapple run's step lines, topology measure's "
    "table, profile model's bar, export's 'approximated:'), over 20 s, processes left behind, a special output "
    "place changed or created, a file changed or left by a failed run, a temporary file left, a written file that "
    "does not read back (strict JSON and dapple's own reader, PNG/SVG ends, TOML, CSV), --json output that does not "
    "parse.",
    "--search-space full is never drawn on clusters of 3 to 4 machines of 8 GPUs (3x8, 4x8) nor 8x4: there the "
    "full space is a legitimate search of 15 s to minutes, not a defect. 8x8 and other sizes between 32 and 256 "
    "GPUs are not in the spec pool; 32x8 and 64x8 with full are.",
    "dapple run, profile model and topology measure start torch processes; they are drawn with tiny settings "
    "(GPT of 2 layers of width 16, digits of 2 layers of width 16, 1 or 2 steps, 2 or 3 measuring processes, "
    "message sizes up to 64 KiB), and with bad values past the ranges, not with valid values that ask for "
    "large work (millions of steps, a slowdown of 1000, 128 processes, batch sizes of millions), which would "
    "be slow by request, not by defect.",
    "`dapple`, `dapple topology` and `dapple profile` alone print their help on stderr with exit 2 by design "
    "(main.py, NoArgsIsHelpError); that help is not counted as a multi-line error.",
    "The whole shipped Table V suite (15 plans, about 14 s alone) is not drawn for regress: suites of 1 to 3 "
    "cases are.",
    "Runs that start no torch run under an address-space cap of 8 GiB (prlimit) so that two at once cannot "
    "exhaust this machine's memory; a violation near the cap says so.",
    "The campaign runs as root, so a folder without write permission does not stop writes; /sys and /proc stand "
    "for read-only folders.",
]


if __name__ == "__main__":
    main()
