"""Offloading the optimizer (issue 46, item 4): a stage's master weights
and optimizer state in host memory, stepped by the host's CPU (ZeRO-Offload),
searched where GPU memory needs it, priced, exported where the target runs
it, and refused in one line where it does not."""

import json

import pytest

from conftest import assert_one_line_error, write_hand_plan
from dapple import planner
from dapple.planner.plan import shape_label


@pytest.fixture(scope="module")
def llama_7b(tmp_path_factory):
    """Llama-2-7B at 1,024 tokens, timed on V100-32GB: 6.74e9 parameters,
    16 bytes of state each (bf16 weights and gradients, fp32 master weights
    and Adam's moments)."""
    out = tmp_path_factory.mktemp("offload") / "llama-2-7b.json"
    planner.transformer_profile("llama-2-7b", gpu="V100-32GB", seq_len=1024).save(out)
    return out


def test_the_search_offloads_the_optimizer_where_gpu_memory_needs_it_and_only_there(llama_7b):
    # Four 16 GB V100s cannot hold 108 GB of state even with ZeRO-1 and
    # 4-way tensor parallelism (6.74e9 x (4 + 12 / 4) bytes = 47 GB):
    # only with the optimizer on the host does it fit.
    small = planner.plan(llama_7b, "1x4-v100-16gb", 64)
    offloaded = [i for i, s in enumerate(small.stage_shapes) if s.offload == "optimizer"]
    assert offloaded and small.estimate["fits_memory"]
    assert all("off" in shape_label(small.stage_shapes[i]).split() for i in offloaded)
    # Its step is on the critical tail: gradients out, Adam, weights back.
    steps = [small.estimate["stages"][i]["offloaded_step_ms"] for i in offloaded]
    assert all(ms > 0 for ms in steps)
    assert small.iteration_ms > max(steps)
    # Eight 32 GB V100s hold it on the GPUs: nothing is offloaded, as an
    # offloaded step only adds time.
    roomy = planner.plan(llama_7b, "1x8-v100-32gb", 64)
    assert all(s.offload == "none" for s in roomy.stage_shapes)
    assert all("offloaded_step_ms" not in s for s in roomy.estimate["stages"])


def test_offloading_a_plan_moves_its_optimizer_state_to_the_host_and_adds_the_step(llama_7b, tmp_path):
    on_gpu = planner.plan(llama_7b, "1x8-v100-32gb", 64)
    data = json.loads(json.dumps(on_gpu.data))
    for stage in data["stages"]:
        stage["offload"] = "optimizer"
    off = planner.evaluate(write_hand_plan(data, tmp_path / "offloaded.json"), llama_7b)
    assert off.data["schema_version"] >= 11  # the version that added offloading
    for before, after in zip(on_gpu.estimate["stages"], off.estimate["stages"]):
        assert after["memory_bytes"] < before["memory_bytes"]
        assert after["offloaded_step_ms"] > 0
        assert (after["fwd_ms"], after["bwd_ms"]) == (before["fwd_ms"], before["bwd_ms"])
    assert off.iteration_ms > on_gpu.iteration_ms


def _offloaded_plan(profile, tmp_path, topology="1x8-v100-32gb", **stage):
    """Megatron-LM's layout of one stage split 2 ways on 4 replicas, every
    layer re-computed one at a time, with ``stage``'s fields besides."""
    data = planner.megatron_plan(profile, topology, 64, tensor_parallel=2, pipeline_parallel=1,
                                 micro_batch_size=2, recompute="per-layer").data
    data["stages"][0].update(stage)
    return write_hand_plan(data, tmp_path / "plan.json")


def test_megatron_plans_take_the_offload_as_runs_write_it(llama_7b):
    # Megatron-LM's --optimizer-cpu-offload beside its distributed optimizer.
    # At t4 x r2 with ZeRO-1 a GPU holds 6.74e9 x (4 / 4 + 12 / 8) bytes
    # of state, 16.8 GB; offloaded, the first 6.7 GB alone.
    on_gpu, off = (planner.megatron_plan(llama_7b, "1x8-v100-16gb", 64, tensor_parallel=4, pipeline_parallel=1,
                                         micro_batch_size=2, shard_level=1, recompute="per-layer",
                                         offload=offload)
                   for offload in ("none", "optimizer"))
    assert not on_gpu.estimate["fits_memory"] and off.estimate["fits_memory"]
    assert [s.offload for s in off.stage_shapes] == ["optimizer"]
    with pytest.raises(planner.InvalidInputError, match="offload"):
        planner.megatron_plan(llama_7b, "1x8-v100-16gb", 64, tensor_parallel=8, pipeline_parallel=1,
                              micro_batch_size=8, offload="disk")


def test_an_unknown_offload_target_is_one_line_naming_the_field(llama_7b, tmp_path, dapple):
    plan = _offloaded_plan(llama_7b, tmp_path, offload="nvme")
    assert_one_line_error(dapple("estimate", "--plan", plan, "--profile", llama_7b), 3,
                          "stages[0].offload", "nvme")


def test_offloading_to_a_host_the_catalog_does_not_know_is_refused_by_name(llama_7b, tmp_path, dapple):
    topology = tmp_path / "custom.json"
    custom = planner.Topology.resolve("1x8-v100-32gb").data
    custom["machine_groups"][0]["gpu"]["type"] = "X1-32GB"
    custom["machine_groups"][0]["gpu"]["relative_speed"] = 1.0
    topology.write_text(json.dumps(custom))
    plan = _offloaded_plan(llama_7b, tmp_path, topology=str(topology), offload="optimizer")
    assert_one_line_error(dapple("estimate", "--plan", plan, "--profile", llama_7b), 3,
                          "stages[0].offload", '"X1-32GB"', "no host figures")


def _exported(dapple, plan, target, tmp_path, *extra):
    out = tmp_path / f"{target}.out"
    r = dapple("export", "--plan", plan, "--to", target, "--out", out, *extra)
    return r, out


def test_megatron_and_deepspeed_offload_with_their_sharded_optimizers(llama_7b, tmp_path, dapple):
    plan = _offloaded_plan(llama_7b, tmp_path, shard_level=1, offload="optimizer")
    r, out = _exported(dapple, plan, "megatron", tmp_path, "--profile", llama_7b)
    assert r.returncode == 0, r.stderr
    words = out.read_text()
    for flag in ("--use-distributed-optimizer", "--optimizer-cpu-offload", "--optimizer-offload-fraction 1.0",
                 "--use-precision-aware-optimizer"):
        assert flag in words
    r, out = _exported(dapple, plan, "deepspeed", tmp_path)
    assert r.returncode == 0, r.stderr
    assert json.loads(out.read_text())["config"]["zero_optimization"] == {
        "stage": 1, "offload_optimizer": {"device": "cpu", "pin_memory": True}}


@pytest.mark.parametrize("target", ["megatron", "deepspeed"])
def test_an_offload_without_zero_is_refused_or_approximated_aloud(llama_7b, tmp_path, dapple, target):
    # Both shard what they offload over the replicas: each host would step
    # a quarter of what the plan costed.
    plan = _offloaded_plan(llama_7b, tmp_path, offload="optimizer")
    extra = ("--profile", llama_7b) if target == "megatron" else ()
    r, out = _exported(dapple, plan, target, tmp_path, *extra)
    assert_one_line_error(r, 4, "an offloaded optimizer without ZeRO-1", "--approximate writes ZeRO-1")
    assert not out.exists()
    r, out = _exported(dapple, plan, target, tmp_path, *extra, "--approximate")
    assert r.returncode == 0, r.stderr
    assert "an offloaded optimizer without ZeRO-1 -> ZeRO-1" in r.stderr


def test_torchtitan_refuses_an_offloaded_optimizer_and_dapples_runtime_takes_it(llama_7b, tmp_path, dapple):
    plan = _offloaded_plan(llama_7b, tmp_path, shard_level=1, offload="optimizer")
    r, _ = _exported(dapple, plan, "torchtitan", tmp_path, "--profile", llama_7b)
    assert_one_line_error(r, 4, "torchtitan cannot express an optimizer offloaded alone")
    # dapple's runtime steps it on the host (tests/test_moe_runtime.py runs it).
    layout = planner.runtime.layout.Layout.of(planner.Plan.load(plan))
    assert all(stage.offload_optimizer for stage in layout.stages)


def test_a_plan_offloading_more_than_its_host_holds_does_not_fit(llama_7b):
    # Each of 8 replicas offloading all of Llama-2-7B's optimizer state:
    # 6.74e9 x 12 bytes, 75 GiB, beside a DGX-1's 64 GiB of host memory a
    # GPU, though its GPU holds the rest (25.5 of 32 GiB). Under ZeRO-1 its
    # host keeps an eighth, and it fits.
    alone, sharded = (planner.megatron_plan(llama_7b, "1x8-v100-32gb", 8, tensor_parallel=1, pipeline_parallel=1,
                                            micro_batch_size=1, recompute="per-layer", shard_level=int(zero),
                                            offload="optimizer")
                      for zero in (False, True))
    stage = alone.estimate["stages"][0]
    assert stage["memory_bytes"] < stage["memory_limit_bytes"]
    assert stage["host_memory_bytes"] > stage["host_memory_limit_bytes"] == 64 * 2**30
    assert not alone.estimate["fits_memory"]
    stage = sharded.estimate["stages"][0]
    assert stage["host_memory_bytes"] == pytest.approx(alone.estimate["stages"][0]["host_memory_bytes"] / 8)
    assert sharded.estimate["fits_memory"]


def test_no_plan_says_offloading_was_weighed_within_the_hosts_memory(llama_7b, dapple):
    # One V100-32GB: 25 GiB of weights and gradients fit, but its 75 GiB
    # of optimizer state does not fit a DGX-1's 64 GiB of host a GPU.
    r = dapple("plan", "--profile", llama_7b, "--topology", "1x1-v100-32gb", "--global-batch-size", 16)
    assert_one_line_error(r, 5, "no plan fits in GPU memory",
                          "offloading the optimizer where a host's 64.00 GiB a GPU holds it")
