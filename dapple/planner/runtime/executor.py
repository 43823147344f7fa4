"""The one loop every schedule runs: a rank walks its stage's list of
passes (``_core.Pass``, typed by the core: ``F3``, ``B3``, ``AR``, ``OPT``
with the weights of each forward and backward, and the stage it computes)
in order, one handler per kind of action, as ``torch.distributed.pipelining``
executes its ``_Action`` lists. A rank of a chunked plan walks its order's
list over its chunks, each pass run by the chunk it names.

- ``F``: the input (the global batch's rows on the first stage, the
  previous stage's outputs elsewhere), the stage's forward, then the loss
  (last stage) or the send to the next stage.
- ``B``: the gradient of the output (received from the next stage; none on
  the last, whose output is the loss), the stage's backward, then the
  input's gradient sent back.
- ``AR``: the stage's gradients summed over its replicas.
- ``OPT``: one optimizer step on the accumulated gradients.

How a forward and a backward compute, and what they keep in between, is the
mode's (``compute.py``): the graph kept (synchronous schedules) or the
forward re-run on versioned weights (asynchronous ones). A list covers one
mini-batch (synchronous) or many (asynchronous); the last stage's loss on a
slice of n samples is scaled to the mean over the global batch
(``training.scaled_loss``). The list ends with this rank's sends complete.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from .. import _core
from .compute import KeptGraph, Replayed
from .config import Job
from .rank import RankSetup, step_optimizers
from .timing import EventTimer
from .training import scaled_loss


@dataclass
class ListRun:
    """What walking one list measured. Times in seconds."""

    #: The last stage's loss of each mini-batch of the list (its slices'
    #: scaled losses added up; empty on other stages).
    losses: dict[int, float] = field(default_factory=dict)
    #: Seconds from the list's start to each update, one per mini-batch.
    update_s: list[float] = field(default_factory=list)
    #: Most micro-batches whose activations were held at once.
    peak_in_flight: int = 0
    #: Forwards and backwards, less the waits in their receives.
    compute_s: float = 0.0
    #: The same on the GPU's clock (``timing.EventTimer``), where the
    #: executor was asked to time it; None on the CPU.
    gpu_compute_s: float | None = None
    recv_wait_s: float = 0.0
    allreduce_s: float = 0.0
    optimizer_s: float = 0.0
    #: Waiting, at the list's end, for its sends to complete.
    send_wait_s: float = 0.0


class Executor:
    """Runs lists of passes on one rank: ``Executor(ctx, job).run(passes,
    first_step, trace)``. ``trace``, when given, receives the actions run
    before the list's first update (``"F0"``, ``"B0"``, ..., ``"AR"`` when
    the stage reduces, ``"OPT"``; under a chunked plan each prefixed by its
    stage, ``"4F0"``). ``gpu_timing``: on CUDA, also time the
    forwards and backwards with CUDA events, read at the list's end
    (``ListRun.gpu_compute_s``): for one-step lists, whose events are few.
    ``chunks``: every stage the rank holds (a chunked plan's; ``ctx`` is
    the first), each pass run by the stage it names."""

    def __init__(self, ctx: RankSetup, job: Job, predictor=None, gpu_timing: bool = False,
                 chunks: Sequence[RankSetup] = ()):
        self.ctx = ctx
        self.chunks = {c.stage: c for c in chunks} if chunks else {ctx.stage: ctx}
        self.config = job.config
        # Asked of the core once, not at every pass.
        self.micro_batches = job.layout.micro_batches
        self.micro_batch_size = job.layout.micro_batch_size
        self.global_batch_size = job.layout.global_batch_size
        self.predictor = predictor
        self._handlers = {"F": self._forward, "B": self._backward, "I": self._input_gradient,
                          "W": self._weight_gradient, "AR": self._all_reduce, "OPT": self._update}
        self.gpu_timer = EventTimer() if gpu_timing and ctx.dev.type == "cuda" else None
        ctx.comm.gpu_timer = self.gpu_timer

    def run(self, passes: Sequence[_core.Pass], first_step: int, trace: list[str] | None = None) -> ListRun:
        if self.config.schedule is None:
            self.modes: dict[int, Any] = {s: KeptGraph(c, c.recompute) for s, c in self.chunks.items()}
        else:
            ctx = self.ctx
            self.modes = {ctx.stage: Replayed(ctx, passes, self.predictor, self.micro_batches, ctx.recompute)}
        self.first_step, self.trace, self.updates, self.steps_taken = first_step, trace, 0, 0
        self.batches: dict[int, Any] = {}
        self.losses: dict[int, torch.Tensor] = {}
        self.result = ListRun()
        self.ctx.comm.recv_s = 0.0
        for c in self.chunks.values():
            for p in c.params:
                p.grad = None
        self.t_start = time.perf_counter()
        for p in passes:
            # The stage the pass computes: the rank's one, or one of its chunks.
            self.ctx, self.mode = self.chunks[p.stage], self.modes[p.stage]
            self._handlers[p.action.kind](p)
        ctx = self.ctx
        t0 = time.perf_counter()
        ctx.comm.wait_all()
        self.result.send_wait_s = time.perf_counter() - t0
        self.result.recv_wait_s = ctx.comm.recv_s
        # The last stage's losses were kept on the device: read once, here.
        self.result.losses = {m: float(loss) for m, loss in self.losses.items()}
        if self.gpu_timer is not None:
            self.result.gpu_compute_s = self.gpu_timer.seconds()
        return self.result

    def _traced(self, action: _core.Action) -> None:
        if self.trace is not None and self.updates == 0:
            self.trace.append(str(action) if len(self.chunks) == 1 else f"{self.ctx.stage}{action}")

    def _batch(self, mini_batch: int):
        """The global batch of the list's ``mini_batch``, drawn once."""
        if mini_batch not in self.batches:
            step = self.first_step + mini_batch
            x_all, y_all = self.config.batches[step % len(self.config.batches)]
            if x_all.shape[0] != self.global_batch_size:
                raise ValueError(f"batch {step} has {x_all.shape[0]} samples, "
                                 f"the plan needs {self.global_batch_size}")
            self.batches[mini_batch] = (x_all, y_all)
        return self.batches[mini_batch]

    def _rows(self, p: _core.Pass, which: int) -> torch.Tensor:
        """This replica's rows of the pass's micro-batch: inputs (0) or
        targets (1), at this rank's tokens where its stage cuts sequences."""
        base = (p.action.micro_batch % self.micro_batches) * self.micro_batch_size
        rows = self._batch(p.mini_batch)[which][base + self.ctx.lo : base + self.ctx.hi]
        return (rows if self.ctx.context is None else self.ctx.context.cut(rows)).to(self.ctx.dev)

    def _loss(self, out: torch.Tensor, p: _core.Pass) -> torch.Tensor:
        """The loss of the last stage's slice (its tokens where it cuts
        sequences), scaled to the global batch (under the run's autocast,
        like the forward)."""
        c, context = self.config, self.ctx.context
        n = self.ctx.hi - self.ctx.lo
        loss_fn = self.ctx.loss_fn or c.loss_fn
        with self.ctx.precision.autocast():
            return scaled_loss(loss_fn, out, self._rows(p, 1), n, self.global_batch_size, c.loss_reduction,
                               parts=1 if context is None else context.size)

    def _backward_loss(self, out: torch.Tensor, p: _core.Pass) -> torch.Tensor:
        """What the last stage's backward starts from: the loss, times fp16's loss scale."""
        return self.ctx.precision.scaled(self._loss(out, p))

    def _timed_pass(self, work, p: _core.Pass) -> None:
        self._traced(p.action)
        t0, recv_before = time.perf_counter(), self.ctx.comm.recv_s
        gpu = self.gpu_timer.start() if self.gpu_timer is not None else None
        work(p)
        if gpu is not None:
            self.gpu_timer.stop(gpu)
        self.result.compute_s += time.perf_counter() - t0 - (self.ctx.comm.recv_s - recv_before)

    def _forward(self, p: _core.Pass) -> None:
        self._timed_pass(self._run_forward, p)

    def _backward(self, p: _core.Pass) -> None:
        self._timed_pass(self._run_backward, p)

    def _run_forward(self, p: _core.Pass) -> None:
        ctx, t = self.ctx, p.action.micro_batch
        x = self._rows(p, 0) if ctx.first else ctx.links.receive_input(t)
        out = self.mode.forward(p, x)
        if ctx.last:
            loss = self._loss(out, p)
            if ctx.shard == 0:  # every shard of a split replica has the same loss: count it once
                # Added up in float64 on the device, as Python adds floats,
                # without waiting for the device at each micro-batch.
                part = loss.detach().to(torch.float64)
                self.losses[p.mini_batch] = self.losses[p.mini_batch] + part if p.mini_batch in self.losses else part
            out = self.ctx.precision.scaled(loss)
        else:
            ctx.links.send_output(out, t)
        self.mode.keep(p, x, out)
        held = sum(mode.in_flight() for mode in self.modes.values())  # the rank's chunks together
        self.result.peak_in_flight = max(self.result.peak_in_flight, held)

    def _input_gradient(self, p: _core.Pass) -> None:
        self._timed_pass(self._run_backward, p)

    def _weight_gradient(self, p: _core.Pass) -> None:
        self._timed_pass(self.mode.differentiate_weights, p)

    def _run_backward(self, p: _core.Pass) -> None:
        """B, or a split backward's I: the input's gradient goes back at once."""
        ctx, t = self.ctx, p.action.micro_batch
        out, x = self.mode.replay(p, self._backward_loss)
        grad = None if ctx.last else ctx.links.receive_output_grad(out, t)
        if p.action.kind == "I":
            self.mode.differentiate_input(p, out, grad, x)
        else:
            self.mode.differentiate(out, grad, x)
        if not ctx.first:
            ctx.links.send_input_grad(x.grad if x.grad is not None else torch.zeros_like(x), t)

    def _all_reduce(self, p: _core.Pass) -> None:
        t0 = time.perf_counter()
        if self.ctx.reduce_gradients(skip=self.config.skip_allreduce):
            self._traced(p.action)
        self.result.allreduce_s += time.perf_counter() - t0

    def _update(self, p: _core.Pass) -> None:
        self._traced(p.action)
        t0 = time.perf_counter()
        self.mode.before_update(self.updates)
        self.steps_taken += 1
        # A rank's chunks step together, at its last chunk's OPT: fp16 skips
        # an overflowing step in all of them or none (``step_optimizers``).
        if self.steps_taken % len(self.chunks):
            self.result.optimizer_s += time.perf_counter() - t0
            return
        step_optimizers(list(self.chunks.values()))
        self.result.optimizer_s += time.perf_counter() - t0
        self.updates += 1
        self.batches.pop(self.updates - 1, None)
        self.ctx.comm.reap()
        self.result.update_s.append(time.perf_counter() - self.t_start)
