"""``dapple topology``: show what a spec or file means."""

from __future__ import annotations

import click

import planner

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
    """Show a topology: a spec (2x8-nvlink, 16x1-25gbps), a preset (A, B, C) or a JSON file."""
    topo = planner.Topology.resolve(spec)
    if as_json:
        click.echo(topo.text, nl=False)
        return
    click.echo(f"{topo.name}: {topo.num_devices} GPUs")
    click.echo(topo.describe())


topology_group.add_command(topology_measure_command, "measure")
