"""A forward's autograd graph whose backward reads other weights than the
forward ran on: an asynchronous pass without re-computation (docs/xpipe.md).

The backward keeps the forward's activations but takes the weights its
schedule gives it (PipeDream's stash: the same version; XPipe: the live
weights). The forward runs on leaves that share the forward weights'
storage, under ``torch.autograd.graph.saved_tensors_hooks``: a saved tensor
that is one of those weights, a view of one (``weight.t()`` in a linear
layer), or a view of autocast's cast of one, is saved as where it sits in
that weight, not as data, and read back at the backward from the
backward's weights. Everything else is saved as autograd saves it.

After the forward the leaves give their storage back (a zero-stride
scalar of the same shape), so a graph in flight holds no copy of the
weights: only its activations.
"""

from __future__ import annotations

from typing import Sequence

import torch

#: Autograd nodes that only view their input (same storage, other strides):
#: a saved tensor reached from a weight through these alone is that weight,
#: seen another way.
_VIEW_NODES = frozenset({
    "TBackward0", "TransposeBackward0", "ViewBackward0", "UnsafeViewBackward0", "PermuteBackward0",
    "ExpandBackward0", "AsStridedBackward0", "ReshapeAliasBackward0", "SqueezeBackward0",
    "SqueezeBackward1", "UnsqueezeBackward0", "AliasBackward0", "SliceBackward0", "SelectBackward0",
})


class WeightedGraph:
    """One forward's graph on ``weights``; its backward reads the weights
    given to :meth:`rebind` instead.

    ``graph = WeightedGraph(weights)``; ``with graph.recording(): out =
    f(graph.leaves, x)``; ``graph.release()`` once the forward's output is
    used; later ``graph.rebind(other)`` and differentiate ``out`` with
    ``graph.leaves`` among the inputs."""

    def __init__(self, weights: Sequence[torch.Tensor]):
        self.leaves = [w.detach().requires_grad_(True) for w in weights]
        self._by_storage = {leaf.untyped_storage().data_ptr(): i for i, leaf in enumerate(self.leaves)}
        self._by_id = {id(leaf): i for i, leaf in enumerate(self.leaves)}
        self._backward: list[torch.Tensor] | None = None
        self._casts: dict[tuple[int, torch.dtype], torch.Tensor] = {}

    def recording(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def release(self) -> None:
        """Give the forward weights' storage back: the graph keeps none of it."""
        for leaf in self.leaves:
            leaf.data = torch.zeros((), dtype=leaf.dtype, device=leaf.device).expand(leaf.shape)

    def rebind(self, weights: Sequence[torch.Tensor]) -> None:
        """The weights the backward reads, in the leaves' order."""
        self._backward = [w.detach() for w in weights]
        self._casts = {}

    def _weight_of(self, t: torch.Tensor) -> tuple[int, torch.dtype | None] | None:
        """Which weight ``t`` is a view of (and the dtype autocast cast it
        to first), or None when it is not one."""
        i = self._by_storage.get(t.untyped_storage().data_ptr())
        if i is not None:
            return i, None
        node = t.grad_fn
        while node is not None and node.name() in _VIEW_NODES:
            node = node.next_functions[0][0]
        if node is not None and node.name() == "ToCopyBackward0":
            source = getattr(node.next_functions[0][0], "variable", None)
            if source is not None and id(source) in self._by_id:
                return self._by_id[id(source)], t.dtype
        return None

    def _pack(self, t: torch.Tensor):
        found = self._weight_of(t)
        if found is None:
            return t
        return (*found, t.size(), t.stride(), t.storage_offset())

    def _unpack(self, saved):
        if isinstance(saved, torch.Tensor):
            return saved
        if self._backward is None:
            raise RuntimeError("the backward's weights were not given (WeightedGraph.rebind)")
        i, dtype, size, stride, offset = saved
        base = self._backward[i]
        if dtype is not None:
            if (i, dtype) not in self._casts:
                self._casts[(i, dtype)] = base.to(dtype)
            base = self._casts[(i, dtype)]
        return base.as_strided(size, stride, offset)
