"""Expert parallelism (issue 46): a stage's routed experts spread over
groups of replicas, priced and checked by the core, searched, shown, and
refused where a runtime or an export does not run it yet."""

import json

import pytest

from conftest import assert_one_line_error
from dapple import planner
from dapple.planner.plan import shape_label


def _moe_config(path, experts=8):
    """A small Mixtral-like model: 4 blocks of `experts` experts, 2 a token."""
    path.write_text(json.dumps({
        "model_type": "mixtral", "hidden_act": "silu", "hidden_size": 256, "intermediate_size": 512,
        "num_attention_heads": 8, "num_key_value_heads": 4, "num_hidden_layers": 4, "vocab_size": 1000,
        "num_local_experts": experts, "num_experts_per_tok": 2,
    }))
    return path


@pytest.fixture
def moe_profile(tmp_path, dapple):
    out = tmp_path / "moe-profile.json"
    r = dapple("profile", "transformer", "--config", _moe_config(tmp_path / "moe.json"), "--gpu", "a100",
               "--seq-len", 128, "--out", out)
    assert r.returncode == 0, r.stderr
    return out


def _one_stage_plan(profile, tmp_path, **stage):
    """All six layers on the 8 GPUs of one machine, as ``stage`` says."""
    data = planner.layout_plan(str(profile), "1x8-a100-80gb", 64, [(0, 6, list(range(8)))]).data
    data["stages"][0].update(stage)
    data.pop("estimate")
    data.pop("selection", None)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    return path


def test_spread_experts_hold_less_and_exchange_tokens(moe_profile, tmp_path):
    whole = planner.evaluate(_one_stage_plan(moe_profile, tmp_path), moe_profile)
    spread_path = _one_stage_plan(moe_profile, tmp_path, expert_parallel=4)
    spread = planner.evaluate(spread_path, moe_profile)
    assert json.loads(spread_path.read_text())["stages"][0]["expert_parallel"] == 4
    shape = spread.stage_shapes[0]
    assert shape.expert_parallel == 4 and not shape.is_plain
    assert shape_label(shape) == "t1\u00d7r8 e4"
    # A GPU holds a quarter of each block's experts: less model state.
    held = [m["model_state_bytes"] for m in (whole.estimate["memory"][0], spread.estimate["memory"][0])]
    assert held[1] < 0.6 * held[0], held
    # Its passes now exchange the tokens' copies: no faster.
    stage = [e["stages"][0] for e in (whole.estimate, spread.estimate)]
    assert stage[1]["fwd_ms"] > stage[0]["fwd_ms"]
    assert stage[1]["bwd_ms"] > stage[0]["bwd_ms"]
    # The dense share alone crosses all 8 replicas: less to reduce.
    assert stage[1]["allreduce_ms"] < stage[0]["allreduce_ms"]


@pytest.mark.parametrize(("stage", "message"), [
    ({"expert_parallel": 3}, "stages[0].expert_parallel: value 3 does not divide the stage's 8 replicas"),
    ({"expert_parallel": 4, "tensor_parallel": 4}, "stages[0].expert_parallel: value 4 does not divide the "
                                                    "stage's 2 replicas"),
    ({"expert_parallel": 0}, "stages[0].expert_parallel: value 0 must be >= 1"),
])
def test_a_bad_expert_degree_is_one_line_naming_the_field(moe_profile, tmp_path, dapple, stage, message):
    r = dapple("estimate", "--plan", _one_stage_plan(moe_profile, tmp_path, **stage), "--profile", moe_profile)
    assert_one_line_error(r, 3, message)


def test_experts_a_degree_does_not_divide_and_stages_without_experts_are_refused(tmp_path, dapple):
    six = tmp_path / "six.json"
    r = dapple("profile", "transformer", "--config", _moe_config(tmp_path / "moe6.json", experts=6), "--gpu",
               "a100", "--seq-len", 128, "--out", six)
    assert r.returncode == 0, r.stderr
    r = dapple("estimate", "--plan", _one_stage_plan(six, tmp_path, expert_parallel=4), "--profile", six)
    assert_one_line_error(r, 3, "expert_parallel: value 4 does not divide the 6 experts of layer \"block_0\" "
                                "(layers[1])")
    # The embedding alone has no experts to spread.
    data = planner.layout_plan(str(six), "1x8-a100-80gb", 64,
                               [(0, 1, [0, 1]), (1, 6, [2, 3, 4, 5, 6, 7])]).data
    data["stages"][0]["expert_parallel"] = 2
    data.pop("estimate")
    data.pop("selection", None)
    plan = tmp_path / "dense-stage.json"
    plan.write_text(json.dumps(data))
    r = dapple("estimate", "--plan", plan, "--profile", six)
    assert_one_line_error(r, 3, "stages[0].expert_parallel: value 2: no layer of the stage (layers 0..1) has experts")


def test_the_search_is_no_slower_than_spreading_the_experts_by_hand(moe_profile, tmp_path):
    # The search weighs every expert degree with its other dimensions
    # (exactly so on small cases: the core's exhaustive test), so it is no
    # slower than one stage of eight replicas with the experts spread.
    searched = planner.plan(moe_profile, "1x8-a100-80gb", 64)
    for e in (1, 2, 4, 8):
        by_hand = planner.evaluate(_one_stage_plan(moe_profile, tmp_path, expert_parallel=e), moe_profile)
        assert searched.iteration_ms <= by_hand.iteration_ms * (1 + 1e-9), (e, searched.iteration_ms)


def test_deepspeed_torchtitan_and_the_runtime_refuse_spread_experts(moe_profile, tmp_path, dapple):
    plan = _one_stage_plan(moe_profile, tmp_path, expert_parallel=2)
    for target, name in (("deepspeed", "DeepSpeed"), ("torchtitan", "torchtitan")):
        r = dapple("export", "--plan", plan, "--to", target, "--out", tmp_path / f"{target}.out")
        assert_one_line_error(r, 4, f"{name} cannot express expert parallelism (stages[0].expert_parallel 2)")
        assert not (tmp_path / f"{target}.out").exists()
    from dapple.planner.runtime.layout import Layout

    with pytest.raises(planner.IncompatibleInputsError, match="stages\\[0\\].expert_parallel: dapple's runtime"):
        Layout.of(planner.Plan.load(plan))


@pytest.fixture
def dense_first_moe(tmp_path):
    """DeepSeek's way: a dense first block, then 3 of 8 experts, 2 a token."""
    config = tmp_path / "dense-first.json"
    config.write_text(json.dumps({
        "model_type": "deepseek_v3", "hidden_act": "silu", "hidden_size": 256, "intermediate_size": 512,
        "num_attention_heads": 8, "num_key_value_heads": 8, "num_hidden_layers": 4, "vocab_size": 1000,
        "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 128, "first_k_dense_replace": 1,
    }))
    return planner.transformer_profile(config, gpu="a100", seq_len=128, micro_batch_sizes=[1, 2])


def _megatron_moe_plan(profile, expert_parallel, sequence_parallel=True):
    return planner.megatron_plan(profile, "1x8-a100-80gb", 64, tensor_parallel=2, pipeline_parallel=2,
                                 micro_batch_size=1, sequence_parallel=sequence_parallel,
                                 expert_parallel=expert_parallel)


def test_megatron_asks_for_sequence_parallelism_beside_experts_and_tensor_parallelism(dense_first_moe):
    # Megatron-LM's validate_args: "When using MoE and tensor parallelism,
    # sequence parallelism must be used."
    from dapple.planner.export.megatron import megatron_arguments

    plan = _megatron_moe_plan(dense_first_moe, 2, sequence_parallel=False)
    with pytest.raises(planner.IncompatibleInputsError, match="split 2 ways without sequence parallelism"):
        megatron_arguments(plan, dense_first_moe)
    approximated = megatron_arguments(plan, dense_first_moe, approximate=True)
    assert "--sequence-parallel" in approximated.arguments
    assert any("without sequence parallelism -> --sequence-parallel" in c for c in approximated.changes)


def test_chunks_without_experts_spread_none(dense_first_moe):
    # Two ranks of two chunks: the first chunk (the embedding and the dense
    # block) has no experts to spread, its rank's other chunk has.
    plan = _megatron_moe_plan(dense_first_moe, 2)
    chunked = planner.chunked(plan, dense_first_moe, "interleaved-1f1b", chunks=2)
    spread = [(s["layer_start"], s["layer_end"], s.get("expert_parallel", 1)) for s in chunked.stages]
    experts = [bool(layer.get("experts")) for layer in dense_first_moe.data["layers"]]
    for start, end, e in spread:
        assert e == (2 if any(experts[start:end]) else 1), spread
    assert 1 in [e for *_, e in spread] and chunked.estimate["fits_memory"]


def test_a_stage_that_spreads_experts_lists_its_devices_in_order(moe_profile, tmp_path, dapple):
    plan = _one_stage_plan(moe_profile, tmp_path, expert_parallel=2, devices=[1, 0, 2, 3, 4, 5, 6, 7])
    r = dapple("estimate", "--plan", plan, "--profile", moe_profile)
    assert_one_line_error(r, 3, "stages[0].devices: list the devices of a stage that spreads experts in ascending "
                                "order")


def test_megatron_gets_the_experts_and_their_degrees(dense_first_moe):
    from dapple.planner.export.megatron import megatron_arguments

    plan = _megatron_moe_plan(dense_first_moe, 2)
    assert [s.get("expert_parallel", 1) for s in plan.stages] == [2, 2]
    words = megatron_arguments(plan, dense_first_moe).arguments
    value = {words[i]: words[i + 1] for i in range(len(words) - 1) if words[i].startswith("--")}
    assert (value["--num-experts"], value["--moe-router-topk"]) == ("8", "2")
    assert (value["--expert-model-parallel-size"], value["--expert-tensor-parallel-size"]) == ("2", "2")
    # Megatron-LM's list form of which blocks have experts: the first does not.
    assert eval(value["--moe-layer-freq"]) == [0, 1, 1, 1]
    # A pipeline that spreads the experts on one stage only is refused.
    data = json.loads(json.dumps(plan.data))
    data["stages"][1]["expert_parallel"] = 1
    with pytest.raises(planner.IncompatibleInputsError, match="expert parallelism on some stages only"):
        megatron_arguments(planner.Plan.from_dict(data), dense_first_moe)


def test_megatron_cores_own_groups_are_dapples_expert_groups(dense_first_moe):
    parallel_state = pytest.importorskip("megatron.core.parallel_state")
    transformer = pytest.importorskip("megatron.core.transformer")
    from dapple.planner.export.megatron import megatron_arguments

    for e in (1, 2):
        plan = _megatron_moe_plan(dense_first_moe, e)
        words = megatron_arguments(plan, dense_first_moe).arguments
        value = {words[i]: words[i + 1] for i in range(len(words) - 1) if words[i].startswith("--")}
        t, p = int(value["--tensor-model-parallel-size"]), int(value["--pipeline-model-parallel-size"])
        ep, etp = int(value["--expert-model-parallel-size"]), int(value["--expert-tensor-parallel-size"])
        # megatron-core validates the degrees as a run would build them ...
        transformer.TransformerConfig(
            num_layers=int(value["--num-layers"]), hidden_size=256, num_attention_heads=8, add_bias_linear=False,
            num_moe_experts=int(value["--num-experts"]), moe_router_topk=int(value["--moe-router-topk"]),
            moe_ffn_hidden_size=128, moe_layer_freq=eval(value["--moe-layer-freq"]), tensor_model_parallel_size=t,
            pipeline_model_parallel_size=p, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
            sequence_parallel="--sequence-parallel" in words, pipeline_dtype=pytest.importorskip("torch").bfloat16)
        # ... and groups the ranks (its default order) into the GPUs that
        # dapple's all-to-all prices together.
        experts = parallel_state.RankGenerator(tp=etp, ep=ep, dp=8 // (etp * ep * p), pp=p, cp=1,
                                               order="tp-cp-ep-dp-pp")
        ours = sorted(group for shape in plan.stage_shapes for group in shape.expert_groups)
        assert sorted(experts.get_ranks("ep")) == ours, e
