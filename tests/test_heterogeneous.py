"""Mixed GPUs (Whale): uneven slices balanced by speed within memory, in the
plan format, the cost model, the baselines and the search."""

import json

import pytest

from dapple import planner
from conftest import PROFILES, ROOT

WHALE_16 = ROOT / "profiles" / "topologies" / "whale-8v100-8p100.json"
BERT = PROFILES / "bert-48-pbs-2.json"


def test_whale_topologies_are_two_kinds_of_gpu():
    topo = planner.Topology.load(WHALE_16)
    assert topo.num_devices == 16
    gpus = [g["gpu"] for g in topo.data["machine_groups"]]
    assert [(g["type"], g["memory_bytes"] >> 30) for g in gpus] == [("V100-32GB", 32), ("P100-16GB", 16)]
    assert gpus[1]["relative_speed"] < gpus[0]["relative_speed"]


def test_balanced_data_parallelism_gives_fast_gpus_more_samples_and_is_faster():
    even = planner.baseline("data-parallel", BERT, WHALE_16, 64)
    whale = planner.baseline("whale-data-parallel", BERT, WHALE_16, 64)
    slices = whale.stages[0]["slices"]
    assert sum(slices) == whale.micro_batch_size
    # devices 0-7 are V100s, 8-15 P100s
    assert min(slices[:8]) > max(slices[8:])
    assert whale.iteration_ms < 0.9 * even.iteration_ms
    # and the search's plan is no slower: by construction, as the search offers
    # Whale's plans as candidates up to 16 GPUs (this checks the binding's
    # search does). That the search's own space finds it, without them, is
    # the core's `the_searchs_own_plans_are_no_slower_than_whales_on_mixed_gpus`.
    assert planner.plan(BERT, WHALE_16, 64).iteration_ms <= whale.iteration_ms * (1 + 1e-9)


def test_on_one_kind_of_gpu_balancing_changes_nothing():
    even = planner.baseline("data-parallel", BERT, "2x8-nvlink", 64)
    whale = planner.baseline("whale-data-parallel", BERT, "2x8-nvlink", 64)
    assert whale.iteration_ms == even.iteration_ms
    assert len(set(whale.stages[0]["slices"])) == 1


@pytest.mark.parametrize(
    "slices, needle",
    [([3] * 16, "adds up to 48 samples, not the micro-batch size 64"),
     ([64], "1 slices for 16 devices"),
     ([1] + [4] * 14 + [7], "slice 0 has 1 samples, below the minimum 2")],
)
def test_slices_that_do_not_fit_the_plan_name_the_field(dapple, tmp_path, slices, needle):
    from conftest import assert_one_line_error

    plan = json.loads(planner.baseline("data-parallel", BERT, "2x8-nvlink", 64).text)
    plan["stages"][0]["slices"] = slices
    out = tmp_path / "p.json"
    out.write_text(json.dumps(plan))
    assert_one_line_error(dapple("estimate", "--plan", out, "--profile", BERT), 3, str(out), "stages[0].slices", needle)


WHALE_8 = ROOT / "profiles" / "topologies" / "whale-4v100-4p100.json"


def _timed_on(tmp_path, device, scale_of_layer, name):
    """The shipped BERT-48 profile as if measured on `device`: every
    layer's times multiplied by `scale_of_layer(i)`."""
    data = json.loads(BERT.read_text())
    data["device"] = device
    for i, layer in enumerate(data["layers"]):
        for m in layer["measurements"]:
            m["fwd_ms"] *= scale_of_layer(i)
            m["bwd_ms"] *= scale_of_layer(i)
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


def _merged(dapple, tmp_path, scale_of_layer):
    p100 = _timed_on(tmp_path, "P100-16GB", scale_of_layer, "p100.json")
    out = tmp_path / "both.json"
    result = dapple("profile", "merge", BERT, p100, "--out", out)
    assert result.returncode == 0, result.stderr
    return out


def test_a_gpu_type_timed_on_its_own_runs_at_its_measured_times(dapple, tmp_path):
    speed = planner.Topology.load(WHALE_8).data["machine_groups"][1]["gpu"]["relative_speed"]
    # P100 times that are the V100's over the topology's relative speed cost
    # exactly what the relative speed does: the measured times replace it.
    merged = planner.Profile.load(_merged(dapple, tmp_path, lambda i: 1 / speed))
    assert merged.devices == ["V100-16GB", "P100-16GB"]
    by_speed = planner.plan(BERT, WHALE_8, 64)
    by_times = planner.plan(merged, WHALE_8, 64)
    assert by_times.shape == by_speed.shape
    assert by_times.iteration_ms == pytest.approx(by_speed.iteration_ms, rel=1e-9)


def test_per_layer_speed_ratios_are_the_types_own(dapple, tmp_path):
    # A P100 twice as slow on the first half of the model, as fast on the rest.
    n = len(json.loads(BERT.read_text())["layers"])
    merged = _merged(dapple, tmp_path, lambda i: 2.0 if i < n // 2 else 1.0)
    front, back = (0, n // 2), (n // 2, n)
    v100_only = planner.layout_plan(BERT, WHALE_8, 64, [(*front, [0]), (*back, [1])])
    on_p100 = planner.layout_plan(merged, WHALE_8, 64, [(*front, [4]), (*back, [5])])
    back_on_p100 = planner.layout_plan(merged, WHALE_8, 64, [(*front, [0]), (*back, [5])])
    # Per sample (the profile is measured at one batch size, so times are
    # proportional to it); each layout has its own best micro-batch size.
    fwd = [[s["fwd_ms"] / s["slice_size"] for s in p.estimate["stages"]] for p in (v100_only, on_p100, back_on_p100)]
    assert fwd[1][0] == pytest.approx(2 * fwd[0][0]) and fwd[1][1] == pytest.approx(fwd[0][1])
    assert fwd[2] == pytest.approx(fwd[0])
    # A layout given from outside keeps even slices; the search's own
    # slices follow each stage's own per-layer ratio (the core's
    # `each_gpu_type_runs_its_own_measured_times`), and add up.
    front_both = planner.layout_plan(merged, WHALE_8, 64, [(*front, [0, 4]), (*back, [1, 5])])
    assert [s.get("slices") for s in front_both.stages] == [None, None]  # a layout keeps even slices
    plan = planner.plan(merged, WHALE_8, 64)
    for stage in plan.stages:
        slices = stage.get("slices")
        if slices:
            assert sum(slices) == plan.micro_batch_size


def test_a_timed_type_no_group_has_and_a_group_no_profile_times_are_named(dapple, tmp_path):
    from conftest import assert_one_line_error

    merged = _merged(dapple, tmp_path, lambda i: 1.5)
    result = dapple("plan", "--profile", merged, "--topology", "2x8-nvlink", "--global-batch-size", "64")
    assert_one_line_error(result, 4, str(merged), "other_devices[0].device", '"P100-16GB"')
    topology = json.loads(WHALE_8.read_text())
    topology["machine_groups"][1]["gpu"]["type"] = "K80"
    del topology["machine_groups"][1]["gpu"]["relative_speed"]
    k80 = tmp_path / "k80.json"
    k80.write_text(json.dumps(topology))
    result = dapple("plan", "--profile", merged, "--topology", k80, "--global-batch-size", "64")
    assert_one_line_error(result, 4, str(k80), "machine_groups[1].gpu.relative_speed", '"K80"')
    # With one GPU type in the profile, a group without a speed runs at its speed.
    assert dapple("plan", "--profile", BERT, "--topology", k80, "--global-batch-size", "64").returncode == 0


def test_merging_profiles_of_another_model_names_the_file_and_field(dapple, tmp_path):
    from conftest import assert_one_line_error

    other = json.loads(BERT.read_text())
    other["device"] = "P100-16GB"
    other["layers"][3]["param_bytes"] += 1
    path = tmp_path / "other.json"
    path.write_text(json.dumps(other))
    out = tmp_path / "both.json"
    result = dapple("profile", "merge", BERT, path, "--out", out)
    assert_one_line_error(result, 3, str(path), "layers[3].param_bytes")
    assert not out.exists()
    del other["device"]
    other["layers"][3]["param_bytes"] -= 1
    path.write_text(json.dumps(other))
    assert_one_line_error(dapple("profile", "merge", BERT, path, "--out", out), 3, str(path), "field device")
