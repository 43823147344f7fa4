"""The table and figures of docs/export.md's "what --for costs", written by
its cog blocks (`cog -I docs -r docs/export.md`; `--check` fails where the
doc differs) from benchmarks/results/targets_cost.json, which
`python benchmarks/targets_cost.py` writes (the table is that benchmark's
own `--table`). No figure here is typed in."""

from __future__ import annotations

import json
import re
import sys
import textwrap
from pathlib import Path

import cog

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import targets_cost  # noqa: E402  the benchmark's own table

RESULTS = json.loads((ROOT / "benchmarks" / "results" / "targets_cost.json").read_text())
ROWS = RESULTS["rows"]
#: Schedules whose ranks hold several chunks, which dapple writes for torch's CSV only.
CHUNKED = ("dualpipev", "zb-v", "interleaved-zero-bubble", "interleaved-1f1b")
#: The shipped configs with experts.
MIXTURES = ("mixtral", "qwen3", "deepseek", "m6-moe")
#: How prose names the configs.
NAMES = {"gpt3-175b": "GPT-3", "llama-2-7b": "Llama-2-7B", "llama-2-13b": "Llama-2-13B",
         "llama-2-70b": "Llama-2-70B", "llama-3-8b": "Llama-3-8B", "llama-3-70b": "Llama-3-70B",
         "llama-3-405b": "Llama-3-405B", "deepseek-v3": "DeepSeek-V3", "m6-moe-1t": "M6-MoE-1T",
         "qwen3-235b-a22b": "Qwen3-235B-A22B", "qwen3-30b-a3b": "Qwen3-30B-A3B", "mixtral-8x7b": "Mixtral-8x7B",
         "m6-moe-100b": "M6-MoE-100B",
         "m6-moe-10t": "M6-MoE-10T"}
TARGETS = ("megatron", "deepspeed", "torchtitan", "torch")


def prose(text: str) -> None:
    cog.outl(textwrap.fill(text, width=76, break_long_words=False, break_on_hyphens=False))


def x(v: float) -> str:
    return f"{v:.2f}x"


def span(values) -> str:
    lo, hi = x(min(values)), x(max(values))
    return lo if lo == hi else f"{lo} to {hi}"


def words(items) -> str:
    items = list(items)
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def row(config: str, cluster: str, target: str) -> dict:
    return next(r for r in ROWS if (r["config"], r["cluster"], r["target"]) == (config, cluster, target))


def costed(where) -> list[dict]:
    return [r for r in ROWS if "cost" in r and where(r)]


def dense(r: dict) -> bool:
    return not r["config"].startswith(MIXTURES)


def header() -> None:
    build = RESULTS["build"]
    dirty = " (with uncommitted changes to the core's sources)" if build.get("uncommitted_core_changes") else ""
    clusters = words(f"{gpu.split('-')[0]}s on {spec.split('-')[0]}" for gpu, spec in targets_cost.CLUSTERS.items())
    prose(f"What that costs on the shipped transformer configs (`benchmarks/targets_cost.py`, "
          f"`benchmarks/results/targets_cost.json`, written {RESULTS['when'][:10]} at {build['git_head']}{dirty}; "
          f"global batch {RESULTS['global_batch_size']}, sequence 4096, GPT-3 2048; {clusters}; each profile at "
          "efficiency 0.5):")


def table() -> None:
    cog.outl(targets_cost.table(RESULTS))


def findings() -> None:
    took = costed(lambda r: True)
    exported = all(r["export_refusal"] is None for r in took)
    # Dense models whose free plan holds several chunks a rank.
    chunked = costed(lambda r: dense(r) and r["free_kind"] in CHUNKED)
    sp_refused = {(r["config"], r["cluster"]) for r in took
                  if r["target"] == "torch" and "sequence_parallel" in (r["free_refused"] or "") and r["cost"] > 1.005}
    level_1 = all("sharding level 1" in (r["free_refused"] or "")
                  for r in costed(lambda r: dense(r) and r["target"] == "torchtitan" and ":" not in r["free_shape"]))
    pipelined_targets = [r["cost"] for r in chunked if r["target"] in ("megatron", "torchtitan")]
    deepspeed = [r["cost"] for r in chunked
                 if r["target"] == "deepspeed" and (r["config"], r["cluster"]) not in sp_refused]
    flat = costed(lambda r: dense(r) and r["free_kind"] not in CHUNKED and r["target"] in ("megatron", "deepspeed"))
    nothing = all(abs(r["cost"] - 1) < 0.0005 for r in flat)
    unpiped = costed(lambda r: dense(r) and r["target"] == "torchtitan" and ":" not in r["free_shape"])
    unpiped_names = list(dict.fromkeys(NAMES.get(r["config"], r["config"]) for r in unpiped))
    sp = [r["cost"] for r in took
          if (r["config"], r["cluster"]) in sp_refused and r["target"] in ("torch", "deepspeed")]
    order = [(r["config"], r["cluster"]) for r in ROWS]
    sp_names = list(dict.fromkeys(NAMES.get(c, c) for c, k in order if (c, k) in sp_refused))
    sp_chunked = list(dict.fromkeys(NAMES.get(r["config"], r["config"]) for r in chunked
                                    if r["target"] == "deepspeed" and (r["config"], r["cluster"]) in sp_refused))
    torch_others = costed(lambda r: dense(r) and r["target"] == "torch"
                          and (r["config"], r["cluster"]) not in sp_refused)
    torch_free = all(abs(r["cost"] - 1) < 0.0005 for r in torch_others)
    m6 = [r["cost"] for r in costed(lambda r: r["config"].startswith("m6-moe") and r["target"] != "torch")]
    text = [
        "Each cell is the target's plan's simulated time over the free plan's"
        + ("; every plan a target took exports to it without refusal (the benchmark exports it)." if exported else
           "; a plan marked refused! did not export, a bug."),
        f"Where the free plan of a dense model interleaves chunks (DualPipeV, ZB-V, interleaved zero bubble), "
        f"Megatron-LM and torchtitan cost {span(pipelined_targets)}, and DeepSpeed {span(deepspeed)}"
        + (f" but for {words(sp_chunked)}" if sp_chunked else "")
        + ", as dapple does not write chunked schedules for them yet"
        + ("; where it runs 1F1B, or ZB-H1 ties it, Megatron-LM and DeepSpeed cost nothing." if nothing else "."),
        f"torchtitan costs {span([r['cost'] for r in unpiped])} on the models that need no pipeline "
        f"({words(unpiped_names)})"
        + (": the free plan shards only the optimizer (ZeRO-1), which torchtitan's FSDP runs only as level 3 there."
           if level_1 else "."),
    ]
    if sp:
        text.append(f"torch's runtime and DeepSpeed's pipeline engine run no sequence parallelism, which "
                    f"{words(n + chr(39) + 's' for n in sp_names)} free plans use: without it they cost {span(sp)}"
                    + ("; torch's runtime takes every other dense model's free plan as it is (its schedule CSV "
                       "writes chunked orders too)." if torch_free else "."))
    text.append(f"The mixtures of experts cost most where the free plan gives its stages different expert degrees or "
                f"replica counts (M6-MoE: {span(m6)} for Megatron-LM, DeepSpeed and torchtitan); `--for deepspeed` "
                "takes no plan that spreads experts, since it checks each candidate without the profile that names "
                "them (`dapple export --to deepspeed` takes one, with the plan's profile).")
    text.extend(_no_plan())
    llama = [r["cost"] for r in took if r["config"] == "llama-3-405b" and r["target"] in ("megatron", "torchtitan")]
    text.append(f"Megatron-LM and torchtitan take Llama-3-405B at {span(llama)}: per-layer re-computation and "
                "sequence parallelism are in the search, where before issue 45's cost model its plan re-computed "
                "whole stages, which both refused.")
    prose(" ".join(text))


def _no_plan() -> list[str]:
    """What the table's rows without a plan say."""
    said, unfit = [], {}
    for config, cluster in dict.fromkeys((r["config"], r["cluster"]) for r in ROWS):
        rows = [row(config, cluster, t) for t in TARGETS]
        name = NAMES.get(config, config)
        machines = cluster.split("-")[0]
        gpus = "A100s" if "a100" in cluster else "H100s"
        planned = [r["target"] for r in rows if "cost" in r]
        if planned and len(planned) < len(rows):
            refused = [r for r in rows if "error" in r]
            need = re.search(r"uniform shapes: .*?needs at least ([\d.]+) GiB", refused[0]["error"])
            runtime = {"torch": "torch's runtime", "megatron": "Megatron-LM", "deepspeed": "DeepSpeed",
                       "torchtitan": "torchtitan"}
            said.append(f"{name} on {machines} {gpus} has a plan for {words(runtime[t] for t in planned)} only: "
                        "every other target refuses its stages' different sharding levels or expert degrees"
                        + (f", and Megatron-LM's uniform shapes need {need[1]} GiB a GPU" if need else "")
                        + "; `--for` says so in one line naming each candidate's refusal (exit 4).")
        elif not planned:
            error = rows[0]["error"]
            if "stopped at its limit" in error:
                said.append(f"{name} on {machines} {gpus} stops at the search's step limit at every micro-batch size "
                            "without a plan (the error says to raise it).")
            elif "no plan fits in GPU memory" in error:
                need = re.search(r"at least ([\d.]+) GiB", error)[1]
                unfit.setdefault(name, []).append(f"{need} GiB a GPU on {machines} {gpus}")
    for name, needs in unfit.items():
        clusters = len({r["cluster"] for r in ROWS})
        where = "neither cluster" if len(needs) == clusters == 2 else "no cluster" if len(needs) == clusters else \
            f"{len(needs)} of the clusters"
        said.append(f"{name} fits on {where} (its state alone needs {words(needs)}).")
    return said
