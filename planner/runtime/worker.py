"""One rank's training loop: its stage's layers, its action list, the
sends and receives to the neighbouring stages, the gradient AllReduce among
the stage's replicas and the optimizer step.

Per iteration (one global batch): the global batch is split into M
micro-batches of ``micro_batch_size`` consecutive samples, and each replica
computes its slice of each (``layout.py``). The last stage's loss on a
slice of n samples is ``loss_fn(out, tgt) * n / global_batch``
(``loss_reduction="mean"``) or ``loss_fn(out, tgt) / global_batch``
(``"sum"``), so the accumulated gradient is that of the mean loss over the
global batch. Then each stage's gradients are summed over its replicas
(AllReduce on a process group per stage) and one optimizer step
(``optimizers.py``) is taken. An asynchronous schedule runs
``asynchronous.py``'s loop instead, on the same ``RankSetup``.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from .data import SeededBatches
from .evaluation import eval_line, evaluate
from .layout import Layout
from .memory import PeakMemory
from .training import layers_of, make_optimizer, prefixed_state, scaled_loss
from .transport import PointToPoint


@dataclass
class Job:
    """Everything a rank needs to train: picklable, handed to launched workers."""

    layout: Layout
    layers_factory: Callable
    loss_fn: Callable
    batches: list
    steps: int
    lr: float
    optimizer: str = "sgd"
    seed: int = 0
    loss_reduction: str = "mean"
    skip_allreduce: bool = False  # testing hook: must break equivalence
    out_dir: str | None = None
    threads: int = 1
    start_step: int = 0  # resume: the step the checkpoint in checkpoint_dir holds
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    log: bool = False  # rank 0 prints one line per iteration to stderr; workers' stdout goes to stderr
    timeout_s: float = 30.0
    recompute: bool = False  # keep only each stage's input; re-run the stage's forward in its backward
    exact_memory: bool = False  # see memory.return_freed_memory
    device: str = "cpu"  # "cpu" (gloo) or "cuda" (NCCL, one GPU per rank)
    # Experiment only (off by default): rank -> factor; that rank sleeps
    # (factor - 1) times each forward's and backward's own time after it, so
    # one machine can stand for GPUs of unequal speed (docs/heterogeneous.md).
    slowdown: dict[int, float] = field(default_factory=dict)
    # An asynchronous schedule (xpipe, pipedream, spectrain, async) to run
    # instead of the plan's own; its action lists, one per stage, for the
    # mini-batches from start_step to steps (asynchronous.py).
    schedule: str | None = None
    passes: dict | None = None
    # Score the model on its validation split every K steps (evaluation.py).
    eval_every: int = 0


def log_line(text: str) -> None:
    """Writes one line to stderr in a single write. Ranks started by torchrun
    share one stderr; print() writes the text and its newline separately, so
    another rank's line could land between them (as CI once saw)."""
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


def backend(device: str) -> str:
    return "nccl" if device == "cuda" else "gloo"


def rank_device(device: str, rank: int) -> torch.device:
    """The device of ``rank``: the CPU, or the GPU of its local rank
    (``LOCAL_RANK`` under torchrun, the rank itself for local processes)."""
    if device == "cpu":
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", rank))
    if local >= torch.cuda.device_count():
        raise ValueError(f"rank {rank} needs GPU {local}, only {torch.cuda.device_count()} visible")
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


def allreduce_grads(params: list[nn.Parameter], group) -> None:
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    offset = 0
    for p, g in zip(params, grads):
        n = g.numel()
        p.grad = flat[offset : offset + n].view_as(p).clone()
        offset += n


@dataclass
class RankSetup:
    """What one rank holds once its process group is up: its stage's layers
    and optimizer, its peers and its transport. Shared by the synchronous
    loop (``run_rank``) and the asynchronous one (``asynchronous.py``)."""

    rank: int
    stage: int
    replica: int
    first: bool
    last: bool
    layer_range: tuple[int, int]
    dev: torch.device
    layers: list[nn.Module]
    module: nn.Module
    params: list[nn.Parameter]
    opt: Any
    group: Any
    #: (rank, (start, end)): who this replica receives its input from and
    #: sends its output to, with the samples of each micro-batch they share.
    prev: list[tuple[int, tuple[int, int]]]
    nxt: list[tuple[int, tuple[int, int]]]
    comm: PointToPoint
    #: Samples [lo, hi) of every micro-batch this replica computes.
    lo: int
    hi: int
    meter: PeakMemory
    slow: float
    #: Saved state beyond the model and the optimizer, from the checkpoint
    #: resumed (None when starting afresh).
    resumed: dict | None = None

    def computed(self, work):
        """``work()``, made ``slow`` times longer when the experiment asks."""
        if self.slow == 1.0:
            return work()
        t0 = time.perf_counter()
        result = work()
        time.sleep((self.slow - 1.0) * (time.perf_counter() - t0))
        return result

    def save_checkpoint(self, job: Job, done: int, **extra) -> None:
        """Save this rank's stage after ``done`` steps; rank 0 marks the step
        complete once every rank has saved."""
        from . import checkpoint as ckpt

        ckpt.save_rank(job.checkpoint_dir, done, self.rank, {
            "step": done,
            "rank": self.rank,
            "stage": self.stage,
            "layer_range": list(self.layer_range),
            "model": self.module.state_dict(),
            "optimizer": self.opt.state_dict() if self.opt is not None else None,
            **extra,
        })
        dist.barrier()  # every rank's file is on disk
        if self.rank == 0:
            ckpt.write_latest(job.checkpoint_dir, done)


def open_rank(rank: int, job: Job) -> RankSetup:
    """Build this rank's stage (from the checkpoint when resuming), its
    process groups and its peers; the process group must be up."""
    lay = job.layout
    stage, replica = lay.where(rank)
    me = lay.stages[stage].replicas[replica]
    n_stages = len(lay.stage_ranks)
    a, b = lay.layer_ranges[stage]

    torch.manual_seed(job.seed)
    made = job.layers_factory()
    all_layers = layers_of(made)
    if isinstance(job.batches, SeededBatches):
        job.batches.use_maker(getattr(made, "make_batch", None))
    if lay.layer_ranges[-1][1] != len(all_layers):
        raise ValueError(
            f"the plan's stages end at layer {lay.layer_ranges[-1][1]}, the model has {len(all_layers)}"
        )
    layers = all_layers[a:b]
    del all_layers, made  # the other stages' layers are not this rank's to keep
    dev = rank_device(job.device, rank)
    module = nn.Sequential(*layers).to(dev)
    params = [p for p in module.parameters() if p.requires_grad]
    opt = make_optimizer(params, job.optimizer, job.lr)
    resumed = None
    if job.start_step:
        from . import checkpoint as ckpt

        resumed = ckpt.load_rank(job.checkpoint_dir, job.start_step, rank)
        if resumed["step"] != job.start_step or tuple(resumed["layer_range"]) != (a, b):
            raise ValueError(
                f"checkpoint step {job.start_step} rank {rank} holds layers {resumed['layer_range']} "
                f"at step {resumed['step']}, this plan gives the rank layers {(a, b)}"
            )
        module.load_state_dict(resumed["model"])
        if opt is not None:
            opt.load_state_dict(resumed["optimizer"])

    # Process groups: created by every rank, in stage order.
    groups = [dist.new_group(ranks) if len(ranks) > 1 else None for ranks in lay.stage_ranks]
    return RankSetup(
        rank=rank,
        stage=stage,
        replica=replica,
        first=stage == 0,
        last=stage == n_stages - 1,
        layer_range=(a, b),
        dev=dev,
        layers=layers,
        module=module,
        params=params,
        opt=opt,
        group=groups[stage],
        prev=[(p.rank, (p.start, p.end)) for p in me.receives_from],
        nxt=[(p.rank, (p.start, p.end)) for p in me.sends_to],
        comm=PointToPoint(dev),
        lo=me.start,
        hi=me.end,
        # The peak of the training iterations, from the size after the stage
        # and its optimizer were built (Adam's state arrives with the first step).
        meter=PeakMemory(cuda=dev.type == "cuda"),
        slow=job.slowdown.get(rank, 1.0),
        resumed=resumed,
    )


def run_rank(rank: int, job: Job) -> dict[str, Any]:
    """The training loop of one rank; the process group must be up.
    Returns ``{"state", "trace", "peak_in_flight"}``: the stage's final
    state, the actions run in the first iteration (``"F0"``, ``"B0"``, ...,
    ``"AR"``, ``"OPT"``) and the most micro-batches whose activations were
    held at once. An asynchronous schedule runs ``asynchronous.py``'s loop."""
    if job.schedule is not None:
        from .asynchronous import run_asynchronous

        return run_asynchronous(open_rank(rank, job), job)
    lay = job.layout
    ctx = open_rank(rank, job)
    stage, replica = ctx.stage, ctx.replica
    first, last = ctx.first, ctx.last
    a, _ = ctx.layer_range
    layers, module, params, opt, group = ctx.layers, ctx.module, ctx.params, ctx.opt, ctx.group
    prev, nxt, comm, lo, hi = ctx.prev, ctx.nxt, ctx.comm, ctx.lo, ctx.hi
    dev, meter, computed = ctx.dev, ctx.meter, ctx.computed
    mbs, gbs = lay.micro_batch_size, lay.global_batch_size
    trace: list[str] = []
    peak = 0
    iteration_ms: list[float] = []
    losses: list[float] = []
    compute_s = bubble_s = 0.0
    # Where each iteration's time went on this rank (see RunResult.metrics).
    phase_ms: dict[str, list[float]] = {
        k: [] for k in ("compute", "recv_wait", "send_wait", "allreduce", "optimizer", "end_sync")
    }
    evaluations: list[dict] = []  # rank 0's, every job.eval_every steps
    fail_rank = os.environ.get("DAPPLE_TEST_FAIL_RANK")
    fail_step = int(os.environ.get("DAPPLE_TEST_FAIL_STEP", "1"))
    for it in range(job.start_step, job.steps):
        if fail_rank is not None and int(fail_rank) == rank and it + 1 == fail_step:
            raise RuntimeError(f"injected failure at step {it + 1} (DAPPLE_TEST_FAIL_RANK)")
        dist.barrier()
        t_start = time.perf_counter()
        comm.recv_s = 0.0
        loss_sum = 0.0
        x_all, y_all = job.batches[it % len(job.batches)]
        if x_all.shape[0] != gbs:
            raise ValueError(f"batch {it} has {x_all.shape[0]} samples, the plan needs {gbs}")
        for p in params:
            p.grad = None
        inputs: dict[int, torch.Tensor] = {}
        outputs: dict[int, torch.Tensor] = {}
        for kind, m in lay.schedule[stage]:
            base = m * mbs
            if it == 0:
                trace.append(f"{kind}{m}")
            if kind == "F":
                if first:
                    x = x_all[base + lo : base + hi].to(dev)
                else:
                    parts = [comm.recv_with_header(src, m, False) for src, _ in prev]
                    x = torch.cat(parts, 0) if len(parts) > 1 else parts[0]
                    if x.is_floating_point():
                        x.requires_grad_(True)
                    inputs[m] = x
                if job.recompute:
                    # Stage-level re-computation (GPipe's, and DAPPLE's Table
                    # VI): only the stage input is kept; the backward re-runs
                    # the forward, restoring the RNG state it started with.
                    out = computed(lambda: checkpoint(module, x, use_reentrant=False))
                else:
                    out = computed(lambda: module(x))
                if last:
                    y = y_all[base + lo : base + hi].to(dev)
                    outputs[m] = scaled_loss(job.loss_fn, out, y, hi - lo, gbs, job.loss_reduction)
                    loss_sum += float(outputs[m].detach())
                else:
                    for dst, (s0, s1) in nxt:
                        comm.send(out[s0 - lo : s1 - lo], dst, m, False, header=True)
                    outputs[m] = out
                peak = max(peak, len(outputs))
            else:
                out = outputs.pop(m)
                if last:
                    grad = None
                else:
                    grad = torch.empty_like(out)
                    for src, (s0, s1) in nxt:
                        piece = torch.empty_like(out[s0 - lo : s1 - lo])
                        comm.recv_into(piece, src, m, True)
                        grad[s0 - lo : s1 - lo] = piece
                if out.requires_grad:
                    computed(lambda: out.backward(grad))
                if not first:
                    x = inputs.pop(m)
                    g = x.grad if x.grad is not None else torch.zeros_like(x)
                    for dst, (s0, s1) in prev:
                        comm.send(g[s0 - lo : s1 - lo], dst, m, True, header=False)
        t_schedule_end = time.perf_counter()
        comm.wait_all()
        t_sent = time.perf_counter()
        if group is not None and not job.skip_allreduce:
            allreduce_grads(params, group)
            if it == 0:
                trace.append("AR")
        t_reduced = time.perf_counter()
        if it == 0:
            trace.append("OPT")
        if opt is not None:
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            opt.step()
        t_stepped = time.perf_counter()
        # The iteration ends when every rank is done; the sum of the last
        # stage's scaled losses is the mean loss over the global batch.
        total = torch.tensor([loss_sum], dtype=torch.float64, device=dev)
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        t_end = time.perf_counter()
        elapsed = t_end - t_start
        for name, seconds in (
            ("compute", t_schedule_end - t_start - comm.recv_s),
            ("recv_wait", comm.recv_s),
            ("send_wait", t_sent - t_schedule_end),
            ("allreduce", t_reduced - t_sent),
            ("optimizer", t_stepped - t_reduced),
            ("end_sync", t_end - t_stepped),
        ):
            phase_ms[name].append(seconds * 1e3)
        iteration_ms.append(elapsed * 1e3)
        losses.append(float(total[0]))
        bubble_s += comm.recv_s
        compute_s += elapsed - comm.recv_s
        if job.log and rank == 0:
            log_line(f"step {it + 1}/{job.steps} loss {losses[-1]:.6f} {elapsed * 1e3:.1f} ms")
        done = it + 1
        if job.eval_every and done % job.eval_every == 0:
            evaluated = evaluate(ctx, job, done)
            if evaluated is not None:
                evaluations.append(evaluated)
                if job.log:
                    log_line(eval_line(evaluated))
        if job.checkpoint_dir and job.checkpoint_every and done % job.checkpoint_every == 0:
            ctx.save_checkpoint(job, done)
    metrics = {
        "stage": stage,
        "replica": replica,
        "iteration_ms": iteration_ms,
        "losses": losses,
        "compute_ms": compute_s * 1e3,
        "bubble_ms": bubble_s * 1e3,
        "phase_ms": phase_ms,
        "peak_memory_bytes": meter.peak_bytes(),
        "memory_before_bytes": meter.baseline_bytes,
        "memory_source": meter.source,
        "evaluations": evaluations,
    }
    return {"state": prefixed_state(layers, a), "trace": trace, "peak_in_flight": peak, "metrics": metrics}
