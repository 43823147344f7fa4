"""Sharding levels 2 and 3 run (issue 47, item 3): a stage sharded over its
replicas with torch's FSDP2 on gloo trains as one process does: after 5
steps every parameter, gathered back whole, within 1e-5 of single-process
training from the same seed (CPU)."""

import pytest

from conftest import assert_one_line_error, assert_trains_as_one_process, hand_plan

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


def test_what_the_runtime_does_not_shard_is_refused_in_one_line(tmp_path, dapple):
    # Sharded beside tensor parallelism: refused by name, before any process starts.
    plan = hand_plan(2, [(0, 4, [0, 1, 2, 3], {"tensor_parallel": 2, **ZERO3})], GBS)
    path = tmp_path / "plan.json"
    plan.save(path)
    r = dapple("run", "--plan", path, "--model", "dapple.planner.runtime.models:digits", "--steps", 1)
    assert_one_line_error(r, 4, "stages[0].shard_level", "beside tensor parallelism")
