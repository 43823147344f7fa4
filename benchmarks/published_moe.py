"""Published mixture-of-experts runs at scale (`../shared/reference/published-runs.json`:
Qwen3-235B-A22B on 256 H100, DeepSeek-V3 on 1,024 H100), each written as a
dapple plan as it was published and costed by dapple's simulator, against
the step time its authors give or imply.

    python benchmarks/published_moe.py [--runs FILE] [--out benchmarks/results/published_moe.json] [--own-plans]
    python benchmarks/published_moe.py --table   # docs/published-runs.md's MoE tables, from the results file

Each run's model is the shipped config (`profiles/models/`), profiled by
``dapple profile transformer`` on its GPU at its sequence length (operator
by operator, FlashAttention); its layout is ``planner.megatron_plan``'s at
its tensor, pipeline, expert and expert tensor degrees, interleaved over its
virtual stages (``planner.chunked``). What the run had that dapple cannot
express is listed per row (``not_modelled``), with what the simulated time
would be without the token exchange (``no_exchange_s``: the same plan on a
profile whose all-to-all bytes are 0), which shows how much of the gap the
exchange's pricing holds, and with NCCL's all-to-all in place of the run's
deduplicating dispatcher (``all_to_all_s``). Nothing here sets a constant
of dapple's.

With ``--own-plans`` each row also gets ``dapple plan``'s own plan for the
same model, cluster and global batch.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from published_runs import cli, gradients_of, topology_of  # noqa: E402

DEFAULT_OUT = HERE / "results" / "published_moe.json"
MODELS = HERE.parent / "profiles" / "models"

#: The shared file's model names, as the shipped configs name them.
CONFIG_OF = {"Qwen3-235B-A22B": "qwen3-235b-a22b", "DeepSeekV3": "deepseek-v3"}
#: The catalog's type of each run's GPU.
GPU_OF = {"H100": "H100-80GB", "H100 (DGX-H100)": "H100-80GB"}


def config_name(run: dict) -> str | None:
    name = run["model"]["name"]
    return next((config for prefix, config in CONFIG_OF.items() if name.startswith(prefix)), None)


def layout(run: dict) -> tuple[dict, list[str], list[str]]:
    """The run's layout as ``planner.megatron_plan`` takes it, what that
    assumes, and what the run had that dapple does not model."""
    lay = run["layout"]
    assumptions, missing = [], []
    etp = lay.get("etp")
    if etp is None:
        etp = 1
        assumptions.append("expert tensor degree 1 (the file gives none; Megatron-MoE-ModelZoo's DeepSeek-V3 "
                           "benchmarking config sets --expert-tensor-parallel-size 1)")
    recompute = str(lay.get("recompute", "none"))
    if "recompute" not in lay:
        assumptions.append("no re-computation (the row gives none)")
    elif recompute != "none":
        assumptions.append(f"re-computation \"{recompute}\" costed as none: Megatron-LM's --recompute-modules "
                           "re-run the norms and the experts' activation (memory-bound), which dapple's "
                           "selective re-computation (the attention core) does not name; the time is low by "
                           "their re-run, the memory high by what they drop")
    assumptions += [
        "sequence parallelism with the tensor parallelism (Megatron-LM asserts it with experts)",
        "distributed optimizer (ZeRO-1) with --overlap-grad-reduce and --overlap-param-gather "
        "(Megatron-MoE-ModelZoo's benchmarking configs)",
        "routing balanced (the Qwen3 recipe's --moe-router-force-load-balancing; the Bridge row says "
        "force-balanced)",
        "stages of equal blocks, interleaved over the virtual stages (the runs place the embedding and the "
        "loss in the pipeline split, --account-for-embedding-in-pipeline-split or a layout string)",
    ]
    dispatcher = lay.get("dispatcher", "")
    if dispatcher:
        assumptions.append(f"the row's dispatcher, {dispatcher}, as dapple's deepep (a token crosses the network "
                           "once to each machine holding some of its experts)")
    else:
        dispatcher = "DeepEP"
        assumptions.append(
            "dispatcher DeepEP (the row does not say; it says dropless and force-balanced, which in "
            "NVIDIA-NeMo/Megatron-Bridge@27dfb3d scripts/performance/configs/deepseek/deepseek_v3_llm_pretrain.py "
            "is deepseek_v3_h100_bf16_config: enable_deepep=True, moe_router_force_load_balancing; its FP8 config "
            "drops tokens over the all-to-all dispatcher instead. That file's version may not be the 25.09 one)")
        missing.append("the exchange hidden behind the other micro-batch's computation (that config's "
                       "a2a_1f1b, --overlap-moe-expert-parallel-comm), and its re-computation of MLA's up "
                       "projection and the MLP (recompute_modules, which lowers the memory dapple counts)")
    if config_name(run) == "deepseek-v3":
        assumptions.append("group-limited routing from the shipped config (n_group 8, topk_group 4: a token's "
                           "experts from 4 groups of 32; with 64 GPUs on 8 machines, a group a machine)")
    gradients, why = gradients_of(run)
    assumptions.append(why)
    precision = str(lay.get("precision", "BF16"))
    if precision.startswith("FP8"):
        missing.append(f"FP8 matrix products ({precision}); dapple prices them in BF16")
    if precision == "BF16":
        missing.append("--tp-comm-overlap (the tensor-parallel gathers hidden in the products; the Qwen3 "
                       "recipe's bf16 setting)")
    missing.append("the grouped product's shapes under expert parallelism (a GPU's E/e experts over the "
                   "group's tokens, e et / t times a replica's share each; the profile times all E experts over "
                   "a replica's share, whose tiles fill the SMs' waves already)")
    if run["model"].get("mtp_depth") or config_name(run) == "deepseek-v3":
        missing.append("DeepSeek-V3's multi-token prediction layer")
    gbs = lay["gbs_seq"]
    return ({"tensor_parallel": lay["tp"], "pipeline_parallel": lay["pp"], "micro_batch_size": lay.get("mbs", 1),
             "expert_parallel": lay["ep"], "expert_tensor_parallel": etp,
             "chunks": lay.get("vpp") or lay.get("vp"), "global_batch": gbs, "seq_len": lay["seq_len"],
             "dispatcher": "deepep" if dispatcher.lower() == "deepep" else "all-to-all", "gradients": gradients},
            assumptions, missing)


def published_seconds(run: dict, shape: dict) -> tuple[float, str]:
    """The run's step time: measured, or from its measured tokens a second."""
    measured = run["measured"]
    if "step_time_s" in measured:
        return measured["step_time_s"], "measured.step_time_s"
    per_gpu = measured["tokens_per_s_per_gpu"]
    tokens = shape["global_batch"] * shape["seq_len"]
    return (tokens / (per_gpu * run["hardware"]["count"]),
            f"derived here: {shape['global_batch']} x {shape['seq_len']} tokens / ({per_gpu} tokens/s a GPU x "
            f"{run['hardware']['count']} GPUs)")


def published_tflops(run: dict) -> float | None:
    measured = run["measured"]
    value = measured.get("tflops_per_gpu", measured.get("model_tflops_per_gpu"))
    if isinstance(value, str):
        value = float(value.split()[0])
    return value


def simulate(profile_path: Path, topology: str, shape: dict) -> tuple[object, float]:
    from dapple import planner

    plan = planner.megatron_plan(
        str(profile_path), topology, shape["global_batch"], tensor_parallel=shape["tensor_parallel"],
        pipeline_parallel=shape["pipeline_parallel"], micro_batch_size=shape["micro_batch_size"],
        shard_level=1, sequence_parallel=True, recompute="none", overlap_grad_reduce="every-stage",
        overlap_param_gather=True, expert_parallel=shape["expert_parallel"],
        expert_tensor_parallel=shape["expert_tensor_parallel"])
    if shape["chunks"]:
        plan = planner.chunked(plan, str(profile_path), "interleaved-1f1b", shape["chunks"])
    return plan, planner.simulate(plan, str(profile_path)).iteration_ms / 1e3


def estimate_run(run: dict, folder: Path, own_plans: bool) -> dict:
    from dapple import planner
    from dapple.planner.plan import shape_label

    gpu = GPU_OF[run["hardware"]["gpu"]]
    count = run["hardware"]["count"]
    topology, network_assumed = topology_of(run, gpu)
    name = config_name(run)
    shape, assumptions, missing = layout(run)
    assumptions = network_assumed + assumptions
    profile = planner.transformer_profile(MODELS / f"{name}.json", gpu=gpu, seq_len=shape["seq_len"],
                                          micro_batch_sizes=[shape["micro_batch_size"]], attention="flash",
                                          dispatcher=shape["dispatcher"], gradients=shape["gradients"])
    path = folder / f"{run['id']}.json"
    path.write_text(json.dumps(profile.data))
    started = time.perf_counter()
    plan, dapple_s = simulate(path, topology, shape)
    simulate_s = time.perf_counter() - started

    def variant(suffix: str, change) -> float:
        """The same plan on the profile with each block's experts changed."""
        data = json.loads(json.dumps(profile.data))
        for layer in data["layers"]:
            if layer.get("experts"):
                change(layer["experts"])
        changed = folder / f"{run['id']}-{suffix}.json"
        changed.write_text(json.dumps(data))
        return simulate(changed, topology, shape)[1]

    no_exchange_s = variant("no-exchange", lambda e: e.update(all_to_all_bytes_per_sample=0.0))
    all_to_all_s = variant("all-to-all", lambda e: e.pop("dispatcher", None))
    seconds, published_from = published_seconds(run, shape)
    tflops = published_tflops(run)
    row = {
        "id": run["id"], "source": " ".join(str(v) for v in run["source"].values()), "model": name, "gpu": gpu,
        "gpus": count, "topology": topology, "layout": shape, "schedule": plan.data["schedule"]["kind"],
        "dapple_s": dapple_s, "published_s": seconds, "published_from": published_from,
        "ratio": dapple_s / seconds, "no_exchange_s": no_exchange_s, "all_to_all_s": all_to_all_s,
        "published_tflops_per_gpu": tflops,
        # The run's own FLOP count, at dapple's time.
        "dapple_tflops_per_gpu": tflops * seconds / dapple_s if tflops else None,
        "mfu": plan.estimate.get("mfu"), "peak_memory_gib": plan.estimate["peak_memory_bytes"] / 2**30,
        "fits_memory": plan.estimate["fits_memory"], "assumptions": assumptions, "not_modelled": missing,
        "simulate_s": simulate_s,
    }
    if own_plans:
        started = time.perf_counter()
        own = planner.plan(str(path), topology, shape["global_batch"], overlap_grad_reduce="every-stage",
                           overlap_param_gather=True)
        labels = sorted({shape_label(s) for s in own.stage_shapes})
        row["own_plan"] = {"simulated_s": planner.simulate(own, str(path)).iteration_ms / 1e3,
                           "shape": own.shape, "stage_shapes": labels, "stages": len(own.stages),
                           "schedule": own.data["schedule"]["kind"],
                           "micro_batch_size": own.micro_batch_size, "plan_s": time.perf_counter() - started}
    return row


def table(results: dict) -> str:
    lines = ["| run | GPUs | layout | dispatcher | dapple s | published s | ratio | dapple TFLOP/s (published) | "
             "with NCCL's all-to-all, s | without the exchange, s | memory GiB |",
             "|---|--:|---|---|--:|--:|--:|--:|--:|--:|--:|"]
    for r in results["rows"]:
        if "error" in r:
            lines.append(f"| {r['id']} | | {r['error']} | | | | | | | | |")
            continue
        lay = r["layout"]
        d = r["gpus"] // (lay["tensor_parallel"] * lay["pipeline_parallel"])
        tflops = (f"{r['dapple_tflops_per_gpu']:.0f} ({r['published_tflops_per_gpu']:.0f})"
                  if r["dapple_tflops_per_gpu"] else "")
        lines.append(
            f"| {r['id']} | {r['gpus']} | t{lay['tensor_parallel']} p{lay['pipeline_parallel']} v{lay['chunks']} "
            f"d{d} e{lay['expert_parallel']} et{lay['expert_tensor_parallel']} b{lay['micro_batch_size']} sp zero | "
            f"{lay['dispatcher']} | {r['dapple_s']:.2f} | {r['published_s']:.2f} | {r['ratio']:.2f} | {tflops} | "
            f"{r['all_to_all_s']:.2f} | {r['no_exchange_s']:.2f} | "
            f"{r['peak_memory_gib']:.1f}{'' if r['fits_memory'] else ' (over)'} |")
    own = [r for r in results["rows"] if "own_plan" in r]
    if own:
        lines += ["", "| run | published layout, dapple s | dapple's own plan, s | faster by | its stages (GPUs, "
                  "shapes), kind, micro-batch | planned in s |", "|---|--:|--:|--:|---|--:|"]
        for r in own:
            o = r["own_plan"]
            shapes = "; ".join(label or "plain" for label in o["stage_shapes"])
            ranks, _, chunks = o["shape"].partition(" ")
            sizes = "/".join(sorted(set(ranks.split(":")), key=int))
            stages = f"{ranks.count(':') + 1} stages of {sizes} GPUs{' ' + chunks if chunks else ''}"
            lines.append(f"| {r['id']} | {r['dapple_s']:.2f} | {o['simulated_s']:.2f} | "
                         f"{r['dapple_s'] / o['simulated_s']:.2f} | {stages} ({shapes}), "
                         f"{o['schedule']}, {o['micro_batch_size']} | {o['plan_s']:.0f} |")
    return "\n".join(lines)


def moe_rows(runs: list[dict], folder: Path, own_plans: bool) -> list[dict]:
    rows = []
    for run in runs:
        if int(run["layout"].get("ep") or 1) <= 1:
            continue  # dense: benchmarks/published_runs.py
        if config_name(run) is None or run["hardware"]["gpu"] not in GPU_OF:
            rows.append({"id": run["id"], "error": f"not costed: no shipped config or catalog GPU for "
                                                   f"{run['model']['name']} on {run['hardware']['gpu']}"})
        else:
            try:
                rows.append(estimate_run(run, folder, own_plans))
            except Exception as e:  # noqa: BLE001  a row that cannot be costed says why
                rows.append({"id": run["id"], "error": f"{type(e).__name__}: {e}"})
        print(json.dumps(rows[-1])[:400], file=sys.stderr)
    return rows


if __name__ == "__main__":
    cli(__doc__, DEFAULT_OUT, moe_rows, table)
