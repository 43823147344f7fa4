"""Learning curves: the model a run has trained so far, on the validation
split its factory declares (``ModelSpec.validation``), every
``--eval-every`` steps. Every rank must call :func:`evaluate` at the same
step (it gathers over the process group); rank 0 scores the whole model in
its own process and returns the result."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .tensor_parallel import full_state
from .training import layers_of


def evaluate(stages, job, step: int) -> dict[str, Any] | None:
    """``{"step", "loss", "accuracy"}`` of the model after ``step`` steps,
    on rank 0 (None elsewhere): replica 0 of every stage sends its layers'
    state to rank 0, which loads them into a fresh build of the model.
    ``stages``: the rank's (one, or a chunked plan's chunks)."""
    state: dict[str, torch.Tensor] = {}
    for ctx in stages:
        part = full_state(ctx.layers, ctx.layer_range[0])  # every shard of a split group gathers
        if ctx.replica == 0 and ctx.shard == 0:
            state.update(part)
    rank = stages[0].rank
    gathered: list[Any] | None = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(state, gathered, dst=0)
    if rank != 0:
        return None
    spec = job.config.layers_factory()
    model = nn.Sequential(*layers_of(spec))
    whole: dict[str, torch.Tensor] = {}
    for part in gathered:
        whole.update(part)
    model.load_state_dict(whole)
    model.eval()
    x, y = spec.validation()
    with torch.no_grad():
        out = model(x)
        loss = float(spec.loss(out, y))
        accuracy = float((out.argmax(-1) == y).float().mean()) if spec.classifies else None
    return {"step": step, "loss": loss, "accuracy": accuracy}


def declares_validation(made: Any) -> bool:
    """Whether a layers factory's result can be evaluated."""
    return getattr(made, "validation", None) is not None


def eval_line(evaluated: dict[str, Any]) -> str:
    """The log line of one evaluation."""
    line = f"eval after step {evaluated['step']}: validation loss {evaluated['loss']:.6f}"
    if evaluated["accuracy"] is not None:
        line += f", accuracy {evaluated['accuracy'] * 100:.2f}%"
    return line
