"""Expert parallelism (issue 46): a stage's routed experts spread over
groups of replicas, priced and checked by the core, searched, shown, and
refused where a runtime or an export does not run it yet."""

import json
import tomllib

import pytest

from conftest import assert_one_line_error, write_hand_plan
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
    return write_hand_plan(data, tmp_path / "plan.json")


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
    ({"expert_tensor_parallel": 0}, "stages[0].expert_tensor_parallel: value 0 must be >= 1"),
    ({"expert_parallel": 2, "tensor_parallel": 4, "sequence_parallel": True, "expert_tensor_parallel": 3},
     "stages[0].expert_tensor_parallel: value 3 does not divide the stage's tensor_parallel 4"),
    ({"tensor_parallel": 2, "sequence_parallel": True, "expert_tensor_parallel": 1},
     "stages[0].expert_tensor_parallel: value 1: only a stage that spreads its experts (expert_parallel > 1)"),
    ({"expert_parallel": 2, "tensor_parallel": 2, "expert_tensor_parallel": 1},
     "stages[0].expert_tensor_parallel: value 1 below tensor_parallel 2 needs sequence_parallel"),
    ({"expert_parallel": 8, "tensor_parallel": 4, "sequence_parallel": True, "expert_tensor_parallel": 2},
     "stages[0].expert_parallel: value 8 times the expert tensor degree 2 does not divide the stage's 8 GPUs"),
])
def test_a_bad_expert_degree_is_one_line_naming_the_field(moe_profile, tmp_path, dapple, stage, message):
    r = dapple("estimate", "--plan", _one_stage_plan(moe_profile, tmp_path, **stage), "--profile", moe_profile)
    assert_one_line_error(r, 3, message)


def test_a_refused_layout_names_the_keyword_its_caller_typed(moe_profile):
    # megatron_plan builds a plan and the core checks its fields; the
    # caller typed keywords, and the error names them (issue 68), here
    # while context parallelism beside spread experts is refused.
    with pytest.raises(planner.InvalidInputError) as refused:
        planner.megatron_plan(str(moe_profile), "1x8-a100-80gb", 64, tensor_parallel=1, pipeline_parallel=1,
                              micro_batch_size=1, context_parallel=2, expert_parallel=4)
    assert str(refused.value).startswith("context_parallel=2: context parallelism beside spread experts"), refused.value
    assert "stages[" not in str(refused.value) and refused.value.field == "context_parallel"
    with pytest.raises(planner.InvalidInputError, match=r"^expert_parallel=3 does not divide the stage's 8 replicas"):
        planner.megatron_plan(str(moe_profile), "1x8-a100-80gb", 64, tensor_parallel=1, pipeline_parallel=1,
                              micro_batch_size=1, expert_parallel=3)


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
    plan = write_hand_plan(data, tmp_path / "dense-stage.json")
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


def test_deepspeed_writes_spread_experts_from_the_profile(moe_profile, tmp_path, dapple):
    plan = _one_stage_plan(moe_profile, tmp_path, expert_parallel=2)
    out = tmp_path / "deepspeed.json"
    # The experts' count is the profile's: without it, one line.
    data = json.loads(plan.read_text())
    data["inputs"].pop("profile_path", None)
    bare = write_hand_plan(data, tmp_path / "bare.json")
    r = dapple("export", "--plan", bare, "--to", "deepspeed", "--out", out)
    assert_one_line_error(r, 3, "field inputs.profile_path: missing; pass --profile")
    assert not out.exists()
    r = dapple("export", "--plan", bare, "--to", "deepspeed", "--profile", moe_profile, "--out", out)
    assert r.returncode == 0, r.stderr
    blocks = [i for i, layer in enumerate(json.loads(moe_profile.read_text())["layers"]) if layer.get("experts")]
    assert json.loads(out.read_text())["moe"] == {
        "layers": blocks, "num_experts": 8, "k": 2, "ep_size": 2, "enable_expert_tensor_parallelism": False,
        "drop_tokens": False}
    # A dense export stays as it was, without the profile.
    dense = _one_stage_plan(moe_profile, tmp_path)
    r = dapple("export", "--plan", dense, "--to", "deepspeed", "--out", out)
    assert r.returncode == 0, r.stderr
    assert "moe" not in json.loads(out.read_text())


def test_plan_for_deepspeed_keeps_plans_that_spread_experts(moe_profile, tmp_path):
    from dapple.planner.targets import refusal

    # --for deepspeed asks the export whether it runs a candidate; the
    # experts' count is the profile's, so the question carries it (it was
    # asked without, and every plan that spread experts was refused).
    plan = planner.Plan.load(_one_stage_plan(moe_profile, tmp_path, expert_parallel=2))
    profile = planner.Profile.load(moe_profile)
    assert refusal(plan, profile, "deepspeed") is None


def test_the_runtime_lays_out_spread_experts(moe_profile, tmp_path):
    from dapple.planner.runtime.layout import Layout

    # dapple's runtime folds them onto the replicas (tests/test_moe_runtime.py runs it).
    stage = Layout.of(planner.Plan.load(_one_stage_plan(moe_profile, tmp_path, expert_parallel=2))).stages[0]
    assert stage.expert_parallel == 2 and stage.expert_groups == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert stage.expert_replica_groups == [[0, 2, 4, 6], [1, 3, 5, 7]]


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


def _megatron_moe_plan(profile, expert_parallel, sequence_parallel=True, expert_tensor_parallel=None, shard_level=0):
    return planner.megatron_plan(profile, "1x8-a100-80gb", 64, tensor_parallel=2, pipeline_parallel=2,
                                 micro_batch_size=1, sequence_parallel=sequence_parallel,
                                 expert_parallel=expert_parallel, expert_tensor_parallel=expert_tensor_parallel,
                                 shard_level=shard_level)


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
    experts = [bool(layer.get("experts")) for layer in dense_first_moe.data["layers"]]
    for degree, tensor_degree in ((2, None), (4, 1)):
        plan = _megatron_moe_plan(dense_first_moe, degree, expert_tensor_parallel=tensor_degree)
        chunked = planner.chunked(plan, dense_first_moe, "interleaved-1f1b", chunks=2)
        spread = [(s["layer_start"], s["layer_end"], s.get("expert_parallel", 1), s.get("expert_tensor_parallel"))
                  for s in chunked.stages]
        for start, end, e, et in spread:
            has = any(experts[start:end])
            assert (e, et) == ((degree, tensor_degree) if has else (1, None)), spread
        assert 1 in [e for _, _, e, _ in spread] and chunked.estimate["fits_memory"]


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

    for e, et in ((1, None), (2, None), (4, 1)):
        plan = _megatron_moe_plan(dense_first_moe, e, expert_tensor_parallel=et)
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
        assert sorted(experts.get_ranks("ep")) == ours, (e, et)
        assert etp == (et or t), (e, et)


def test_experts_split_fewer_ways_than_the_layers(moe_profile, tmp_path):
    # Megatron-LM's expert tensor degree: 8 GPUs split 2 ways, the experts
    # spread over 4 GPUs whole (et 1: 4 consecutive GPUs exchange) against
    # 4 replicas split 2 ways (et = t: the same shard of 4 replicas).
    stage = {"tensor_parallel": 2, "sequence_parallel": True, "expert_parallel": 4}
    at_t = planner.evaluate(_one_stage_plan(moe_profile, tmp_path, **stage), moe_profile)
    path = _one_stage_plan(moe_profile, tmp_path, **stage, expert_tensor_parallel=1)
    whole = planner.evaluate(path, moe_profile)
    assert json.loads(path.read_text())["stages"][0]["expert_tensor_parallel"] == 1
    assert whole.data["schema_version"] >= 10
    assert at_t.stage_shapes[0].expert_groups == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert whole.stage_shapes[0].expert_groups == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert (at_t.stage_shapes[0].expert_tensor_parallel, whole.stage_shapes[0].expert_tensor_parallel) == (2, 1)
    assert shape_label(whole.stage_shapes[0]) == "t2\u00d7r4 sp e4/et1"
    # A GPU holds a quarter of the experts whole rather than halved: more
    # state; and it gathers none of its experts' tokens over the shards.
    memory = [p.estimate["memory"][0]["model_state_bytes"] for p in (at_t, whole)]
    assert memory[1] > 1.5 * memory[0], memory
    passes = [p.estimate["stages"][0]["fwd_ms"] for p in (at_t, whole)]
    assert passes[1] < passes[0], passes


def _torchtitan_parallelism(plan, profile, tmp_path, dapple):
    out = tmp_path / "job.toml"
    r = dapple("export", "--plan", plan, "--profile", profile, "--to", "torchtitan", "--out", out)
    assert r.returncode == 0, r.stderr
    return tomllib.loads(out.read_text())["parallelism"]


@pytest.mark.parametrize(("degree", "tensor_degree"), [(2, None), (4, 1)])
def test_torchtitans_own_mesh_groups_dapples_expert_groups(dense_first_moe, tmp_path, dapple, degree,
                                                          tensor_degree):
    """torchtitan's ConfigManager reads the exported degrees and its
    ParallelDims builds, on a fake process group of 8 ranks, the expert
    groups dapple prices (ETP = TP and ETP = 1)."""
    manager = pytest.importorskip("torchtitan.config.manager")
    parallel_dims = pytest.importorskip("torchtitan.distributed.parallel_dims")
    fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    dist = pytest.importorskip("torch.distributed")
    # Sharded: torchtitan's FSDP under its pipeline is level 1.
    plan = _megatron_moe_plan(dense_first_moe, degree, expert_tensor_parallel=tensor_degree, shard_level=1)
    path = tmp_path / "plan.json"
    plan.save(path)
    profile = tmp_path / "profile.json"
    dense_first_moe.save(profile)
    keys = _torchtitan_parallelism(path, profile, tmp_path, dapple)
    assert (keys["expert_parallel_degree"], keys["expert_tensor_parallel_degree"]) == (degree, tensor_degree or 2)
    config = manager.ConfigManager().parse_args(["--job.config_file", str(tmp_path / "job.toml")])
    p = config.parallelism
    ours = sorted(group for shape in plan.stage_shapes for group in shape.expert_groups)
    theirs = set()
    # torchtitan asks for a CUDA mesh where it finds no accelerator; its
    # groups are the same on the CPU's.
    parallel_dims.device_type = "cpu"
    device_mesh = pytest.importorskip("torch.distributed.device_mesh")
    for rank in range(8):
        # torch caches a flattened sub-mesh by its root mesh's layout, which
        # the other parameter's root shares: start each mesh afresh.
        device_mesh._mesh_resources.__init__()
        dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=rank, world_size=8)
        try:
            dims = parallel_dims.ParallelDims(
                dp_replicate=p.data_parallel_replicate_degree, dp_shard=p.data_parallel_shard_degree, cp=1,
                tp=p.tensor_parallel_degree, pp=p.pipeline_parallel_degree, ep=p.expert_parallel_degree,
                etp=p.expert_tensor_parallel_degree, world_size=8)
            theirs.add(tuple(dims.world_mesh["ep"].mesh.flatten().tolist()))
        finally:
            dist.destroy_process_group()
    assert sorted(list(group) for group in theirs) == ours


def test_torchtitan_refuses_expert_groups_that_split_replicas(dense_first_moe, tmp_path, dapple):
    # Expert groups of 2 GPUs at expert tensor degree 1 on replicas of 4
    # are fine for dapple, but torchtitan's ParallelDims asks ep to be a
    # multiple of tp then.
    plan = planner.megatron_plan(dense_first_moe, "1x8-a100-80gb", 64, tensor_parallel=4, pipeline_parallel=2,
                                 micro_batch_size=1, sequence_parallel=True, expert_parallel=2,
                                 expert_tensor_parallel=1)
    path, profile = tmp_path / "plan.json", tmp_path / "profile.json"
    plan.save(path)
    dense_first_moe.save(profile)
    r = dapple("export", "--plan", path, "--profile", profile, "--to", "torchtitan", "--out", tmp_path / "job.toml")
    assert_one_line_error(r, 4, "torchtitan cannot express expert groups of 2 GPUs, which split replicas of 4")
    assert not (tmp_path / "job.toml").exists()


def test_an_imbalanced_router_slows_spread_experts_alone(tmp_path, dapple):
    # The busiest GPU takes 1.5 times the mean's tokens: a stage that
    # spreads the experts waits for it; one that holds every expert does not.
    config = _moe_config(tmp_path / "moe.json")
    profiles = {}
    for imbalance in (1.0, 1.5):
        out = tmp_path / f"moe-{imbalance}.json"
        r = dapple("profile", "transformer", "--config", config, "--gpu", "a100", "--seq-len", 128,
                   "--expert-imbalance", imbalance, "--out", out)
        assert r.returncode == 0, r.stderr
        profiles[imbalance] = out
    blocks = [layer["experts"] for layer in json.loads(profiles[1.5].read_text())["layers"] if layer.get("experts")]
    assert {e["imbalance"] for e in blocks} == {1.5} and all(0 < e["compute_fraction"] < 1 for e in blocks)

    def stage(profile, **shape):
        plan = planner.evaluate(_one_stage_plan(profile, tmp_path, **shape), profile)
        return plan.estimate["stages"][0]

    for shape, slower in (({}, False), ({"expert_parallel": 4}, True)):
        balanced, skewed = stage(profiles[1.0], **shape), stage(profiles[1.5], **shape)
        assert (skewed["fwd_ms"] > balanced["fwd_ms"]) == slower, shape
        assert (skewed["bwd_ms"] > balanced["bwd_ms"]) == slower, shape


def test_a_router_more_balanced_than_balanced_is_one_line(tmp_path, dapple):
    r = dapple("profile", "transformer", "--config", _moe_config(tmp_path / "moe.json"), "--gpu", "a100",
               "--seq-len", 128, "--expert-imbalance", 0.5, "--out", tmp_path / "p.json")
    assert_one_line_error(r, 3, "expert_imbalance: value 0.5 must be a finite number >= 1")
    assert not (tmp_path / "p.json").exists()


def test_deepep_sends_a_token_across_machines_once_each(tmp_path, dapple):
    # 16 experts, 2 a token, spread over the 16 GPUs of two machines: NCCL's
    # all-to-all sends both copies, half of them to the other machine;
    # DeepEP sends a token there once, where one of its experts is (at
    # 1024 tokens a sample: at 128 the exchange is bound by each call's
    # latency, and DeepEP's forwarding inside the machine decides).
    config = _moe_config(tmp_path / "moe.json", experts=16)
    profiles = {}
    for dispatcher in planner.TOKEN_DISPATCHERS:
        out = tmp_path / f"moe-{dispatcher}.json"
        r = dapple("profile", "transformer", "--config", config, "--gpu", "a100", "--seq-len", 1024,
                   "--token-dispatcher", dispatcher, "--out", out)
        assert r.returncode == 0, r.stderr
        profiles[dispatcher] = out
    assert set(profiles) == {"all-to-all", "deepep"}
    blocks = [layer["experts"] for layer in json.loads(profiles["deepep"].read_text())["layers"] if layer.get("experts")]
    assert {e["dispatcher"] for e in blocks} == {"deepep"}
    assert all("dispatcher" not in layer.get("experts", {})
               for layer in json.loads(profiles["all-to-all"].read_text())["layers"])

    def stage(profile, **shape):
        data = planner.layout_plan(str(profile), "2x8-a100-80gb", 64, [(0, 6, list(range(16)))]).data
        data["stages"][0].update(shape)
        plan = planner.evaluate(write_hand_plan(data, tmp_path / "plan.json"), profile)
        return plan.estimate["stages"][0]

    whole = [stage(profiles[d]) for d in ("all-to-all", "deepep")]
    assert whole[0] == whole[1]  # nothing exchanged, nothing changes
    spread = [stage(profiles[d], expert_parallel=16) for d in ("all-to-all", "deepep")]
    assert spread[1]["fwd_ms"] < spread[0]["fwd_ms"] and spread[1]["bwd_ms"] < spread[0]["bwd_ms"]
    assert spread[1]["fwd_ms"] > whole[1]["fwd_ms"]


def test_a_bad_token_dispatcher_is_one_line(tmp_path, dapple):
    r = dapple("profile", "transformer", "--config", _moe_config(tmp_path / "moe.json"), "--gpu", "a100",
               "--seq-len", 128, "--token-dispatcher", "pigeon", "--out", tmp_path / "p.json")
    assert r.returncode != 0 and "--token-dispatcher" in r.stderr and "Traceback" not in r.stderr
    profile = json.loads(json.dumps(planner.transformer_profile(_moe_config(tmp_path / "moe.json"), gpu="a100",
                                                                seq_len=128, micro_batch_sizes=[1]).data))
    block = next(layer for layer in profile["layers"] if layer.get("experts"))
    block["experts"]["routing_groups"] = {"groups": 3, "per_token": 1}
    (tmp_path / "bad.json").write_text(json.dumps(profile))
    r = dapple("plan", "--profile", tmp_path / "bad.json", "--topology", "1x8-a100-80gb", "--global-batch-size", 64)
    assert_one_line_error(r, 3, "bad.json", "layers[1].experts.routing_groups.groups: value 3 must divide the 8 "
                                "experts")


def test_megatron_gets_the_dispatcher_and_routing_groups_priced(tmp_path):
    transformer = pytest.importorskip("megatron.core.transformer")
    from dapple.planner.export.megatron import megatron_arguments

    config = tmp_path / "grouped.json"
    config.write_text(json.dumps({
        "model_type": "deepseek_v3", "hidden_act": "silu", "hidden_size": 256, "intermediate_size": 512,
        "num_attention_heads": 8, "num_key_value_heads": 8, "num_hidden_layers": 4, "vocab_size": 1000,
        "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 128, "n_group": 4,
        "topk_group": 2,
    }))
    for dispatcher, expected in (("all-to-all", ["alltoall"]), ("deepep", ["flex", "deepep"])):
        profile = planner.transformer_profile(config, gpu="a100", seq_len=128, micro_batch_sizes=[1, 2],
                                              dispatcher=dispatcher)
        words = megatron_arguments(_megatron_moe_plan(profile, 2), profile).arguments
        value = {words[i]: words[i + 1] for i in range(len(words) - 1) if words[i].startswith("--")}
        assert [value[k] for k in ("--moe-token-dispatcher-type", "--moe-flex-dispatcher-backend")
                if k in value] == expected
        assert (value["--moe-router-num-groups"], value["--moe-router-group-topk"]) == ("4", "2")
        # megatron-core's config takes them as written.
        made = transformer.TransformerConfig(
            num_layers=4, hidden_size=256, num_attention_heads=8, add_bias_linear=False, num_moe_experts=8,
            moe_router_topk=2,
            moe_ffn_hidden_size=128, tensor_model_parallel_size=2, sequence_parallel=True,
            expert_model_parallel_size=2, moe_token_dispatcher_type=value["--moe-token-dispatcher-type"],
            moe_router_num_groups=4, moe_router_group_topk=2,
            **({"moe_flex_dispatcher_backend": value["--moe-flex-dispatcher-backend"]}
               if dispatcher == "deepep" else {}))
        assert made.moe_router_num_groups == 4
    # Held whole (e = 1), the dispatcher is not written.
    words = megatron_arguments(_megatron_moe_plan(profile, 1), profile).arguments
    assert "--moe-token-dispatcher-type" not in words


@pytest.mark.parametrize("target", ["torchtitan", "deepspeed"])
def test_targets_that_send_a_copy_an_expert_refuse_deepeps_exchange(dense_first_moe, tmp_path, dapple, target):
    data = json.loads(json.dumps(dense_first_moe.data))
    for layer in data["layers"]:
        if layer.get("experts"):
            layer["experts"]["dispatcher"] = "deepep"
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(data))
    # DeepSpeed's pipeline engine cuts no sequence: its stages whole.
    t = 2 if target == "torchtitan" else 1
    plan = planner.megatron_plan(str(profile), "1x8-a100-80gb", 64, tensor_parallel=t, pipeline_parallel=2,
                                 micro_batch_size=1, sequence_parallel=t > 1, expert_parallel=2, shard_level=1)
    path = tmp_path / "plan.json"
    plan.save(path)
    out = tmp_path / ("job.toml" if target == "torchtitan" else "ds.json")
    r = dapple("export", "--plan", path, "--profile", profile, "--to", target, "--out", out)
    assert_one_line_error(r, 4, "cannot express DeepEP's deduplicated token exchange",
                          "--approximate writes NCCL's all-to-all")
    assert not out.exists()
    r = dapple("export", "--plan", path, "--profile", profile, "--to", target, "--out", out, "--approximate")
    assert r.returncode == 0 and "NCCL's all-to-all" in r.stderr, r.stderr
