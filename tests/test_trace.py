"""`dapple show --trace` and `dapple simulate --trace`: a simulated iteration
as a Chrome trace (trace-event JSON) that Perfetto opens."""

import json
from collections import Counter

import pytest

from conftest import ROOT
from dapple import planner

BERT = ROOT / "profiles" / "artifact" / "bert-48-pbs-2.json"
REQUIRED = ("name", "ph", "ts", "pid", "tid")


@pytest.fixture(scope="module")
def four_stages(tmp_path_factory):
    """A 4-stage plan of BERT-48 on 16 single-GPU machines (links between
    every pair of stages), and its simulation."""
    from conftest import run_dapple

    out = tmp_path_factory.mktemp("trace") / "bert48-4.json"
    r = run_dapple(
        "plan", "--profile", "profiles/artifact/bert-48-pbs-2.json", "--topology", "B",
        "--global-batch-size", "64", "--stages", "4", "--schedule", "early-backward-1f1b", "--out", out,
    )
    assert r.returncode == 0, r.stderr
    plan = planner.Plan.load(out)
    assert len(plan.data["stages"]) == 4
    return out, plan, planner.simulate(plan, BERT)


def test_every_task_once_with_the_simulation_times_and_a_flow_per_transfer(dapple, four_stages, tmp_path):
    plan_path, plan, sim = four_stages
    out = tmp_path / "t.json"
    r = dapple("show", "--plan", plan_path, "--trace", out)
    assert r.returncode == 0, r.stderr
    assert r.stdout == "" and str(out) in r.stderr
    trace = json.loads(out.read_text())
    events = trace["traceEvents"]
    assert trace["displayTimeUnit"] == "ms"
    for e in events:
        assert all(k in e for k in REQUIRED), e
        if e["ph"] == "X":
            assert "dur" in e and e["dur"] >= 0
    # One track (process) a stage, named with its GPUs.
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert sorted(names) == [0, 1, 2, 3]
    for s, stage in enumerate(plan.data["stages"]):
        assert names[s].startswith(f"stage {s}, GPU")
        assert str(stage["devices"][0]) in names[s]
    # Every simulated task exactly once, at its start and for its duration (µs).
    slices = Counter(
        (e["pid"], e["args"]["kind"], e["args"].get("micro_batch"), round(e["ts"], 3), round(e["dur"], 3))
        for e in events if e["ph"] == "X"
    )
    # A transfer's task names its link's first stage; its slice is on the sender's track.
    sender = {"send_forward": 0, "send_backward": 1}
    tasks = Counter(
        (t["stage"] + sender.get(t["kind"], 0), t["kind"], t.get("micro_batch"), round(t["start_ms"] * 1000, 3),
         round((t["end_ms"] - t["start_ms"]) * 1000, 3))
        for t in sim.tasks
    )
    assert slices == tasks
    kinds = {t["kind"] for t in sim.tasks}
    assert {"forward", "backward", "send_forward", "send_backward", "optimizer_step"} <= kinds
    # A flow from each transfer to the pass that consumes it on the next (or previous) stage.
    starts = {e["id"]: e for e in events if e["ph"] == "s"}
    ends = {e["id"]: e for e in events if e["ph"] == "f"}
    transfers = [t for t in sim.tasks if t["kind"].startswith("send_")]
    assert len(starts) == len(ends) == len(transfers) > 0
    passes = {(t["stage"], t["kind"], t.get("micro_batch")): t["start_ms"] * 1000 for t in sim.tasks}
    for i, s in starts.items():
        f = ends[i]
        step = 1 if s["name"] == "send F" else -1
        assert f["pid"] == s["pid"] + step and f["bp"] == "e"
        consumer = "forward" if step == 1 else "backward"
        mb = next(e["args"]["micro_batch"] for e in events
                  if e["ph"] == "X" and e["tid"] == s["tid"] and e["pid"] == s["pid"] and e["ts"] == s["ts"])
        assert f["ts"] == pytest.approx(passes[(f["pid"], consumer, mb)])
    # Memory as a counter track per stage, the simulation's own points.
    for s, timeline in enumerate(sim.stages):
        counter = [(e["ts"], e["args"]["bytes"]) for e in events if e["ph"] == "C" and e["pid"] == s]
        assert counter == [(ms * 1000, held) for ms, held in timeline["memory"]]


def test_simulate_writes_the_same_trace_beside_its_report(dapple, four_stages, tmp_path):
    plan_path, _, _ = four_stages
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    assert dapple("simulate", "--plan", plan_path, "--trace", a).returncode == 0
    assert dapple("show", "--plan", plan_path, "--trace", b).returncode == 0
    assert json.loads(a.read_text()) == json.loads(b.read_text())


def test_a_chunked_plan_has_a_track_per_rank(four_stages, tmp_path):
    from dapple.planner.trace import chrome_trace

    _, plan, _ = four_stages
    profile = BERT
    chunked = planner.chunked(plan, profile, "interleaved-1f1b", 2)
    sim = planner.simulate(chunked, profile)
    events = chrome_trace(chunked, sim)["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert sorted(names) == [0, 1, 2, 3]
    assert names[1].startswith("rank 1 (stages 1, 5)")
    assert sum(e["ph"] == "X" for e in events) == len(sim.tasks)


@pytest.mark.parametrize("command", ["show", "simulate"])
def test_a_trace_to_a_folder_is_one_line_and_exit_6(dapple, four_stages, tmp_path, command):
    plan_path, _, _ = four_stages
    r = dapple(command, "--plan", plan_path, "--trace", tmp_path)
    assert r.returncode == 6, r.stderr
    assert r.stderr.count("\n") == 1 and str(tmp_path) in r.stderr and "Traceback" not in r.stderr
    assert r.stdout == ""
