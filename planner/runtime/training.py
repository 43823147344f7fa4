"""What every trainer shares, the pipeline's workers and the reference
single-process trainer alike: building the model's layers, the optimizer,
the loss scaling and the state naming."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn


def build_layers(layers_factory: Callable[[], Any], seed: int) -> list[nn.Module]:
    """The model's layers as modules, built after ``torch.manual_seed(seed)``.

    ``layers_factory()`` may return a ModelSpec-like object with ``.layers``,
    a list of ``(name, module)`` pairs, a list of modules, or an
    ``nn.Sequential``."""
    torch.manual_seed(seed)
    return layers_of(layers_factory())


def layers_of(made: Any) -> list[nn.Module]:
    """The modules of what a layers factory returned."""
    made = getattr(made, "layers", made)
    return [item[1] if isinstance(item, tuple) else item for item in made]


def make_optimizer(params, optimizer: str, lr: float):
    """The optimizer named ``optimizer`` (``optimizers.OPTIMIZERS``) over
    ``params``; None when there are none."""
    from .optimizers import OPTIMIZERS

    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}; use {', '.join(OPTIMIZERS)}")
    params = list(params)
    cls, kwargs = OPTIMIZERS[optimizer]
    return getattr(torch.optim, cls)(params, lr=lr, **kwargs) if params else None


def make_sharded_optimizer(params, optimizer: str, lr: float, group):
    """ZeRO-1: the optimizer named ``optimizer`` with its state sharded over
    the ranks of ``group`` (``ZeroRedundancyOptimizer``: each rank steps
    its part of the parameters and broadcasts it); None without parameters."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from .optimizers import OPTIMIZERS

    params = list(params)
    cls, kwargs = OPTIMIZERS[optimizer]
    if not params:
        return None
    return ZeroRedundancyOptimizer(params, optimizer_class=getattr(torch.optim, cls), process_group=group, lr=lr,
                                   **kwargs)


def scaled_loss(loss_fn, out, tgt, n: int, gbs: int, reduction: str):
    """The loss of a slice of ``n`` samples, scaled so that the slices'
    gradients add up to the gradient of the mean loss over ``gbs`` samples."""
    loss = loss_fn(out, tgt)
    if reduction == "mean":
        return loss * (n / gbs)
    if reduction == "sum":
        return loss / gbs
    raise ValueError(f"unknown loss_reduction {reduction!r}; use mean or sum")


def prefixed_state(layers: list[nn.Module], first_index: int) -> dict[str, torch.Tensor]:
    """State of ``layers`` keyed ``"<global layer index>.<name>"`` as
    ``nn.Sequential(*all_layers).state_dict()`` would."""
    out = {}
    for i, layer in enumerate(layers):
        for k, v in layer.state_dict().items():
            out[f"{first_index + i}.{k}"] = v.detach().to("cpu", copy=True)
    return out
