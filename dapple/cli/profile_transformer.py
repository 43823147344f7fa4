"""``dapple profile transformer``: a transformer's profile from its config, without a GPU."""

from __future__ import annotations

import click

from dapple import planner
from dapple.planner.files import check_writable, path_text

from .options import FILE_PATH, PositiveIntList, count_option_type, reports_errors


@click.command("transformer")
@click.option("--config", "config", required=True, metavar="NAME|config.json",
              help=f"A shipped model config ({', '.join(planner.MODEL_CONFIGS)}) or a Hugging Face config.json.")
@click.option("--gpu", required=True, help="GPU type the layers are timed on (dapple topology gpus lists them).")
@click.option("--seq-len", required=True, type=count_option_type(), help="Tokens per sample.")
@click.option("--micro-batch-sizes", type=PositiveIntList(), default="1,2,4,8", show_default=True,
              help="Samples per GPU to write a measurement for.")
@click.option("--efficiency", type=float, default=None,
              help="Time every layer as its FLOPs over this share of the GPU's bf16 peak, in (0, 1], instead of "
                   "operator by operator.")
@click.option("--attention", type=click.Choice(planner.ATTENTION_KERNELS), default=None,
              help="How the attention core runs: FlashAttention (causal), or separate kernels with the s x s "
                   "probabilities in memory (Megatron-LM before FlashAttention). Default: flash where the GPU type "
                   "has it measured (A100 and later), else unfused.")
@click.option("--expert-imbalance", type=float, default=1.0, show_default=True,
              help="Mixtures of experts: the busiest GPU's routed tokens over the mean where a plan spreads the "
                   "experts, >= 1 (1: balanced, as force-balanced benchmarks run; a capacity factor C bounds it at C).")
@click.option("--token-dispatcher", "dispatcher", type=click.Choice(planner.TOKEN_DISPATCHERS), default="all-to-all",
              show_default=True,
              help="Mixtures of experts: how the runtime sends tokens to their experts. all-to-all: a copy an expert "
                   "(NCCL's all-to-all, Megatron-LM's alltoall dispatcher, dapple's runtime); deepep: a token once to "
                   "each machine and each GPU holding some of its experts (DeepEP, Megatron-LM's flex dispatcher).")
@click.option("--gradients", type=click.Choice(planner.GRADIENT_PRECISIONS), default="bf16", show_default=True,
              help="The precision the runtime accumulates gradients in over micro-batches and reduces them in: "
                   "bf16, as the weights, or fp32 (Megatron-LM under bf16, DeepSpeed's bf16 optimizer, Llama 3's "
                   "FSDP). Their memory, their reduction's bytes and Adam's read of them follow.")
@click.option("--host-us-per-kernel", type=float, default=None,
              help=f"What the runtime's host takes to issue one kernel, us: a pass takes no less than its kernels "
                   f"issued one after another. Default: {planner.HOST_US_PER_KERNEL:g}, an eager PyTorch's; "
                   "`dapple calibrate --runs` fits it to measured runs.")
@click.option("--name", "model_name", default=None, help="Model name to record. Default: the config's name.")
@click.option("--out", "out_path", required=True, type=FILE_PATH, help="Profile JSON to write.")
@reports_errors
def profile_transformer_command(config, gpu, seq_len, micro_batch_sizes, efficiency, attention, expert_imbalance,
                                dispatcher, gradients, host_us_per_kernel, model_name, out_path):
    """Write the analytic profile of a decoder-only transformer (Llama, GPT).

    Each layer's FLOPs, parameters and stored activations follow from the
    config. Its time is the sum of its operators' on the GPU type: matrix
    products by their shapes (tiles and waves over the GPU's SMs, at the
    share of its measured best that a transformer's products reach),
    memory-bound operators at its measured memory bandwidth, the attention
    core as the kernel runs it, and Adam's step as a memory-bound pass
    (docs/cost-model.md, "Transformer profiles"); or, with --efficiency,
    its FLOPs over that share of the bf16 peak, and no optimizer step.
    Layers record how they split (Megatron's blocks, the vocabulary for the
    embedding and LM head), so `dapple plan` can shard them.
    """
    check_writable(out_path)
    profile = planner.transformer_profile(
        config, gpu=gpu, seq_len=seq_len, micro_batch_sizes=micro_batch_sizes, efficiency=efficiency,
        attention=attention, expert_imbalance=expert_imbalance, dispatcher=dispatcher, gradients=gradients,
        host_us_per_kernel=host_us_per_kernel,
        model=model_name,
    )
    profile.save(out_path)
    params = sum(layer["param_bytes"] for layer in profile.layers) / profile.data["parameter_state"]["weight_bytes"]
    timed = (f"timed at {efficiency} of the {profile.data['device']} bf16 peak" if efficiency is not None
             else f"timed operator by operator on {profile.data['device']}")
    click.echo(
        f"{path_text(out_path)}: {profile.model}, {len(profile.layers)} layers, {params / 1e9:.2f}e9 parameters, "
        f"sequence {seq_len}, {timed}",
        err=True,
    )
