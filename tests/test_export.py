"""``dapple export``: plans in the form other runtimes take."""

import pytest

from dapple import planner
from conftest import PROFILES

BERT = PROFILES / "bert-48-pbs-2.json"


def plan_file(tmp_path, dapple, topology, *extra):
    out = tmp_path / "plan.json"
    r = dapple("plan", "--profile", BERT, "--topology", topology, "--global-batch-size", 64, "--out", out, *extra)
    assert r.returncode == 0, r.stderr
    return out


def test_torch_csv_is_the_plans_own_schedule_one_row_per_stage(tmp_path, dapple):
    path = plan_file(tmp_path, dapple, "A")  # 8:8, even replicas
    out = tmp_path / "schedule.csv"
    r = dapple("export", "--plan", path, "--to", "torch-csv", "--out", out)
    assert r.returncode == 0, r.stderr
    plan = planner.Plan.load(path)
    rows = [line.split(",") for line in out.read_text().splitlines()]
    # Each row is the stage's list (its warm-up depth K_i), AR and OPT left
    # to the caller, every action prefixed by its stage.
    expected = [[f"{i}{a}" for a in map(str, actions) if a[0] in "FB"] for i, actions in enumerate(plan.core.actions())]
    assert rows == expected
    assert [row.index(f"{i}B0") for i, row in enumerate(rows)] == [s["warmup_micro_batches"] for s in plan.stages]
    assert r.stdout == "" and "2 pipeline ranks" in r.stderr


def test_every_cell_parses_with_torchs_action_notation(tmp_path, dapple):
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    out = tmp_path / "schedule.csv"
    assert dapple("export", "--plan", plan_file(tmp_path, dapple, "A"), "--to", "torch-csv", "--out", out).returncode == 0
    for line in out.read_text().splitlines():
        for cell in line.split(","):
            assert str(schedules._Action.from_str(cell)) == cell


def test_a_zero_bubble_plan_exports_its_split_backwards(tmp_path, dapple):
    # BERT-48 on configuration B: --schedule auto finds a ZB-H1 plan, one
    # GPU a stage, that runs faster than early backward's.
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    path = plan_file(tmp_path, dapple, "B")
    plan = planner.Plan.load(path)
    assert plan.core.schedule_kind == "zb-h1"
    out = tmp_path / "schedule.csv"
    assert dapple("export", "--plan", path, "--to", "torch-csv", "--out", out).returncode == 0
    rows = [line.split(",") for line in out.read_text().splitlines()]
    assert len(rows) == len(plan.stages)
    for rank, row in enumerate(rows):
        actions = [schedules._Action.from_str(cell) for cell in row]
        kinds = [str(a.computation_type) for a in actions]
        assert kinds.count("F") == kinds.count("I") == kinds.count("W") == plan.micro_batches
        assert {a.stage_index for a in actions} == {rank}


@pytest.mark.parametrize("topology,extra,why", [
    ("B", ("--schedule", "early-backward-1f1b"), "stages replicated unevenly (1, 1, 2, 2, 2, 2, 2, 2, 2 by stage)"),
    ("A", ("--schedule", "xpipe"), "schedule xpipe is asynchronous"),
])
def test_what_torch_cannot_run_is_refused_in_one_line_and_nothing_written(tmp_path, dapple, topology, extra, why):
    path = plan_file(tmp_path, dapple, topology, *extra)
    out = tmp_path / "schedule.csv"
    r = dapple("export", "--plan", path, "--to", "torch-csv", "--out", out)
    assert r.returncode == 4, r.stderr
    assert why in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not out.exists()
