"""``dapple profile``: convert profiles into the dapple format."""

from __future__ import annotations

import click

from dapple import planner
from dapple.planner.files import check_writable, path_text

from .options import FILE_PATH, count_option_type, reports_errors
from .profile_model import profile_model_command
from .profile_transformer import profile_transformer_command


@click.group("profile")
def profile_group():
    """Create and convert per-layer profiles."""


@profile_group.command("import-artifact")
@click.argument("graph_txt", type=FILE_PATH)
@click.option("--model", required=True, help="Model name to record, e.g. BERT-48.")
@click.option("--batch-size", required=True, type=count_option_type(), help="Batch size the file was measured at.")
@click.option("--block-pattern", default=None, help="Regex naming the model's own repeated layers (marked kind=block).")
@click.option("--param-bytes-scale", type=float, default=1.0, show_default=True,
              help="Multiply parameter sizes by this (1.048576 for the hand-written VGG-19 file).")
@click.option("--optimizer", default="adam", show_default=True, help="Optimizer the model trains with (memory model).")
@click.option("--device", default=None, help="GPU type the profile was measured on, e.g. V100-16GB.")
@click.option("--origin", default=None, help="Free text recorded as the profile's source.")
@click.option("--measured-peak-memory-gib", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Whole-model peak memory measured on one GPU at the profile's batch size; calibrates stored activations.")
@click.option("--out", "out_path", required=True, type=FILE_PATH, help="Profile JSON to write.")
@reports_errors
def import_artifact(
    graph_txt, model, batch_size, block_pattern, param_bytes_scale, optimizer, device, origin, measured_peak_memory_gib, out_path
):
    """Convert a DAPPLE artifact profile (PipeDream graph.txt) to profile JSON."""
    profile = planner.import_artifact_profile(
        graph_txt,
        model=model,
        batch_size=batch_size,
        block_pattern=block_pattern,
        param_bytes_scale=param_bytes_scale,
        optimizer=optimizer,
        device=device,
        origin=origin,
    )
    if measured_peak_memory_gib is not None:
        profile = planner.calibrate_stored_activations(profile, measured_peak_memory_gib * 2**30, batch_size)
    profile.save(out_path)
    blocks = sum(1 for layer in profile.layers if layer.get("kind") == "block")
    click.echo(f"{path_text(out_path)}: {len(profile.layers)} layers ({blocks} blocks) from {path_text(graph_txt)}", err=True)


@profile_group.command("merge")
@click.argument("profile_paths", nargs=-1, required=True, type=FILE_PATH, metavar="PROFILE...")
@click.option("--out", "out_path", required=True, type=FILE_PATH, help="Profile JSON to write.")
@reports_errors
def merge(profile_paths, out_path):
    """One profile of a model timed on several GPU types.

    Give one profile per GPU type, each naming its `device`; the first gives
    the memory figures, and topologies' `relative_speed` is relative to it.
    A topology group whose GPU type is one of these runs at that type's own
    measured times (per-layer speed ratios may differ between types).
    """
    if len(profile_paths) < 2:
        raise click.UsageError("give at least two profiles, one per GPU type")
    check_writable(out_path)
    merged = planner.merge_profiles([planner.Profile.load(p) for p in profile_paths])
    merged.save(out_path)
    click.echo(f"{path_text(out_path)}: {merged.model} timed on {', '.join(map(str, merged.devices))}", err=True)


profile_group.add_command(profile_model_command, "model")
profile_group.add_command(profile_transformer_command, "transformer")
