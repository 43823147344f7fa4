"""Sharding levels 2 and 3 run (issue 47, item 3): a stage sharded over its
replicas with torch's FSDP2 on gloo trains as one process does: after 5
steps every parameter, gathered back whole, within 1e-5 of single-process
training from the same seed (CPU)."""

import pytest

from conftest import assert_one_line_error, assert_trains_as_one_process, hand_plan, max_diff

torch = pytest.importorskip("torch")

from dapple.planner.runtime.launcher import run_plan  # noqa: E402
# The shaped stages' model, batches and single-process reference.
from test_shaped_run import GBS, GPT, LR, STEPS, batches, reference  # noqa: E402, F401

ZERO2 = {"shard_level": 2}
ZERO3 = {"shard_level": 3, "reshard_after_forward": True}
ZERO3_KEPT = {"shard_level": 3}
CASES = {
    # one stage on 2 replicas, 2 micro-batches of 4
    "zero3-r2": hand_plan(4, [(0, 4, [0, 1], ZERO3)], GBS),
    "zero3-kept-r2": hand_plan(4, [(0, 4, [0, 1], ZERO3_KEPT)], GBS),
    "zero2-r2": hand_plan(4, [(0, 4, [0, 1], ZERO2)], GBS),
    # a pipeline of 2 stages, the second sharded over 2 replicas, 4
    # micro-batches of 2 (1F1B: two in flight on the first stage)
    "1-then-zero3-r2": hand_plan(2, [(0, 2, [0], {}), (2, 4, [1, 2], ZERO3)], GBS),
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_sharded_stage_trains_as_one_process(name, batches, reference):
    res = run_plan(CASES[name], GPT, GPT().loss, batches, STEPS, LR, start_method="fork")
    assert_trains_as_one_process(res, reference, name)


@pytest.mark.parametrize("name", ["zero3-r2", "zero2-r2", "1-then-zero3-r2"])
def test_a_sharded_stage_resumes_where_it_saved(name, batches, tmp_path):
    # Adam's state sharded by FSDP is saved whole and sharded again on resuming.
    plan, common = CASES[name], dict(optimizer="adam", checkpoint_every=2, start_method="fork")
    full = run_plan(plan, GPT, GPT().loss, batches, STEPS, LR, checkpoint_dir=str(tmp_path / "a"), **common)
    run_plan(plan, GPT, GPT().loss, batches, 2, LR, checkpoint_dir=str(tmp_path / "b"), **common)
    resumed = run_plan(plan, GPT, GPT().loss, batches, STEPS, LR, checkpoint_dir=str(tmp_path / "b"),
                       start_step=2, **common)
    assert max_diff(resumed.params, full.params) < 1e-6
    assert resumed.losses[-3:] == pytest.approx(full.losses[-3:], abs=1e-6)
    # Each rank's file holds the stage whole: every weight at its full size, and Adam's state by name.
    from dapple.planner.runtime import checkpoint

    saved = checkpoint.load_rank(str(tmp_path / "b"), 2, plan.core.layout().stages[-1].replicas[-1].rank)
    stage = saved["stages"][0]
    q_k_v = [value for key, value in stage["model"].items() if key.endswith("attn.in_proj_weight")]
    assert [tuple(v.shape) for v in q_k_v] == [(48, 16)] * len(q_k_v) and q_k_v
    assert all(isinstance(k, str) for k in stage["optimizer"]["state"])


def test_what_the_runtime_does_not_shard_is_refused_in_one_line(tmp_path, dapple):
    # Sharded beside tensor parallelism: refused by name, before any process starts.
    plan = hand_plan(2, [(0, 4, [0, 1, 2, 3], {"tensor_parallel": 2, **ZERO3})], GBS)
    path = tmp_path / "plan.json"
    plan.save(path)
    r = dapple("run", "--plan", path, "--model", "dapple.planner.runtime.models:digits", "--steps", 1)
    assert_one_line_error(r, 4, "stages[0].shard_level", "beside tensor parallelism")
