"""The reference trainer: the whole model in one process. The tests hold
every plan's run to it (gradients equal to single-device training)."""

from __future__ import annotations

import torch
from torch import nn

from .training import build_layers, make_optimizer, prefixed_state, scaled_loss


def train_single_process(
    layers_factory,
    loss_fn,
    batches,
    steps: int | None = None,
    lr: float = 0.1,
    optimizer: str = "sgd",
    seed: int = 0,
    loss_reduction: str = "mean",
) -> dict[str, torch.Tensor]:
    """Plain training of the whole model on the global batches (loss = mean
    over each global batch), returning the Sequential state."""
    layers = build_layers(layers_factory, seed)
    model = nn.Sequential(*layers)
    opt = make_optimizer(model.parameters(), optimizer, lr)
    steps = len(batches) if steps is None else steps
    for it in range(steps):
        x, y = batches[it % len(batches)]
        opt.zero_grad(set_to_none=False)
        loss = scaled_loss(loss_fn, model(x), y, x.shape[0], x.shape[0], loss_reduction)
        loss.backward()
        opt.step()
    return prefixed_state(layers, 0)
