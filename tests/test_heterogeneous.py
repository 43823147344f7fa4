"""Mixed GPUs (Whale): uneven slices balanced by speed within memory, in the
plan format, the cost model, the baselines and the search."""

import json

import pytest

import planner
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
    # and the search finds it (or better) on this mixed cluster
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
