"""Whale's annotations as search constraints (issue 29; docs/hints.md).

That the search is exact under every hint, against an enumeration of the
constrained space, is the core's test `hints_constrain_the_search_exactly`
(`rust_core/core/src/search/mod.rs`): 96 random small cases, each hint kind
and two at once. Here: the options as users give them, what the plan
records, the errors, a Megatron layout's round trip and Whale's M6-10B shape.
"""

from __future__ import annotations

import json

import pytest

from dapple import planner
from dapple.planner.megatron_layout import plan_layout
from conftest import PROFILES, ROOT, assert_one_line_error

BERT = PROFILES / "bert-48-pbs-2.json"
M6_CONFIG = ROOT / "profiles" / "whale" / "m6-10b-config.json"


def layout_of(plan: dict) -> list[tuple[int, int, int]]:
    return [(s["layer_start"], s["layer_end"], len(s["devices"])) for s in plan["stages"]]


def test_hints_shape_the_plan_and_the_plan_records_them(dapple, tmp_path):
    out = tmp_path / "plan.json"
    free = json.loads(dapple("plan", "--profile", BERT, "--topology", "1x4-nvlink", "--global-batch-size", 16,
                             "--json").stdout)
    r = dapple("plan", "--profile", BERT, "--topology", "1x4-nvlink", "--global-batch-size", 16, "--stages", 3,
               "--micro-batches", 4, "--pin-cut", "layer_20", "--replicate", "40..53:1", "--out", out)
    assert r.returncode == 0, r.stderr
    plan = json.loads(out.read_text())
    # BERT-48's layer 24 is named layer_20 (four layers of embeddings first).
    assert [layer["name"] for layer in json.loads(BERT.read_text())["layers"]][24] == "layer_20"
    stages = layout_of(plan)
    assert len(stages) == 3 and plan["micro_batches"] == 4
    assert 24 in [start for start, _, _ in stages]
    assert stages[-1] == (40, 53, 1)
    assert plan["inputs"]["options"]["hints"] == {"stages": 3, "micro_batches": 4, "cuts": [24],
                                                  "ranges": [{"layer_start": 40, "layer_end": 53,
                                                              "tensor_parallel": 1, "replicas": 1}]}
    # The hints cost something here: the free plan is another one, faster.
    assert layout_of(free) != stages
    assert free["estimate"]["iteration_ms"] < plan["estimate"]["iteration_ms"]
    assert "hints" not in free["inputs"]["options"]


def test_the_python_api_takes_the_same_hints():
    # Two stages, the first layers 0..10 split 2 ways: the boundary at 30
    # cannot be kept as well.
    with pytest.raises(planner.IncompatibleInputsError, match="no plan keeps the hints --stages 2 --pin-cut 30 --split 0..10:2"):
        planner.plan(BERT, "1x4-nvlink", 16, stages=2, split=["0..10:2"], pin_cuts=[30])
    plan = planner.plan(BERT, "1x4-nvlink", 16, stages=3, split=["0..10:2"], pin_cuts=["30"])
    assert [(s["layer_start"], s["layer_end"], len(s["devices"])) for s in plan.stages] == [(0, 10, 2), (10, 30, 1),
                                                                                          (30, 53, 1)]
    assert plan.stages[0]["tensor_parallel"] == 2
    with pytest.raises(planner.IncompatibleInputsError, match="stages"):
        planner.plan(BERT, "1x4-nvlink", 16, schedule="pipedream", stages=2)


@pytest.mark.parametrize(
    "args, code, needles",
    [
        (["--stages", 9], 3, ["--stages 9: must be between 1 and 4"]),
        (["--micro-batches", 5], 3, ["--micro-batches 5: must divide the global batch size 16"]),
        (["--pin-cut", 60], 3, ["--pin-cut 60", "past the profile's 53 layers"]),
        (["--pin-cut", "nosuch"], 3, ["--pin-cut nosuch", "neither a layer index nor a layer name"]),
        (["--split", "0..10"], 3, ["--split 0..10: expected START..END:DEGREE"]),
        (["--replicate", "10-20"], 3, ["--replicate 10-20: expected START..END[:N]"]),
        (["--replicate", "0..20", "--pin-cut", 10], 3, ["--replicate 0..20: --pin-cut 10 falls inside it"]),
        (["--replicate", "0..20:8"], 3, ["--replicate 0..20:8: needs more GPUs than the topology's 4"]),
        # Valid alone, but no plan keeps both: one stage cannot hold a boundary.
        (["--stages", 1, "--pin-cut", 10], 4, ["no plan keeps the hints --stages 1 --pin-cut 10"]),
        # Kept by some layouts, but none of them fits in memory.
        (["--replicate", "0..53:1", "--micro-batches", 1], 5,
         ["no plan fits in GPU memory", "(under the hints --micro-batches 1 --replicate 0..53:1)"]),
        # The floor every plan keeps, at the hinted micro-batch size.
        (["--micro-batches", 1, "--global-batch-size", 1024], 5,
         ["every plan keeps at least", "(under the hints --micro-batches 1)"]),
        (["--micro-batches", 16], 4, ["--micro-batches 16: micro-batches of 1 samples are below the smallest "
                                      "slice of 2"]),
        (["--split", "0..10:99999999999"], 3, ["--split 0..10:99999999999: degree 99999999999 must be a whole "
                                               "number from 1 to 4294967295"]),
        (["--pin-cut", "\u00b2"], 3, ["neither a layer index nor a layer name"]),
        # More digits than int() reads (4,300) are a number past the layers.
        (["--pin-cut", "9" * 5000], 3, ["is past the profile's 53 layers"]),
        (["--replicate", "\u00b2..4"], 3, ["neither a layer index nor a layer name"]),
        # A chunked kind cuts the ranks' layers again: it cannot keep the layers the hints fix.
        (["--schedule", "zb-v", "--pin-cut", 10], 4, ["schedule zb-v cuts each rank's layers again into chunks, "
                                                      "which the hints --pin-cut 10 fix"]),
    ],
)
def test_a_hint_no_plan_can_keep_names_itself(dapple, args, code, needles):
    r = dapple("plan", "--profile", BERT, "--topology", "1x4-nvlink", "--global-batch-size", 16, *args)
    assert_one_line_error(r, code, *needles)


def test_more_micro_batches_than_a_simulation_runs_is_a_limit(dapple, small_profile):
    from dapple.planner.limits import MAX_PASSES

    m = MAX_PASSES + 1  # one stage of MAX_PASSES + 1 micro-batches of 1
    r = dapple("plan", "--profile", small_profile(), "--topology", "1x2", "--global-batch-size", m,
               "--micro-batches", m)
    assert_one_line_error(r, 9, f"--micro-batches {m}: even one stage", "--max-passes")


def test_a_layer_name_two_layers_share_is_refused_with_their_indices(dapple, tmp_path):
    profile = json.loads(BERT.read_text())
    profile["layers"][3]["name"] = profile["layers"][2]["name"]
    path = tmp_path / "twice.json"
    path.write_text(json.dumps(profile))
    name = profile["layers"][2]["name"]
    r = dapple("plan", "--profile", path, "--topology", "1x4-nvlink", "--global-batch-size", 16, "--pin-cut", name)
    assert_one_line_error(r, 3, f"2 layers are named {name!r} (layers 2, 3); give the index")


def test_the_machine_aligned_space_keeps_a_hinted_replica_count():
    # 24 replicas of a micro-batch of 30 take the same largest slice (2) as
    # 16 do, so the machine-aligned space, which keeps the fewest GPUs per
    # slice, left 24 out; a hint asking for them brings them back.
    plan = planner.plan(BERT, "4x8-nvlink", 30, min_micro_batch_size=1, micro_batches=1, replicate=["0..53:24"],
                        stage_shapes="plain")
    assert plan.data["inputs"]["options"]["search_space"] == "machine-aligned"
    assert [(s["layer_start"], s["layer_end"], len(s["devices"])) for s in plan.stages] == [(0, 53, 24)]


def test_a_megatron_layout_round_trips_to_the_same_plan(dapple, tmp_path):
    # plan -> layout string -> --from-layout -> the same plan.
    profile, first, again = tmp_path / "llama.json", tmp_path / "first.json", tmp_path / "again.json"
    assert dapple("profile", "transformer", "--config", "llama-2-7b", "--gpu", "v100-16gb", "--seq-len", 1024,
                  "--out", profile).returncode == 0
    # A plan of one stage a rank, as Megatron's layout describes one, in one kind.
    common = ["--profile", profile, "--topology", "1x8-v100-16gb", "--global-batch-size", 32, "--schedule",
              "early-backward-1f1b"]
    assert dapple("plan", *common, "--out", first).returncode == 0
    plan = json.loads(first.read_text())
    assert len(plan["stages"]) > 1  # a pipeline, so that the layout says something
    layout = plan_layout([(s["layer_start"], s["layer_end"]) for s in plan["stages"]], planner.Profile.load(profile))
    r = dapple("plan", *common, "--from-layout", layout, "--out", again)
    assert r.returncode == 0, r.stderr
    replanned = json.loads(again.read_text())
    assert layout_of(replanned) == layout_of(plan)
    assert replanned["estimate"]["iteration_ms"] == pytest.approx(plan["estimate"]["iteration_ms"], rel=1e-12)
    # A layout that does not match the profile's layers is named.
    r = dapple("plan", *common, "--from-layout", "Et*10|t*10L")
    assert_one_line_error(r, 3, "--from-layout", "holds 20 transformer layer (t)", "has 32")


def test_whales_m6_10b_shape(dapple, tmp_path):
    # Whale trained M6-10B (48 layers) in 8 stages of 35 micro-batches with
    # re-computation (whale.txt, 5.3.1). The same hints on a 48-block
    # stand-in (profiles/whale/m6-10b-config.json) give that shape where
    # activations need it: 32 V100-16GB at a global batch of 35 x 32.
    profile, out = tmp_path / "m6.json", tmp_path / "plan.json"
    assert dapple("profile", "transformer", "--config", M6_CONFIG, "--gpu", "v100-16gb", "--seq-len", 512,
                  "--out", profile).returncode == 0
    r = dapple("plan", "--profile", profile, "--topology", "4x8-v100-16gb", "--global-batch-size", 35 * 32,
               "--stages", 8, "--micro-batches", 35, "--out", out)
    assert r.returncode == 0, r.stderr
    plan = json.loads(out.read_text())
    assert len(plan["stages"]) == 8 and plan["micro_batches"] == 35
    assert sum(s["layer_end"] - s["layer_start"] for s in plan["stages"]) == 50  # 48 blocks, embedding, head
    assert any(s.get("recompute", "none") != "none" for s in plan["stages"])
    assert plan["estimate"]["fits_memory"]
