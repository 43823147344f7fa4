"""Tensor parallelism (Whale's ``split``, Megatron-LM's layers): a layer
sharded over the t ranks of its replica's split group.

A model's layer declares how it splits with two attributes: a list of
``split_patterns`` (the profile's ``layers[i].split``, from the core's
``transformer_splits``) and ``shard(group) -> nn.Module``, the rank's shard
built from the whole layer (so every rank starts from the weights of the
one seeded build). Shards here are plain modules with plain tensors:
column-parallel then row-parallel matrices joined by Megatron's two
autograd functions (:func:`copy_to_split`: identity forward, AllReduce of
the gradient backward; :func:`reduce_from_split`: AllReduce forward,
identity backward).

Why not ``torch.distributed.tensor.parallel``: its ColwiseParallel and
RowwiseParallel turn parameters into DTensors, and everything else the
runtime does with a stage's parameters works on plain tensors: the flat
gradient AllReduce over the replicas (``rank.allreduce_grads``),
``ZeroRedundancyOptimizer`` (ZeRO-1), checkpoints and
``torch.func.functional_call``. ``nn.MultiheadAttention`` also packs Q, K
and V in one ``in_proj_weight``, which a column plan cannot shard by heads;
and its ``loss_parallel`` must run the backward inside its context, while
the executor runs each backward later, pass by pass. Plain shards keep all
of that unchanged, and gloo on the CPU runs them.

Parameters every shard keeps whole (layer norms, the biases added after a
row-parallel matrix, position embeddings) get equal gradients on every
shard, so they need no AllReduce over the split group: their inputs and
output gradients are the same on every shard.

Each shard gives back the whole layer's state (:meth:`full_state`, an
all-gather over the split group) under the whole layer's names, so a run's
result compares with single-process training.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from .context_parallel import ContextGroup, attention, token_positions
from .fully_sharded import whole
from .groups import GroupMember


@dataclass(frozen=True)
class SplitGroup(GroupMember):
    """The t ranks a replica's layers are sharded over: this rank is shard
    ``index`` of ``size``; ``group`` is their process group."""


class _CopyToSplit(torch.autograd.Function):
    """Megatron's f: the input of column-parallel matrices; the gradient
    sums the shards' parts."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromSplit(torch.autograd.Function):
    """Megatron's g: the output of row-parallel matrices, summed over the
    shards; the gradient is every shard's as it is."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to_split(x: torch.Tensor, split: SplitGroup) -> torch.Tensor:
    return _CopyToSplit.apply(x, split.group)


def reduce_from_split(x: torch.Tensor, split: SplitGroup) -> torch.Tensor:
    return _ReduceFromSplit.apply(x, split.group)


def _part(t: torch.Tensor, split: SplitGroup, dim: int) -> torch.Tensor:
    """This shard's contiguous part of ``t`` along ``dim``."""
    return nn.Parameter(t.detach().chunk(split.size, dim)[split.index].clone())


def _gathered(t: torch.Tensor, split: SplitGroup) -> list[torch.Tensor]:
    parts = [torch.empty_like(t) for _ in range(split.size)]
    dist.all_gather(parts, t.detach().contiguous(), group=split.group)
    return parts


class ShardedModule(nn.Module):
    """A layer held in part: a shard of a split group, or a member's part
    of a layer whose experts are spread (``experts.SpreadMoEBlock``).
    ``full_state()`` is the whole layer's state (every rank holding a part
    must call it together)."""

    def full_state(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError


class ShardedBlock(ShardedModule):
    """A transformer block (``models.TransformerBlock``) at 1/t of its
    attention heads and MLP columns: Q, K, V and the first MLP matrix split
    by columns, the attention output and the second MLP matrix by rows."""

    def __init__(self, block: nn.Module, split: SplitGroup):
        super().__init__()
        self.split, self.pre_ln = split, block.pre_ln
        attn, t = block.attn, split.size
        self.heads, self.d_model = attn.num_heads // t, attn.embed_dim
        self.ln1, self.ln2 = block.ln1, block.ln2
        # in_proj packs [Q; K; V]: this shard's heads of each, side by side.
        w, b = attn.in_proj_weight.detach().chunk(3, 0), attn.in_proj_bias.detach().chunk(3, 0)
        self.qkv_weight = nn.Parameter(torch.cat([_part(m, split, 0) for m in w]))
        self.qkv_bias = nn.Parameter(torch.cat([_part(v, split, 0) for v in b]))
        self.out_weight = _part(attn.out_proj.weight, split, 1)
        self.out_bias = attn.out_proj.bias  # whole: added once, after the sum
        fc1, fc2 = block.mlp[0], block.mlp[2]
        self.fc1_weight, self.fc1_bias = _part(fc1.weight, split, 0), _part(fc1.bias, split, 0)
        self.fc2_weight, self.fc2_bias = _part(fc2.weight, split, 1), fc2.bias
        self.causal = block.causal

    #: The rank's context group where its stage also cuts sequences: this
    #: shard's heads' keys and values are gathered over the same shard of
    #: every context rank.
    context: ContextGroup | None = None

    def _attend(self, h):
        b, n, _ = h.shape
        q, k, v = F.linear(copy_to_split(h, self.split), self.qkv_weight, self.qkv_bias).chunk(3, -1)
        q, k, v = (m.reshape(b, n, self.heads, -1).transpose(1, 2) for m in (q, k, v))
        out = attention(q, k, v, causal=self.causal, context=self.context).transpose(1, 2).reshape(b, n, -1)
        return reduce_from_split(F.linear(out, self.out_weight), self.split) + self.out_bias

    def _mlp(self, h):
        h = F.gelu(F.linear(copy_to_split(h, self.split), self.fc1_weight, self.fc1_bias))
        return reduce_from_split(F.linear(h, self.fc2_weight), self.split) + self.fc2_bias

    def forward(self, x):
        if self.pre_ln:
            x = x + self._attend(self.ln1(x))
            return x + self._mlp(self.ln2(x))
        x = self.ln1(x + self._attend(x))
        return self.ln2(x + self._mlp(x))

    def full_state(self) -> dict[str, torch.Tensor]:
        s = self.split
        qkv = [p.chunk(3, 0) for p in _gathered(self.qkv_weight, s)]
        qkv_b = [p.chunk(3, 0) for p in _gathered(self.qkv_bias, s)]
        state = {
            "attn.in_proj_weight": torch.cat([part[i] for i in range(3) for part in qkv]),
            "attn.in_proj_bias": torch.cat([part[i] for i in range(3) for part in qkv_b]),
            "attn.out_proj.weight": torch.cat(_gathered(self.out_weight, s), 1),
            "attn.out_proj.bias": self.out_bias,
            "mlp.0.weight": torch.cat(_gathered(self.fc1_weight, s), 0),
            "mlp.0.bias": torch.cat(_gathered(self.fc1_bias, s), 0),
            "mlp.2.weight": torch.cat(_gathered(self.fc2_weight, s), 1),
            "mlp.2.bias": self.fc2_bias,
        }
        for name, norm in (("ln1", self.ln1), ("ln2", self.ln2)):
            state.update({f"{name}.{k}": v for k, v in norm.state_dict().items()})
        return {k: v.detach().clone() for k, v in state.items()}


class ShardedEmbedding(ShardedModule):
    """Token embedding split over the vocabulary: each shard looks up the
    ids in its rows (zeros for the others) and an AllReduce sums them; the
    position embedding (and a norm) are kept whole."""

    def __init__(self, embedding: nn.Module, split: SplitGroup):
        super().__init__()
        self.split = split
        self.rows = embedding.tok.num_embeddings // split.size
        self.tok_weight = _part(embedding.tok.weight, split, 0)
        self.pos, self.norm = embedding.pos, embedding.norm

    context: ContextGroup | None = None

    def forward(self, ids):
        local = ids - self.split.index * self.rows
        mine = (local >= 0) & (local < self.rows)
        found = F.embedding(torch.where(mine, local, 0), self.tok_weight) * mine.unsqueeze(-1)
        positions = token_positions(ids.shape[1], self.context, ids.device)
        return self.norm(reduce_from_split(found, self.split) + self.pos(positions))

    def full_state(self) -> dict[str, torch.Tensor]:
        state = {"tok.weight": torch.cat(_gathered(self.tok_weight, self.split), 0)}
        state.update({f"pos.{k}": v for k, v in self.pos.state_dict().items()})
        state.update({f"norm.{k}": v for k, v in self.norm.state_dict().items()})
        return {k: v.detach().clone() for k, v in state.items()}


class ShardedLMHead(ShardedModule):
    """The LM head split over the vocabulary (Whale's SP1): the norm whole,
    this shard's rows of the projection; its output is the shard's logits,
    which :meth:`parallel_loss` turns into the model's loss with a
    distributed softmax."""

    def __init__(self, head: nn.Module, split: SplitGroup):
        super().__init__()
        self.split = split
        self.ln = head.ln
        self.rows = head.proj.out_features // split.size
        self.proj_weight = _part(head.proj.weight, split, 0)

    context: ContextGroup | None = None

    def forward(self, x):
        return F.linear(copy_to_split(self.ln(x), self.split), self.proj_weight)

    def parallel_loss(self, local_logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean cross-entropy over tokens (``models._lm_loss``) from
        each shard's logits: the same number on every shard. In fp32 under
        autocast too, as autocast computes ``cross_entropy``: the sums of
        exponentials would lose the loss's precision in bf16."""
        flat = local_logits.reshape(-1, local_logits.shape[-1]).float()
        per_token = _VocabParallelCrossEntropy.apply(flat, targets.reshape(-1), self.split.index * self.rows,
                                                     self.split.group)
        return per_token.mean()

    def full_state(self) -> dict[str, torch.Tensor]:
        state = {f"ln.{k}": v for k, v in self.ln.state_dict().items()}
        state["proj.weight"] = torch.cat(_gathered(self.proj_weight, self.split), 0)
        return {k: v.detach().clone() for k, v in state.items()}


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy of logits split over the vocabulary (Megatron-LM's):
    each token's maximum, sum of exponentials and target logit are reduced
    over the shards, never the logits themselves."""

    @staticmethod
    def forward(ctx, logits, targets, first_row, group):
        top = logits.max(-1).values.detach()
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - top.unsqueeze(-1)
        local = targets - first_row
        mine = (local >= 0) & (local < logits.shape[-1])
        local = torch.where(mine, local, 0)
        target_logit = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1) * mine
        exp = shifted.exp()
        total = exp.sum(-1)
        both = torch.stack([target_logit, total])
        dist.all_reduce(both, group=group)
        target_logit, total = both[0], both[1]
        ctx.save_for_backward(exp / total.unsqueeze(-1), local, mine)
        return total.log() - target_logit

    @staticmethod
    def backward(ctx, grad):
        softmax, local, mine = ctx.saved_tensors
        g = softmax.clone()
        g.scatter_add_(-1, local.unsqueeze(-1), -mine.to(g.dtype).unsqueeze(-1))
        return g * grad.unsqueeze(-1), None, None, None


def shard_layers(layers: list[nn.Module], split: SplitGroup) -> list[nn.Module]:
    """Each layer's shard (each declares ``shard``; ``config.check_split_layers``
    has checked that it can split at ``split.size``)."""
    return [layer.shard(split) for layer in layers]


def full_state(layers: list[nn.Module], first_index: int) -> dict[str, torch.Tensor]:
    """The whole state of a stage's ``layers`` keyed as
    ``training.prefixed_state`` keys it, shards gathered back (every shard
    of a split group must call this together)."""
    out = {}
    for i, layer in enumerate(layers):
        state = layer.full_state() if isinstance(layer, ShardedModule) else layer.state_dict()
        for k, v in state.items():
            out[f"{first_index + i}.{k}"] = whole(v).detach().to("cpu", copy=True)
    return out
