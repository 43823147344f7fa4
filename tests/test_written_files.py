"""Every JSON file a command writes carries the `format` and
`schema_version` of the core's table (`dapple.planner._core.FORMATS`) and reads
back through the core's own parser for that format. (`profile model` and
`topology measure` are read back by `dapple plan` in test_profiler.py and
test_links.py; `run --metrics` in test_run.py.)"""

import json
import shutil

import pytest

from dapple import planner
import dapple.planner._core as core
from conftest import PROFILES, ROOT, SHARED

DATA = ROOT / "tests" / "data"

BERT = PROFILES / "bert-48-pbs-2.json"


def read_back(text: str, cls, source: str):
    data = json.loads(text)
    version, _ = core.FORMATS[data["format"]]
    assert data["schema_version"] == version, source
    return cls.from_json(text, source)


def test_plan_out(dapple, tmp_path):
    out = tmp_path / "p.json"
    assert dapple("plan", "--profile", BERT, "--topology", "A", "--global-batch-size", 64, "--out", out).returncode == 0
    assert read_back(out.read_text(), core.Plan, str(out)).shape == planner.plan(BERT, "A", 64).shape


def test_simulate_json(dapple, tmp_path):
    out = tmp_path / "p.json"
    assert dapple("plan", "--profile", BERT, "--topology", "A", "--global-batch-size", 64, "--out", out).returncode == 0
    r = dapple("simulate", "--plan", out, "--json")
    assert r.returncode == 0, r.stderr
    sim = read_back(r.stdout, core.Simulation, "stdout")
    assert sim.iteration_ms == pytest.approx(planner.Plan.load(out).iteration_ms)


def test_topology_show_json(dapple):
    r = dapple("topology", "show", "B", "--json")
    assert read_back(r.stdout, core.Topology, "stdout").num_devices == 16


def test_import_artifact_out(dapple, tmp_path):
    graph = SHARED / "profiles" / "dapple-artifact" / "bert-48-pbs-2.txt"
    if not graph.exists():
        pytest.skip(f"{graph} is not beside this checkout")
    out = tmp_path / "bert.json"
    r = dapple("profile", "import-artifact", graph, "--model", "BERT-48", "--batch-size", 2, "--out", out)
    assert r.returncode == 0, r.stderr
    assert read_back(out.read_text(), core.Profile, str(out)).model == "BERT-48"


def test_regress_update(dapple, tmp_path):
    shutil.copy(BERT, tmp_path / "bert.json")
    suite = tmp_path / "suite.json"
    suite.write_text(json.dumps({
        "format": "dapple.regress-suite", "schema_version": 2,
        "cases": [{"name": "bert A", "profile": "bert.json", "topology": "A", "global_batch_size": 64}],
    }))
    assert dapple("regress", suite, "--update").returncode == 0
    assert read_back(suite.read_text(), core.RegressSuite, str(suite)).num_cases == 1
    assert json.loads(suite.read_text())["cases"][0]["expected_shape"] == planner.plan(BERT, "A", 64).shape


def test_a_plan_whose_memory_sums_round_below_zero_reads_back(dapple, tmp_path):
    # Issue 29's fuzz campaign: on this measured profile the simulated peak's
    # "other" memory came out as -1.8e-12 (events that came and went), and
    # the plan written was refused when read back.
    out = tmp_path / "plan.json"
    r = dapple("plan", "--profile", DATA / "digits-profile-rounding.json", "--topology", "1x2",
               "--global-batch-size", 2, "--out", out, "--quiet")
    assert r.returncode == 0, r.stderr
    plan = planner.Plan.load(out)
    assert all(m["other_bytes"] >= 0 and m["working_bytes"] >= 0 for m in plan.data["estimate"]["memory"])


def test_every_output_kind_is_written_with_the_umasks_mode(tmp_path):
    """Issue 67: under umask 022 a plan, its pictures, its trace, every
    export (the torchtitan schedule CSV beside its TOML) and a profile are
    all written 0644, the mode a plain open() gives a new file."""
    import os
    import stat

    from conftest import run_dapple

    config = tmp_path / "small-llama.json"
    config.write_text(json.dumps({"model_type": "llama", "hidden_act": "silu", "hidden_size": 256,
                                  "intermediate_size": 688, "num_attention_heads": 8, "num_key_value_heads": 4,
                                  "num_hidden_layers": 4, "vocab_size": 1000}))
    profile, plan = tmp_path / "profile.json", tmp_path / "plan.json"
    commands = [
        ("profile", "transformer", "--config", config, "--gpu", "a100", "--seq-len", 128, "--out", profile),
        ("plan", "--profile", profile, "--topology", "1x8-a100-80gb", "--global-batch-size", 16, "--out", plan),
        ("show", "--plan", plan, "--gantt", tmp_path / "g.svg", "--memory", tmp_path / "m.png",
         "--diagram", tmp_path / "d.png", "--trace", tmp_path / "t.json"),
        ("export", "--plan", plan, "--to", "torch-csv", "--out", tmp_path / "x-torch.csv"),
        # --approximate: this plan shards its gradients, which the runtimes write at their nearest level
        *[("export", "--plan", plan, "--to", target, "--out", tmp_path / f"x-{target}", "--approximate")
          for target in ("torchtitan", "megatron", "deepspeed")],
    ]
    before = os.umask(0o022)
    try:
        for args in commands:
            r = run_dapple(*args)
            assert r.returncode == 0, (args, r.stderr)
    finally:
        os.umask(before)
    written = [p for p in tmp_path.iterdir() if p != config]
    assert len(written) >= 10, sorted(p.name for p in written)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in written}
    assert set(modes.values()) == {0o644}, {name: oct(mode) for name, mode in modes.items()}
