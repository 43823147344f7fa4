"""Shaped stages run (issue 26, item 7): tensor parallelism (Megatron's
split of the GPT model over a stage's split groups), ZeRO-1 over a stage's
replicas and per-stage re-computation train exactly as one process does:
after 5 steps every parameter, shards gathered back, within 1e-5 of plain
single-process training from the same seed (CPU, gloo)."""

import functools

import pytest

from conftest import assert_trains_as_one_process, hand_plan, max_diff
from dapple import planner

torch = pytest.importorskip("torch")

from dapple.planner.runtime.launcher import run_plan  # noqa: E402
from dapple.planner.runtime.layout import Layout  # noqa: E402
from dapple.planner.runtime.models import gpt  # noqa: E402
from dapple.planner.runtime.reference import train_single_process  # noqa: E402
from dapple.planner.runtime.training import build_layers, prefixed_state  # noqa: E402

STEPS = 5
LR = 0.1
GBS = 8
# Embedding, 2 blocks, LM head: 4 layers; 2 heads and 32 tokens split in 2.
GPT = functools.partial(gpt, n_layers=2, d_model=16, n_heads=2, seq=8, vocab=32)
FAST = {"start_method": "fork"}


def shaped_plan(mbs, stages, gbs=GBS):
    return hand_plan(mbs, stages, gbs)


@pytest.fixture(scope="module")
def batches():
    g = torch.Generator().manual_seed(7)
    spec = GPT()
    return [spec.make_batch(GBS, g) for _ in range(STEPS)]


@pytest.fixture(scope="module")
def reference(batches):
    torch.set_num_threads(1)
    return train_single_process(GPT, GPT().loss, batches, STEPS, LR)


def run(plan, batches, **options):
    return run_plan(plan, GPT, GPT().loss, batches, STEPS, LR, **FAST, **options)


T2 = {"tensor_parallel": 2}
CASES = {
    # t = 2 with p = 2: both stages split, 4 processes
    "t2-p2": shaped_plan(2, [(0, 2, [0, 1], T2), (2, 4, [2, 3], T2)]),
    # t = 2 with r = 2, one stage: 2 replicas of 2 shards
    "t2-r2": shaped_plan(4, [(0, 4, [0, 1, 2, 3], T2)]),
    # t = 2 with r = 2 over two stages, after a plain stage of one device
    # that feeds both shards of both replicas
    "1-then-t2-r2": shaped_plan(4, [(0, 1, [0], {}), (1, 4, [1, 2, 3, 4], T2)]),
    # a split stage feeding a plain one: each shard gets its output's gradient
    "t2-then-1": shaped_plan(2, [(0, 3, [0, 1], T2), (3, 4, [2], {})]),
}


def test_the_reference_moves_the_weights(reference):
    assert max_diff(prefixed_state(build_layers(GPT, 0), 0), reference) > 1e-3


@pytest.mark.parametrize("name", list(CASES))
def test_split_stages_train_as_one_process(name, batches, reference, tmp_path):
    p = CASES[name]
    res = run(p, batches, checkpoint_dir=str(tmp_path), checkpoint_every=STEPS)
    # Every rank gathered its stage back whole, and all agree.
    assert_trains_as_one_process(res, reference, name)
    # Each shard held half of the matrices while it trained (its own checkpoint).
    from dapple.planner.runtime import checkpoint

    lay = Layout.of(p)
    stage = next(i for i, s in enumerate(lay.stages) if s.tensor_parallel == 2)
    rank = lay.stages[stage].split_groups[0][1]
    block = lay.stages[stage].layer_start if stage > 0 else 1  # a block of the split stage
    held = checkpoint.load_rank(str(tmp_path), STEPS, rank)["stages"][0]["model"]
    assert held[f"{block - lay.stages[stage].layer_start}.qkv_weight"].shape == (3 * 16 // 2, 16)
    # One loss per step, counted once although every shard computes it.
    ref_loss = GPT().loss(GPT().forward(batches[0][0]), batches[0][1]).item()
    assert abs(res.losses[0] - ref_loss) < 1e-5


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_split_stages_train_under_autocast_as_one_process(dtype, batches):
    # t = 2 with p = 2 against one process under the same autocast: each
    # shard's row-parallel product and its AllReduce round in the dtype at
    # other places than the whole product (measured 5.6e-5 in bf16), and
    # the vocabulary-split loss is fp32, as autocast's cross_entropy.
    p = CASES["t2-p2"]
    res = run(p, batches, dtype=dtype)
    losses = []
    ref = train_single_process(GPT, GPT().loss, batches, STEPS, LR, dtype=dtype, micro_batches=p.micro_batches,
                               losses=losses)
    assert max_diff(res.params, ref) < 2e-4
    assert res.losses == pytest.approx(losses, abs=1e-3)
    assert res.replicas_agree(atol=1e-6)


def test_zero1_over_two_replicas_trains_as_one_process(batches, tmp_path):
    # Momentum SGD: optimizer state (one buffer a parameter) that ZeRO-1
    # shards. (Adam is held to the plain data-parallel run below instead:
    # the attention's key bias has a zero gradient, whose rounding noise
    # Adam's normalisation blows up to the size of a step in any run that
    # sums gradients in another order.)
    p = shaped_plan(4, [(0, 2, [0], {}), (2, 4, [1, 2], {"shard_level": 1})])
    ref = train_single_process(GPT, GPT().loss, batches, STEPS, LR, optimizer="momentum")
    res = run(p, batches, optimizer="momentum", checkpoint_dir=str(tmp_path), checkpoint_every=STEPS)
    diff = max_diff(res.params, ref)
    print(f"zero1-r2: max parameter difference {diff:.2e}")
    assert diff < 1e-5
    # Each replica keeps the momentum of its part of the stage's parameters
    # only, and the two parts make up the whole.
    from dapple.planner.runtime import checkpoint

    held = [len(checkpoint.load_rank(str(tmp_path), STEPS, r)["stages"][0]["optimizer"]["state"]) for r in (1, 2)]
    stage_params = sum(1 for _, layer in GPT().layers[2:] for _ in layer.parameters())
    assert 0 < min(held) and sum(held) == stage_params, (held, stage_params)


def test_zero1_with_adam_equals_plain_data_parallelism(batches):
    plain = shaped_plan(4, [(0, 2, [0], {}), (2, 4, [1, 2], {})])
    sharded = shaped_plan(4, [(0, 2, [0], {}), (2, 4, [1, 2], {"shard_level": 1})])
    a = run_plan(plain, GPT, GPT().loss, batches, STEPS, 0.01, optimizer="adam", **FAST)
    b = run_plan(sharded, GPT, GPT().loss, batches, STEPS, 0.01, optimizer="adam", **FAST)
    assert max_diff(a.params, b.params) < 1e-6


class CountingForwards(torch.nn.Module):
    """A layer that counts its forwards in its state (a re-computed
    stage runs each forward twice)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.register_buffer("forwards", torch.zeros(()))

    def forward(self, x):
        with torch.no_grad():
            self.forwards += 1
        return self.inner(x)


def counting_gpt():
    spec = GPT()
    spec.layers = [(name, CountingForwards(layer)) for name, layer in spec.layers]
    return spec


@pytest.mark.parametrize("recompute", ["full", "per-layer"])
def test_per_stage_recompute_trains_as_one_process(batches, reference, recompute):
    p = shaped_plan(2, [(0, 2, [0], {"recompute": recompute}), (2, 4, [1], {})])
    stages = Layout.of(p).stages
    assert [(s.recompute, s.recompute_per_layer) for s in stages] == [(True, recompute == "per-layer"),
                                                                       (False, False)]
    res = run_plan(p, counting_gpt, GPT().loss, batches, STEPS, LR, **FAST)
    forwards = {k: v.item() for k, v in res.params.items() if k.endswith("forwards")}
    micro_batches = STEPS * GBS // 2
    # Stage 0 (layers 0, 1) runs each forward again in its backward, the
    # stage under one checkpoint or each layer under its own; stage 1 does not.
    assert forwards == {"0.forwards": 2 * micro_batches, "1.forwards": 2 * micro_batches,
                        "2.forwards": micro_batches, "3.forwards": micro_batches}
    trained = {k.replace(".inner", ""): v for k, v in res.params.items() if not k.endswith("forwards")}
    diff = max_diff(trained, reference)
    print(f"recompute {recompute}, stage 0: max parameter difference {diff:.2e}")
    assert diff < 1e-5


def test_a_split_layer_that_cannot_split_is_refused_before_the_run():
    # 3 heads: t = 2 cannot split a block.
    p = shaped_plan(2, [(0, 4, [0, 1], T2)])
    three_heads = functools.partial(gpt, n_layers=2, d_model=12, n_heads=3, seq=8, vocab=32)
    from dapple.planner.runtime.config import check_split_layers

    with pytest.raises(planner.IncompatibleInputsError, match=r"stages\[0\].tensor_parallel: value 2 cannot split layer 1"):
        check_split_layers(Layout.of(p), [layer for _, layer in three_heads().layers])
