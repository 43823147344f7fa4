"""Numbers beyond what dapple can count are refused where they enter, with
the usual one-line errors (issue 12): sample counts beyond 32 bits, GPU
counts that would wrap or exhaust memory."""

import json

import pytest

from dapple import planner
from conftest import PROFILES, assert_one_line_error, write_hand_plan
from dapple.planner._core import MAX_PASSES

BERT = PROFILES / "bert-48-pbs-2.json"
PLAN_ARGS = ["plan", "--profile", BERT, "--topology", "A"]


@pytest.mark.parametrize("value", ["4294967296", "99999999999999999999"])
def test_counts_beyond_32_bits_are_usage_errors_not_overflows(dapple, value):
    r = dapple(*PLAN_ARGS, "--global-batch-size", value)
    assert r.returncode == 2, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "4294967295" in lines[0] and "Traceback" not in r.stderr


def test_counts_beyond_32_bits_through_the_api_name_the_field(tmp_path):
    with pytest.raises(planner.InvalidInputError, match="field global_batch_size: value 4294967296"):
        planner.plan(BERT, "A", 2**32)
    with pytest.raises(planner.InvalidInputError, match="field min_micro_batch_size"):
        planner.baseline("gpipe", BERT, "A", 64, min_micro_batch_size=-1)


def test_usage_errors_are_one_line(dapple):
    r = dapple("plan", "--topology", "A")
    assert r.returncode == 2
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "--profile" in lines[0] and "dapple plan --help" in lines[0]


@pytest.mark.parametrize("spec", ["65536x65536-nvlink", "99999x99999", "4294967295x1", "1x2000-nvlink"])
def test_gpu_counts_that_would_wrap_are_invalid_specs(dapple, spec):
    r = dapple("topology", "show", spec)
    assert_one_line_error(r, 3, spec)


@pytest.mark.parametrize("mutate, field", [
    (lambda d: d["layers"][1]["measurements"][0].update(fwd_ms=1e307), "layers[1].measurements[0].fwd_ms"),
    (lambda d: d["layers"][2]["measurements"][0].update(bwd_ms=2e12), "layers[2].measurements[0].bwd_ms"),
])
def test_times_beyond_the_bound_are_invalid_inputs_not_infinite_plans(dapple, small_profile, tmp_path, mutate, field):
    out = tmp_path / "plan.json"
    out.write_text("keep me")
    r = dapple("plan", "--profile", small_profile(mutate), "--topology", "1x2-nvlink",
               "--global-batch-size", "4", "--out", out, "--json")
    assert_one_line_error(r, 3, field, "1e12")
    assert out.read_text() == "keep me" and r.stdout == ""


@pytest.mark.parametrize("group, field", [
    ({"gpu": {"type": "x", "memory_bytes": 17179869184, "relative_speed": 1e-308}}, "gpu.relative_speed"),
    ({"intra_machine": {"kind": "nvlink", "bandwidth_gbps": 1e-308}}, "intra_machine.bandwidth_gbps"),
])
def test_rates_beyond_the_bound_are_invalid_inputs(dapple, tmp_path, group, field):
    import json

    topo = {
        "format": "dapple.topology", "schema_version": 1, "name": "t",
        "machine_groups": [{"machines": 1, "gpus_per_machine": 2,
                            "gpu": {"type": "V100-16GB", "memory_bytes": 17179869184},
                            "intra_machine": {"kind": "nvlink", "bandwidth_gbps": 1040.0}, **group}],
        "inter_machine": {"kind": "ethernet", "bandwidth_gbps": 25.0},
    }
    path = tmp_path / "t.json"
    path.write_text(json.dumps(topo))
    r = dapple("topology", "show", path)
    assert_one_line_error(r, 3, str(path), field, "1e-9")


def _one_gpu_plan(dapple, profile, path, micro_batches):
    """A one-stage plan on one GPU with `micro_batches` micro-batches of one sample."""
    assert dapple("plan", "--profile", profile, "--topology", "1x1", "--global-batch-size", 8, "--out", path,
                  "--warmup-policy", "A").returncode == 0
    plan = json.loads(path.read_text())
    plan["inputs"]["global_batch_size"] = micro_batches
    plan["micro_batch_size"], plan["micro_batches"] = 1, micro_batches
    plan["stages"][-1]["warmup_micro_batches"] = 1
    return write_hand_plan(plan, path)


def test_a_plan_over_the_simulation_limit_is_refused_not_run(dapple, small_profile, tmp_path):
    # One GPU, micro-batches of one sample: 2^23 micro-batches, over MAX_PASSES (2^18).
    profile = small_profile()
    out = _one_gpu_plan(dapple, profile, tmp_path / "p.json", 2**23)
    for command in ("simulate", "estimate"):
        r = dapple(command, "--plan", out, "--profile", profile)
        assert_one_line_error(r, 9, str(out), "field micro_batches", f"over the limit of {MAX_PASSES}")


def test_the_search_leaves_out_sizes_over_the_simulation_limit():
    # 2^27 samples: micro-batches of 32 (the profile's smallest) would make
    # 2^22 micro-batches; the search starts where they are MAX_PASSES.
    p = planner.plan(PROFILES / "vgg-19-pbs-32.json", "A", 2**27)
    sizes = p.search_stats.micro_batch_sizes
    assert min(sizes) == 2**27 // MAX_PASSES and p.micro_batches * len(p.stages) <= MAX_PASSES


def test_a_timeline_too_big_to_draw_is_refused_and_nothing_is_written(dapple, tmp_path):
    bert = PROFILES / "bert-48-pbs-2.json"
    d = planner.baseline("straight", bert, "1x2-nvlink", 64, warmup_policy="A").core.to_dict()
    del d["estimate"]
    m = 10_000
    d["inputs"].update(global_batch_size=2 * m, profile_path=str(bert))
    d["micro_batch_size"], d["micro_batches"] = 2, m
    for i, s in enumerate(d["stages"]):
        s["warmup_micro_batches"] = min(len(d["stages"]) - i, m)
    plan = tmp_path / "p.json"
    planner.Plan.from_dict(d).save(plan)
    picture = tmp_path / "g.png"
    r = dapple("show", "--plan", plan, "--gantt", picture, "--memory", tmp_path / "m.png")
    assert_one_line_error(r, 9, str(picture), "over the limit of 20000")
    assert not picture.exists() and not (tmp_path / "m.png").exists()


def test_the_search_stops_at_its_memory_limit_with_one_line(dapple, tmp_path):
    out = tmp_path / "plan.json"
    out.write_text("kept\n")
    args = ["plan", "--profile", PROFILES / "bert-48-pbs-2.json", "--topology", "2x8-nvlink",
            "--global-batch-size", "64", "--out", out]
    # 0.001 GiB (1 MiB) of tables is too little for BERT-48 on 16 GPUs.
    r = dapple(*args, "--max-search-gib", "0.001")
    assert_one_line_error(r, 9, "the search's tables reached", "past the limit of 0.00 GiB", "--max-search-gib")
    assert out.read_text() == "kept\n"
    # The default leaves room for it, and a limit is a positive number of GiB.
    assert dapple(*args).returncode == 0
    for bad in ("0", "-1", "2000", "x"):
        assert dapple(*args, "--max-search-gib", bad).returncode == 2
    with pytest.raises(planner.InvalidInputError, match="max_search_gib"):
        planner.plan(PROFILES / "bert-48-pbs-2.json", "2x8-nvlink", 64, max_search_gib=0)


def test_a_limit_can_be_raised_for_one_command(dapple, small_profile, tmp_path):
    profile = small_profile()
    over = MAX_PASSES + 1  # one stage
    out = _one_gpu_plan(dapple, profile, tmp_path / "p.json", over)
    assert dapple("estimate", "--plan", out, "--profile", profile).returncode == 9
    raised = dapple("estimate", "--plan", out, "--profile", profile, "--max-passes", str(over))
    assert raised.returncode == 0, raised.stderr
    # Ranges: at least one pass, at most the ceiling; a timeline's tasks likewise.
    from dapple.planner.limits import MAX_PASSES_CEILING, MAX_TASKS_DRAWN_CEILING

    for bad in ("0", str(MAX_PASSES_CEILING + 1)):
        assert dapple("estimate", "--plan", out, "--profile", profile, "--max-passes", bad).returncode == 2
    for bad in ("0", str(MAX_TASKS_DRAWN_CEILING + 1)):
        r = dapple("show", "--plan", out, "--gantt", tmp_path / "g.png", "--max-tasks-drawn", bad)
        assert r.returncode == 2 and not (tmp_path / "g.png").exists()


def test_a_timeline_limit_is_the_callers_to_set():
    from dapple.planner.pictures import check_timeline_size

    plan = planner.baseline("straight", PROFILES / "bert-48-pbs-2.json", "1x2-nvlink", 64, warmup_policy="A")
    tasks = 2 * plan.micro_batches * (2 * len(plan.stages) - 1) + 2 * len(plan.stages)
    check_timeline_size(plan, "g.png", max_tasks=tasks)
    with pytest.raises(planner.LimitExceededError, match="--max-tasks-drawn"):
        check_timeline_size(plan, "g.png", max_tasks=tasks - 1)


@pytest.mark.parametrize("command,topology,gbs", [("plan", "A", "1000000000"), ("compare", "B", "2147483647")])
def test_requests_no_layout_can_fit_fail_before_any_search(dapple, command, topology, gbs):
    # These searched for 42 s and 25 s before saying no plan fits; the
    # floor every layout keeps (the model's activations of the smallest
    # micro-batch over all GPUs) says it at once.
    r = dapple(command, "--profile", PROFILES / "bert-48-pbs-2.json", "--topology", topology,
               "--global-batch-size", gbs, timeout=60)
    assert_one_line_error(r, 5, "no plan fits in GPU memory: every plan keeps at least", "lower the global batch size")


def test_a_model_state_no_cluster_holds_fails_before_any_search(dapple, tmp_path):
    # Llama-2-70B on 16 V100-16GB: its weights and gradients alone, spread
    # over every GPU, pass 16 GiB (its optimizer could go to the hosts).
    # The search ran out of steps (exit 9) before saying so.
    profile = tmp_path / "llama.json"
    made = dapple("profile", "transformer", "--config", "llama-2-70b", "--gpu", "A100-80GB", "--seq-len", "4096",
                  "--out", profile)
    assert made.returncode == 0, made.stderr
    r = dapple("plan", "--profile", profile, "--topology", "2x8-nvlink", "--global-batch-size", "64", timeout=60)
    assert_one_line_error(r, 5, "every plan keeps at least", "the model's weights and gradients",
                          "the state alone needs more GPUs or larger ones")


def test_the_full_space_past_its_size_is_refused_before_searching(dapple, small_profile):
    # Issue 29: the full space on 32x8 ran about a minute to reach its table
    # limit (GNMT-32 on 4x8 runs minutes). Past 32 GPUs of multi-GPU
    # machines it is refused at once at the default limit; a raised limit
    # searches it (a 4-layer model, quickly).
    args = ["plan", "--profile", PROFILES / "vgg-19-pbs-32.json", "--global-batch-size", 2048,
            "--search-space", "full"]
    r = dapple(*args, "--topology", "32x8", timeout=60)
    assert_one_line_error(r, 9, "the full search space on 256 GPUs of multi-GPU machines", "up to 32",
                          "--search-space machine-aligned", "--max-search-gib")
    assert dapple(*args, "--topology", "64x1").returncode == 0  # no partly used machines
    assert dapple(*args, "--topology", "2x8").returncode == 0
    small = ["plan", "--profile", small_profile(), "--topology", "5x8", "--search-space", "full"]
    assert dapple(*small).returncode == 9
    raised = dapple(*small, "--max-search-gib", "1.01", timeout=120)
    assert raised.returncode == 0, raised.stderr


def test_the_memory_floor_never_refuses_a_plan_the_search_finds():
    from dapple.planner import _core

    # Four layers keeping 1000 bytes a sample each, on two GPUs of 1 GiB.
    profile = planner.Profile.from_dict({
        "format": "dapple.profile", "schema_version": 1, "model": "tiny", "optimizer": "sgd",
        "layers": [{"name": f"l{i}", "param_bytes": 1000,
                    "measurements": [{"batch_size": 1, "fwd_ms": 1.0, "bwd_ms": 2.0, "activation_bytes": 1000,
                                      "stored_activation_bytes": 1000}]} for i in range(4)]})
    data = planner.Topology.from_spec("1x2").data
    data["machine_groups"][0]["gpu"]["memory_bytes"] = 2**30
    topology = planner.Topology.from_dict(data)
    gbs, refused = 2**21, []
    for slice_ in (2**14, 2**16, 2**18, 2**19, 2**20):
        try:
            _core.check_memory_floor(profile.core, topology.core, gbs, min_micro_batch_size=slice_)
        except planner.InfeasibleError:
            refused.append(slice_)
            with pytest.raises(planner.InfeasibleError):  # the search agrees
                planner.plan(profile, topology, gbs, min_micro_batch_size=slice_, refine=False)
        else:
            planner.plan(profile, topology, gbs, min_micro_batch_size=slice_, refine=False)
    # 4000 bytes a sample over 2 GPUs: slices of 2^19 samples need 2^30
    # bytes, just the GPU; above, the floor refuses without a search.
    assert refused == [2**20]


def test_a_search_past_its_step_limit_writes_its_best_plan_and_says_so(dapple, tmp_path):
    # Issue 29: GNMT-32 (192 layers) on 4x8 at a global batch of 256 took
    # 38 s, most of it at one micro-batch of 256, where thousands of layouts
    # come within 2 ms of data parallelism. Past the steps of a size, its
    # complete plans so far stay candidates and the rest is left to the walk.
    out = tmp_path / "plan.json"
    # Early backward without refinement both: the space where the search is
    # exact. (Under auto, the limited search's kind phase runs one of its
    # layouts as ZB-H1 at 245.2 ms, below the early-backward optimum of
    # 250.7 ms that the full search keeps: the kind phase is exact only on
    # small spaces.)
    args = ["plan", "--profile", PROFILES / "gnmt-16-pbs-64.json", "--topology", "2x4", "--global-batch-size", "256",
            "--no-refine", "--schedule", "early-backward-1f1b", "--out", out]
    r = dapple(*args, "--max-search-steps", "20000")
    assert r.returncode == 0, r.stderr
    notes = [line for line in r.stderr.splitlines() if line.startswith("note: at micro-batch sizes")]
    assert len(notes) == 1 and "limit of 20000 steps per size (--max-search-steps)" in notes[0], r.stderr
    limited = planner.Plan.load(out)
    exact = planner.plan(PROFILES / "gnmt-16-pbs-64.json", "2x4", 256, refine=False, schedule="early-backward-1f1b")
    assert exact.search_stats.abandoned_micro_batch_sizes == []
    assert exact.data["selection"]["optimal"] is True
    # The best found is a plan of the space: no faster than its optimum, and
    # the bound it records is still below both.
    selection = limited.data["selection"]
    assert selection["simulated_ms"] >= exact.data["selection"]["simulated_ms"] * (1 - 1e-9)
    assert selection["lower_bound_ms"] <= exact.data["selection"]["lower_bound_ms"] * (1 + 1e-9)
    # The API names the sizes; a limit is a count.
    again = planner.plan(PROFILES / "gnmt-16-pbs-64.json", "2x4", 256, max_search_steps=20000)
    assert again.search_stats.abandoned_micro_batch_sizes
    assert set(again.search_stats.abandoned_micro_batch_sizes) <= set(again.search_stats.micro_batch_sizes)
    for bad in ("0", "-1", "x"):
        assert dapple(*args, "--max-search-steps", bad).returncode == 2
    with pytest.raises(planner.InvalidInputError, match="max_search_steps"):
        planner.plan(PROFILES / "gnmt-16-pbs-64.json", "2x4", 256, max_search_steps=0)


def uneven_chain(layers: int, seed: int) -> dict:
    """A chain whose layers differ about fourfold in time, parameters and
    activations (as `benchmarks/uneven_chains.py`'s), with 200 MB of
    parameters a unit: a pipeline of many stages is needed on 16 GB GPUs."""
    import math
    import random

    rng = random.Random(seed)
    out = []
    for i in range(layers):
        w = math.exp(rng.uniform(0.0, math.log(4.0)))
        out.append({"name": f"layer{i}", "kind": "block", "param_bytes": round(w * 200 * 2**20),
                    "inputs": [i - 1] if i else [],
                    "measurements": [{"batch_size": 1, "fwd_ms": round(3 * w, 4), "bwd_ms": round(6 * w, 4),
                                      "activation_bytes": round(w * 10 * 2**20)}]})
    return {"format": "dapple.profile", "schema_version": 1, "model": f"uneven-{layers}", "device": "V100-16GB",
            "optimizer": "adam", "layers": out}


def test_a_search_stopped_at_every_size_before_any_plan_is_complete_still_answers(dapple, tmp_path):
    # Issue 44: a 128-layer uneven chain on 128x8 exited 9 ("the search
    # found no plan") where uniform pipelines fit: every size's DP run
    # stopped before it completed a plan. The uniform shapes are candidates
    # in every search now; a limit of one step a size leaves only them.
    profile, out = tmp_path / "uneven.json", tmp_path / "plan.json"
    profile.write_text(json.dumps(uneven_chain(128, 0)))
    r = dapple("plan", "--profile", profile, "--topology", "128x8-nvlink", "--global-batch-size", "2048",
               "--max-search-steps", "1", "--out", out)
    assert r.returncode == 0, r.stderr
    plan = planner.Plan.load(out)
    notes = [line for line in r.stderr.splitlines() if line.startswith("note: at micro-batch sizes")]
    assert len(notes) == 1 and "limit of 1 steps per size (--max-search-steps)" in notes[0], r.stderr
    assert "not proven optimal" in notes[0]
    assert plan.data["selection"]["source"] == "megatron"
    sim = planner.simulate(plan, profile)
    assert sim.fits_memory and sim.iteration_ms == pytest.approx(plan.iteration_ms)
    # Every size reached the limit but 1, whose every stage alone (2048
    # micro-batches of a layer of at least 9 ms) is slower than the seeds'
    # bound: its run proves that in its first step.
    again = planner.plan(profile, "128x8-nvlink", 2048, max_search_steps=1)
    sizes = again.search_stats.micro_batch_sizes
    assert again.search_stats.abandoned_micro_batch_sizes == [b for b in sizes if b != 1]


def test_a_slow_baseline_or_a_limit_in_one_row_leaves_the_comparison(dapple, small_profile):
    # Issue 29: at a global batch of 2^24 the megatron row's one stage of
    # 524,288 micro-batches is over the passes one simulation runs; that row
    # says so and the others are compared (before, the command ended exit 9).
    r = dapple("compare", "--profile", small_profile(), "--topology", "1x2", "--global-batch-size", str(2**20),
               "--min-micro-batch-size", "1", "--json", timeout=120)
    assert r.returncode == 0, r.stderr
    import json

    rows = {row["strategy"]: row for row in json.loads(r.stdout)}
    assert rows["dapple"]["error"] is None
    limited = [name for name, row in rows.items() if row["error"] and "--max-passes" in row["error"]]
    assert limited, rows


def test_a_usage_error_naming_a_file_with_a_newline_is_one_line(dapple):
    # The fifth fuzz campaign: click quotes an extra argument as given, so a
    # name holding a newline made the error two lines.
    r = dapple(*PLAN_ARGS, "--global-batch-size", "8", "new\nline.json")
    assert_one_line_error(r, 2, "unexpected extra argument", "new\\nline.json")


def test_an_input_error_naming_a_file_with_a_newline_is_one_line(dapple, tmp_path):
    # The sixth fuzz campaign (seed 20261133): a picture named with a
    # newline and an unknown suffix, refused by dapple show itself (exit 3).
    plan = tmp_path / "plan.json"
    assert dapple(*PLAN_ARGS, "--global-batch-size", "8", "--out", str(plan)).returncode == 0
    r = dapple("show", "--plan", str(plan), "--gantt", str(tmp_path / "new\nline.txt"))
    assert_one_line_error(r, 3, "unsupported picture format", "new\\nline.txt")
