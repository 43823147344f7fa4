"""Expert parallelism (Whale's M6-MoE: the experts under ``split``, the
rest under ``replicate``, on the same GPUs): a mixture-of-experts layer's
routed experts spread over the e ranks of an expert group, the tokens
exchanged between them.

A layer declares its experts with two attributes: ``expert_pattern`` (the
profile's ``layers[i].experts``, from the core's ``transformer_splits``)
and ``spread(group) -> nn.Module``, the rank's part built from the whole
layer (so every rank starts from the weights of the one seeded build).
The core lays the groups out (``RunLayout``: ``expert_groups``, e
consecutive replicas each, and ``expert_replica_groups``, the ranks that
hold the same experts).

Member k of a group holds experts ``k E/e .. (k+1) E/e``. Each rank routes
its own tokens (the router is whole on every rank), sends each token's
copies to the members holding their experts and gets the results back:
two ``torch.distributed.nn.functional.all_to_all_single`` calls, whose
backward is the reverse exchange. gloo runs them on the CPU. The sizes of
each exchange differ from step to step (routing decides them), so each
forward first exchanges the counts.

Gradients: what every rank keeps whole (attention, norms, the router) is
reduced over the stage's replica group, as before; a routed expert's
gradient already holds every token of its group that reached it (the
exchange's backward brought them), and is reduced only over the ranks
holding the same experts in the other groups.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.nn.functional import all_to_all_single
from torch.nn import functional as F

from .context_parallel import ContextGroup, self_attention
from .groups import GroupMember
from .tensor_parallel import ShardedModule

#: ``run_experts(inputs, counts)``: the routed inputs grouped by expert,
#: ``counts[i]`` rows for expert i in expert order, through their experts,
#: in the same order.
RunExperts = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class ExpertGroup(GroupMember):
    """The e ranks a layer's routed experts are spread over: this rank is
    member ``index`` of ``size``; ``group`` is their process group."""


def route(h: torch.Tensor, router: nn.Linear, per_token: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's ``per_token`` experts and their weights: the largest
    router probabilities, renormalized over the chosen (Mixtral's)."""
    probabilities = F.softmax(router(h), dim=-1)
    weights, chosen = probabilities.topk(per_token, dim=-1)
    return chosen, weights / weights.sum(-1, keepdim=True)


def mixture(h: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, experts: int,
            run_experts: RunExperts) -> torch.Tensor:
    """The tokens ``h`` (rows) through their chosen experts, each copy
    weighted and summed back into its token's row."""
    per_token = chosen.shape[-1]
    order = chosen.reshape(-1).argsort(stable=True)  # copies grouped by expert
    token = order // per_token
    counts = torch.bincount(chosen.reshape(-1), minlength=experts)
    out = run_experts(h[token], counts) * weights.reshape(-1)[order].unsqueeze(-1)
    return torch.zeros_like(h).index_add(0, token, out)


def _experts_in_turn(experts: nn.ModuleList) -> RunExperts:
    def run(x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        parts = x.split(counts.tolist())
        return torch.cat([expert(part) for expert, part in zip(experts, parts)])

    return run


class MoEBlock(nn.Module):
    """A pre-LayerNorm transformer block whose MLP is a mixture of
    ``experts`` routed experts (GELU MLPs of ``expert_ffn`` columns, no
    biases, as Mixtral's have none), ``per_token`` a token, no shared
    experts and no capacity limit (no token dropped)."""

    def __init__(self, d_model: int, n_heads: int, *, experts: int, per_token: int, expert_ffn: int):
        super().__init__()
        self.experts_count, self.per_token = experts, per_token
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = nn.MultiheadAttention(d_model, n_heads, dropout=0.0, batch_first=True)
        self.ln2 = nn.LayerNorm(d_model)
        self.router = nn.Linear(d_model, experts, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(d_model, expert_ffn, bias=False), nn.GELU(),
                          nn.Linear(expert_ffn, d_model, bias=False))
            for _ in range(experts))

    #: The rank's context group where its stage cuts sequences (``context_parallel.py``).
    context: ContextGroup | None = None

    def attend(self, h: torch.Tensor) -> torch.Tensor:
        return self_attention(self.attn, h, causal=True, context=self.context)

    def mix(self, h: torch.Tensor, run_experts: RunExperts) -> torch.Tensor:
        flat = h.reshape(-1, h.shape[-1])
        chosen, weights = route(flat, self.router, self.per_token)
        return mixture(flat, chosen, weights, self.experts_count, run_experts).view_as(h)

    def forward(self, x):
        x = x + self.attend(self.ln1(x))
        return x + self.mix(self.ln2(x), _experts_in_turn(self.experts))

    def spread(self, group: ExpertGroup) -> nn.Module:
        """This rank's part: its E/e experts, everything else whole."""
        return SpreadMoEBlock(self, group)


class _Exchange:
    """One forward's token exchange in an expert group: how many copies
    each member sends each other member's experts."""

    def __init__(self, counts: torch.Tensor, group: ExpertGroup):
        e = group.size
        self.group = group
        self.local = counts.numel() // e
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=group.group)
        #: Copies for each of this member's experts, by sending member.
        self.received = received.view(e, self.local)
        self.send_splits = counts.view(e, self.local).sum(1).tolist()
        self.receive_splits = self.received.sum(1).tolist()

    def dispatch(self, x: torch.Tensor) -> torch.Tensor:
        out = x.new_empty(sum(self.receive_splits), x.shape[-1])
        return all_to_all_single(out, x, self.receive_splits, self.send_splits, group=self.group.group)

    def combine(self, y: torch.Tensor) -> torch.Tensor:
        out = y.new_empty(sum(self.send_splits), y.shape[-1])
        return all_to_all_single(out, y, self.send_splits, self.receive_splits, group=self.group.group)


class SpreadMoEBlock(ShardedModule):
    """A :class:`MoEBlock` on member k of an expert group: attention,
    norms and router whole, experts ``k E/e .. (k+1) E/e``; its routed
    copies go to their experts' members and come back."""

    def __init__(self, block: MoEBlock, group: ExpertGroup):
        super().__init__()
        self.group, self.block = group, block
        local = block.experts_count // group.size
        self.first = group.index * local
        # The block keeps only this member's experts.
        block.experts = nn.ModuleList(list(block.experts)[self.first:self.first + local])

    def forward(self, x):
        block = self.block
        x = x + block.attend(block.ln1(x))
        return x + block.mix(block.ln2(x), self._run_spread)

    def _run_spread(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        exchange = _Exchange(counts, self.group)
        received = exchange.dispatch(x)
        # Received copies come by sender, then by expert: each expert takes
        # its rows from every sender, and its outputs go back in place.
        by_sender = exchange.received
        parts = list(received.split(by_sender.reshape(-1).tolist()))
        out = list(parts)
        for j, expert in enumerate(self.block.experts):
            rows = [parts[s * exchange.local + j] for s in range(self.group.size)]
            done = expert(torch.cat(rows)).split(by_sender[:, j].tolist())
            for s in range(self.group.size):
                out[s * exchange.local + j] = done[s]
        return exchange.combine(torch.cat(out))

    def expert_parameters(self) -> list[nn.Parameter]:
        """The routed experts this member holds: reduced over the ranks
        that hold the same ones, not over the replicas."""
        return list(self.block.experts.parameters())

    def full_state(self) -> dict[str, torch.Tensor]:
        """The whole block's state, every member's experts gathered (every
        member of the group must call it together)."""
        state = {k: v for k, v in self.block.state_dict().items() if not k.startswith("experts.")}
        local = len(self.block.experts)
        for j, expert in enumerate(self.block.experts):
            for name, value in expert.state_dict().items():
                parts = [torch.empty_like(value) for _ in range(self.group.size)]
                dist.all_gather(parts, value.contiguous(), group=self.group.group)
                for k, part in enumerate(parts):
                    state[f"experts.{k * local + j}.{name}"] = part
        return {k: v.detach().clone() for k, v in state.items()}


def spread_layers(layers: list[nn.Module], group: ExpertGroup) -> list[nn.Module]:
    """Each layer's part on this member: a layer with experts spreads them
    (``config.check_expert_layers`` has checked that e divides them), the
    others stay whole."""
    return [layer.spread(group) if getattr(layer, "expert_pattern", None) else layer for layer in layers]


def expert_parameters(layers: list[nn.Module]) -> set[int]:
    """The ids of the routed experts' parameters among ``layers``' parts."""
    return {id(p) for layer in layers for p in getattr(layer, "expert_parameters", lambda: [])()}
