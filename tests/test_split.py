"""Whale's `split` from the outside: transformer profiles without a GPU, GPU
types in specs, shaped stages in hand-written plans, the Megatron baseline,
and the one-line errors of each."""

import json
from pathlib import Path

import pytest

from conftest import assert_one_line_error, write_hand_plan
from dapple import planner

TINY = {  # a Llama-style config small enough to plan in a blink
    "model_type": "llama",
    "hidden_act": "silu",
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "num_hidden_layers": 4,
    "vocab_size": 1000,
}


@pytest.fixture
def tiny_profile(tmp_path, dapple):
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps(TINY))
    out = tmp_path / "tiny-profile.json"
    result = dapple("profile", "transformer", "--config", config, "--gpu", "a100", "--seq-len", 128, "--out", out)
    assert result.returncode == 0, result.stderr
    return out


def test_a_transformer_profile_counts_its_parameters_and_says_how_it_splits(tiny_profile):
    data = json.loads(tiny_profile.read_text())
    assert data["device"] == "A100-80GB" and "analytic" in data["source"]
    names = [layer["name"] for layer in data["layers"]]
    assert names == ["embedding", "block_0", "block_1", "block_2", "block_3", "lm_head"]
    # vocabulary padded to 1024; a block: 2h^2 + 2h (h/a kv) + 3hf + 2h norms, at 2 bytes each
    h, f, kv = 256, 688, 128
    assert data["layers"][0]["param_bytes"] == 1024 * h * 2
    assert data["layers"][1]["param_bytes"] == (2 * h * h + 2 * h * kv + 3 * h * f + 2 * h) * 2
    block = data["layers"][1]["split"][0]
    assert block["name"] == "megatron-block"
    assert [d["count"] for d in block["divides"]] == [8, 4]
    assert block["fwd_allreduce_bytes_per_sample"] == 2 * 128 * h * 2
    assert data["parameter_state"] == {"weight_bytes": 2, "gradient_bytes": 2, "master_weight_bytes": 4, "optimizer_bytes": 8}


def test_a_transformer_plan_reports_its_mfu_below_the_profiles_ceiling(tiny_profile, tmp_path, dapple):
    plan = planner.plan(str(tiny_profile), "2x8-a100-80gb", 64)
    # Timed by operator, the ceiling is the GPU's best product over its peak (271.2 of 312 TFLOP/s):
    # small products, memory-bound operators, bubbles and communication keep MFU below it.
    ceiling = planner.GPU_TYPES["A100-80GB"]["kernels"]["gemm_tflops"] / planner.GPU_TYPES["A100-80GB"]["bf16_tflops"]
    assert plan.estimate["mfu"] is not None and 0 < plan.estimate["mfu"] < ceiling
    # At an efficiency the user gives, that is the ceiling.
    flat = tmp_path / "flat.json"
    assert dapple("profile", "transformer", "--config", tmp_path / "tiny.json", "--gpu", "a100", "--seq-len", 128,
                  "--efficiency", "0.5", "--out", flat).returncode == 0
    assert 0 < planner.plan(str(flat), "2x8-a100-80gb", 64).estimate["mfu"] < 0.5


def _hand_plan(profile_path, topology, gbs, devices_per_stage, t, tmp_path, **shape):
    profile = planner.Profile.load(str(profile_path))
    n = len(profile.layers)
    base = planner.layout_plan(profile, topology, gbs, [(0, n, list(range(devices_per_stage)))])
    data = base.data
    data["stages"][0]["tensor_parallel"] = t
    data["stages"][0].update(shape)
    return write_hand_plan(data, tmp_path / "hand.json")


def test_a_hand_written_split_plan_is_costed(tiny_profile, tmp_path, dapple):
    def peak(t, **shape):
        path = _hand_plan(tiny_profile, "1x8-a100-80gb", 64, 8, t, tmp_path, **shape)
        result = dapple("estimate", "--plan", path, "--profile", tiny_profile, "--json")
        assert result.returncode == 0, result.stderr
        estimate = json.loads(result.stdout)["estimate"]
        assert estimate["iteration_ms"] > 0 and estimate["mfu"] > 0
        return estimate["peak_memory_bytes"]

    plain = peak(1)
    # split 4 ways: a quarter of the weights (norms aside) on each GPU
    assert peak(4) < plain
    # ZeRO-1: the optimizer state shared by 8 replicas
    assert peak(1, shard_level=1) < plain
    assert peak(4, shard_level=1) < peak(4)
    # ZeRO-2 shares the gradients too, ZeRO-3 re-sharded the weights too;
    # level 3 keeping them after the forward holds what level 2 does.
    assert peak(1, shard_level=3, reshard_after_forward=True) < peak(1, shard_level=2) < peak(1, shard_level=1)
    assert peak(1, shard_level=3) == peak(1, shard_level=2)
    # A plan before version 12 said level 1 as a flag.
    assert peak(1, shard_optimizer=True) == peak(1, shard_level=1)


@pytest.mark.parametrize("shape, field, needle", [
    ({"shard_level": 4}, "stages[0].shard_level", "sharding level 4 is none of"),
    ({"shard_level": 2, "reshard_after_forward": True}, "stages[0].reshard_after_forward",
     "needs sharding level 3 (the weights), not 2"),
    ({"reshard_after_forward": True}, "stages[0].reshard_after_forward", "not 0"),
])
def test_a_sharding_level_that_is_none_is_refused_in_one_line(tiny_profile, tmp_path, dapple, shape, field, needle):
    path = _hand_plan(tiny_profile, "1x8-a100-80gb", 64, 8, 1, tmp_path, **shape)
    assert_one_line_error(dapple("estimate", "--plan", path, "--profile", tiny_profile), 3, field, needle)


def test_a_split_degree_that_does_not_divide_the_heads_or_the_vocabulary_is_refused(tiny_profile, tmp_path, dapple):
    # The whole model on 6 GPUs split 3 ways: the embedding's 1024 (padded) entries refuse first.
    whole = _hand_plan(tiny_profile, "1x6-a100-80gb", 60, 6, 3, tmp_path)
    # Only the blocks on 3 GPUs split 3 ways: 8 heads refuse.
    profile = planner.Profile.load(str(tiny_profile))
    data = planner.layout_plan(profile, "1x5-a100-80gb", 60, [(0, 1, [0]), (1, 5, [1, 2, 3]), (5, 6, [4])]).data
    data["stages"][1]["tensor_parallel"] = 3
    blocks = write_hand_plan(data, tmp_path / "blocks.json")
    for path, field, message in [
        (whole, "stages[0]", 'value 3 does not divide the vocabulary entries (padded to a multiple of 128) (1024) of layer "embedding"'),
        (blocks, "stages[1]", 'value 3 does not divide the attention heads (8) of layer "block_0"'),
    ]:
        result = dapple("estimate", "--plan", path, "--profile", tiny_profile)
        assert result.returncode == 3, result.stderr
        assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
        assert f"{path}: field {field}.tensor_parallel: {message}" in result.stderr


def test_a_split_group_that_spans_machines_unevenly_is_refused(tiny_profile, tmp_path, dapple):
    # Devices 6-13 of 2x8 in groups of 4: 6-9 takes 2 GPUs of each machine, 10-13 all 4 of one.
    profile = planner.Profile.load(str(tiny_profile))
    n = len(profile.layers)
    data = planner.layout_plan(profile, "2x8-a100-80gb", 64, [(0, n, list(range(6, 14)))]).data
    data["stages"][0]["tensor_parallel"] = 4
    path = write_hand_plan(data, tmp_path / "spans.json")
    result = dapple("estimate", "--plan", path, "--profile", tiny_profile)
    assert result.returncode == 3, result.stderr
    assert "field stages[0].tensor_parallel: value 4: split group [10, 11, 12, 13] takes [4] GPUs" in result.stderr
    assert result.stderr.count("\n") == 1


def test_bad_inputs_of_the_generator_name_their_field(tmp_path, dapple):
    out = tmp_path / "p.json"
    unknown = dapple("profile", "transformer", "--config", "llama-2-7b", "--gpu", "A100-81GB", "--seq-len", 8, "--out", out)
    assert unknown.returncode == 3
    assert "unknown GPU type \"A100-81GB\"; known types: V100-16GB, V100-32GB, A100-40GB, A100-80GB" in unknown.stderr
    config = tmp_path / "config.json"
    config.write_text(json.dumps({k: v for k, v in TINY.items() if k != "num_attention_heads"}))
    missing = dapple("profile", "transformer", "--config", config, "--gpu", "h100", "--seq-len", 8, "--out", out)
    assert missing.returncode == 3
    assert f"{config}: field num_attention_heads: is missing" in missing.stderr
    assert not out.exists()
    spec = dapple("topology", "show", "8x8-a100-81gb")
    assert spec.returncode == 3 and "unknown GPU type \"a100-81gb\"; known types:" in spec.stderr


def test_gpu_types_come_from_the_core_with_a_source_each(dapple):
    assert list(planner.GPU_TYPES) == ["V100-16GB", "V100-32GB", "A100-40GB", "A100-80GB", "H100-80GB", "H200", "B200"]
    assert all(g["source"] for g in planner.GPU_TYPES.values())
    listing = dapple("topology", "gpus")
    assert listing.returncode == 0 and listing.stdout.count("\n") == len(planner.GPU_TYPES)
    shown = json.loads(dapple("topology", "show", "2x8-h100", "--json").stdout)
    assert shown["machine_groups"][0]["gpu"]["type"] == "H100-80GB"
    assert shown["inter_machine"]["bandwidth_gbps"] == 8 * 400.0


def test_megatron_is_a_baseline_of_compare(tiny_profile):
    megatron = planner.baseline("megatron", str(tiny_profile), "2x8-a100-80gb", 64)
    stage = megatron.stages[0]
    t = stage.get("tensor_parallel", 1)
    assert all(s.get("tensor_parallel", 1) == t for s in megatron.stages)
    assert sum(len(s["devices"]) for s in megatron.stages) == 16
    assert megatron.data["inputs"]["options"]["search_space"] == "megatron"
    # the search offers every Megatron shape, so its plan is no slower (by construction)
    assert planner.plan(str(tiny_profile), "2x8-a100-80gb", 64).iteration_ms <= megatron.iteration_ms * (1 + 1e-9)


WHALE = Path(__file__).resolve().parent.parent / "profiles" / "whale"


@pytest.mark.parametrize("name", ["resnet50-fc100k.json", "resnet50-fc1000k.json"])
def test_whales_classifiers_are_valid_profiles_and_plans_with_them_too(name, tmp_path):
    jsonschema = pytest.importorskip("jsonschema")
    schemas = Path(__file__).resolve().parent.parent / "profiles" / "schema"
    profile_schema = json.loads((schemas / "profile.schema.json").read_text())
    jsonschema.Draft202012Validator(profile_schema).validate(json.loads((WHALE / name).read_text()))
    plan = planner.plan(str(WHALE / name), "4x8-v100-32gb-nvlink-50gbps", 1024)
    plan_schema = json.loads((schemas / "plan.schema.json").read_text())
    jsonschema.Draft202012Validator(plan_schema).validate(json.loads(plan.core.to_json()))


def test_whales_classifier_splits_its_fc_and_gains_more_with_more_gpus():
    path = str(WHALE / "resnet50-fc100k.json")
    speedups = []
    for machines in (1, 2, 4):
        topology, gbs = f"{machines}x8-v100-32gb-nvlink-50gbps", 256 * machines
        plan = planner.plan(path, topology, gbs)
        dp = planner.baseline("data-parallel", path, topology, gbs)
        speedups.append(dp.iteration_ms / plan.iteration_ms)
    assert speedups == sorted(speedups) and speedups[0] >= 1.0 - 1e-9
    assert speedups[-1] >= 1.5
    # on 32 GPUs the FC layer is split
    assert plan.stages[-1].get("tensor_parallel", 1) > 1


def test_dapple_run_refuses_a_split_stage_whose_layers_do_not_all_split(tiny_profile, tmp_path, dapple):
    # The digits model's layers declare no split pattern: its stage would be
    # Whale's collocated hybrid (layers data parallel beside split ones),
    # which the runtime does not run.
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    path = _hand_plan(tiny_profile, "1x8-a100-80gb", 64, 8, 4, tmp_path)
    result = dapple("run", "--plan", path, "--model", "dapple.planner.runtime.models:digits", "--model-arg", "n_layers=6",
                    "--steps", 1)
    assert result.returncode == 4, result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert (f"{path}: field stages[0].tensor_parallel: value 4: layer 0 of dapple.planner.runtime.models:digits declares "
            "no split pattern") in result.stderr


def test_profiling_the_gpt_model_writes_the_patterns_the_runtime_splits(tmp_path, dapple):
    pytest.importorskip("torch")
    out = tmp_path / "gpt.json"
    result = dapple("profile", "model", "--model", "dapple.planner.runtime.models:gpt", "--model-arg", "n_layers=1",
                    "--model-arg", "d_model=16", "--model-arg", "n_heads=2", "--model-arg", "seq=8",
                    "--model-arg", "vocab=32", "--batch-sizes", "1", "--repeats", "1", "--out", out)
    assert result.returncode == 0, result.stderr
    layers = json.loads(out.read_text())["layers"]
    names = [[p["name"] for p in layer["split"]] for layer in layers]
    assert names == [["vocabulary-parallel embedding"], ["megatron-block"],
                     ["vocabulary-parallel head with distributed softmax (SP1)"]]
    # The core's rule at fp32 values: two AllReduces of the block's output (8 tokens x 16) each way.
    assert layers[1]["split"][0]["fwd_allreduce_bytes_per_sample"] == 2 * 8 * 16 * 4
    assert [d["count"] for d in layers[0]["split"][0]["divides"]] == [32]
    # The planner's checks take a plan splitting every layer in two on it.
    plan = _hand_plan(out, "1x8-pcie", 8, 2, 2, tmp_path)
    result = dapple("estimate", "--plan", plan, "--profile", out, "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["estimate"]["iteration_ms"] > 0
