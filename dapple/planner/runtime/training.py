"""What every trainer shares, the pipeline's workers and the reference
single-process trainer alike: building the model's layers, the optimizer,
the loss scaling, the precision (``Precision``) and the state naming."""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
from torch import nn

from ..precision import check_precision, torch_dtype


class Precision:
    """How a trainer computes in ``dtype``: its forwards and its loss under
    ``torch.autocast`` on ``device_type`` ("cpu" or "cuda"), while the
    parameters, their gradients and the optimizer's state stay fp32; with
    fp16, the loss scaled by torch's own GradScaler (fp16's range would
    flush small gradients to zero). Made by :meth:`single` (one process) or
    :meth:`for_rank` (one rank of a run)."""

    def __init__(self, dtype: str, device: torch.device, scaler=None):
        check_precision(dtype)
        self.dtype = dtype
        self.device = device
        self.scaler = scaler
        self._idle_opts: list = []

    @classmethod
    def single(cls, dtype: str, device: torch.device = torch.device("cpu")) -> "Precision":
        """For a trainer alone in its process: a plain ``GradScaler`` for fp16."""
        return cls(dtype, device, torch.amp.GradScaler(device.type) if dtype == "fp16" else None)

    @classmethod
    def for_rank(cls, dtype: str, device: torch.device) -> "Precision":
        """For one rank of a run whose process group is up. fp16 scales with
        ``ShardedGradScaler`` (torch's GradScaler that all-reduces its
        found-inf flag) over every rank: the last stage scales the loss and
        every stage's gradients come from it, so every rank must unscale by
        the same scale, and skip an overflowing step and lower the scale
        together, or the stages and replicas would part."""
        if dtype != "fp16":
            return cls(dtype, device)
        import torch.distributed as dist
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        scaler = ShardedGradScaler(device.type, process_group=dist.group.WORLD)
        # Only the last stage scales a loss; scaling a placeholder makes the
        # scale on every rank, on the rank's device, for unscale_ and update.
        scaler.scale(torch.zeros((), device=device))
        return cls(dtype, device, scaler)

    def autocast(self):
        """The context a forward and a loss run in. A backward runs outside
        it, in the dtypes its forward recorded; ``torch.utils.checkpoint``
        re-runs a forward under the autocast state it first ran in."""
        if self.dtype == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=torch_dtype(torch, self.dtype))

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss a backward starts from: multiplied by the loss scale under fp16."""
        return loss if self.scaler is None else self.scaler.scale(loss)

    def step_all(self, opts: list) -> None:
        """One optimizer step of each of a rank's stages (one, or a chunked
        plan's chunks) on the accumulated gradients: under fp16 unscaled
        first, and skipped (the scale lowered once) where any of them, in any
        stage of any rank, is not finite. A stage without parameters (its
        optimizer None) still joins the ranks' inf check, with a placeholder
        optimizer whose one gradient is zero, so that every rank checks as
        many optimizers, in the same order, and keeps the scale the others
        keep."""
        if self.scaler is None:
            for opt in opts:
                if opt is not None:
                    opt.step()
            return
        opts = [opt if opt is not None else self._idle_optimizer(i) for i, opt in enumerate(opts)]
        for opt in opts:
            self.scaler.unscale_(opt)  # ShardedGradScaler sums each one's found-inf over the ranks
        overflowed = any(float(found) > 0 for state in self.scaler._per_optimizer_states.values()
                         for found in state["found_inf_per_device"].values())
        if not overflowed:
            for opt in opts:
                self.scaler.step(opt)  # unscaled already: steps
        self.scaler.update()  # lowers the scale where any optimizer overflowed

    def _idle_optimizer(self, i: int):
        """The placeholder optimizer of a rank's ``i``-th stage without parameters."""
        while len(self._idle_opts) <= i:
            w = torch.zeros(1, device=self.device, requires_grad=True)
            self._idle_opts.append(torch.optim.SGD([w], lr=0.0))
        opt = self._idle_opts[i]
        opt.param_groups[0]["params"][0].grad = torch.zeros(1, device=self.device)
        return opt

    @property
    def loss_scale(self) -> float | None:
        """The current loss scale (None without loss scaling)."""
        return None if self.scaler is None else float(self.scaler.get_scale())

    def state_dict(self) -> dict | None:
        return None if self.scaler is None else self.scaler.state_dict()

    def load_state_dict(self, state: dict | None) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)


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


def make_optimizer(params, optimizer: str, lr: float, offload: bool = False):
    """The optimizer named ``optimizer`` (``optimizers.OPTIMIZERS``) over
    ``params``, stepped on the host where ``offload`` (:func:`host_stepped`);
    None when there are none."""
    params = list(params)
    return _optimizer_class(optimizer, offload)(params, lr=lr, **_arguments(optimizer)) if params else None


def make_sharded_optimizer(params, optimizer: str, lr: float, group, offload: bool = False):
    """ZeRO-1: the optimizer named ``optimizer`` with its state sharded over
    the ranks of ``group`` (``ZeroRedundancyOptimizer``: each rank steps
    its part of the parameters, on the host where ``offload``, and
    broadcasts it); None without parameters."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    params = list(params)
    if not params:
        return None
    return ZeroRedundancyOptimizer(params, optimizer_class=_optimizer_class(optimizer, offload), process_group=group,
                                   lr=lr, **_arguments(optimizer))


def stage_optimizer(parts: list, optimizer: str, lr: float, *, shard: bool, offload: bool):
    """A stage's optimizer over ``parts``, (parameters, group) pairs: one
    optimizer over each part that has parameters, ZeRO-1 over its group
    where the stage shards its state and the group is not the rank alone;
    one part's alone, several together (:class:`StageOptimizers`), None
    without parameters."""
    made = [make_sharded_optimizer(params, optimizer, lr, group, offload=offload) if shard and group is not None
            else make_optimizer(params, optimizer, lr, offload=offload)
            for params, group in parts if params]
    if not made:
        return None
    return made[0] if len(made) == 1 else StageOptimizers(made)


def local_optimizer(opt):
    """The optimizer this rank steps: under ZeRO-1 the one over its part of
    the parameters, whose state each rank saves and loads as its own (the
    partition is the same in every run of the plan), so checkpoints need no
    gathering."""
    return getattr(opt, "optim", opt)


class StageOptimizers:
    """A stage's optimizers where its parameters step apart: the dense ones
    (ZeRO-1 over the replica group) and the routed experts a rank holds
    (ZeRO-1 over the ranks holding the same ones). Stepped, saved and loaded
    together; torch's GradScaler unscales their parameter groups as one
    optimizer's."""

    def __init__(self, parts: list):
        self.parts = parts

    @property
    def param_groups(self) -> list[dict]:
        return [group for part in self.parts for group in part.param_groups]

    def step(self, closure=None):
        for part in self.parts:
            part.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts:
            part.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {"parts": [local_optimizer(part).state_dict() for part in self.parts]}

    def load_state_dict(self, state: dict) -> None:
        for part, saved in zip(self.parts, state["parts"], strict=True):
            local_optimizer(part).load_state_dict(saved)


def _optimizer_class(optimizer: str, offload: bool):
    from .optimizers import OPTIMIZERS

    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}; use {', '.join(OPTIMIZERS)}")
    cls = getattr(torch.optim, OPTIMIZERS[optimizer][0])
    return host_stepped(cls) if offload else cls


def _arguments(optimizer: str) -> dict:
    from .optimizers import OPTIMIZERS

    return OPTIMIZERS[optimizer][1]


def host_stepped(optimizer_class: type) -> type:
    """``optimizer_class`` with its master weights, state and step in host
    memory (ZeRO-Offload; DeepSpeed's ``offload_optimizer``, Megatron-LM's
    ``--optimizer-cpu-offload``): the device keeps the weights the passes
    use and their gradients; a step copies the gradients to fp32 masters on
    the CPU, steps them there, and copies the weights back. On the CPU
    device the copies are plain copies: the run computes what the device
    would, step for step."""

    class HostStepped(torch.optim.Optimizer):
        def __init__(self, params, **defaults):
            super().__init__(params, defaults)
            host = torch.device("cpu")
            self.masters = {p: p.detach().to(host, torch.float32, copy=True)
                            for group in self.param_groups for p in group["params"]}
            self.host = optimizer_class([{**_hyper(group), "params": [self.masters[p] for p in group["params"]]}
                                         for group in self.param_groups], **defaults)

        @torch.no_grad()
        def step(self, closure=None):
            pairs = [(p, self.masters[p]) for group in self.param_groups for p in group["params"]]
            for group, host_group in zip(self.param_groups, self.host.param_groups):
                host_group.update(_hyper(group))  # a learning rate set on this optimizer
            for p, master in pairs:
                master.grad = None if p.grad is None else p.grad.to(master.device, torch.float32, copy=True)
            self.host.step()
            for p, master in pairs:
                p.copy_(master)
            return None

        def state_dict(self):
            return self.host.state_dict()

        def load_state_dict(self, state_dict):
            """The host's state, and its masters from the weights (loaded
            from the same checkpoint before)."""
            self.host.load_state_dict(state_dict)
            with torch.no_grad():
                for p, master in self.masters.items():
                    master.copy_(p)

    HostStepped.__name__ = HostStepped.__qualname__ = f"HostStepped{optimizer_class.__name__}"
    return HostStepped


def _hyper(group: dict) -> dict:
    """A parameter group's settings, without its parameters."""
    return {k: v for k, v in group.items() if k != "params"}


def scaled_loss(loss_fn, out, tgt, n: int, gbs: int, reduction: str, parts: int = 1):
    """The loss of a slice of ``n`` samples, scaled so that the slices'
    gradients add up to the gradient of the mean loss over ``gbs`` samples.
    ``parts``: the slice's tokens are cut over that many context ranks, each
    holding as many: a mean over one rank's tokens weighs 1/parts of the
    slice's."""
    loss = loss_fn(out, tgt)
    if reduction == "mean":
        return loss * (n / (gbs * parts))
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
