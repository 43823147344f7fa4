"""``dapple topology``: show what a spec or file means."""

from __future__ import annotations

import json

import click

from dapple import planner

from .options import json_option, reports_errors
from .topology_measure import topology_measure_command


@click.group("topology")
def topology_group():
    """Inspect cluster topologies."""


@topology_group.command("show")
@click.argument("spec")
@json_option
@reports_errors
def show(spec, as_json):
    """Show a topology: a spec (2x8-nvlink, 16x1-25gbps, 64x8-a100-80gb), a preset (A, B, C) or a JSON file."""
    topo = planner.Topology.resolve(spec)
    if as_json:
        click.echo(topo.text, nl=False)
        return
    click.echo(f"{topo.name}: {topo.num_devices} GPUs")
    click.echo(topo.describe())


@topology_group.command("gpus")
@json_option
@reports_errors
def gpus(as_json):
    """List the GPU types specs may name (64x8-a100-80gb), with their figures and sources."""
    if as_json:
        click.echo(json.dumps(planner.GPU_TYPES, indent=1))
        return
    for name, g in planner.GPU_TYPES.items():
        click.echo(
            f"{name:10} {g['memory_bytes'] / 2**30:5.0f} GiB  bf16 {g['bf16_tflops']:7.1f} TFLOP/s  "
            f"fp32 {g['fp32_tflops']:5.1f}  NVLink {g['nvlink_gbps']:6.0f} Gbps  "
            f"network {g['network_gbps_per_gpu']:4.0f} Gbps/GPU  host {g['host']['copy_gb_per_s']:5.1f} GB/s "
            f"{g['host']['memory_gib_per_gpu']:4.0f} GiB/GPU ({g['server']}); spec names: {', '.join(g['aliases'])}"
        )
    click.echo("Sources: dapple topology gpus --json", err=True)


topology_group.add_command(topology_measure_command, "measure")
