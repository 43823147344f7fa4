"""``dapple topology measure``: time the link between local worker processes
and write it as a topology."""

from __future__ import annotations

import click

from dapple.planner.errors import InvalidInputError
from dapple.planner.files import check_writable, path_text, write_atomic

from .options import FILE_PATH, PositiveIntList, reports_errors, require_torch


# Bounds on the work one measurement may start: every process imports torch
# (about 150 MB each), every size is a tensor in each of them, and every
# repeat is one message per size.
MAX_PROCESSES = 128
MAX_SIZE_KIB = 1 << 20  # 1 GiB
MAX_REPEATS = 10_000


@click.command("measure")
@click.option("--processes", type=click.IntRange(2, MAX_PROCESSES), default=2, show_default=True,
              help=f"Local gloo processes, the 'GPUs' of the topology (2..{MAX_PROCESSES}).")
@click.option("--sizes-kib", "sizes_kib", type=PositiveIntList(most=MAX_SIZE_KIB), default="4,64,1024,4096,16384",
              show_default=True, help=f"Message sizes to time, in KiB (each 1..{MAX_SIZE_KIB}).")
@click.option("--repeats", type=click.IntRange(1, MAX_REPEATS), default=20, show_default=True,
              help=f"Timed messages per size, median kept (1..{MAX_REPEATS}).")
@click.option("--name", default=None, help="Topology name. Default: what was measured and when.")
@click.option("--out", "out_path", type=FILE_PATH, default=None,
              help="Topology JSON to write. Default: print it on stdout.")
@reports_errors
def topology_measure_command(processes, sizes_kib, repeats, name, out_path):
    """Measure point-to-point and AllReduce times between local gloo processes.

    Fits the link (latency_us, bandwidth_gbps) to the point-to-point times and
    writes a one-machine topology for planning `dapple run` on this machine.
    The table on stderr also shows each AllReduce against the cost model's
    ring formula on the fitted link.
    """
    if out_path is not None:
        check_writable(out_path)  # before measuring, not after
    require_torch("topology measure")
    from dapple.planner.runtime.links import measure_links, topology_of

    try:
        measured = measure_links(processes, [k * 1024 for k in sizes_kib], repeats)
    except ValueError as e:
        raise InvalidInputError(str(e)) from None
    topo = topology_of(measured, name)
    err = click.get_text_stream("stderr")
    click.echo(f"link: latency {measured['latency_us']:.1f} us, bandwidth {measured['bandwidth_gbps']:.2f} Gbit/s "
               f"(fitted to point-to-point, {processes} processes, median of {repeats})", file=err)
    click.echo(f"{'KiB':>8} {'p2p ms':>9} {'fit ms':>9} {'allreduce ms':>13} {'model ms':>9}", file=err)
    for r in measured["sizes"]:
        click.echo(f"{r['bytes'] // 1024:>8} {r['p2p_ms']:>9.3f} {r['p2p_fit_ms']:>9.3f} "
                   f"{r['allreduce_ms']:>13.3f} {r['allreduce_model_ms']:>9.3f}", file=err)
    if out_path is not None:
        write_atomic(out_path, topo.text)
        click.echo(f"wrote {path_text(out_path)}", file=err)
    else:
        click.echo(topo.text, nl=False)
