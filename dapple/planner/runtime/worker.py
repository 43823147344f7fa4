"""One rank's run: its stage (``rank.py``), then the run's lists walked
through the one executor (``executor.py``), with what each schedule does
between two lists, and the scoring and checkpoints after them.

Per step (one global batch): the global batch is split into M micro-batches
of ``micro_batch_size`` consecutive samples, and each replica computes its
slice of each (``layout.py``). Each stage's gradients are summed over its
replicas (``AR``) and one optimizer step (``OPT``) is taken.

- A synchronous schedule (early backward, GPipe) walks a one-step list per
  step, between a barrier and the reduction of the step's loss over every
  rank: the pipeline flushes every step.
- An asynchronous one (``config.schedule``) walks one list per segment of
  steps (``schedule.segments``): the pipeline drains only where a segment
  ends, at every checkpoint and evaluation (a checkpoint holds no
  micro-batch in flight, and an evaluation scores one version of every
  stage).
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.distributed as dist

from .. import _core
from .config import Job
from .evaluation import eval_line, evaluate
from .executor import Executor
from .prediction import PREDICTORS
from .rank import RankSetup, log_line, open_stages, save_checkpoint
from .tensor_parallel import full_state

PHASES = ("compute", "recv_wait", "send_wait", "allreduce", "optimizer", "end_sync")


def rank_metrics(ctx: RankSetup, *, iteration_ms: list[float], losses: list[float], compute_s: float,
                 bubble_s: float, phase_ms: dict[str, list[float]], evaluations: list[dict],
                 asynchronous: bool) -> dict[str, Any]:
    """One rank's measurements (``launcher.RunResult.metrics``), the one
    place they are put together, for every schedule."""
    metrics = {
        "stage": ctx.stage,
        "replica": ctx.replica,
        "iteration_ms": iteration_ms,
        "losses": losses,
        "compute_ms": compute_s * 1e3,
        "bubble_ms": bubble_s * 1e3,
        "phase_ms": phase_ms,
        "peak_memory_bytes": ctx.meter.peak_bytes(),
        "memory_before_bytes": ctx.meter.baseline_bytes,
        "memory_source": ctx.meter.source,
        "evaluations": evaluations,
    }
    if asynchronous:
        metrics["asynchronous"] = True
    if ctx.precision.loss_scale is not None:
        metrics["loss_scale"] = ctx.precision.loss_scale  # fp16's, at the end: the same on every rank
    return metrics


class FlushedSteps:
    """A synchronous schedule: a one-step list a step. ``iteration_ms``
    runs from a barrier to the end of the loss reduction; ``phase_ms``
    splits it (see ``launcher.RunResult``). On CUDA its ``compute`` is the
    GPU's time (``timing.EventTimer``), read once a step."""

    logs_live = True  # every rank knows each step's loss when it ends

    def __init__(self, ctx: RankSetup, job: Job, chunks: list[RankSetup] = ()):
        self.ctx, self.job = ctx, job
        self.executor = Executor(ctx, job, gpu_timing=True, chunks=chunks)
        self.iteration_ms: list[float] = []
        self.losses: list[float] = []
        self.phase_ms: dict[str, list[float]] = {k: [] for k in PHASES}
        self.compute_s = self.bubble_s = 0.0
        self.peak = 0

    def walk(self, a: int, b: int, trace: list[str] | None) -> None:
        ctx, config = self.ctx, self.job.config
        dist.barrier()
        t_start = time.perf_counter()
        run = self.executor.run(self.job.lists[b - a][ctx.stage], a, trace)
        t_listed = time.perf_counter()
        # The step ends when every rank is done; the sum of the last
        # stage's scaled losses is the mean loss over the global batch.
        total = torch.tensor([run.losses.get(0, 0.0)], dtype=torch.float64, device=ctx.dev)
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        t_end = time.perf_counter()
        elapsed = t_end - t_start
        waits = {"recv_wait": run.recv_wait_s, "send_wait": run.send_wait_s, "allreduce": run.allreduce_s,
                 "optimizer": run.optimizer_s, "end_sync": t_end - t_listed}
        # On the CPU the phases add up to the step; on CUDA the compute is
        # the GPU's own time, which the host's phases overlap.
        compute = elapsed - sum(waits.values()) if run.gpu_compute_s is None else run.gpu_compute_s
        for name, seconds in {"compute": compute, **waits}.items():
            self.phase_ms[name].append(seconds * 1e3)
        self.iteration_ms.append(elapsed * 1e3)
        self.losses.append(float(total[0]))
        self.bubble_s += run.recv_wait_s
        self.compute_s += elapsed - run.recv_wait_s
        self.peak = max(self.peak, run.peak_in_flight)
        if config.log and ctx.rank == 0:
            log_line(f"step {b}/{config.steps} loss {self.losses[-1]:.6f} {elapsed * 1e3:.1f} ms")

    def checkpoint_state(self) -> dict:
        return {}

    def metrics(self, evaluations: list[dict], aside_s: float) -> dict[str, Any]:
        return rank_metrics(self.ctx, iteration_ms=self.iteration_ms, losses=self.losses, compute_s=self.compute_s,
                            bubble_s=self.bubble_s, phase_ms=self.phase_ms, evaluations=evaluations,
                            asynchronous=False)


class DrainedSegments:
    """An asynchronous schedule: one list a segment, drained at its end.
    ``iteration_ms`` runs from one update of this rank to the next; the
    last stage keeps the partial losses of its slices."""

    logs_live = False  # only the last stage knows a step's loss: the caller prints them after the run

    def __init__(self, ctx: RankSetup, job: Job):
        self.ctx, self.job = ctx, job
        predictor = None
        name = _core.SCHEDULE_PREDICTORS.get(job.config.schedule)
        if name is not None and ctx.opt is not None:
            predictor = PREDICTORS[name](ctx.params, ctx.opt)
            if ctx.resumed is not None and ctx.resumed.get("predictor") is not None:
                predictor.load_state_dict(ctx.resumed["predictor"])
        self.predictor = predictor
        self.executor = Executor(ctx, job, predictor)
        self.iteration_ms: list[float] = []
        self.losses: list[float] = []
        self.compute_s = 0.0
        self.peak = 0
        self.t_run = time.perf_counter()

    def walk(self, a: int, b: int, trace: list[str] | None) -> None:
        run = self.executor.run(self.job.lists[b - a][self.ctx.stage], a, trace)
        dist.barrier()  # the segment ends drained on every rank
        updates = [0.0, *run.update_s]
        self.iteration_ms += [(t1 - t0) * 1e3 for t0, t1 in zip(updates, updates[1:])]
        self.losses += [run.losses.get(n, 0.0) for n in range(len(run.update_s))]
        self.compute_s += run.compute_s
        self.peak = max(self.peak, run.peak_in_flight)

    def checkpoint_state(self) -> dict:
        return {"predictor": self.predictor.state_dict() if self.predictor is not None else None}

    def metrics(self, evaluations: list[dict], aside_s: float) -> dict[str, Any]:
        total_s = time.perf_counter() - self.t_run - aside_s
        return rank_metrics(self.ctx, iteration_ms=self.iteration_ms, losses=self.losses if self.ctx.last else [],
                            compute_s=self.compute_s, bubble_s=max(total_s - self.compute_s, 0.0), phase_ms={},
                            evaluations=evaluations, asynchronous=True)


def _fail_if_asked(rank: int, a: int, b: int) -> None:
    """Test hook: ``DAPPLE_TEST_FAIL_RANK=r`` (``DAPPLE_TEST_FAIL_STEP=n``,
    default 1) makes rank r raise before step n."""
    fail_rank = os.environ.get("DAPPLE_TEST_FAIL_RANK")
    fail_step = int(os.environ.get("DAPPLE_TEST_FAIL_STEP", "1"))
    if fail_rank is not None and int(fail_rank) == rank and a < fail_step <= b:
        raise RuntimeError(f"injected failure at step {fail_step} (DAPPLE_TEST_FAIL_RANK)")


def run_rank(rank: int, job: Job) -> dict[str, Any]:
    """The training loop of one rank; the process group must be up.
    Returns ``{"state", "trace", "peak_in_flight", "metrics"}``: the stage's
    final state, the actions run before this run's first update (``"F0"``,
    ``"B0"``, ..., ``"AR"`` when the stage reduces, ``"OPT"``), the most
    micro-batches whose activations were held at once, and its measurements
    (:func:`rank_metrics`)."""
    chunks = open_stages(rank, job)
    ctx, config = chunks[0], job.config
    loop = FlushedSteps(ctx, job, chunks) if config.schedule is None else DrainedSegments(ctx, job)
    trace: list[str] = []
    evaluations: list[dict] = []  # rank 0's, every config.eval_every steps
    aside_s = 0.0  # scoring and saving are not training time
    for a, b in job.segments():
        _fail_if_asked(rank, a, b)
        loop.walk(a, b, trace if a == config.start_step else None)
        t_aside = time.perf_counter()
        if config.eval_every and b % config.eval_every == 0:
            evaluated = evaluate(chunks, job, b)
            if evaluated is not None:
                evaluations.append(evaluated)
                if config.log and loop.logs_live:
                    log_line(eval_line(evaluated))
        if config.checkpoint_dir and config.checkpoint_every and b % config.checkpoint_every == 0:
            save_checkpoint(chunks, config.checkpoint_dir, b, **loop.checkpoint_state())
        aside_s += time.perf_counter() - t_aside
    # A split stage's shards gathered back: every rank's result is whole layers.
    state = {k: v for c in chunks for k, v in full_state(c.layers, c.layer_range[0]).items()}
    return {"state": state, "trace": trace, "peak_in_flight": loop.peak, "metrics": loop.metrics(evaluations, aside_s)}
