"""Measure the link between local worker processes, as a topology.

The shipped specs describe GPUs joined by NVLink or PCIe. On this CPU
machine `dapple run`'s "devices" are processes talking through gloo over
loopback TCP, which is far slower and has a much larger fixed cost per
message. :func:`measure_links` times that link the way the cost model uses
it, and :func:`topology_of` writes the result as a one-machine topology, so
plans and predictions for local runs rest on measured numbers.

- Point to point, rank 0 to rank 1: a ping-pong of ``size`` bytes, half the
  round trip, median of ``repeats``. A least-squares line ``time = latency
  + bytes / bandwidth`` over the sizes (relative errors) gives the link's
  ``latency_us`` and ``bandwidth_gbps``.
- AllReduce over all ranks at each size, median of ``repeats``, and what the
  cost model (``allreduce_ms`` in ``cost.rs``, asked through the measured
  topology) predicts for it on the fitted link: the gap says how far the
  model is from gloo's own algorithm.
"""

from __future__ import annotations

import os
import platform
import statistics
import tempfile
import time
from datetime import datetime, timedelta, timezone

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..profiler import cpu_name
from ..topology import Topology
from .launcher import free_port
from .rank import silence_stdout

DEFAULT_SIZES_BYTES = [4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20]
_WARMUP = 5


def _bench(rank: int, world_size: int, port: int, sizes: list[int], repeats: int, out: str) -> None:
    silence_stdout()  # gloo's connection notices: stdout may hold the caller's JSON
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    try:
        p2p, allreduce = {}, {}
        for size in sizes:
            buf = torch.zeros(max(1, size // 4), dtype=torch.float32)
            times = []
            for i in range(repeats + _WARMUP):  # warm the connection and gloo's buffers up first
                dist.barrier()
                t0 = time.perf_counter()
                if rank == 0:
                    dist.send(buf, 1)
                    dist.recv(buf, 1)
                elif rank == 1:
                    dist.recv(buf, 0)
                    dist.send(buf, 0)
                if i >= _WARMUP:
                    times.append((time.perf_counter() - t0) / 2)
            p2p[size] = statistics.median(times)
            times = []
            for i in range(repeats + _WARMUP):
                dist.barrier()
                t0 = time.perf_counter()
                dist.all_reduce(buf)
                if i >= _WARMUP:
                    times.append(time.perf_counter() - t0)
            allreduce[size] = statistics.median(times)
        if rank == 0:
            torch.save({"p2p": p2p, "allreduce": allreduce}, out)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def fit_link(sizes_bytes: list[int], seconds: list[float]) -> tuple[float, float]:
    """Least-squares ``seconds = latency + bytes / bandwidth``; returns
    ``(latency_us, bandwidth_gbps)``. The latency is clamped at 0 (a negative
    intercept is noise at small sizes)."""
    import numpy as np

    x = np.asarray(sizes_bytes, dtype=float)
    y = np.asarray(seconds, dtype=float)
    if len(x) < 2 or np.ptp(x) == 0:
        raise ValueError("fitting a link needs at least two different message sizes")
    # Weighted by 1/time: relative errors count, so the small sizes that
    # decide the latency are not drowned by the large ones.
    slope, intercept = np.polyfit(x, y, 1, w=1.0 / y)
    if slope <= 0:
        raise ValueError(f"message time did not grow with size ({dict(zip(sizes_bytes, seconds))}); "
                         "measure larger sizes or more repeats")
    return max(0.0, float(intercept)) * 1e6, 8.0 / float(slope) / 1e9


def measure_links(processes: int, sizes_bytes: list[int] | None = None, repeats: int = 20) -> dict:
    """Time gloo point-to-point and AllReduce among ``processes`` local
    processes; return the raw medians, the fitted link and the AllReduce
    prediction of the cost model for each size."""
    if processes < 2:
        raise ValueError(f"measuring a link needs at least 2 processes, not {processes}")
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, not {repeats}")
    sizes = sorted(set(sizes_bytes or DEFAULT_SIZES_BYTES))
    if any(s < 4 for s in sizes):
        raise ValueError(f"message sizes must be at least 4 bytes, not {sizes}")
    if len(sizes) < 2:
        raise ValueError(f"fitting a link needs at least two different message sizes, not {sizes}")
    with tempfile.TemporaryDirectory(prefix="dapple-links-") as tmp:
        out = os.path.join(tmp, "links.pt")
        mp.start_processes(_bench, args=(processes, free_port(), sizes, repeats, out), nprocs=processes,
                           start_method="fork" if platform.system() == "Linux" else "spawn")
        raw = torch.load(out, weights_only=True)
    p2p = [raw["p2p"][s] for s in sizes]
    latency_us, bandwidth_gbps = fit_link(sizes, p2p)
    measured = {"processes": processes, "repeats": repeats, "latency_us": latency_us, "bandwidth_gbps": bandwidth_gbps}
    # The cost model's AllReduce on the fitted link, from the core.
    topology = topology_of(measured)
    rows = []
    for s in sizes:
        rows.append({
            "bytes": s,
            "p2p_ms": raw["p2p"][s] * 1e3,
            "p2p_fit_ms": (latency_us / 1e6 + s * 8 / (bandwidth_gbps * 1e9)) * 1e3,
            "allreduce_ms": raw["allreduce"][s] * 1e3,
            "allreduce_model_ms": topology.core.allreduce_ms(list(range(processes)), float(s)),
        })
    return {**measured, "sizes": rows}


def _host_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 << 30


def topology_of(measured: dict, name: str | None = None) -> Topology:
    """One machine of ``processes`` "GPUs" (the processes), sharing the
    host's memory equally, joined by the measured link. The name records
    what was measured and when."""
    n = measured["processes"]
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    cpu = cpu_name()
    link = {"kind": "gloo-loopback (measured)", "bandwidth_gbps": round(measured["bandwidth_gbps"], 4),
            "latency_us": round(measured["latency_us"], 2)}
    return Topology.from_dict({
        "name": name or f"local 1x{n} gloo processes, measured {date}",
        "machine_groups": [{
            "machines": 1,
            "gpus_per_machine": n,
            "gpu": {"type": f"{cpu} process", "memory_bytes": _host_memory_bytes() // n, "relative_speed": 1.0},
            "intra_machine": link,
        }],
        # One machine: no traffic crosses machines; the same link keeps the file valid.
        "inter_machine": dict(link),
    })
