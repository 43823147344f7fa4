"""A forward's graph differentiated on other weights
(``dapple.planner.runtime.backward_weights``): what an asynchronous backward
without re-computation computes, checked against the chain rule by hand."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torch.func import functional_call  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from dapple.planner.runtime.backward_weights import WeightedGraph  # noqa: E402


def model_and_weights():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.LayerNorm(5), torch.nn.Linear(5, 3))
    names = [n for n, _ in model.named_parameters()]
    forward = [p.detach().clone() for p in model.parameters()]
    backward = [w + 0.1 * torch.randn_like(w) for w in forward]
    return model, names, forward, backward


def gradients(model, names, forward, backward, x, autocast_dtype=None):
    """d(sum(out^2)) by the weights, the forward on ``forward``, the backward reading ``backward``."""
    graph = WeightedGraph(forward)
    autocast = torch.autocast("cpu", dtype=autocast_dtype, enabled=autocast_dtype is not None)
    with graph.recording(), autocast:
        out = functional_call(model, dict(zip(names, graph.leaves)), (x,))
    loss = out.float().pow(2).sum()
    graph.release()
    # The graph holds no copy of the forward's weights any more.
    assert all(leaf.untyped_storage().nbytes() <= leaf.element_size() for leaf in graph.leaves)
    graph.rebind(backward)
    torch.autograd.backward(loss, inputs=graph.leaves)
    return [leaf.grad for leaf in graph.leaves]


def test_the_backward_reads_its_own_weights_and_the_forwards_activations():
    model, names, (w1, b1, g, b, w2, b2), backward = model_and_weights()
    x = torch.randn(4, 6)
    got = gradients(model, names, [w1, b1, g, b, w2, b2], backward, x)
    # By hand: activations from the forward's weights ...
    h = x @ w1.T + b1
    r = h.relu()
    normed = F.layer_norm(r, (5,))
    y = normed * g + b
    out = y @ w2.T + b2
    grad_out = 2 * out
    # ... and wherever a gradient passes through a weight, the backward's.
    _, _, g_back, _, w2_back, _ = backward
    grad_y = grad_out @ w2_back
    r_leaf = r.clone().requires_grad_(True)
    (F.layer_norm(r_leaf, (5,)) * (grad_y * g_back)).sum().backward()
    grad_h = r_leaf.grad * (h > 0)
    expected = [grad_h.T @ x, grad_h.sum(0), (grad_y * normed).sum(0), grad_y.sum(0), grad_out.T @ y, grad_out.sum(0)]
    for name, a, e in zip(names, got, expected):
        assert torch.allclose(a, e, atol=1e-5), name


def test_under_autocast_the_weights_cast_copies_are_read_from_the_backwards_too():
    model, names, forward, backward = model_and_weights()
    x = torch.randn(4, 6)
    # The same weights both ways: exactly what autograd computes without the hooks.
    leaves = [w.detach().requires_grad_(True) for w in forward]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = functional_call(model, dict(zip(names, leaves)), (x,))
    out.float().pow(2).sum().backward()
    same = gradients(model, names, forward, forward, x, torch.bfloat16)
    assert all(torch.equal(a, leaf.grad) for a, leaf in zip(same, leaves))
    # The last linear layer's input gradient goes through its bf16 cast:
    # reading the backward's weights there moves the first layer's gradient
    # as it does in fp32.
    moved = gradients(model, names, forward, backward, x, torch.bfloat16)
    fp32_moved = gradients(model, names, forward, backward, x)
    fp32_same = gradients(model, names, forward, forward, x)
    shift, fp32_shift = moved[0] - same[0], fp32_moved[0] - fp32_same[0]
    assert fp32_shift.abs().max() > 0.05
    assert (shift - fp32_shift).abs().max() < 0.1 * fp32_shift.abs().max()


def test_a_backward_without_its_weights_is_an_error():
    model, names, forward, _ = model_and_weights()
    graph = WeightedGraph(forward)
    with graph.recording():
        out = functional_call(model, dict(zip(names, graph.leaves)), (torch.randn(2, 6),))
    with pytest.raises(RuntimeError, match="rebind"):
        out.sum().backward()
