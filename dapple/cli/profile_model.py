"""``dapple profile model``: measure a per-layer profile of a PyTorch model."""

from __future__ import annotations

import click

from dapple.planner.files import check_writable, path_text
from dapple.planner.precision import PRECISIONS

from .options import FILE_PATH, PositiveIntList, model_kwargs, model_options, reports_errors, require_torch


@click.command("model")
@model_options
@click.option("--batch-sizes", required=True, type=PositiveIntList(), help="Batch sizes to measure, e.g. 1,2,4,8.")
@click.option("--device", default="cpu", show_default=True, help="cpu, cuda or cuda:N.")
@click.option("--dtype", type=click.Choice(PRECISIONS), default="fp32", show_default=True,
              help="Number format: fp32, or bf16/fp16 under torch's autocast, as dapple run --dtype trains.")
@click.option("--repeats", type=click.IntRange(min=1), default=5, show_default=True,
              help="Timed passes of the whole model (each layer's median kept).")
@click.option("--warmup", type=click.IntRange(min=0), default=2, show_default=True, help="Untimed passes before them.")
@click.option("--threads", type=click.IntRange(min=1), default=1, show_default=True,
              help="CPU threads torch uses while measuring (1 gives steadier times).")
@click.option("--name", "model_name", default=None, help="Model name to record. Default: the factory's (e.g. gpt-4x64).")
@click.option("--out", "out_path", required=True, type=FILE_PATH, help="Profile JSON to write.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
@reports_errors
def profile_model_command(model_spec, model_args, batch_sizes, device, dtype, repeats, warmup, threads, model_name,
                          out_path, quiet):
    """Measure forward/backward time and memory of each layer of a PyTorch model.

    The whole model runs forward and backward on real tensors at each batch
    size, each layer timed inside the pass; the profile is ready for
    `dapple plan`.
    """
    kwargs = model_kwargs(model_args)
    check_writable(out_path)  # before measuring, not after
    require_torch("profile model")
    from dapple.planner.profiler import check_device, profile_model
    from dapple.planner.runtime.models import load_model

    check_device(device)
    spec = load_model(model_spec, **kwargs)
    profile = profile_model(
        spec,
        model_name or spec.name,
        batch_sizes,
        device=device,
        dtype=dtype,
        warmup=warmup,
        repeats=repeats,
        progress=not quiet,
        threads=threads,
    )
    profile.save(out_path)
    blocks = sum(1 for layer in profile.layers if layer.get("kind") == "block")
    click.echo(
        f"{path_text(out_path)}: {len(profile.layers)} layers ({blocks} blocks) of {profile.model} at batch sizes "
        f"{','.join(map(str, profile.batch_sizes))} on {profile.data['device']} in {dtype}",
        err=True,
    )
