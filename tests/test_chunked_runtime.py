"""dapple's runtime on plans whose ranks hold several stages (the chunked
kinds: interleaved 1F1B, interleaved zero bubble, ZB-V, DualPipeV): each rank walks
its order's list, each pass on the chunk it names, a V's turn handed over
in memory; 5 steps on gloo train as one process does."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from dapple import planner  # noqa: E402
from dapple.planner import _core  # noqa: E402
from dapple.planner.runtime.config import RunConfig, check_run  # noqa: E402
from dapple.planner.runtime.launcher import run_plan  # noqa: E402
from dapple.planner.runtime.layout import Layout  # noqa: E402
from dapple.planner.runtime.reference import train_single_process  # noqa: E402
from test_runtime import FAST, GBS, LR, STEPS, batches, deep_layers, deep_profile, layout_plan, max_diff, mse  # noqa: E402, F401 (batches: the fixture)

LAYOUTS = {
    # (micro-batch size, stages of one stage a rank): GBS 12 in 4 micro-batches
    "2 ranks": (3, [(0, 4, [0]), (4, 9, [1])]),
    "4 ranks": (3, [(0, 2, [0]), (2, 4, [1]), (4, 6, [2]), (6, 9, [3])]),
    # rank 0 two replicas (slices 2 and 1), rank 1 one: chunks cross between them both ways
    "2:1": (3, [(0, 4, [0, 1]), (4, 9, [2])]),
}
CASES = [(name, kind) for name in LAYOUTS for kind in planner.CHUNKED_SCHEDULES]


@pytest.fixture(scope="module")
def deep_reference(batches):
    """One process training ``deep_layers`` on ``batches`` (test_runtime's fixture)."""
    torch.set_num_threads(1)
    return train_single_process(deep_layers, mse, batches, STEPS, LR)


def chunked_plan(name: str, kind: str):
    mbs, stages = LAYOUTS[name]
    if kind == "dualpipev" and GBS // mbs < 2 * len(stages):
        mbs = 1  # DualPipeV takes at least two micro-batches a stage: 12 here
    return planner.chunked(layout_plan(mbs, stages), deep_profile(), kind, 2)


@pytest.mark.parametrize("name,kind", CASES)
def test_a_chunked_plan_trains_as_one_process_does(name, kind, batches, deep_reference):
    plan = chunked_plan(name, kind)
    lay = Layout.of(plan)
    ranks = len(LAYOUTS[name][1])
    assert len(plan.stages) == 2 * ranks and lay.world_size == len({d for s in plan.stages for d in s["devices"]})
    res = run_plan(plan, deep_layers, mse, batches, STEPS, LR, world_size=lay.world_size, **FAST)
    assert max_diff(res.params, deep_reference) < 1e-5
    assert res.replicas_agree(atol=1e-6)
    # Each process ran its pipeline rank's order, each pass naming its chunk,
    # then every chunk's AllReduce (where it is replicated) and step.
    stage_ranks, m = plan.core.stage_ranks, plan.micro_batches
    order = {"interleaved-1f1b": lambda: _core.PipelineOrder.interleaved_1f1b(ranks, m, 2),
             "interleaved-zero-bubble": lambda: _core.PipelineOrder.interleaved_zero_bubble(ranks, m, 2),
             "zb-v": lambda: _core.PipelineOrder.zbv(ranks, m),
             "dualpipev": lambda: _core.PipelineOrder.dualpipev(ranks, m)}[kind]()
    for r in range(lay.world_size):
        stages = [s for s, _ in lay.positions(r)]
        assert {stage_ranks[s] for s in stages} == {stage_ranks[stages[0]]} and len(stages) == 2
        passes = [t for t in res.trace[r] if not t.endswith(("AR", "OPT"))]
        assert passes == [str(a) for a in order.rank_actions[stage_ranks[stages[0]]]], (r, res.trace[r][:8])
        assert set(res.trace[r][-2:]) == {f"{s}OPT" for s in stages}


def test_a_rank_holds_each_of_its_chunks_and_nothing_else():
    plan = chunked_plan("2:1", "zb-v")
    lay = Layout.of(plan)
    # ZB-V: rank 0's chunks are stages 0 and 3 (devices 0 and 1), rank 1's 1 and 2.
    assert plan.core.stage_ranks == [0, 1, 1, 0]
    assert [lay.positions(r) for r in range(3)] == [[(0, 0), (3, 0)], [(0, 1), (3, 1)], [(1, 0), (2, 0)]]
    # The V's turn stays on its process: stage 2 receives from stage 1 on the same rank.
    assert [p.rank for p in lay.stages[2].replicas[0].receives_from] == [2]


def test_an_asynchronous_schedule_is_refused_for_chunks(batches):
    lay = Layout.of(chunked_plan("2 ranks", "interleaved-1f1b"))
    config = RunConfig(layers_factory=deep_layers, loss_fn=mse, batches=batches, steps=STEPS, lr=LR, schedule="xpipe")
    with pytest.raises(planner.IncompatibleInputsError, match="schedule xpipe: the plan's ranks hold several stages"):
        check_run(config, lay)


def boosted_deep_layers():
    """``deep_layers`` with the first chunk's gradients 1000 times larger (a
    boost before its first Tanh): at fp16's first loss scales they overflow
    in that chunk alone."""
    from test_precision import GradBoost

    layers = deep_layers()
    layers[1] = ("act0", torch.nn.Sequential(GradBoost(1000.0), torch.nn.Tanh()))
    return layers


def test_fp16_chunks_skip_overflowing_steps_together(batches):
    # Rank 0 holds the overflowing chunk (stage 0) and a chunk that does not
    # overflow (stage 2): a rank's chunks skip and step together, with every
    # other rank's, as one process does with one optimizer. (Stepping stage 2
    # where stage 0 overflowed ends 0.057 away from the reference.)
    plan = chunked_plan("2 ranks", "interleaved-1f1b")
    assert plan.core.stage_ranks == [0, 1, 0, 1]
    res = run_plan(plan, boosted_deep_layers, mse, batches, STEPS, LR, world_size=2, dtype="fp16", **FAST)
    losses, scales = [], []
    ref = train_single_process(boosted_deep_layers, mse, batches, STEPS, LR, dtype="fp16", micro_batches=4,
                               losses=losses, loss_scales=scales)
    assert scales[-1] < 65536.0  # steps were skipped
    assert {m["loss_scale"] for m in res.metrics.values()} == {scales[-1]}
    assert max_diff(res.params, ref) < 1e-6
    assert res.losses == pytest.approx(losses, abs=1e-6)


@pytest.mark.parametrize("kind", ["interleaved-1f1b", "zb-v"])
def test_a_chunked_run_resumes_where_it_saved(kind, batches, tmp_path):
    # Each rank saves its chunks in one file and loads each back by stage.
    plan = chunked_plan("2:1", kind)
    common = dict(world_size=3, optimizer="adam", checkpoint_every=2, **FAST)
    full = run_plan(plan, deep_layers, mse, batches, STEPS, LR, checkpoint_dir=str(tmp_path / "a"), **common)
    run_plan(plan, deep_layers, mse, batches, 2, LR, checkpoint_dir=str(tmp_path / "b"), **common)
    saved = torch.load(tmp_path / "b" / "step-2" / "rank-0.pt", weights_only=True)
    assert [entry["stage"] for entry in saved["stages"]] == [s for s, _ in Layout.of(plan).positions(0)]
    resumed = run_plan(plan, deep_layers, mse, batches, STEPS, LR, checkpoint_dir=str(tmp_path / "b"), start_step=2,
                       **common)
    assert max_diff(resumed.params, full.params) < 1e-6
    assert resumed.losses == pytest.approx(full.losses[2:], abs=1e-6)
    # Resuming another plan's checkpoint names the rank, the stage and the layers.
    other = chunked_plan("2:1", "interleaved-zero-bubble" if kind == "zb-v" else "zb-v")
    with pytest.raises(Exception, match=r"checkpoint step 2 rank \d holds layers \[\[.*as stage \d"):
        run_plan(other, deep_layers, mse, batches, STEPS, LR, checkpoint_dir=str(tmp_path / "b"), start_step=2,
                 **common)


def test_a_chunked_run_evaluates_the_whole_model():
    # digits (4 layers) on 2 ranks of two one-layer chunks: every evaluation
    # equals that of the same run on the plan's unchunked layout.
    from dapple.planner.runtime import models
    from dapple.planner.runtime.data import SeededBatches

    factory = lambda: models.load_model("dapple.planner.runtime.models:digits")  # noqa: E731
    spec = factory()
    profile = planner.Profile.from_dict({"model": "digits", "layers": [
        {"name": name, "param_bytes": 1000,
         "measurements": [{"batch_size": 1, "fwd_ms": 1.0, "bwd_ms": 2.0, "activation_bytes": 100}]}
        for name, _ in spec.layers]})
    unchunked = layout_plan(8, [(0, 2, [0]), (2, 4, [1])], gbs=16)
    runs = [run_plan(plan, factory, spec.loss, SeededBatches(factory, 16, 6, 0), 6, 0.05, optimizer="adam",
                     eval_every=3, **FAST) for plan in (unchunked, planner.chunked(unchunked, profile, "zb-v"))]
    evaluations = [r.metrics[0]["evaluations"] for r in runs]
    assert [e["step"] for e in evaluations[1]] == [3, 6]
    for got, want in zip(*evaluations):
        assert got["loss"] == pytest.approx(want["loss"], abs=1e-6)
        assert got["accuracy"] == pytest.approx(want["accuracy"])
