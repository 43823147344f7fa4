"""Context parallelism (issue 47): each sample's sequence cut over a stage's
context ranks, in the profile, the search, the exports and the refusals
(docs/cost-model.md, "Context parallelism")."""

import json

import pytest

from conftest import assert_one_line_error, run_dapple
from dapple import planner
from dapple.planner.runtime.layout import Layout

TOPOLOGY = "2x8-h100-80gb"


@pytest.fixture(scope="module")
def long_llama(tmp_path_factory):
    """Llama-3-8B at 131,072 tokens on H100s: issue 47's long-sequence case."""
    out = tmp_path_factory.mktemp("context") / "llama-3-8b-131k.json"
    r = run_dapple("profile", "transformer", "--config", "llama-3-8b", "--gpu", "H100-80GB", "--seq-len", 131072,
                   "--out", out)
    assert r.returncode == 0, r.stderr
    return out


def test_a_transformer_profile_says_how_each_layer_cuts_its_sequence(long_llama):
    layers = json.loads(long_llama.read_text())["layers"]
    assert all(layer["context"]["sequence_length"] == 131072 for layer in layers)
    # Keys and values of the 8 KV heads of 128 values, bf16, over the sequence;
    # the embedding and the head pass none.
    blocks = [layer for layer in layers if layer["name"].startswith("block")]
    assert all(b["context"]["kv_bytes_per_sample"] == 2 * 131072 * 8 * 128 * 2 for b in blocks)
    assert layers[0]["context"]["kv_bytes_per_sample"] == 0 == layers[-1]["context"]["kv_bytes_per_sample"]
    # At 131k tokens attention's core is most of a block's time.
    assert all(0.5 < b["context"]["attention_compute_fraction"] < 1 for b in blocks)


@pytest.fixture(scope="module")
def long_plans(long_llama):
    """The free plan and the plan without context parallelism."""
    return (planner.plan(long_llama, TOPOLOGY, 16),
            planner.plan(long_llama, TOPOLOGY, 16, max_context_parallel=1))


def test_the_search_cuts_long_sequences_and_is_faster_for_it(long_plans):
    cut, whole = long_plans
    assert any(s.context_parallel > 1 for s in cut.stage_shapes)
    assert all(s.context_parallel == 1 for s in whole.stage_shapes)
    assert cut.iteration_ms < whole.iteration_ms
    assert cut.estimate["fits_memory"] and cut.estimate["mfu"] > whole.estimate["mfu"]
    # Each stage's GPUs are its data replicas x t x c.
    for s, stage in zip(cut.stage_shapes, cut.stages):
        assert s.replicas * s.tensor_parallel * s.context_parallel == len(stage["devices"])


def test_a_published_layout_with_context_parallelism_costs_less_memory_per_micro_batch(long_llama):
    def layout(c):
        return planner.megatron_plan(long_llama, TOPOLOGY, 16, tensor_parallel=4, pipeline_parallel=2,
                                     micro_batch_size=1, sequence_parallel=True, context_parallel=c)

    one, two = layout(1), layout(2)
    assert [len(s["devices"]) for s in two.stages] == [8, 8]
    assert two.stage_shapes[0].replicas == 1 and one.stage_shapes[0].replicas == 2
    terms = [p.estimate["memory"][0]["per_micro_batch_bytes"] for p in (one, two)]
    assert terms[1] == pytest.approx(terms[0] / 2, rel=0.01)
    # A degree that does not cut 131,072 tokens into 2c equal chunks is refused, naming the field.
    with pytest.raises(planner.InvalidInputError, match="context_parallel=3 does not cut"):
        planner.megatron_plan(long_llama, "3x8-h100-80gb", 24, tensor_parallel=8, pipeline_parallel=1,
                              micro_batch_size=1, context_parallel=3)


def test_exports_write_the_context_degree_or_refuse_it(long_llama, long_plans, tmp_path):
    plan_path = tmp_path / "cut.json"
    # One data replica a stage, its optimizer state sharded over its 2 context ranks.
    plan = planner.megatron_plan(long_llama, TOPOLOGY, 16, tensor_parallel=4, pipeline_parallel=2,
                                 micro_batch_size=1, sequence_parallel=True, context_parallel=2, shard_level=1)
    assert plan.stage_shapes[0].replicas == 1
    plan.save(plan_path)
    out = tmp_path / "megatron.sh"
    r = run_dapple("export", "--plan", plan_path, "--profile", long_llama, "--to", "megatron", "--out", out)
    assert r.returncode == 0, r.stderr
    text = out.read_text()
    assert "--context-parallel-size 2" in text and "--use-distributed-optimizer" in text
    out = tmp_path / "titan.toml"
    r = run_dapple("export", "--plan", plan_path, "--profile", long_llama, "--to", "torchtitan", "--out", out)
    assert r.returncode == 0, r.stderr
    text = out.read_text()
    # torchtitan's FSDP shards over the data and context ranks (its dp_shard_cp mesh): level 1 beside a pipeline.
    assert "context_parallel_degree = 2" in text and 'fsdp_reshard_after_forward = "never"' in text
    plain_sequence = planner.megatron_plan(long_llama, TOPOLOGY, 16, tensor_parallel=4, pipeline_parallel=2,
                                           micro_batch_size=1, context_parallel=2)
    plain_sequence.save(tmp_path / "cut-no-sp.json")
    r = run_dapple("export", "--plan", tmp_path / "cut-no-sp.json", "--to", "deepspeed", "--out", tmp_path / "ds.json")
    assert_one_line_error(r, 4, "context parallelism (degree 2)")
    assert not (tmp_path / "ds.json").exists()
    # dapple's runtime lays the context ranks out: one replica of 4 shards at each of 2 context ranks.
    stage = Layout.of(plain_sequence).stages[0]
    assert (stage.context_parallel, len(stage.context_groups), len(stage.context_groups[0])) == (2, 4, 2)


def test_each_target_gets_the_context_degrees_it_runs(long_llama):
    # DeepSpeed's pipeline engine cuts no sequence.
    made = planner.plan_for("deepspeed", long_llama, TOPOLOGY, 16)
    assert all(s.context_parallel == 1 for s in made.plan.stage_shapes)
    # dapple's runtime cuts every stage's alike: the plan it gets cuts, and it lays it out.
    made = planner.plan_for("torch", long_llama, TOPOLOGY, 16)
    degrees = {s.context_parallel for s in made.plan.stage_shapes}
    assert len(degrees) == 1 and degrees.pop() > 1, made.plan.stage_shapes
    assert Layout.of(made.plan).stages[0].context_parallel > 1


def test_a_bad_context_bound_is_a_usage_error(dapple, long_llama):
    r = dapple("plan", "--profile", long_llama, "--topology", TOPOLOGY, "--max-context-parallel", "0")
    assert r.returncode == 2 and "max-context-parallel" in r.stderr and "Traceback" not in r.stderr


def test_megatron_core_and_torchtitan_read_the_context_degree_written(long_llama, tmp_path):
    transformer = pytest.importorskip("megatron.core.transformer")
    parallel_state = pytest.importorskip("megatron.core.parallel_state")
    manager = pytest.importorskip("torchtitan.config.manager")
    from dapple.planner.export.megatron import megatron_arguments

    profile = planner.Profile.load(long_llama)
    plan = planner.megatron_plan(profile, TOPOLOGY, 16, tensor_parallel=4, pipeline_parallel=2, micro_batch_size=1,
                                 sequence_parallel=True, context_parallel=2, shard_level=1)
    words = megatron_arguments(plan, profile).arguments
    value = {words[i]: words[i + 1] for i in range(len(words) - 1) if words[i].startswith("--")}
    t, p, c = (int(value[f"--{name}-parallel-size"]) for name in ("tensor-model", "pipeline-model", "context"))
    # megatron-core validates the degrees as a run would build them (Llama-3-8B's attention) ...
    transformer.TransformerConfig(
        num_layers=int(value["--num-layers"]), hidden_size=4096, num_attention_heads=32, num_query_groups=8,
        tensor_model_parallel_size=t, pipeline_model_parallel_size=p, context_parallel_size=c,
        sequence_parallel="--sequence-parallel" in words, pipeline_dtype=torch_dtype())
    # ... and groups the ranks (its default order) into the context groups of dapple's layout.
    groups = parallel_state.RankGenerator(tp=t, ep=1, dp=16 // (t * c * p), pp=p, cp=c, order="tp-cp-ep-dp-pp")
    ours = sorted(group for stage in plan.core.layout().stages for group in stage.context_groups)
    assert sorted(groups.get_ranks("cp")) == ours
    plan.save(tmp_path / "cut.json")
    out = tmp_path / "titan.toml"
    r = run_dapple("export", "--plan", tmp_path / "cut.json", "--profile", long_llama, "--to", "torchtitan",
                   "--out", out)
    assert r.returncode == 0, r.stderr
    config = manager.ConfigManager().parse_args(["--job.config_file", str(out)])
    assert (config.parallelism.context_parallel_degree, config.parallelism.tensor_parallel_degree) == (2, 4)


def torch_dtype():
    return pytest.importorskip("torch").bfloat16


def test_above_1024_gpus_a_sequence_that_fits_only_cut_still_plans(tmp_path):
    # Above 1,024 GPUs the search's own space cuts no sequence; the uniform
    # layouts that do are its candidates. Where nothing of the space fits,
    # they must still be ranked (Llama 3 405B at 131,072 tokens on 16,384
    # H100s with fp32 gradients answered "no plan fits" before).
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps({
        "model_type": "llama", "hidden_size": 1024, "intermediate_size": 4096, "num_attention_heads": 8,
        "num_key_value_heads": 8, "num_hidden_layers": 4, "vocab_size": 32000,
        "max_position_embeddings": 4194304}))
    profile = planner.transformer_profile(config, gpu="H100-80GB", seq_len=4194304, micro_batch_sizes=[1])
    topology = "130x8-h100-80gb"
    with pytest.raises(planner.InfeasibleError, match="no plan fits in GPU memory"):
        planner.plan(profile, topology, 130, max_context_parallel=1)
    plan = planner.plan(profile, topology, 130)
    assert plan.estimate["fits_memory"]
    assert all(s.context_parallel > 1 for s in plan.stage_shapes)
    # No plan of the space fits, so it records no bound of its own, and says so.
    assert "lower_bound_ms" not in plan.data["selection"] and plan.data["selection"]["space_fits"] is False
    path = tmp_path / "tiny-profile.json"
    profile.save(path)
    r = run_dapple("plan", "--profile", path, "--topology", topology, "--global-batch-size", 130,
                   "--out", tmp_path / "plan.json")
    assert r.returncode == 0, r.stderr
    assert "chosen by simulation: the megatron candidate; no plan of the search space fits" in r.stdout + r.stderr


def test_a_long_sequence_that_fits_re_computed_and_sharded_plans(dapple, tmp_path):
    # Issue 66: this exited 5, "every plan keeps at least 81.75 GiB": the
    # floor before searching counted every activation a layer stores, where
    # per-layer re-computation keeps only each layer's input (1 GiB a layer
    # at 131,072 tokens of 4,096 in bf16, where it stores 17 GiB).
    profile = tmp_path / "p.json"
    r = dapple("profile", "transformer", "--config", "llama-3-8b", "--gpu", "H100-80GB", "--seq-len", 131072,
               "--micro-batch-sizes", 1, "--gradients", "fp32", "--out", profile)
    assert r.returncode == 0, r.stderr
    plan_path = tmp_path / "plan.json"
    r = dapple("plan", "--profile", profile, "--topology", "1x8-h100-80gb", "--global-batch-size", 2,
               "--max-shard-level", 3, "--out", plan_path, "--quiet")
    assert r.returncode == 0, r.stderr
    plan = planner.Plan.load(plan_path)
    assert plan.estimate["fits_memory"]
    assert all(s.recompute != "none" for s in plan.stage_shapes)
