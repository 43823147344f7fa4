"""dapple's runtime on plans whose ranks hold several stages (the chunked
kinds: interleaved 1F1B, interleaved zero bubble, ZB-V): each rank walks
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
from test_runtime import FAST, LR, STEPS, batches, deep_layers, deep_profile, layout_plan, max_diff, mse  # noqa: E402, F401 (batches: the fixture)

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
             "zb-v": lambda: _core.PipelineOrder.zbv(ranks, m)}[kind]()
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


@pytest.mark.parametrize("asked,field", [({"schedule": "xpipe"}, "schedule xpipe"), ({"dtype": "fp16"}, "fp16"),
                                         ({"checkpoint_every": 2, "checkpoint_dir": "x"}, "checkpoints"),
                                         ({"eval_every": 2}, "evaluations")])
def test_what_the_runtime_does_not_run_for_chunks_yet_is_refused_by_name(asked, field, batches):
    lay = Layout.of(chunked_plan("2 ranks", "interleaved-1f1b"))
    config = RunConfig(layers_factory=deep_layers, loss_fn=mse, batches=batches, steps=STEPS, lr=LR, **asked)
    with pytest.raises(planner.IncompatibleInputsError, match=field):
        check_run(config, lay)
