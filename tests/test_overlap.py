"""What a runtime hides behind computation (issue 45, item 4): each
stage's gradient reduction behind its last backward, ZeRO-1's weight
gather behind the next forward, as a plan records it (``schedule.overlap``)
and the exports and ``--for`` carry it (``docs/cost-model.md``, "Overlap")."""

import json

import pytest

from dapple import planner
from dapple.planner.export.deepspeed import deepspeed_partition
from dapple.planner.export.megatron import megatron_arguments
from dapple.planner.runtime.layout import Layout


@pytest.fixture(scope="module")
def llama_7b():
    return planner.transformer_profile("llama-2-7b", gpu="a100", seq_len=1024, micro_batch_sizes=[1])


def _pipeline(profile, grad_reduce="data-parallel", param_gather=False, shard_level=0):
    """Llama-2-7B on 32 A100s at t2 p2 d8: each stage's 8 replicas span two
    machines, so their gradients cross the network."""
    return planner.megatron_plan(profile, "4x8-a100-80gb", 64, tensor_parallel=2, pipeline_parallel=2,
                                 micro_batch_size=1, shard_level=shard_level,
                                 overlap_grad_reduce=grad_reduce, overlap_param_gather=param_gather)


def test_a_pipeline_hides_its_gradient_reduction_where_its_runtime_does(llama_7b, tmp_path):
    dapple_ms, none_ms, every_ms = (_pipeline(llama_7b, g).iteration_ms
                                    for g in ("data-parallel", "none", "every-stage"))
    # DAPPLE's model hides a pipeline's reduction no more than "none" does.
    assert dapple_ms == none_ms
    assert every_ms < dapple_ms
    every = _pipeline(llama_7b, "every-stage")
    assert every.data["schedule"]["overlap"] == {"grad_reduce": "every-stage", "param_gather": False}
    assert every.overlap == ("every-stage", False)
    # The simulator's "no overlap" is the runtime that hides none.
    assert planner.simulate(every, llama_7b, overlap_allreduce=False).iteration_ms == none_ms
    # Written and read again, the plan costs the same.
    every.save(tmp_path / "every.json")
    again = planner.evaluate(tmp_path / "every.json", llama_7b)
    assert again.overlap == every.overlap and again.iteration_ms == every.iteration_ms
    # A default plan writes no overlap, as a version 7 plan read the same way.
    plain = _pipeline(llama_7b)
    assert "overlap" not in plain.data["schedule"] and plain.data["schema_version"] >= 8


def test_zero_1_gathers_its_weights_behind_the_forward_only_where_asked(llama_7b):
    after, behind_backward, behind_both = (
        _pipeline(llama_7b, grad_reduce, param_gather, shard_level=1).iteration_ms
        for grad_reduce, param_gather in (("none", False), ("every-stage", False), ("every-stage", True)))
    assert behind_both < behind_backward < after
    # Without ZeRO-1 there is no gather to hide.
    assert _pipeline(llama_7b, "every-stage", True).iteration_ms == _pipeline(llama_7b, "every-stage").iteration_ms


def test_the_exports_write_what_the_plan_hides_or_refuse_it(llama_7b):
    def words(plan, **kw):
        return megatron_arguments(plan, llama_7b, **kw).arguments

    both = _pipeline(llama_7b, "every-stage", True, shard_level=1)
    assert {"--overlap-grad-reduce", "--overlap-param-gather", "--use-distributed-optimizer"} <= set(words(both))
    # Megatron-LM reduces a pipeline's gradients after its backward unless told.
    assert not {"--overlap-grad-reduce", "--overlap-param-gather"} & set(words(_pipeline(llama_7b)))
    one_stage = planner.megatron_plan(llama_7b, "2x8-a100-80gb", 64, tensor_parallel=1, pipeline_parallel=1,
                                      micro_batch_size=1)
    assert "--overlap-grad-reduce" in words(one_stage)  # DAPPLE's model hides a data-parallel plan's
    # Megatron-LM gathers behind the forward only while it reduces behind the backward.
    gather_only = _pipeline(llama_7b, "none", True, shard_level=1)
    with pytest.raises(planner.IncompatibleInputsError, match="asserts --overlap-grad-reduce"):
        words(gather_only)
    assert "--overlap-grad-reduce" in words(gather_only, approximate=True)
    with pytest.raises(planner.IncompatibleInputsError, match="DeepSpeed cannot express gradient reduction"):
        deepspeed_partition(_pipeline(llama_7b, "every-stage"))
    assert deepspeed_partition(_pipeline(llama_7b, "every-stage"), approximate=True).changes
    with pytest.raises(planner.IncompatibleInputsError, match=r"field schedule\.overlap: value grad_reduce"):
        Layout.of(_pipeline(llama_7b, "every-stage"))


def test_a_plan_for_megatron_is_costed_with_megatrons_overlap(llama_7b):
    made = planner.plan_for("megatron", llama_7b, "4x8-a100-80gb", 64)
    assert made.plan.overlap == ("every-stage", True)
    assert "--overlap-grad-reduce" in megatron_arguments(made.plan, llama_7b).arguments
    # The free plan is costed with the same overlap: the cost is the shapes'.
    assert made.cost >= 1.0
    with pytest.raises(planner.InvalidInputError, match="the free plan given for megatron hides"):
        planner.plan_for("megatron", llama_7b, "4x8-a100-80gb", 64, free=_pipeline(llama_7b))


def test_plan_takes_the_overlap_on_the_command_line(tmp_path, dapple, llama_7b):
    profile = tmp_path / "llama.json"
    llama_7b.save(profile)
    base = ("plan", "--profile", profile, "--topology", "2x8-a100-80gb", "--global-batch-size", 32, "--json",
            "--quiet")
    done = dapple(*base, "--overlap-grad-reduce", "every-stage", "--overlap-param-gather")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["schedule"]["overlap"] == {"grad_reduce": "every-stage", "param_gather": True}
    bad = dapple(*base, "--overlap-grad-reduce", "sometimes")
    assert bad.returncode == 2 and "sometimes" in bad.stderr
