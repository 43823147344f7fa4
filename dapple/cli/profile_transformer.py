"""``dapple profile transformer``: a transformer's profile from its config, without a GPU."""

from __future__ import annotations

import click

from dapple import planner
from dapple.planner.files import check_writable, path_text

from .options import FILE_PATH, PositiveIntList, count_option_type, reports_errors


@click.command("transformer")
@click.option("--config", "config", required=True, metavar="NAME|config.json",
              help=f"A shipped model config ({', '.join(planner.MODEL_CONFIGS)}) or a Hugging Face config.json.")
@click.option("--gpu", required=True, help="GPU type whose bf16 peak times the layers (dapple topology gpus lists them).")
@click.option("--seq-len", required=True, type=count_option_type(), help="Tokens per sample.")
@click.option("--micro-batch-sizes", type=PositiveIntList(), default="1,2,4,8", show_default=True,
              help="Samples per GPU to write a measurement for.")
@click.option("--efficiency", type=float, default=0.5, show_default=True,
              help="Share of the GPU's bf16 peak the layers reach, in (0, 1]: the profile's MFU ceiling.")
@click.option("--name", "model_name", default=None, help="Model name to record. Default: the config's name.")
@click.option("--out", "out_path", required=True, type=FILE_PATH, help="Profile JSON to write.")
@reports_errors
def profile_transformer_command(config, gpu, seq_len, micro_batch_sizes, efficiency, model_name, out_path):
    """Write the analytic profile of a decoder-only transformer (Llama, GPT).

    Each layer's FLOPs, parameters and stored activations follow from the
    config; its time is its FLOPs over the GPU's bf16 peak times the
    efficiency. Layers record how they split (Megatron's blocks, the
    vocabulary for the embedding and LM head), so `dapple plan` can shard them.
    """
    check_writable(out_path)
    profile = planner.transformer_profile(
        config, gpu=gpu, seq_len=seq_len, micro_batch_sizes=micro_batch_sizes, efficiency=efficiency, model=model_name
    )
    profile.save(out_path)
    params = sum(layer["param_bytes"] for layer in profile.layers) / profile.data["parameter_state"]["weight_bytes"]
    click.echo(
        f"{path_text(out_path)}: {profile.model}, {len(profile.layers)} layers, {params / 1e9:.2f}e9 parameters, "
        f"sequence {seq_len}, timed at {efficiency} of the {profile.data['device']} bf16 peak",
        err=True,
    )
