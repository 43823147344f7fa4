"""The command line as users meet it: output, files, exit codes, error lines."""

import json
import math

import pytest

from dapple import planner
from conftest import PROFILES, ROOT, assert_one_line_error

BERT = PROFILES / "bert-48-pbs-2.json"




def test_plan_prints_a_table_and_writes_the_plan(dapple, tmp_path):
    out = tmp_path / "plan.json"
    r = dapple("plan", "--profile", BERT, "--topology", "2x8-nvlink", "--global-batch-size", "64", "--out", out)
    assert r.returncode == 0, r.stderr
    assert "BERT-48 on 2x8-nvlink" in r.stdout
    assert "iteration" in r.stdout and "speedup" in r.stdout
    plan = json.loads(out.read_text())
    assert plan["format"] == "dapple.plan"
    assert len({d for s in plan["stages"] for d in s["devices"]}) == 16  # a chunked plan's ranks list theirs per chunk
    assert plan["micro_batch_size"] * plan["micro_batches"] == 64
    est = plan["estimate"]
    assert math.isclose(est["latency_ms"], est["warmup_ms"] + est["steady_ms"] + est["ending_ms"])
    assert est["fits_memory"]
    # The headline is the simulated iteration, the formula its lower bound.
    version = planner._core.FORMATS["dapple.plan"][0]  # the version this dapple writes
    assert plan["schema_version"] == version and plan["schedule"]["warmup_policy"] == "auto"
    assert est["iteration_ms"] >= est["latency_ms"] * (1 - 1e-9)  # a bound, equal up to rounding where met
    assert f"iteration {est['iteration_ms']:.1f} ms (simulated)" in r.stdout
    assert "bubble ms" in r.stdout and "lower bound" in r.stdout


def test_a_fixed_warmup_policy_is_kept_and_never_faster_than_auto(dapple):
    args = ("plan", "--profile", BERT, "--topology", "A", "--global-batch-size", "64", "--json")
    plain = dapple(*args)
    assert plain.returncode == 0, plain.stderr
    fixed = json.loads(dapple(*args, "--warmup-policy", "B").stdout)
    assert fixed["schedule"]["warmup_policy"] == "B"
    assert fixed["estimate"]["iteration_ms"] >= json.loads(plain.stdout)["estimate"]["iteration_ms"] - 1e-6


def test_refinement_moves_the_plan_and_says_from_where(dapple, tmp_path):
    # AmoebaNet-18 on 16 GPUs over 10 Gbps: the search space's best found
    # plan gets faster by local moves (stage boundaries, GPUs left idle).
    # Early backward alone: refinement moves the search's own kind.
    amoeba = PROFILES / "amoeba-18-pbs-8.json"
    args = ("plan", "--profile", amoeba, "--topology", "C", "--global-batch-size", "128",
            "--schedule", "early-backward-1f1b")
    refined, unrefined = dapple(*args, "--json"), dapple(*args, "--no-refine", "--json")
    assert refined.returncode == unrefined.returncode == 0, refined.stderr + unrefined.stderr
    moved, space = json.loads(refined.stdout), json.loads(unrefined.stdout)
    assert "refined_from_ms" not in space["selection"]
    # Refinement starts from the space's plan and keeps only faster moves.
    assert moved["selection"]["refined_from_ms"] == space["estimate"]["iteration_ms"]
    assert moved["estimate"]["iteration_ms"] < space["estimate"]["iteration_ms"]
    assert moved["stages"] != space["stages"]
    # The refined plan costs again to its own estimate, and the table says
    # where it started.
    out = tmp_path / "refined.json"
    table = dapple(*args, "--out", out)
    assert f"refined from {space['estimate']['iteration_ms']:.1f} ms" in table.stdout
    again = dapple("estimate", "--plan", out, "--json")
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["estimate"] == moved["estimate"]


def test_plan_json_goes_to_stdout_and_diagnostics_to_stderr(dapple):
    r = dapple("plan", "--profile", BERT, "--topology", "A", "--global-batch-size", "64", "--json")
    assert r.returncode == 0
    assert json.loads(r.stdout)["inputs"]["topology"]["name"] == "A"
    assert "searched micro-batch sizes" in r.stderr


def test_estimate_reproduces_the_plans_own_estimate(dapple, tmp_path):
    out = tmp_path / "plan.json"
    assert dapple("plan", "--profile", BERT, "--topology", "B", "--global-batch-size", "64", "--out", out).returncode == 0
    r = dapple("estimate", "--plan", out, "--json")
    assert r.returncode == 0, r.stderr
    planned = json.loads(out.read_text())["estimate"]
    assert json.loads(r.stdout)["estimate"] == planned


def test_estimate_rejects_a_plan_for_another_profile(dapple, tmp_path):
    out = tmp_path / "plan.json"
    dapple("plan", "--profile", BERT, "--topology", "A", "--global-batch-size", "64", "--out", out)
    r = dapple("estimate", "--plan", out, "--profile", PROFILES / "xlnet-36-pbs-1.json")
    assert_one_line_error(r, 4, "inputs.profile_sha256")


def test_topology_show(dapple):
    r = dapple("topology", "show", "16x1-10gbps")
    assert r.returncode == 0
    assert "16 GPUs" in r.stdout and "10" in r.stdout


@pytest.mark.parametrize(
    "mutate, needles",
    [
        (lambda d: d["layers"][1]["measurements"][0].pop("fwd_ms"), ["layers[1].measurements[0]", "fwd_ms"]),
        (lambda d: d["layers"][2]["measurements"][0].update(bwd_ms=-3.5), ["layers[2].measurements[0].bwd_ms", "-3.5"]),
        (lambda d: d.update(layers=[]), ["field layers", "zero layers"]),
        (lambda d: d.update(schema_version=9), ["field schema_version", "value 9"]),
        (lambda d: d.update(format="dapple.plan"), ["field format", "dapple.plan"]),
        (lambda d: d["layers"][0].update(param_bytes="lots"), ["layers[0].param_bytes", "lots"]),
        (lambda d: d.update(optimizer="adadelta"), ["field optimizer", "adadelta"]),
    ],
)
def test_bad_profiles_get_one_line_naming_file_field_and_value(dapple, small_profile, mutate, needles):
    path = small_profile(mutate)
    r = dapple("plan", "--profile", path, "--topology", "1x2-nvlink", "--global-batch-size", "4")
    assert_one_line_error(r, 3, str(path), *needles)


def test_nan_is_reported(dapple, small_profile):
    path = small_profile(raw='{"format": "dapple.profile", "schema_version": 1, "model": "m", "layers": '
                             '[{"name": "a", "param_bytes": 1, "measurements": [{"batch_size": 1, "fwd_ms": NaN, '
                             '"bwd_ms": 1, "activation_bytes": 1}]}]}')
    r = dapple("plan", "--profile", path, "--topology", "1x2-nvlink", "--global-batch-size", "4")
    assert_one_line_error(r, 3, str(path), "NaN")


def test_unknown_topology_spec(dapple):
    r = dapple("plan", "--profile", BERT, "--topology", "2x8-warpdrive", "--global-batch-size", "64")
    assert_one_line_error(r, 3, "2x8-warpdrive", "unknown link")


def test_batch_size_the_gpus_cannot_share(dapple, small_profile):
    # Slices must be at least the profiled batch size (4); 2 samples cannot be split that way.
    path = small_profile(lambda d: [l["measurements"][0].update(batch_size=4) for l in d["layers"]])
    r = dapple("plan", "--profile", path, "--topology", "1x2-nvlink", "--global-batch-size", "2")
    assert_one_line_error(r, 4, "global batch size 2")


def test_more_gpus_than_work_leaves_gpus_idle(dapple, small_profile):
    # 1 sample cannot be split over 8 GPUs: the plan uses one GPU per stage
    # for its single micro-batch and says how many it leaves idle.
    path = small_profile()
    r = dapple("plan", "--profile", path, "--topology", "1x8-nvlink", "--global-batch-size", "1", "--json")
    assert r.returncode == 0, r.stderr
    used = sum(len(s["devices"]) for s in json.loads(r.stdout)["stages"])
    assert 1 <= used < 8
    table = dapple("plan", "--profile", path, "--topology", "1x8-nvlink", "--global-batch-size", "1")
    assert f"leaves {8 - used} of 8 GPUs idle" in table.stdout


def test_model_that_fits_nowhere(dapple, small_profile):
    path = small_profile(lambda d: [l.update(param_bytes=40 * 2**30) for l in d["layers"]])
    r = dapple("plan", "--profile", path, "--topology", "1x2-nvlink", "--global-batch-size", "4")
    assert_one_line_error(r, 5, "GiB")


def test_missing_file(dapple, tmp_path):
    r = dapple("plan", "--profile", tmp_path / "nope.json", "--topology", "A", "--global-batch-size", "4")
    assert_one_line_error(r, 6, "nope.json", "no such file")


def test_failed_plan_leaves_out_untouched(dapple, small_profile, tmp_path):
    out = tmp_path / "plan.json"
    out.write_text("previous plan")
    path = small_profile(lambda d: [l.update(param_bytes=40 * 2**30) for l in d["layers"]])
    r = dapple("plan", "--profile", path, "--topology", "1x2-nvlink", "--global-batch-size", "4", "--out", out)
    assert r.returncode == 5
    assert out.read_text() == "previous plan"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".plan.json")] == []


def test_out_into_missing_directory_is_an_io_error(dapple, tmp_path):
    r = dapple("plan", "--profile", BERT, "--topology", "A", "--global-batch-size", "64",
               "--out", tmp_path / "no" / "such" / "dir" / "plan.json")
    assert_one_line_error(r, 6, "cannot write")


def test_bad_topology_file_names_the_field(dapple, tmp_path):
    topo = json.loads(dapple("topology", "show", "2x8-nvlink", "--json").stdout)
    topo["inter_machine"]["bandwidth_gbps"] = -25
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(topo))
    r = dapple("plan", "--profile", BERT, "--topology", path, "--global-batch-size", "64")
    assert_one_line_error(r, 3, str(path), "inter_machine.bandwidth_gbps", "-25")


def edited_plan(dapple, tmp_path, edit):
    """A plan of BERT-48 on A written by `dapple plan`, changed by
    ``edit(plan_dict)`` and saved again; its path."""
    out = tmp_path / "plan.json"
    assert dapple("plan", "--profile", BERT, "--topology", "A", "--global-batch-size", "64", "--out", out).returncode == 0
    plan = json.loads(out.read_text())
    edit(plan)
    out.write_text(json.dumps(plan))
    return out


def test_hand_written_plan_with_overlapping_devices(dapple, tmp_path):
    out = edited_plan(dapple, tmp_path, lambda p: p["stages"][1]["devices"].__setitem__(0, p["stages"][0]["devices"][0]))
    r = dapple("estimate", "--plan", out, "--profile", BERT)
    assert_one_line_error(r, 3, str(out), "stages[1].devices", "used by two stages")


def test_usage_errors_exit_2(dapple):
    r = dapple("plan", "--topology", "A")
    assert r.returncode == 2
    assert "Traceback" not in r.stderr


def test_plan_whose_warmup_contradicts_its_policy(dapple, tmp_path):
    out = edited_plan(dapple, tmp_path, lambda p: p["stages"][0].update(warmup_micro_batches=99))
    r = dapple("estimate", "--plan", out)
    assert_one_line_error(r, 3, "stages[0].warmup_micro_batches", "99")


def test_plan_with_a_foreign_embedded_topology_version(dapple, tmp_path):
    out = edited_plan(dapple, tmp_path, lambda p: p["inputs"]["topology"].update(schema_version=2))
    r = dapple("estimate", "--plan", out)
    assert_one_line_error(r, 3, "inputs.topology.schema_version", "2")


def test_profile_without_any_compute_time(dapple, small_profile):
    path = small_profile(lambda d: [l["measurements"][0].update(fwd_ms=0, bwd_ms=0) for l in d["layers"]])
    r = dapple("plan", "--profile", path, "--topology", "1x2-nvlink", "--global-batch-size", "4")
    assert_one_line_error(r, 3, str(path), "0 ms")


def test_missing_recorded_profile_names_the_plan_field(dapple, tmp_path):
    r = dapple("plan", "--profile", PROFILES / "vgg-19-pbs-32.json", "--topology", "1x2-pcie",
               "--global-batch-size", 64, "--json")
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    plan["inputs"]["profile_path"] = "gone.json"
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    assert_one_line_error(dapple("simulate", "--plan", path), 6, str(path), "inputs.profile_path", "gone.json")


def test_a_device_listed_twice_in_one_stage_says_so(dapple, tmp_path):
    out = edited_plan(dapple, tmp_path, lambda p: p["stages"][0]["devices"].__setitem__(1, p["stages"][0]["devices"][0]))
    r = dapple("estimate", "--plan", out, "--profile", BERT)
    assert_one_line_error(r, 3, str(out), "stages[0].devices", "listed twice")


def test_an_empty_recorded_profile_path_names_the_plan_field(dapple, tmp_path):
    out = edited_plan(dapple, tmp_path, lambda p: p["inputs"].update(profile_path=""))
    r = dapple("simulate", "--plan", out)
    assert_one_line_error(r, 3, str(out), "inputs.profile_path", "empty")


@pytest.mark.parametrize("text, needle", [("[" * 5000 + "]" * 5000, "recursion limit exceeded"),
                                           ('{"format": ' + "9" * 5000 + "}", "number out of range")])
def test_regress_suites_that_json_cannot_hold_are_one_line(dapple, tmp_path, text, needle):
    path = tmp_path / "suite.json"
    path.write_text(text)
    r = dapple("regress", path)
    assert_one_line_error(r, 3, str(path), needle)


def test_infeasible_on_mixed_memories_names_the_range(dapple, small_profile, tmp_path):
    topo = json.loads(dapple("topology", "show", "1x2-nvlink", "--json").stdout)
    tiny = json.loads(json.dumps(topo["machine_groups"][0]))
    tiny["gpu"]["memory_bytes"] = 1024
    topo["machine_groups"].append(tiny)
    path = tmp_path / "mixed.json"
    path.write_text(json.dumps(topo))
    heavy = small_profile(lambda d: [l.update(param_bytes=40 * 2**30) for l in d["layers"]])
    r = dapple("plan", "--profile", heavy, "--topology", path, "--global-batch-size", "4")
    # Not "a GPU has 16.00 GiB": the tiny group's GPUs hold 1024 bytes.
    assert_one_line_error(r, 5, "the GPUs have 1024 bytes to 16.00 GiB")


def test_a_key_given_twice_is_refused(dapple, tmp_path):
    out = tmp_path / "plan.json"
    assert dapple("plan", "--profile", BERT, "--topology", "A", "--global-batch-size", "64", "--out", out).returncode == 0
    text = out.read_text()
    twice = text.replace('"micro_batches": ', '"micro_batches": 1, "micro_batches": ', 1)
    assert twice != text
    out.write_text(twice)
    assert_one_line_error(dapple("estimate", "--plan", out, "--profile", BERT), 3, str(out),
                          "duplicate field `micro_batches`")


def test_text_outputs_show_each_stages_shape(dapple, shaped_plan, tmp_path):
    plan, profile = shaped_plan
    table = dapple("estimate", "--plan", plan, "--profile", profile)
    assert table.returncode == 0, table.stderr
    rows = [line for line in table.stdout.splitlines() if line.lstrip()[:1].isdigit()]
    assert "t2\u00d7r2 zero" in rows[0] and "t1\u00d7r4 rc" in rows[1], table.stdout
    assert "shape tT\u00d7rR:" in table.stdout
    sim = dapple("simulate", "--plan", plan, "--profile", profile)
    assert sim.returncode == 0, sim.stderr
    assert "stage 0 (t2\u00d7r2 zero): busy" in sim.stdout and "stage 1 (t1\u00d7r4 rc): busy" in sim.stdout
    # a plain plan's text has no shapes to tell; its header names the
    # layout: two stages of eight replicas (issue 67)
    plain = tmp_path / "plain.json"
    assert dapple("plan", "--profile", BERT, "--topology", "A", "--global-batch-size", 64, "--schedule",
                  "early-backward-1f1b", "--out", plain).returncode == 0
    outputs = {}
    for command in ("estimate", "simulate"):
        r = dapple(command, "--plan", plain)
        assert r.returncode == 0, r.stderr
        header, *rest = r.stdout.splitlines()
        assert "pp2 \u00d7 (r8)" in header, header
        assert not any("\u00d7" in line for line in rest) and "shape" not in r.stdout, r.stdout
        outputs[command] = r.stdout
    assert "stage 0: busy" in outputs["simulate"]


def test_run_says_it_trains_on_cuda_too(dapple):
    listed = dapple("--help").stdout
    run_line = next(line for line in listed.splitlines() if line.strip("│ ").startswith("run "))
    assert "CUDA" in run_line and "on CPU following" not in run_line
    assert "NCCL" in dapple("run", "--help").stdout


def _stderr_on_a_terminal(args: list[str], env: dict) -> str:
    """Run dapple with stderr on a pseudo-terminal; what it showed there."""
    import os
    import pty
    import subprocess

    from conftest import DAPPLE, ROOT

    main, tty = pty.openpty()
    proc = subprocess.Popen([str(DAPPLE), *map(str, args)], stdout=subprocess.DEVNULL, stderr=tty,
                            stdin=subprocess.DEVNULL, env=env, cwd=ROOT)
    os.close(tty)
    shown = b""
    while True:
        try:
            chunk = os.read(main, 65536)
        except OSError:  # the terminal closed with the process
            break
        if not chunk:
            break
        shown += chunk
    os.close(main)
    assert proc.wait(timeout=120) == 0, shown
    return shown.decode("utf-8", "replace")


@pytest.mark.parametrize("command", ["plan", "compare"])
def test_a_progress_indicator_shows_on_a_terminal_only(dapple, command, monkeypatch):
    import os

    monkeypatch.setenv("DAPPLE_PROGRESS_DELAY_S", "0")  # shown at once, however fast the call
    args = [command, "--profile", PROFILES / "bert-48-pbs-2.json", "--topology", "A", "--global-batch-size", "64"]
    env = {**os.environ, "TERM": "xterm", "COLUMNS": "100"}
    what = "planning" if command == "plan" else "comparing strategies"
    shown = _stderr_on_a_terminal(args, env)
    assert what in shown and "BERT-48 on A" in shown, shown
    assert "0:00:0" in shown  # the elapsed time
    # --quiet, or stderr not a terminal: nothing of it.
    assert what not in _stderr_on_a_terminal([*args, "--quiet"], env)
    piped = dapple(*args)
    assert piped.returncode == 0 and what not in piped.stderr, piped.stderr


def test_a_profile_the_plans_stages_do_not_cover_is_refused_by_name(dapple, tmp_path):
    # Issue 29's fuzz campaign: show's diagram indexed past the profile's
    # layers (exit 1) when given another model's profile.
    plan = tmp_path / "plan.json"
    assert dapple("plan", "--profile", PROFILES / "bert-24-pbs-6.json", "--topology", "1x4-nvlink",
                  "--global-batch-size", 24, "--out", plan, "--quiet").returncode == 0
    other = PROFILES / "vgg-19-pbs-32.json"
    layers = len(json.loads(other.read_text())["layers"])
    r = dapple("show", "--plan", plan, "--profile", other, "--diagram", tmp_path / "d.png")
    assert_one_line_error(r, 4, "the plan's stages end at layer 29", f"has {layers} layers")
    assert not (tmp_path / "d.png").exists()


def test_a_plans_header_names_its_layout_as_its_stages_hold_it(dapple):
    """Issue 67: Whale's ResNet-50 with a 1,000,000-class FC on 4x8 V100s
    is one stage split 32 ways on one replica: the header says t32×r1, not
    "data parallel 32"; a plain stage of 8 replicas is data parallelism."""
    r = dapple("plan", "--profile", ROOT / "profiles" / "whale" / "resnet50-fc1000k.json",
               "--topology", "4x8-v100-32gb-nvlink-50gbps", "--global-batch-size", 512)
    assert r.returncode == 0, r.stderr
    header = r.stdout.splitlines()[0]
    assert ": t32\u00d7r1" in header and "data parallel" not in header, header
    from dapple.planner.plan import layout_label

    dp = planner.baseline("data-parallel", BERT, "A", 64)
    assert layout_label(dp.stage_shapes) == "data parallel 16" == dp.layout
    straight = planner.baseline("straight", BERT, "A", 64)
    assert straight.layout == f"pp{len(straight.stages)}"
