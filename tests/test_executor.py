"""The typed lists the executor walks: the core's actions and passes cross
the binding as objects that print, parse and pickle as the core writes them,
the layout is the core's own, and a run's options are checked once, before
any process starts."""

import pickle

import pytest

from dapple import planner
from dapple.planner import _core
from dapple.planner.runtime.config import RunConfig, check_run
from dapple.planner.runtime.layout import Layout
from test_runtime import layout_plan


def test_actions_print_parse_and_pickle_as_the_core_writes_them():
    for text in ("F0", "B12", "AR", "OPT"):
        action = _core.Action.parse(text)
        assert str(action) == text and pickle.loads(pickle.dumps(action)) == action
    assert _core.Action("B", 3) == _core.Action.parse("B3") and _core.Action("AR").micro_batch is None
    assert len({_core.Action("F", 1), _core.Action.parse("F1")}) == 1
    for bad in ("F", "F01", "AR1", "X3", "F-1"):
        with pytest.raises(planner.InvalidInputError, match="is not F<n>, B<n>, I<n>, W<n>, AR or OPT"):
            _core.Action.parse(bad)
    with pytest.raises(ValueError, match="needs a micro-batch"):
        _core.Action("F")


def test_passes_carry_the_weights_table():
    plan = layout_plan(2, [(0, 2, [0]), (2, 4, [1])], gbs=4)
    lists = plan.core.pass_weights("xpipe", 3)
    table = plan.core.weights_table("xpipe", 3).splitlines()
    for s, passes in enumerate(lists):
        assert table[s] == f"stage {s}: " + " ".join(map(str, passes))
        assert [pickle.loads(pickle.dumps(p)) for p in passes] == passes
    ends = [p for p in lists[0] if p.action.micro_batch is None]
    assert [str(p.action) for p in ends] == ["AR", "OPT"] * 3 and ends[0].base_version is None
    # A synchronous list: every pass on the live weights of its one mini-batch.
    sync = plan.core.pass_weights(None, 1)
    assert {(p.mini_batch, p.base_version, p.predicted_updates) for p in sync[0] if p.mini_batch is not None} == {
        (0, 0, 0)}
    assert [p.action for p in sync[1]] == list(Layout.of(plan).stages[1].actions)


def test_the_layout_is_the_cores_and_pickles():
    lay = Layout.of(layout_plan(2, [(0, 2, [0, 1]), (2, 4, [2])], gbs=4))
    again = pickle.loads(pickle.dumps(lay))
    assert again.core.to_json() == lay.core.to_json()
    assert (lay.world_size, lay.global_batch_size, lay.where(2)) == (3, 4, (1, 0))
    with pytest.raises(ValueError, match="rank 3 is not in the plan"):
        lay.where(3)


def test_a_run_is_checked_once_before_it_starts():
    plan = layout_plan(2, [(0, 2, [0]), (2, 4, [1])], gbs=4)
    lay = Layout.of(plan)
    ok = RunConfig(list, None, [], 4, 0.1)
    check_run(ok.for_plan(plan), lay)
    bad = {
        "device": (dict(device="tpu"), "device 'tpu'"),
        "steps": (dict(start_step=4), "start_step 4 is not below steps 4"),
        "world": (dict(world_size=3), "world_size 3"),
        "schedule": (dict(schedule="gpipe"), "is not one of"),
        "slowdown": (dict(slowdown={2: 2.0}), "rank 2 is not a rank of the plan"),
    }
    for name, (changes, needle) in bad.items():
        with pytest.raises(planner.InvalidInputError, match=needle) as e:
            check_run(RunConfig(list, None, [], 4, 0.1, **changes).for_plan(plan), lay)
        assert (e.value.field == "slowdown") == (name == "slowdown")
    with pytest.raises(planner.IncompatibleInputsError, match="spectrain"):
        check_run(RunConfig(list, None, [], 4, 0.1, schedule="spectrain").for_plan(plan), lay)
    with pytest.raises(planner.IncompatibleInputsError, match="shows 1 GPUs"):
        check_run(RunConfig(list, None, [], 4, 0.1, device="cuda"), lay, visible_gpus=1)
