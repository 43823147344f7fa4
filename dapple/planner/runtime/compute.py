"""How a stage computes its forwards and backwards: the one difference
between the synchronous and the asynchronous schedules that the executor
(``executor.py``) leaves to its mode.

- :class:`KeptGraph` (early backward, GPipe, ZB-H1): each forward builds
  its autograd graph on the live weights and keeps it (or, with
  ``recompute``, only the stage input: ``torch.utils.checkpoint``) until
  its backward, whole (B) or split into the input gradient (I) and, later,
  the weight gradient (W) with torch's own ``stage_backward_input`` and
  ``stage_backward_weight`` (``torch.distributed.pipelining``).
- :class:`Replayed` (XPipe, PipeDream's weight stashing, SpecTrain,
  asynchronous without prediction; docs/xpipe.md): a backward may use other
  weights than its forward. The core's table (``_core.Pass``) says which
  weights each pass uses: the live ones, a version stashed at its forward,
  or a prediction ``s`` updates ahead made by the mini-batch's first pass
  in that direction (its bellwether) and cached for the others. With
  ``recompute``, each forward runs without autograd and keeps only the
  stage input; its backward re-runs the forward (with the forward's random
  state) on its own weights and differentiates that. Without, each forward
  keeps its graph, and its backward reads its own weights where the graph
  saved weights (``backward_weights.WeightedGraph``). Gradients, whatever
  weights they were computed on, accumulate into the live parameters,
  which the optimizer updates.

A mode is made for one list and holds what its passes keep between a
forward and its backward.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight
from torch.func import functional_call
from torch.utils.checkpoint import checkpoint

from .. import _core
from .backward_weights import WeightedGraph
from .rank import RankSetup

#: ``loss_of(out, pass)``: the last stage's loss of ``out``, scaled to the
#: global batch and by the loss scale (fp16): what its backward starts from.
LossOf = Callable[[torch.Tensor, _core.Pass], torch.Tensor]


def _each_layer_checkpointed(module: torch.nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    """The stage's layers in turn, each under its own non-reentrant
    checkpoint (which restores the RNG and autocast state it started with)."""
    for layer in module:
        x = checkpoint(layer, x, use_reentrant=False)
    return x


class KeptGraph:
    """Synchronous passes: the autograd graph of each forward kept for its
    backward."""

    def __init__(self, ctx: RankSetup, recompute: bool):
        self.ctx = ctx
        self.recompute = recompute
        self.inputs: dict[int, torch.Tensor] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        #: Split backwards between their I and their W: what the W needs
        #: (torch's parameter groups; or, on the first stage, whose input
        #: gradient nobody needs, the output and its gradient), by micro-batch.
        self.weights_pending: dict[int, object] = {}

    def forward(self, p: _core.Pass, x: torch.Tensor) -> torch.Tensor:
        ctx, t = self.ctx, p.action.micro_batch
        if not ctx.first:
            if x.is_floating_point():
                x.requires_grad_(True)
            self.inputs[t] = x
        with ctx.precision.autocast():
            if self.recompute and ctx.recompute_per_layer:
                # Per-layer re-computation (Megatron-LM's and torchtitan's
                # full activation checkpointing): each layer's input is kept,
                # and each layer re-runs just before its own backward.
                return ctx.computed(lambda: _each_layer_checkpointed(ctx.module, x))
            if self.recompute:
                # Stage-level re-computation (GPipe's, and DAPPLE's Table VI):
                # only the stage input is kept; the backward re-runs the
                # forward, restoring the RNG state and the autocast state it
                # started with (non-reentrant checkpoint records both).
                return ctx.computed(lambda: checkpoint(ctx.module, x, use_reentrant=False))
            return ctx.computed(lambda: ctx.module(x))

    def keep(self, p: _core.Pass, x: torch.Tensor, out: torch.Tensor) -> None:
        """Hold the forward's output (the scaled loss on the last stage) with its graph."""
        self.outputs[p.action.micro_batch] = out

    def in_flight(self) -> int:
        """Micro-batches whose activations are held: until B, or until W."""
        return len(self.outputs) + len(self.weights_pending)

    def replay(self, p: _core.Pass, loss_of: LossOf) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The forward's output and input, as the forward left them."""
        t = p.action.micro_batch
        return self.outputs.pop(t), self.inputs.pop(t, None)

    def differentiate(self, out: torch.Tensor, grad: torch.Tensor | None, x: torch.Tensor | None) -> None:
        if out.requires_grad:
            self.ctx.computed(lambda: out.backward(grad))

    def differentiate_input(self, p: _core.Pass, out: torch.Tensor, grad: torch.Tensor | None,
                            x: torch.Tensor | None) -> None:
        """I: the gradient of the stage input alone, into ``x.grad``; what
        its W needs stays (the graph, and the gradients where it splits)."""
        t = p.action.micro_batch
        if not out.requires_grad:
            self.weights_pending[t] = None
        elif x is None or not x.requires_grad:
            # The first stage: no stage waits for its input's gradient, so
            # the whole backward waits for the W.
            self.weights_pending[t] = (out, grad)
        else:
            grads = None if grad is None else [grad]
            _, groups = self.ctx.computed(
                lambda: stage_backward_input([out], grads, [x], iter(self.ctx.params)))
            self.weights_pending[t] = groups

    def differentiate_weights(self, p: _core.Pass) -> None:
        """W: the weight gradients the micro-batch's I left, added into the
        parameters' gradients."""
        pending = self.weights_pending.pop(p.action.micro_batch)
        if isinstance(pending, tuple):
            out, grad = pending
            self.ctx.computed(lambda: out.backward(grad))
        elif pending is not None:
            self.ctx.computed(lambda: stage_backward_weight(iter(self.ctx.params), pending))

    def before_update(self, version: int) -> None:
        """Nothing to keep: every pass uses the live weights."""


class Replayed:
    """Asynchronous passes: backwards on the weights the core's table gives
    them, re-running the forward (``recompute``) or on its kept graph."""

    def __init__(self, ctx: RankSetup, passes: Sequence[_core.Pass], predictor, micro_batches: int,
                 recompute: bool):
        self.ctx = ctx
        self.recompute = recompute
        #: Without ``recompute``: each forward's graph, output and input.
        self.kept: dict[int, tuple[WeightedGraph, torch.Tensor, torch.Tensor]] = {}
        self.predictor = predictor
        self.micro_batches = micro_batches
        self.names = [n for n, p in ctx.module.named_parameters() if p.requires_grad]
        # Versions a later backward uses after the live weights move past
        # them, and the last backward of each: PipeDream's stash.
        self.stash_needed: set[int] = set()
        self.last_use: dict[int, int] = {}
        for p in passes:
            if p.action.kind == "B" and p.predicted_updates == 0 and p.base_version != p.live_version:
                self.stash_needed.add(p.base_version)
                self.last_use[p.base_version] = p.action.micro_batch
        self.stash: dict[int, list[torch.Tensor]] = {}
        self.cache: dict[tuple[int, int], list[torch.Tensor]] = {}
        self.left: dict[tuple[int, int], int] = {}  # passes of (mini-batch, direction) still to run here
        self.inputs: dict[int, torch.Tensor] = {}
        # The random state each forward started from (the CPU's, and the GPU's
        # on CUDA), so the backward's re-run draws the same dropout masks.
        self.rng: dict[int, tuple] = {}
        self.cuda = [ctx.dev] if ctx.dev.type == "cuda" else []
        #: The weights of the backward being run, as leaves of its graph:
        #: from ``replay`` to ``differentiate``.
        self.leaves: list[torch.Tensor] = []
        #: Without ``recompute``: the graph of the forward being run, from
        #: ``forward`` to ``keep``.
        self.graphs: dict[int, WeightedGraph] = {}

    def _weights(self, p: _core.Pass) -> list[torch.Tensor]:
        live, ahead = self.ctx.params, p.predicted_updates
        if ahead > 0 and self.predictor is None:
            return live  # a stage without parameters: nothing to predict
        if ahead > 0:
            key = (p.mini_batch, 0 if p.action.kind == "F" else 1)
            if key not in self.cache:  # the bellwether predicts for its mini-batch
                self.cache[key] = self.predictor.predict(ahead)
                self.left[key] = self.micro_batches
            self.left[key] -= 1
            w = self.cache[key]
            if self.left[key] == 0:
                del self.cache[key], self.left[key]
            return w
        if p.base_version != p.live_version:
            return self.stash[p.base_version]
        return live

    def _run(self, w: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return functional_call(self.ctx.module, dict(zip(self.names, w)), (x,))

    def forward(self, p: _core.Pass, x: torch.Tensor) -> torch.Tensor:
        w = self._weights(p)
        if not self.recompute:
            graph = WeightedGraph(w)
            self.graphs[p.action.micro_batch] = graph
            if not self.ctx.first and x.is_floating_point():
                x.requires_grad_(True)
            with graph.recording(), self.ctx.precision.autocast():
                return self.ctx.computed(lambda: self._run(graph.leaves, x))
        self.rng[p.action.micro_batch] = (torch.get_rng_state(), [torch.cuda.get_rng_state(d) for d in self.cuda])
        with torch.no_grad(), self.ctx.precision.autocast():
            return self.ctx.computed(lambda: self._run(w, x))

    def keep(self, p: _core.Pass, x: torch.Tensor, out: torch.Tensor) -> None:
        """With ``recompute``, hold only the stage input: the backward
        re-runs the forward. Without, the graph (and the scaled loss on the
        last stage), but no copy of the forward's weights."""
        t = p.action.micro_batch
        if self.recompute:
            self.inputs[t] = x
            return
        graph = self.graphs.pop(t)
        graph.release()
        self.kept[t] = (graph, out, x)

    def in_flight(self) -> int:
        return len(self.inputs) + len(self.kept)

    def replay(self, p: _core.Pass, loss_of: LossOf) -> tuple[torch.Tensor, torch.Tensor]:
        """The forward's output (the scaled loss on the last stage) and its
        input, differentiated on this backward's weights: re-run on them
        with the forward's random state (``recompute``), or the kept graph
        reading them where it saved weights."""
        ctx, t = self.ctx, p.action.micro_batch
        w = self._weights(p)
        if not self.recompute:
            graph, out, x = self.kept.pop(t)
            graph.rebind(w)
            self.leaves = graph.leaves
            for leaf, live in zip(self.leaves, ctx.params):
                leaf.grad = live.grad
            self._release_stash(p)
            return out, x
        x = self.inputs.pop(t)
        x = x.detach().requires_grad_(not ctx.first and x.is_floating_point())
        self.leaves = [v.detach().requires_grad_(True) for v in w]
        for leaf, live in zip(self.leaves, ctx.params):
            # Accumulate straight into the live gradient, parameter by
            # parameter during the backward, as autograd does for a
            # module's own parameters: no second set of gradients.
            leaf.grad = live.grad
        with torch.random.fork_rng(devices=self.cuda):
            cpu_state, gpu_states = self.rng.pop(t)
            torch.set_rng_state(cpu_state)
            for d, state in zip(self.cuda, gpu_states):
                torch.cuda.set_rng_state(state, d)
            # Under the forward's autocast too, so the re-run computes what
            # the forward sent (the loss_of scales and casts its own loss).
            with torch.enable_grad(), ctx.precision.autocast():
                out = ctx.computed(lambda: self._run(self.leaves, x))
                if ctx.last:
                    out = loss_of(out, p)
        self._release_stash(p)
        return out, x

    def _release_stash(self, p: _core.Pass) -> None:
        """Drop a stashed version after the last backward that uses it."""
        if self.last_use.get(p.base_version) == p.action.micro_batch:
            del self.stash[p.base_version]

    def differentiate(self, out: torch.Tensor, grad: torch.Tensor | None, x: torch.Tensor) -> None:
        leaves, self.leaves = self.leaves, []
        targets = leaves + ([x] if x.requires_grad else [])
        if out.requires_grad and targets:
            self.ctx.computed(lambda: torch.autograd.backward(out, grad, inputs=targets))
        for live, leaf in zip(self.ctx.params, leaves):
            live.grad = leaf.grad

    def before_update(self, version: int) -> None:
        """Let the predictor see the gradients, and stash the weights a later
        backward computes with."""
        if self.predictor is not None:
            self.predictor.observe()
        if version in self.stash_needed:
            self.stash[version] = [p.detach().clone() for p in self.ctx.params]
