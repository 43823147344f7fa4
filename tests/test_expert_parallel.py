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


def test_exports_and_the_runtime_refuse_spread_experts(moe_profile, tmp_path, dapple):
    plan = _one_stage_plan(moe_profile, tmp_path, expert_parallel=2)
    for target, name in (("megatron", "Megatron-LM"), ("deepspeed", "DeepSpeed"), ("torchtitan", "torchtitan")):
        r = dapple("export", "--plan", plan, "--to", target, "--out", tmp_path / f"{target}.out")
        assert_one_line_error(r, 4, f"{name} cannot express expert parallelism (stages[0].expert_parallel 2)")
        assert not (tmp_path / f"{target}.out").exists()
    from dapple.planner.runtime.layout import Layout

    with pytest.raises(planner.IncompatibleInputsError, match="stages\\[0\\].expert_parallel: dapple's runtime"):
        Layout.of(planner.Plan.load(plan))
