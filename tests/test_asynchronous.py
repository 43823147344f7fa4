"""Asynchronous schedules (XPipe, PipeDream's weight stashing, SpecTrain,
asynchronous without prediction) in the simulator and on the command line.
The schedules themselves are tested as literal tables in the core
(``rust_core/core/src/schedule.rs``)."""

from __future__ import annotations

import json

import pytest
from conftest import PROFILES, assert_one_line_error

import planner

BERT = PROFILES / "bert-48-pbs-2.json"


@pytest.fixture(scope="module")
def gpipe_plan(tmp_path_factory):
    path = tmp_path_factory.mktemp("plans") / "gpipe.json"
    planner.baseline("gpipe", BERT, "1x4-nvlink", 32).save(path)
    return path


def test_asynchronous_simulation_is_a_steady_state_over_many_mini_batches(gpipe_plan):
    plan = planner.Plan.load(gpipe_plan)
    flushed = planner.simulate(plan, BERT, recompute=True)
    for kind in planner.ASYNCHRONOUS_SCHEDULES:
        sim = planner.simulate(plan, BERT, schedule=kind)
        assert (sim.schedule, sim.recompute) == (kind, True)
        assert sim.mini_batches > 1 and sim.span_ms > sim.iteration_ms * (sim.mini_batches - 1)
        # Every pass of every mini-batch ran.
        passes = [t for t in sim.tasks if t["kind"] in ("forward", "backward")]
        assert len(passes) == 2 * len(plan.stages) * plan.micro_batches * sim.mini_batches
        assert sim.iteration_ms < flushed.iteration_ms
        # The last stage never holds another version of its weights.
        assert sim.stages[-1]["peak_weight_copies"] == 0
    stash = planner.simulate(plan, BERT, schedule="pipedream")
    live = planner.simulate(plan, BERT, schedule="async")
    assert stash.stages[0]["peak_weight_copies"] >= 1
    assert stash.stages[0]["peak_memory_bytes"] > live.stages[0]["peak_memory_bytes"]


def test_simulate_command_reports_the_steady_state_and_the_weights_of_each_pass(dapple, gpipe_plan):
    r = dapple("simulate", "--plan", gpipe_plan, "--profile", BERT, "--schedule", "xpipe")
    assert r.returncode == 0, r.stderr
    assert "steady state:" in r.stdout and "per mini-batch" in r.stdout and "weight copies" in r.stdout
    r = dapple("simulate", "--plan", gpipe_plan, "--profile", BERT, "--schedule", "xpipe", "--json")
    data = json.loads(r.stdout)
    assert (data["format"], data["schema_version"], data["schedule"]) == ("dapple.simulation", 2, "xpipe")
    assert data["mini_batches"] > 1
    # The table is the core's: stage 0 warms up one micro-batch per stage,
    # and its fifth forward (mini-batch 0 of 16 micro-batches) needs no
    # prediction yet.
    r = dapple("simulate", "--plan", gpipe_plan, "--profile", BERT, "--schedule", "xpipe", "--actions")
    lines = r.stdout.splitlines()
    assert len(lines) == 4 and lines[0].startswith("stage 0: F0@0 F1@0 F2@0 F3@0 B0@0 F4@0 ")
    assert " AR OPT " in lines[0] and "+1" in lines[0]


def test_a_plan_names_a_synchronous_schedule(dapple, gpipe_plan, tmp_path):
    d = planner.Plan.load(gpipe_plan).core.to_dict()
    d["schedule"]["kind"] = "xpipe"
    path = tmp_path / "xpipe.json"
    path.write_text(json.dumps(d))
    r = dapple("simulate", "--plan", path, "--profile", BERT)
    assert_one_line_error(r, 3, str(path), "schedule.kind", '"xpipe" is asynchronous', "--schedule xpipe")
