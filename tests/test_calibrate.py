"""`dapple calibrate`: the round trip plan, run, calibrate, plan again on
CPU processes, and metrics that are not of the plan refused in one line."""

import json

import pytest

torch = pytest.importorskip("torch")

from dapple import planner  # noqa: E402
from conftest import assert_one_line_error, run_dapple  # noqa: E402

MODEL = ["--model", "dapple.planner.runtime.models:gpt", "--model-arg", "n_layers=2", "--model-arg", "d_model=16",
         "--model-arg", "n_heads=2", "--model-arg", "seq=8", "--model-arg", "vocab=32"]


def ok(*args):
    r = run_dapple(*args, timeout=180)
    assert r.returncode == 0, r.stderr
    return r


@pytest.fixture(scope="module")
def trip(tmp_path_factory):
    """A profile of the tiny GPT, the plan `dapple plan` makes for it on
    two CPU processes, a straight two-stage plan written from it, and the
    metrics of a short run of each."""
    d = tmp_path_factory.mktemp("calibrate")
    prof, plan, straight = d / "gpt.json", d / "plan.json", d / "straight.json"
    ok("profile", "model", *MODEL, "--batch-sizes", "1,2", "--repeats", "2", "--quiet", "--out", prof)
    ok("plan", "--profile", prof, "--topology", "1x2-pcie", "--global-batch-size", "4", "--out", plan)
    p = json.loads(plan.read_text())
    p.pop("estimate", None)
    p.pop("selection", None)
    p["micro_batch_size"], p["micro_batches"] = 1, 4
    p["stages"] = [{"layer_start": 0, "layer_end": 2, "devices": [0], "warmup_micro_batches": 2},
                   {"layer_start": 2, "layer_end": 4, "devices": [1], "warmup_micro_batches": 1}]
    straight.write_text(planner.Plan.from_json(json.dumps(p)).text)
    metrics = {}
    for name, path in (("plan", plan), ("straight", straight)):
        metrics[name] = d / f"{name}-metrics.json"
        ok("run", "--plan", path, *MODEL, "--steps", "4", "--metrics", metrics[name])
    return {"dir": d, "profile": prof, "plan": plan, "straight": straight, "metrics": metrics}


def test_round_trip_plan_run_calibrate_plan_again(trip):
    d = trip["dir"]
    out = d / "calibrated.json"
    r = ok("calibrate", "--plan", trip["plan"], "--metrics", trip["metrics"]["plan"], "--out", out)
    # Data on stdout: one row per stage; diagnostics on stderr.
    assert "time x" in r.stdout and "memory x" in r.stdout
    assert "memory left alone where rss-" in r.stderr and "cuda-allocated" in r.stderr
    assert f"calibrated profile written to {out}" in r.stderr
    before, after = planner.Profile.load(trip["profile"]), planner.Profile.load(out)
    factor = after.layers[0]["measurements"][0]["fwd_ms"] / before.layers[0]["measurements"][0]["fwd_ms"]
    assert f"{factor:.3f}" in r.stdout
    assert "calibrated by dapple calibrate" in after.data["source"]
    # CPU RSS: stored activations as they were.
    assert [m.get("stored_activation_bytes") for layer in after.layers for m in layer["measurements"]] == \
        [m.get("stored_activation_bytes") for layer in before.layers for m in layer["measurements"]]
    # The next plan uses what was measured (and records the calibrated profile).
    again = d / "again.json"
    ok("plan", "--profile", out, "--topology", "1x2-pcie", "--global-batch-size", "4", "--out", again)
    plan = json.loads(again.read_text())
    assert plan["inputs"]["profile_sha256"] == after.sha256
    assert plan["inputs"]["profile_path"] == str(out)


def test_each_stage_of_a_pipeline_scales_its_own_layers(trip):
    result = planner.calibrate(trip["straight"], trip["metrics"]["straight"], trip["profile"])
    assert [(s["layer_start"], s["layer_end"]) for s in result.stages] == [(0, 2), (2, 4)]
    before = planner.Profile.load(trip["profile"])
    for s in result.stages:
        assert s["time_factor"] == pytest.approx(s["measured_compute_ms"] / s["predicted_compute_ms"])
        assert s["memory_factor"] is None and s["memory_source"].startswith("rss-")
        for layer in range(s["layer_start"], s["layer_end"]):
            for old, new in zip(before.layers[layer]["measurements"], result.profile.layers[layer]["measurements"]):
                assert new["bwd_ms"] == pytest.approx(old["bwd_ms"] * s["time_factor"])


def test_metrics_of_another_plan_are_one_line_naming_file_and_field(trip, tmp_path):
    out = tmp_path / "c.json"
    # The straight plan's metrics (one rank a stage) against the searched plan.
    r = run_dapple("calibrate", "--plan", trip["plan"], "--metrics", trip["metrics"]["straight"], "--out", out)
    plan = json.loads(trip["plan"].read_text())
    if len(plan["stages"]) == 2 and all(len(s["devices"]) == 1 for s in plan["stages"]):
        pytest.skip("the searched plan is itself straight")
    assert_one_line_error(r, 4, str(trip["metrics"]["straight"]), "field ", "these metrics are not of this plan")
    assert not out.exists()
    # Another global batch.
    other = json.loads(trip["metrics"]["plan"].read_text())
    other["global_batch_size"] = 8
    bad = tmp_path / "m.json"
    bad.write_text(json.dumps(other))
    r = run_dapple("calibrate", "--plan", trip["plan"], "--metrics", bad, "--out", out)
    assert_one_line_error(r, 4, f"{bad}: field global_batch_size: value 8 is not the plan's 4")


def test_missing_and_invalid_inputs(trip, tmp_path):
    out = tmp_path / "c.json"
    missing = tmp_path / "none.json"
    r = run_dapple("calibrate", "--plan", trip["plan"], "--metrics", missing, "--out", out)
    assert_one_line_error(r, 6, str(missing))
    r = run_dapple("calibrate", "--plan", missing, "--metrics", trip["metrics"]["plan"], "--out", out)
    assert_one_line_error(r, 6, str(missing))
    # A profile (valid, but not metrics) given as the metrics.
    r = run_dapple("calibrate", "--plan", trip["plan"], "--metrics", trip["profile"], "--out", out)
    assert_one_line_error(r, 3, str(trip["profile"]), "field format")
    # The plan was made from another profile than the one given.
    other = json.loads(trip["profile"].read_text())
    other["model"] = "another"
    other_path = tmp_path / "other.json"
    other_path.write_text(json.dumps(other))
    r = run_dapple("calibrate", "--plan", trip["plan"], "--metrics", trip["metrics"]["plan"],
                   "--profile", other_path, "--out", out)
    assert_one_line_error(r, 4, str(trip["plan"]), "field inputs.profile_sha256")
    r = run_dapple("calibrate", "--plan", trip["plan"], "--metrics", trip["metrics"]["plan"])
    assert r.returncode == 2 and "--out" in r.stderr
    assert not out.exists()
