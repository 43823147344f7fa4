"""Sharding levels 2 and 3 of a stage (``docs/cost-model.md``, "Sharding"):
torch's FSDP2 (``torch.distributed.fsdp.fully_shard``) over the stage's
replica group, each layer a unit and the stage's module the root.

FSDP2 reduce-scatters each micro-batch's gradients as its backward makes
them and keeps only the rank's shard of the weights, gradients and
optimizer state between passes; a level-3 stage re-shards after the
forward where its plan says so. Level 2 runs as FSDP keeping the weights
from the forward to the backward: the same arithmetic; on this CPU runtime
the memory it holds between steps is not level 2's (the weights are
sharded there too), which only the planner's estimate counts.

dapple sums gradients over a stage's replicas (each loss is already a share
of the global batch's mean), where FSDP averages them by default: every
unit is told to sum, with a plain SUM reduction (gloo has no PREMUL_SUM,
which a divide factor alone asks for).

A checkpoint holds the stage's state whole (torch's
``torch.distributed.checkpoint.state_dict`` with ``full_state_dict``: the
weights and the optimizer's state gathered over the group, keyed by name),
in every rank's own file as an unsharded stage's is; resuming shards it
again (:func:`whole_state`, :func:`load_whole_state`). The gathered copy is
held for the moment of saving: the planner does not count it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def fully_shard_stage(module: nn.Sequential, group: Any, device: torch.device, *, reshard_after_forward: bool) -> None:
    """Shard ``module``'s layers and the module over ``group`` in place."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    mesh = DeviceMesh.from_group(group, device.type)
    for layer in module:
        if any(p.requires_grad for p in layer.parameters()):
            fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward)
    for unit in module.modules():
        if isinstance(unit, FSDPModule):
            unit.set_force_sum_reduction_for_comms(True)
            unit.set_gradient_divide_factor(1.0)


def whole_state(module: nn.Module, opt) -> tuple[dict, dict | None]:
    """The sharded stage's weights and optimizer state (None without an
    optimizer), whole (every rank of the group calls this together)."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    options = StateDictOptions(full_state_dict=True)
    model = get_model_state_dict(module, options=options)
    return model, (get_optimizer_state_dict(module, opt, options=options) if opt is not None else None)


def load_whole_state(module: nn.Module, opt, model: dict, optimizer: dict | None) -> None:
    """Shard :func:`whole_state`'s result back into the stage."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                         set_optimizer_state_dict)

    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(module, model, options=options)
    if opt is not None:
        set_optimizer_state_dict(module, opt, optimizer, options=options)


def whole(value: torch.Tensor) -> torch.Tensor:
    """A parameter or gradient whole, gathered where FSDP sharded it (every
    rank of its group must call this together)."""
    from torch.distributed.tensor import DTensor

    return value.full_tensor() if isinstance(value, DTensor) else value
