"""Starting a run: one process per rank, spawned here and watched, or one
rank of a run torchrun started; then the ranks' results gathered into one
:class:`RunResult`. :func:`launch` takes the plan and a
:class:`~dapple.planner.runtime.config.RunConfig`; the training itself is
``worker.py``'s.
"""

from __future__ import annotations

import os
import pickle
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..plan import Plan
from .config import Job, RunConfig, check_run
from .layout import Layout
from .memory import set_host_allocator
from .rank import init_process_group, silence_stdout
from .worker import run_rank


def _die_with_parent(parent_pid: int) -> None:
    """Linux: have the kernel kill this worker when the process that started
    it dies, so a killed `dapple run` leaves no worker training on (and
    writing checkpoints) behind it."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    pr_set_pdeathsig = 1  # linux/prctl.h
    try:
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def _worker(rank: int, world_size: int, port: int, job: Job, out_dir: str, parent_pid: int) -> None:
    _die_with_parent(parent_pid)
    config = job.config
    silence_stdout()  # gloo's connection notices; the parent prints the run's output
    torch.set_num_threads(config.threads)
    set_host_allocator(config.device, config.exact_memory)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    init_process_group(config.device, rank, world_size, config.timeout_s)
    try:
        result = run_rank(rank, job)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def launched_by_torchrun() -> bool:
    """True in a process torchrun (or another launcher speaking its
    protocol) started: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
    ``MASTER_PORT`` are all set."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def visible_gpus(device: str) -> int | None:
    """The GPUs local workers of a run on ``device`` can take, or None when
    none are needed here (the CPU) or torchrun placed the processes."""
    if device != "cuda" or launched_by_torchrun():
        return None
    return torch.cuda.device_count()


def _run_this_rank(job: Job) -> RunResult | None:
    lay, config = job.layout, job.config
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world_size != lay.world_size:
        raise ValueError(
            f"torchrun started {world_size} processes (WORLD_SIZE) but the plan uses {lay.world_size} devices"
        )
    torch.set_num_threads(config.threads)
    set_host_allocator(config.device, config.exact_memory)
    # As in _worker: gloo prints connection notices on stdout, which is for
    # rank 0's summary only, so stdout is silenced while the run lasts (for
    # good on the other ranks).
    saved_stdout = None
    if config.log:
        saved_stdout = os.dup(1) if rank == 0 else None
        silence_stdout()
    owns_group = not dist.is_initialized()
    if owns_group:
        init_process_group(config.device, rank, world_size, config.timeout_s)
    try:
        try:
            result = run_rank(rank, job)
        except Exception as e:  # noqa: BLE001 - any failure of this rank ends the run, named
            raise WorkerFailed(rank, f"{type(e).__name__}: {_last_line(str(e))}") from e
        gathered: list[Any] | None = [None] * world_size if rank == 0 else None
        dist.gather_object(result, gathered, dst=0)
        # Every rank past the gather before any tears its connections down:
        # a rank that destroys the group while rank 0 still reads from it
        # can abort in gloo at exit ("terminate called without an active
        # exception", seen once under load in CI).
        dist.barrier()
    finally:
        if owns_group:
            dist.destroy_process_group()
        if saved_stdout is not None:
            sys.stdout.flush()
            os.dup2(saved_stdout, 1)
            os.close(saved_stdout)
    if rank != 0:
        return None
    return _result_of(lay, dict(enumerate(gathered)))


def free_port() -> int:
    """A TCP port free on this host now, for a process group's rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


FIRST_STEPS_LEFT_OUT = 1
"""Steps at the start of each invocation left out of the median step time
``dapple run`` reports: the first one fills the allocator's pools, the
caches and torch's thread pools (and on CUDA, loads the kernels), and runs
the slowest. Benchmarks that compare long runs may leave out more."""


def median_iteration_ms(iteration_ms: list[float]) -> tuple[float, int]:
    """The median step time with the first :data:`FIRST_STEPS_LEFT_OUT` left
    out, and how many were left out (none where no step would be left)."""
    left_out = FIRST_STEPS_LEFT_OUT if len(iteration_ms) > FIRST_STEPS_LEFT_OUT else 0
    return statistics.median(iteration_ms[left_out:]), left_out


@dataclass
class RunResult:
    """``params``: the trained model, ``"<layer index>.<name>"`` -> tensor,
    taken from replica 0 of each stage. ``per_rank``: each rank's stage state.
    ``stage_of_rank``: rank -> (stage, replica). ``trace``: rank -> actions
    run before the run's first update (``"F0"``, ``"B0"``, ..., ``"AR"`` when
    the stage reduces: it is replicated, ``"OPT"``). ``peak_in_flight``: rank -> most
    micro-batches whose activations the rank held at once.

    ``metrics``: rank -> ``{"stage", "replica", "iteration_ms", "losses",
    "compute_ms", "bubble_ms", "phase_ms", "peak_memory_bytes",
    "memory_before_bytes", "memory_source", "evaluations"}`` (and
    ``"asynchronous": True`` under an asynchronous schedule), put together
    by ``worker.rank_metrics``. ``iteration_ms`` runs from
    a barrier to the end of the loss reduction. ``phase_ms`` splits each
    iteration into lists, one value an iteration: ``compute`` (the schedule's
    forwards and backwards, less the waits in receives), ``recv_wait`` (the
    waits: bubbles and transfers), ``send_wait`` (waiting for the
    iteration's sends to finish), ``allreduce`` (the stage's gradients),
    ``optimizer`` (the step, and what the schedule keeps for later passes)
    and ``end_sync`` (the loss reduction that ends the iteration). On CUDA,
    ``compute`` is the GPU's time in the forwards and backwards less its
    waits for received data (CUDA events, ``timing.py``), the other phases
    the host's: there they overlap, and ``end_sync`` holds the host's wait
    for the kernels still queued. ``compute_ms`` and ``bubble_ms`` are the totals over
    the iterations of the iteration time outside receives and inside them
    (the host's clock). ``loss_scale``, under fp16 only: the loss scale at
    the end, equal on every rank."""

    params: dict[str, torch.Tensor]
    per_rank: dict[int, dict[str, torch.Tensor]]
    stage_of_rank: dict[int, tuple[int, int]]
    trace: dict[int, list[str]]
    peak_in_flight: dict[int, int]
    metrics: dict[int, dict] = field(default_factory=dict)

    @property
    def losses(self) -> list[float]:
        """The mean loss over each step's global batch: rank 0's (every
        rank reduces it at the end of a synchronous iteration), or under an
        asynchronous schedule the sum of the last stage's replicas' parts."""
        if not self.metrics.get(0, {}).get("asynchronous"):
            return list(self.metrics.get(0, {}).get("losses", []))
        last = max(s for s, _ in self.stage_of_rank.values())
        parts = [self.metrics[r]["losses"] for r, (s, _) in sorted(self.stage_of_rank.items()) if s == last]
        return [sum(values) for values in zip(*parts)]

    def replicas_agree(self, atol: float = 0.0) -> bool:
        by_stage: dict[int, list[dict]] = {}
        for r, (s, _) in self.stage_of_rank.items():
            by_stage.setdefault(s, []).append(self.per_rank[r])
        for states in by_stage.values():
            for other in states[1:]:
                for k, v in states[0].items():
                    if not torch.allclose(v, other[k], rtol=0, atol=atol):
                        return False
        return True


def _collect(lay: Layout, out_dir: str) -> RunResult:
    return _result_of(lay, {
        r: torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=True)
        for r in range(lay.world_size)
    })


def _result_of(lay: Layout, loaded: dict[int, dict]) -> RunResult:
    per_rank = {r: v["state"] for r, v in loaded.items()}
    params: dict[str, torch.Tensor] = {}
    for ranks in lay.stage_ranks:
        params.update(per_rank[ranks[0]])
    return RunResult(
        params=params,
        per_rank=per_rank,
        stage_of_rank={r: lay.where(r) for r in range(lay.world_size)},
        trace={r: v["trace"] for r, v in loaded.items()},
        peak_in_flight={r: v["peak_in_flight"] for r, v in loaded.items()},
        metrics={r: v.get("metrics", {}) for r, v in loaded.items()},
    )


def launch(plan: Plan, config: RunConfig, layout: Layout | None = None) -> RunResult | None:
    """Train for ``config.steps`` steps following ``plan`` (a validated
    :class:`planner.Plan`; ``layout`` is its :class:`Layout` when the caller
    has it already), on one process per used device.

    Launched normally, spawns the processes, watches them, and returns a
    :class:`RunResult`; if a worker raises or dies, the others are stopped
    and :class:`WorkerFailed` names the rank.
    Launched by torchrun (:func:`launched_by_torchrun`), runs this process's
    rank only and returns the result on rank 0 (``None`` elsewhere), gathered
    over the process group; torchrun watches the processes. A rank that
    raises raises :class:`WorkerFailed` naming itself.

    A test hook: ``DAPPLE_TEST_FAIL_RANK=r`` (with ``DAPPLE_TEST_FAIL_STEP=n``,
    default 1) in the environment makes rank r raise before step n.
    """
    layout = layout or Layout.of(plan)
    config = config.for_plan(plan)
    check_run(config, layout, visible_gpus=visible_gpus(config.device))
    if launched_by_torchrun():
        return _run_this_rank(Job.of(plan, config, layout))
    # CUDA does not survive fork, nor does OpenMP's thread pool: a forked
    # child that asks torch for more than one thread waits for ever on the
    # parent's pool (`dapple run --threads 2` hung in TransformerBlock's
    # first op, found by the command-line fuzz campaign).
    forkable = config.device != "cuda" and config.threads == 1
    start_method = config.start_method if forkable else "spawn"
    with tempfile.TemporaryDirectory(prefix="dapple-run-") as tmp:
        out_dir = config.out_dir or tmp
        # The folder reaches each worker as its own argument, not through the config.
        job = Job.of(plan, config, layout)
        context = mp.start_processes(
            _worker,
            args=(layout.world_size, free_port(), job, out_dir, os.getpid()),
            nprocs=layout.world_size,
            join=False,
            start_method=start_method,
        )
        try:
            _watch(context)
        finally:
            if start_method == "spawn":
                _stop_resource_tracker()
        return _collect(layout, out_dir)


def _stop_resource_tracker() -> None:
    """Stop multiprocessing's resource tracker, which spawned workers start,
    and wait for it: left alone it outlives the command by a moment (found
    by the command-line fuzz campaign). A later spawn starts it again."""
    from multiprocessing import resource_tracker

    stop = getattr(resource_tracker._resource_tracker, "_stop", None)  # CPython 3.8+; private
    if stop is not None:
        stop()


def run_plan(plan: Plan, layers_factory: Callable[[], Any], loss_fn: Callable, batches: list, steps: int, lr: float,
             world_size: int | None = None, **options) -> RunResult | None:
    """:func:`launch` with the :class:`RunConfig` of these arguments and
    ``options`` (its other fields, by name)."""
    return launch(plan, RunConfig(layers_factory, loss_fn, batches, steps, lr, world_size, **options))


class WorkerFailed(RuntimeError):
    """A worker process raised or died; ``rank`` names it, ``reason`` says how."""

    def __init__(self, rank: int, reason: str):
        super().__init__(f"rank {rank} failed: {reason}")
        self.rank = rank
        self.reason = reason


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else "unknown error"


#: What a rank says when a peer it talks to went away: the consequence of
#: another rank's failure, not its cause (gloo's words).
PEER_LOSS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def _root_cause(context, index: int, line: str) -> tuple[int, str]:
    """The failure that started it: where the rank torch reports first only
    lost a peer, the first rank that raised anything else (each failed rank
    left its traceback in its error file)."""
    if not any(marker in line for marker in PEER_LOSS):
        return index, line
    for rank, path in enumerate(context.error_files):
        if rank == index or not os.access(path, os.R_OK) or os.path.getsize(path) == 0:
            continue
        with open(path, "rb") as fh:  # written by torch's spawn in our own worker
            other = _last_line(pickle.load(fh))
        if not any(marker in other for marker in PEER_LOSS):
            return rank, other
    return index, line


def _watch(context) -> None:
    """Poll the workers once a second until all exit. On the first failure
    (torch stops the others in ``join``) raise WorkerFailed; whatever happens,
    no worker outlives this call."""
    from torch.multiprocessing import ProcessExitedException, ProcessRaisedException

    try:
        while not context.join(timeout=1):
            pass
    except ProcessRaisedException as e:
        raise WorkerFailed(*_root_cause(context, e.error_index, _last_line(str(e)))) from None
    except ProcessExitedException as e:
        code = e.exit_code
        how = f"killed by signal {e.signal_name}" if code is not None and code < 0 else f"exited with code {code}"
        raise WorkerFailed(e.error_index, f"process {e.pid} {how}") from None
    finally:
        for p in context.processes:
            if p.is_alive():
                p.terminate()
        deadline = time.monotonic() + 5
        for p in context.processes:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(1)
