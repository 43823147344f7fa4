"""Context parallelism: a replica's sequences cut over the c ranks of its
context group, as Llama 3 and Megatron-LM cut them (the cost model's
``rust_core/core/src/model/context.rs``).

Each sample's tokens are cut in 2c equal chunks and context rank k holds
chunks k and 2c-1-k, so that under a causal mask every rank attends to as
many keys as the others (an early chunk sees few, its partner many). Every
layer computes its own tokens only; attention gathers the keys and values
of every rank of the group (Llama 3's all-gather form; the backward sums
each rank's part of their gradients) and masks by the tokens' positions in
the whole sequence. The loss of a rank is its tokens' mean, a c-th of the
sample's (``training.scaled_loss``), and the gradients are summed over the
replicas and context ranks together (the layout's replica groups).

A layer takes part by declaring a ``context`` attribute (None while it
sees whole sequences); :func:`cut_sequences` sets it on every module of a
stage that cuts its sequences, and ``config.check_context_layers`` refuses
a stage with a layer that does not declare one.

Why not torch's ``context_parallel``
(``torch.distributed.tensor.experimental``): it replaces only the CUDA
kernels of ``scaled_dot_product_attention`` (flash, efficient and cuDNN:
the handlers of its ``_attention.py`` in torch 2.9), so it does not run on
the CPU under gloo; it also needs DTensor inputs over a device mesh and
its context manager around both forward and backward, while the executor
runs each backward later, pass by pass.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from .groups import GroupMember


@dataclass(frozen=True)
class ContextGroup(GroupMember):
    """The c ranks one replica's sequences are cut over: this rank is
    context rank ``index`` of ``size``; ``group`` is their process group."""

    def positions(self, local_tokens: int, device: torch.device) -> torch.Tensor:
        """Positions in the whole sequence of this rank's ``local_tokens``
        tokens: its two chunks, k and 2c-1-k."""
        return _chunk_positions(self.index, self.size, local_tokens // 2, device)

    def cut(self, rows: torch.Tensor) -> torch.Tensor:
        """This rank's tokens of whole sequences (dimension 1 of ``rows``)."""
        chunk = rows.shape[1] // (2 * self.size)
        return rows[:, self.positions(2 * chunk, rows.device)]

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's ``t`` (batch, heads, tokens, dim) side by side in
        the group's order, along the tokens; differentiable."""
        return _GatherTokens.apply(t, self)

    def key_positions(self, local_tokens: int, device: torch.device) -> torch.Tensor:
        """Positions of the tokens :meth:`gather` puts side by side."""
        chunk = local_tokens // 2
        return torch.cat([_chunk_positions(k, self.size, chunk, device) for k in range(self.size)])


class _GatherTokens(torch.autograd.Function):
    """All-gather along the tokens; the backward sums every rank's
    gradient of this rank's part: a reduce-scatter on NCCL; gloo has none,
    so an AllReduce of the whole gradient, of which the rank keeps its part.
    (``torch.distributed.nn.functional.all_gather`` does this on gloo with a
    scatter from each rank that names group ranks as global ones, and fails
    on any group without rank 0: torch 2.9's ``_AlltoAll``.)"""

    @staticmethod
    def forward(ctx, t: torch.Tensor, context: ContextGroup) -> torch.Tensor:
        ctx.context = context
        parts = [torch.empty_like(t) for _ in range(context.size)]
        dist.all_gather(parts, t.contiguous(), group=context.group)
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        context = ctx.context
        if dist.get_backend(context.group) == dist.Backend.NCCL:
            parts = [part.contiguous() for part in grad.chunk(context.size, dim=2)]
            mine = torch.empty_like(parts[context.index])
            dist.reduce_scatter(mine, parts, group=context.group)
            return mine, None
        whole = grad.contiguous()
        dist.all_reduce(whole, group=context.group)
        return whole.chunk(context.size, dim=2)[context.index].contiguous(), None


def _chunk_positions(k: int, c: int, chunk: int, device: torch.device) -> torch.Tensor:
    return torch.cat([torch.arange(k * chunk, (k + 1) * chunk, device=device),
                      torch.arange((2 * c - 1 - k) * chunk, (2 * c - k) * chunk, device=device)])


def token_positions(n: int, context: ContextGroup | None, device: torch.device) -> torch.Tensor:
    """Positions of the ``n`` tokens a layer holds: 0..n-1, or its chunks'."""
    return torch.arange(n, device=device) if context is None else context.positions(n, device)


def self_attention(attn: nn.MultiheadAttention, h: torch.Tensor, *, causal: bool,
                   context: ContextGroup | None) -> torch.Tensor:
    """``attn`` (batch first, no dropout) over ``h``, its packed
    projections applied here so that the keys and values can be gathered."""
    b, n, d = h.shape
    q, k, v = F.linear(h, attn.in_proj_weight, attn.in_proj_bias).chunk(3, -1)
    q, k, v = (m.reshape(b, n, attn.num_heads, -1).transpose(1, 2) for m in (q, k, v))
    out = attention(q, k, v, causal=causal, context=context)
    return attn.out_proj(out.transpose(1, 2).reshape(b, n, d))


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
              context: ContextGroup | None) -> torch.Tensor:
    """Scaled dot-product attention of (batch, heads, tokens, dim) queries
    over the keys and values of the whole sequence: this rank's own, or
    every context rank's gathered; a query sees the keys at or before its
    position when ``causal``."""
    cut = None if context is None else (context.index, context.size)
    if context is not None:
        k, v = context.gather(k), context.gather(v)
    seen = _causal_mask(q.shape[2], cut, q.device) if causal else None
    return F.scaled_dot_product_attention(q, k, v, attn_mask=seen)


@functools.lru_cache(maxsize=64)
def _causal_mask(n: int, cut: tuple[int, int] | None, device: torch.device) -> torch.Tensor:
    """Which keys each of a rank's ``n`` queries sees under a causal mask:
    those at or before its position. ``cut``: the rank's (index, size) of
    its context group, whose keys are gathered. Made once a shape, as the
    blocks' mask buffer was, not at every pass."""
    context = None if cut is None else ContextGroup(None, *cut)
    queries_at = token_positions(n, context, device)
    keys_at = queries_at if context is None else context.key_positions(n, device)
    return keys_at[None, :] <= queries_at[:, None]


def cut_sequences(layers: list[nn.Module], context: ContextGroup) -> None:
    """Make every module of ``layers`` that declares a ``context`` compute
    this rank's tokens of each sequence."""
    for layer in layers:
        for module in layer.modules():
            if hasattr(module, "context"):
                module.context = context
