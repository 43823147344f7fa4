"""dapple's estimates of measured training runs at scale, against the figures
their authors published (`../shared/reference/published-runs.json`).

    python benchmarks/published_runs.py [--runs FILE] [--out benchmarks/results/published_runs.json] [--own-plans]
    python benchmarks/published_runs.py --table   # docs/published-runs.md's tables, from the results file

Each dense run is written as a dapple plan as
it was published (``planner.megatron_plan``: its tensor, context, pipeline and data
degrees, micro-batch size, re-computation, sharding; interleaved over its
virtual stages where it gives them, ``planner.chunked``), on a profile that
``dapple profile transformer`` writes of its model at its sequence length
on its GPU type (operator by operator: no efficiency is given), and costed
by dapple's simulator. What the run's paper leaves unsaid, and what dapple
cannot express yet, is assumed as the row's ``assumptions`` say. The
published iteration time is the paper's, or derived from its FLOP rate as
the row says. The shared file is the test of the cost model: nothing in it
sets a constant of dapple's (docs/published-runs.md).

With ``--own-plans`` each row also gets ``dapple plan``'s own plan for the
same model, cluster and global batch (the search, run at its defaults).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from plan_speed import build_info, machine_info  # noqa: E402

DEFAULT_RUNS = HERE.parent.parent / "shared" / "reference" / "published-runs.json"
DEFAULT_OUT = HERE / "results" / "published_runs.json"

#: The catalog's type of each run's GPU, as the shared file names it.
GPU_OF = {"A100-SXM4-80GB": "A100-80GB", "A100 80GB": "A100-80GB", "H100-SXM 80GB HBM3, 700W": "H100-80GB"}


#: Gbit/s of one unit the shared file writes a network's bandwidth in.
GBITS_PER = {"Gb/s": 1.0, "GB/s": 8.0}


def machine_network_gbps(node: str) -> float | None:
    """A machine's network, Gbit/s, as the shared file's ``hardware.node``
    writes it ("8x200Gb/s HDR IB per node", "4x Omni-Path 100Gb/s per node",
    "RoCE 400Gb/s per GPU", "IB 50 GB/s per GPU", "IB 8x50 GB/s"), for
    machines of 8 GPUs; None where it names none."""
    links = re.search(r"(\d+)\s*x\s*(?:[A-Za-z-]+\s+)?(\d+(?:\.\d+)?)\s*(Gb/s|GB/s)", node)
    if links:
        return int(links[1]) * float(links[2]) * GBITS_PER[links[3]]
    per_gpu = re.search(r"(\d+(?:\.\d+)?)\s*(Gb/s|GB/s) per GPU", node)
    if per_gpu:
        return 8 * float(per_gpu[1]) * GBITS_PER[per_gpu[2]]
    return None


def topology_of(run: dict, gpu: str) -> tuple[str, list[str]]:
    """The run's cluster as a topology spec: machines of 8 GPUs of the
    catalog's type, with its usual server's links unless the run's
    machines had another network, and what that assumes."""
    from dapple import planner

    spec = f"{run['hardware']['count'] // 8}x8-{gpu.lower()}"
    network = machine_network_gbps(run["hardware"].get("node") or "")
    usual = planner.Topology.from_spec(spec).data["inter_machine"]["bandwidth_gbps"]
    if network is None or network == usual:
        return spec, []
    return f"{spec}-nvlink-{network:g}gbps", [
        f"network {network:g} Gbit/s a machine, as hardware.node writes it ({run['hardware']['node']}), "
        f"where the type's usual server has {usual:g}; collectives at NCCL's measured share of InfiniBand"]


def model_config(run: dict) -> tuple[dict, list[str]]:
    """The run's model as a Hugging Face config, and what that assumes."""
    m = run["model"]
    assumptions = []
    if "GQA" in m.get("arch", "") or "SwiGLU" in m.get("arch", ""):
        config = {"hidden_size": m["hidden"], "intermediate_size": m["ffn"], "num_attention_heads": m["heads"],
                  "num_key_value_heads": m["kv_heads"], "num_hidden_layers": m["layers"], "vocab_size": m["vocab"],
                  "hidden_act": "silu"}
    else:
        ffn = m.get("ffn") or 4 * m["hidden"]
        if m.get("ffn") is None:
            assumptions.append(f"MLP width 4h = {ffn} (the file gives none)")
        config = {"n_embd": m["hidden"], "n_inner": ffn, "n_head": m["heads"], "n_layer": m["layers"],
                  "vocab_size": m["vocab"], "n_positions": m["seq_len"], "activation_function": "gelu_new"}
        if "ALiBi" in m.get("arch", ""):
            assumptions.append("ALiBi and the embedding LayerNorm written as GPT's learned positions "
                               f"({m['seq_len']} x {m['hidden']} parameters, 0.02% of the model)")
        if run["id"].startswith("bloom"):
            config.update(resid_pdrop=0.0, attn_pdrop=0.0)
            assumptions.append("no dropout (bigscience/bloom's config.json sets hidden_dropout and "
                               "attention_dropout to 0.0; recalled, not in the shared file)")
        else:
            assumptions.append("hidden and attention dropout 0.1 (Megatron-LM's defaults, --hidden-dropout and "
                               "--attention-dropout; the paper does not say)")
    return config, assumptions


#: Runs measured twice, as a baseline and as the paper's own method
#: (Korthikanti et al.'s Table 5): each variant's recompute field and the
#: measured figure it is compared with.
VARIANTS = {"full": ("full", "iteration_time_s_full_recompute"),
            "sp-selective": ("selective + sequence parallel", "iteration_time_s_sp_selective")}


def variants(run: dict) -> list[tuple[str, str | None]]:
    """The rows a run gives: (id suffix, variant of ``VARIANTS``), or one
    row of the run as it is (``("", None)``)."""
    if str(run["layout"].get("recompute", "")).startswith("baseline: full; present work"):
        return [(f"-{name}", name) for name in VARIANTS]
    return [("", None)]


def layout(run: dict, variant: str | None = None) -> tuple[dict, list[str], list[str]]:
    """The run's layout as dapple takes it (as ``variant`` ran it), what
    that assumes, and what the run had that dapple cannot express yet (the
    estimate leaves it out)."""
    lay = dict(run["layout"])
    if variant is not None:
        lay["recompute"] = VARIANTS[variant][0]
        # Korthikanti et al.'s baseline is Megatron-LM before their work: no sequence parallelism.
        lay["sequence_parallel"] = variant == "sp-selective"
    assumptions, missing = [], []
    mbs = lay.get("mbs")
    if mbs is None:
        mbs = 1
        assumptions.append("micro-batch size 1 (the paper gives none)")
    recompute = str(lay.get("recompute", "none"))
    full = recompute.startswith(("full", "baseline: full"))
    selective = recompute.startswith("selective")
    if selective:
        assumptions.append("selective re-computation of the attention core (Megatron-LM's "
                           "--recompute-granularity selective)")
    if full:
        assumptions.append("full re-computation a layer at a time (Megatron-LM's --checkpoint-activations with "
                           "--checkpoint-num-layers 1, its default; DeepSpeed's activation checkpointing of "
                           "each layer in Megatron-DeepSpeed)")
    zero = str(lay.get("zero", "none"))
    shard_level, reshard_after_forward = (1 if zero.startswith("ZeRO-1") else 0), False
    if "FSDP" in str(lay.get("dp_kind", "")):
        # "shards optimizer states and grads; params not resharded after
        # forward", under a pipeline of 16 stages with "FP32 grad
        # accumulation" (the file's precision): the gradients accumulate
        # whole over the micro-batches and are reduce-scattered once, after
        # the last backward, as torch's pipeline stages run FSDP
        # (torch/distributed/pipelining/stage.py, backward_maybe_with_nosync:
        # gradient sync on the last backward only). That is sharding level 1
        # (docs/cost-model.md, "Sharding": one reduce-scatter and one weight
        # gather an iteration); level 2 would reduce-scatter every
        # micro-batch's gradients.
        shard_level = 1
        assumptions.append("FSDP under a pipeline as sharding level 1: the gradients accumulated whole over the "
                           "micro-batches and reduce-scattered once after the last backward, the weights gathered "
                           "once a step and kept (torch's pipeline stages defer FSDP's gradient sync to the last "
                           "backward; the paper accumulates gradients in FP32 over micro-batches)")
    gradients, why = gradients_of(run)
    assumptions.append(why)
    gbs = lay.get("gbs_seq")
    if gbs is None:
        gbs = lay["batch_per_dp"] * lay["dp"]
        assumptions.append(f"global batch {gbs} sequences: {lay['batch_per_dp']} per data-parallel replica x "
                           f"{lay['dp']} replicas ({lay.get('tokens_per_batch', '?')} tokens)")
    vpp = lay.get("vpp")
    schedule = str(lay.get("schedule", ""))
    interleaving_unstated = vpp is None and schedule.startswith("interleaved") and lay["pp"] > 1
    if interleaving_unstated:
        missing.append("interleaving (the paper gives no virtual-stage count; costed as 1F1B, and beside it at "
                       "every count that divides a rank's layers, up to one layer a virtual stage: interleavings)")
    if lay["pp"] > 1 and "GQA" not in run["model"].get("arch", ""):
        missing.append("the tied word embedding's gradient all-reduce between the first and the last stage, once an "
                       "iteration (Megatron-LM's _allreduce_embedding_grads, DeepSpeed's ReduceTiedGrads)")
    if runs_deepspeed_bf16(lay):
        missing.append("DeepSpeed's pipeline order, whose sends and receives block both sides "
                       "(benchmarks/deepspeed_sends.py replays it on this row's stage times)")
        missing.append("BF16_Optimizer's all-reduce of the fp32 gradients ahead of its sharded step, where ZeRO-1 is "
                       "costed as a reduce-scatter: 8 bytes a parameter moved where 4 are priced")
    sequence_parallel = bool(lay.get("sequence_parallel"))
    # Llama 3's file does not say; the estimate says what the layout
    # would need without it (`estimate_run`).
    sequence_parallel_assumed = "sequence_parallel" not in lay and run["id"].startswith("llama3") and lay["tp"] > 1
    sequence_parallel |= sequence_parallel_assumed
    context_parallel = lay.get("cp", 1)
    if context_parallel > 1:
        assumptions.append(f"context parallelism {context_parallel} as a ring of keys and values beside the "
                           "attention core (TransformerEngine's, torch's); the run gathered them whole before "
                           f"attention ({lay.get('cp_impl', 'the file does not say')}): the same bytes, exposed")
    if lay.get("dp_overlap"):
        assumptions.append(f"data-parallel gradient AllReduce: {lay['dp_overlap']}")
    overlap = runtime_overlap(run, lay)
    assumptions.append(overlap.pop("why"))
    return ({"tensor_parallel": lay["tp"], "pipeline_parallel": lay["pp"], "micro_batch_size": mbs,
             "recompute": "per-layer" if full else "selective" if selective else "none",
             "sequence_parallel": sequence_parallel, "shard_level": shard_level,
             "reshard_after_forward": reshard_after_forward, "global_batch": gbs, "gradients": gradients,
             "context_parallel": context_parallel,
             "chunks": vpp, "interleaving_unstated": interleaving_unstated,
             "sequence_parallel_assumed": sequence_parallel_assumed, **overlap}, assumptions, missing)


def runs_deepspeed_bf16(lay: dict) -> bool:
    """Whether the run trained under DeepSpeed's pipeline engine with its
    bf16 optimizer (the file's ``zero`` names ``BF16Optimizer``: BLOOM)."""
    return "BF16Optimizer" in str(lay.get("zero", ""))


def gradients_of(run: dict) -> tuple[str, str]:
    """The precision the run's runtime accumulated and reduced gradients in
    (the profile's ``--gradients``: their memory, the bytes reduced and
    Adam's read of them), and where that comes from."""
    lay = run["layout"]
    if "FP32 grad" in str(lay.get("precision", "")):
        return "fp32", ("gradients accumulated over the micro-batches and reduce-scattered in FP32, 4 bytes a "
                        "parameter (the file's precision)")
    if runs_deepspeed_bf16(lay):
        return "fp32", ("gradients accumulated and all-reduced in FP32, 4 bytes a parameter, whole on every GPU: "
                        "DeepSpeed's BF16_Optimizer keeps fp32 gradient buffers and reduces them "
                        "(deepspeed/runtime/bf16_optimizer.py, get_grads_for_reduction, as added for bf16 pipelines "
                        "in 56c5223, 2022-04-19, during BLOOM's training)")
    repo = run["source"].get("repo", "")
    if repo.startswith("NVIDIA-NeMo/Megatron-Bridge"):
        return "bf16", ("gradients reduced in bf16 (NVIDIA-NeMo/Megatron-Bridge@27dfb3d "
                        "scripts/performance/configs/deepseek/deepseek_v3_llm_pretrain.py sets "
                        "grad_reduce_in_fp32 = False in every DeepSeek-V3 config)")
    if "Megatron-MoE-ModelZoo" in repo:
        return "fp32", ("gradients accumulated and reduced in fp32: the recipe gives --bf16 without "
                        "--grad-reduce-in-bf16, and Megatron-LM then sets --accumulate-allreduce-grads-in-fp32 "
                        "(megatron/training/arguments.py: \"bfloat16 requires gradient accumulation and "
                        "all-reduce to be done in fp32\")")
    return "bf16", (f"gradients in the weights' 2 bytes (the file's precision: {lay.get('precision', 'not given')}; "
                    "nothing of the gradients)")


def runtime_overlap(run: dict, lay: dict) -> dict:
    """What the run's software hid behind computation (``docs/cost-model.md``,
    "Overlap"), as ``planner.megatron_plan`` takes it, and why."""
    if "FSDP" in str(lay.get("dp_kind", "")):
        return {"overlap_grad_reduce": "every-stage", "overlap_param_gather": True,
                "why": "FSDP's gradient reduce-scatter behind each stage's last backward and its weight gather "
                       "ahead of the forward (torch FSDP's overlap; the paper does not say otherwise)"}
    if runs_deepspeed_bf16(lay):
        why = "gradients reduced after the last backward (DeepSpeed's pipeline engine, _exec_reduce_grads)"
    else:
        why = ("gradients reduced after the backward, none hidden (Megatron-LM of 2021-2022 under its default "
               "--DDP-impl local: train_step all-reduces after forward_backward_func)")
    return {"overlap_grad_reduce": "none", "overlap_param_gather": False, "why": why}


def published_seconds(run: dict, model_flops_per_sample: float, global_batch: int,
                      variant: str | None = None) -> tuple[float, str]:
    """The run's published iteration time (of ``variant``), or one derived
    from its rate."""
    measured, derived = run["measured"], run.get("derived") or {}
    keys = (VARIANTS[variant][1],) if variant else ("iteration_time_s_full_recompute", "iteration_time_s")
    for key in keys:
        if key in measured:
            return measured[key], f"measured.{key}"
    if "iteration_time_s" in derived:
        return derived["iteration_time_s"], "derived.iteration_time_s (the file's, from the published TFLOP/s)"
    tflops = measured["tflops_per_gpu"]
    seconds = model_flops_per_sample * global_batch / (tflops * 1e12 * run["hardware"]["count"])
    return seconds, (f"derived here: dapple's model FLOPs per sample (3 x the forward, attention's whole s^2 "
                     f"product) x {global_batch} / ({tflops} TFLOP/s x {run['hardware']['count']} GPUs)")


@dataclasses.dataclass
class Published:
    """A run's layout as published, written as a dapple plan on a profile of
    its model, and what that assumes and leaves out."""

    plan: object
    profile: object
    gpu: str
    topology: str
    shape: dict
    assumptions: list[str]
    missing: list[str]


def published_plan(run: dict, folder: Path, variant: str | None = None) -> Published:
    """``run`` (as ``variant`` ran it) as a dapple plan: its profile written
    under ``folder``, its layout by ``planner.megatron_plan``."""
    from dapple import planner

    gpu = GPU_OF[run["hardware"]["gpu"]]
    topology, assumptions = topology_of(run, gpu)
    config, more = model_config(run)
    assumptions += more
    shape, more, missing = layout(run, variant)
    assumptions += more
    # FlashAttention arrived in 2022 (arXiv 2205.14135); the Megatron-LM,
    # Korthikanti and BLOOM runs predate it in their codebases.
    attention = "flash" if run["id"].startswith("llama3") else "unfused"
    assumptions.append(f"attention: {attention}")
    path = folder / f"{run['id']}.json"
    path.write_text(json.dumps(config))
    profile = planner.transformer_profile(path, gpu=gpu, seq_len=run["model"]["seq_len"],
                                          micro_batch_sizes=[shape["micro_batch_size"]], attention=attention,
                                          gradients=shape["gradients"])

    def as_published(sequence_parallel: bool):
        return planner.megatron_plan(
            profile, topology, shape["global_batch"], tensor_parallel=shape["tensor_parallel"],
            pipeline_parallel=shape["pipeline_parallel"], micro_batch_size=shape["micro_batch_size"],
            shard_level=shape["shard_level"], reshard_after_forward=shape["reshard_after_forward"],
            sequence_parallel=sequence_parallel, context_parallel=shape["context_parallel"],
            recompute=shape["recompute"], overlap_grad_reduce=shape["overlap_grad_reduce"],
            overlap_param_gather=shape["overlap_param_gather"])

    plan = as_published(shape["sequence_parallel"])
    if shape["sequence_parallel_assumed"]:
        whole = as_published(False).estimate["peak_memory_bytes"] / 2**30
        assumptions.append(f"sequence parallelism with its tensor parallelism (the file does not say; without it "
                           f"the layout would need {whole:.0f} GiB a GPU)")
    if shape["chunks"]:
        plan = planner.chunked(plan, profile, "interleaved-1f1b", shape["chunks"])
    return Published(plan, profile, gpu, topology, shape, assumptions, missing)


def estimate_run(run: dict, folder: Path, own_plans: bool, variant: tuple[str, str | None] = ("", None)) -> dict:
    from dapple import planner

    suffix, variant = variant
    row = {"id": run["id"] + suffix, "source": f"{run['source']['paper']}, {run['source']['location']}"}
    count = run["hardware"]["count"]
    published = published_plan(run, folder, variant)
    plan, profile, shape = published.plan, published.profile, published.shape
    gpu, topology, assumptions, missing = published.gpu, published.topology, published.assumptions, published.missing
    started = time.perf_counter()
    simulated_ms = planner.simulate(plan, profile).iteration_ms
    seconds, published_from = published_seconds(run, profile.data["model_flops_per_sample"], shape["global_batch"],
                                                 variant)
    row.update(
        model=run["model"]["name"], gpu=gpu, gpus=count, topology=topology,
        layout={k: v for k, v in shape.items()
                if k not in ("global_batch", "interleaving_unstated", "sequence_parallel_assumed")},
        global_batch=shape["global_batch"],
        schedule=plan.data["schedule"]["kind"], dapple_s=simulated_ms / 1e3, published_s=seconds,
        published_from=published_from, ratio=simulated_ms / 1e3 / seconds,
        # What the paper gives beside its time, for docs/published-runs.md (generated from this file alone).
        published_tflops_per_gpu=run["measured"].get("tflops_per_gpu",
                                                     run["measured"].get("tflops_per_gpu_hardware")),
        vocab=run["model"]["vocab"], hidden=run["model"]["hidden"],
        mfu=plan.estimate.get("mfu"), peak_memory_gib=plan.estimate["peak_memory_bytes"] / 2**30,
        fits_memory=plan.estimate["fits_memory"], assumptions=assumptions, not_modelled=missing,
        simulate_s=time.perf_counter() - started,
    )
    if shape["interleaving_unstated"]:
        row["interleavings"] = interleavings(plan, profile, shape["pipeline_parallel"], seconds)
    if own_plans:
        started = time.perf_counter()
        # The same runtime: what it hides behind computation, as the row's.
        own = planner.plan(profile, topology, shape["global_batch"], overlap_grad_reduce=shape["overlap_grad_reduce"],
                           overlap_param_gather=shape["overlap_param_gather"])
        row["own_plan"] = {"simulated_s": planner.simulate(own, profile).iteration_ms / 1e3,
                           "shape": own.shape, "stages": len(own.stages), "schedule": own.data["schedule"]["kind"],
                           "micro_batch_size": own.micro_batch_size, "plan_s": time.perf_counter() - started}
    return row


def interleavings(plan, profile, ranks: int, published_s: float) -> list[dict]:
    """``plan`` (1F1B over ``ranks`` ranks) interleaved at every count of
    virtual stages that divides a rank's share of the profile's layers
    evenly (Megatron-LM requires a rank's layers to divide into its virtual
    stages), up to one layer a virtual stage, the most any count can: with
    1F1B, what a run whose paper gives no virtual-stage count may have run.
    Costed and simulated as the row is."""
    from dapple import planner

    finest = len(profile.data["layers"]) // ranks
    costed = []
    for chunks in (c for c in range(2, finest + 1) if finest % c == 0):
        interleaved = planner.chunked(plan, profile, "interleaved-1f1b", chunks)
        simulated = planner.simulate(interleaved, profile)
        costed.append({"chunks": chunks, "dapple_s": simulated.iteration_ms / 1e3,
                       "ratio": simulated.iteration_ms / 1e3 / published_s,
                       "peak_memory_gib": interleaved.estimate["peak_memory_bytes"] / 2**30,
                       "fits_memory": interleaved.estimate["fits_memory"]})
    return costed


def memory_cell(gib: float, fits: bool) -> str:
    return f"{gib:.1f}{'' if fits else ' (over)'}"


def subtable(rows: list[dict], key: str, header: str, alignment: str, cells) -> list[str]:
    """A table of the rows that have ``key``, after a blank line: the run's
    id, then ``cells(row, row[key])``; none where no row has it."""
    having = [r for r in rows if key in r]
    if not having:
        return []
    return ["", f"| {header} |", f"|---|{alignment}|"] + [f"| {r['id']} | {cells(r, r[key])} |" for r in having]


def table(results: dict) -> str:
    rows = results["rows"]
    lines = ["| run | GPUs | layout (t, c, p, d, b, rc) | dapple s | published s | ratio | memory GiB |",
             "|---|--:|---|--:|--:|--:|--:|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['id']} | | | {r['error']} | | | |")
            continue
        lay = r["layout"]
        cp = lay.get("context_parallel", 1)
        d = r["gpus"] // (lay["tensor_parallel"] * cp * lay["pipeline_parallel"])
        v = f" v{lay['chunks']}" if lay.get("chunks") else ""
        c = f" c{cp}" if cp > 1 else ""
        level = lay["shard_level"]
        zero = "" if not level else " zero" if level == 1 else f" zero{level}" + (
            "" if level < 3 or lay["reshard_after_forward"] else " kept")
        sp = " sp" if lay.get("sequence_parallel") else ""
        fp32_gradients = " fp32-grad" if lay.get("gradients") == "fp32" else ""
        lines.append(
            f"| {r['id']} | {r['gpus']} | t{lay['tensor_parallel']}{c} p{lay['pipeline_parallel']}{v} d{d} "
            f"b{lay['micro_batch_size']}{sp} {lay['recompute']}{zero}{fp32_gradients} | {r['dapple_s']:.2f} | "
            f"{r['published_s']:.2f} | {r['ratio']:.2f} | {memory_cell(r['peak_memory_gib'], r['fits_memory'])} |")
    # One line a count, 1F1B (v1) first.
    lines += subtable(
        [{"id": f"{r['id']} | v{c['chunks']}", "costed": c} for r in rows if "interleavings" in r
         for c in [{**r, "chunks": 1}, *r["interleavings"]]],
        "costed", "run (interleaved, virtual stages not given) | virtual stages a rank | dapple s | ratio | memory GiB",
        "--:|--:|--:|--:",
        lambda _, c: f"{c['dapple_s']:.2f} | {c['ratio']:.2f} | {memory_cell(c['peak_memory_gib'], c['fits_memory'])}")
    lines += subtable(
        rows, "own_plan",
        "run | published layout, dapple s | dapple's own plan, s | faster by | its GPUs a stage, kind, micro-batch "
        "| planned in s", "--:|--:|--:|---|--:",
        lambda r, o: f"{r['dapple_s']:.2f} | {o['simulated_s']:.2f} | {r['dapple_s'] / o['simulated_s']:.2f} | "
                     f"{o['shape']}, {o['schedule']}, {o['micro_batch_size']} | {o['plan_s']:.0f}")
    ratios = [r["ratio"] for r in rows if "ratio" in r]
    lines.append("")
    lines.append(f"{len(ratios)} runs: ratios {min(ratios):.2f} to {max(ratios):.2f}, median "
                 f"{statistics.median(ratios):.2f}; within 0.90-1.10: "
                 f"{sum(0.9 <= x <= 1.1 for x in ratios)} of {len(ratios)}.")
    return "\n".join(lines)


def cli(doc: str, default_out: Path, rows_of, table_of) -> None:
    """The command line of a benchmark of published runs: ``rows_of(runs,
    folder, own_plans)`` costs the shared file's runs (a row each, or one
    saying why not) into the results file; ``--table`` prints
    ``table_of(results)`` of that file."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--runs", type=Path, default=DEFAULT_RUNS)
    parser.add_argument("--out", type=Path, default=default_out)
    parser.add_argument("--own-plans", action="store_true")
    parser.add_argument("--table", action="store_true", help="print the tables of the results file and stop")
    args = parser.parse_args()
    if args.table:
        print(table_of(json.loads(args.out.read_text())))
        return
    runs = json.loads(args.runs.read_text())["runs"]
    with tempfile.TemporaryDirectory() as tmp:
        rows = rows_of(runs, Path(tmp), args.own_plans)
    results = {"when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "machine": machine_info(), "build": build_info(), "runs_file": str(args.runs), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp_out = args.out.with_suffix(".tmp")
    tmp_out.write_text(json.dumps(results, indent=1) + "\n")
    os.replace(tmp_out, args.out)
    print(table_of(results))


def dense_rows(runs: list[dict], folder: Path, own_plans: bool) -> list[dict]:
    rows = []
    for run in runs:
        if not str(run["model"].get("arch")).startswith("dense"):
            continue  # experts: benchmarks/published_moe.py
        for variant in variants(run):
            try:
                rows.append(estimate_run(run, folder, own_plans, variant))
            except Exception as e:  # noqa: BLE001  a row that cannot be costed says why
                rows.append({"id": run["id"] + variant[0], "error": f"{type(e).__name__}: {e}"})
            print(json.dumps(rows[-1])[:400], file=sys.stderr)
    return rows


if __name__ == "__main__":
    cli(__doc__, DEFAULT_OUT, dense_rows, table)
