"""The reference trainer: the whole model in one process. The tests hold
every plan's run to it (gradients equal to single-device training)."""

from __future__ import annotations

import torch
from torch import nn

from .training import Precision, build_layers, make_optimizer, prefixed_state, scaled_loss


def train_single_process(
    layers_factory,
    loss_fn,
    batches,
    steps: int | None = None,
    lr: float = 0.1,
    optimizer: str = "sgd",
    seed: int = 0,
    loss_reduction: str = "mean",
    dtype: str = "fp32",
    micro_batches: int = 1,
    losses: list[float] | None = None,
    loss_scales: list[float] | None = None,
) -> dict[str, torch.Tensor]:
    """Plain training of the whole model on the global batches (loss = mean
    over each global batch), returning the Sequential state.

    ``dtype``: the forward and the loss under ``torch.autocast`` on the CPU
    (fp16 with torch's GradScaler), as ``dapple run --dtype`` computes.
    ``micro_batches``: the gradient accumulated over that many equal slices
    of each global batch, in order, as a pipeline does; under autocast the
    slices' gradients are rounded apart, so this is the loop a pipelined
    run matches to fp32's rounding. ``losses`` and ``loss_scales``, when
    given, receive each step's loss and fp16's loss scale after it."""
    layers = build_layers(layers_factory, seed)
    model = nn.Sequential(*layers)
    opt = make_optimizer(model.parameters(), optimizer, lr)
    precision = Precision.single(dtype)
    steps = len(batches) if steps is None else steps
    for it in range(steps):
        x_all, y_all = batches[it % len(batches)]
        gbs = x_all.shape[0]
        opt.zero_grad(set_to_none=False)
        total = 0.0
        for x, y in zip(x_all.chunk(micro_batches), y_all.chunk(micro_batches)):
            with precision.autocast():
                loss = scaled_loss(loss_fn, model(x), y, x.shape[0], gbs, loss_reduction)
            precision.scaled(loss).backward()
            total += float(loss.detach())
        precision.step_all([opt])
        if losses is not None:
            losses.append(total)
        if loss_scales is not None:
            loss_scales.append(precision.loss_scale)
    return prefixed_state(layers, 0)
