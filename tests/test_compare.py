"""Baselines and `dapple compare`."""

import json

import pytest

import planner
from conftest import PROFILES

BERT = PROFILES / "bert-48-pbs-2.json"


def test_every_baseline_is_a_plan_that_evaluates_to_its_own_estimate():
    prof = planner.Profile.load(BERT)
    for kind in planner.BASELINES:
        p = planner.baseline(kind, prof, "A", 64)
        assert sum(len(s["devices"]) for s in p.stages) <= 16
        again = planner.evaluate(p, prof)
        assert again.estimate == p.estimate, kind
    assert planner.baseline("data-parallel", prof, "A", 64).kind == "data parallel"
    assert planner.baseline("gpipe", prof, "A", 64).data["schedule"]["kind"] == "gpipe"


def test_unknown_baseline_is_an_input_error():
    with pytest.raises(planner.InvalidInputError) as e:
        planner.baseline("megatron", BERT, "A", 64)
    assert "megatron" in str(e.value)


def test_dapple_plan_is_never_worse_than_a_baseline_by_its_own_estimate():
    # The search is exact for the estimate, and the baselines using early
    # backward with one GPU per stage or data parallelism lie in its space.
    rows = {r.strategy: r for r in planner.compare(BERT, "A", 64)}
    for name in ("data-parallel", "straight"):
        assert rows["dapple"].estimated_ms <= rows[name].estimated_ms + 1e-6
    # Overlapping the AllReduce can only help data parallelism.
    assert rows["data-parallel"].simulated_ms <= rows["data-parallel (no overlap)"].simulated_ms


def test_compare_command(dapple):
    r = dapple("compare", "--profile", BERT, "--topology", "B", "--global-batch-size", "64", "--json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert [row["strategy"] for row in rows][:2] == ["dapple", "data-parallel (no overlap)"]
    assert all(row["simulated_ms"] > 0 for row in rows if row["error"] is None)
    table = dapple("compare", "--profile", BERT, "--topology", "B", "--global-batch-size", "64")
    assert "pipedream-planner" in table.stdout


def test_inputs_no_strategy_can_use_are_an_error(dapple):
    from conftest import assert_one_line_error

    r = dapple("compare", "--profile", PROFILES / "bert-48-pbs-2.json", "--topology", "A", "--global-batch-size", 1)
    assert_one_line_error(r, 4, "global batch size 1")
