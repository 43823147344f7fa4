"""Mixture-of-experts transformer profiles without a GPU (issue 46, its
first slice): the shipped Mixtral and Qwen3-MoE configs, their experts'
memory and active FLOPs, plans that hold every expert on a stage, and bad
configs refused in one line."""

import json

from conftest import assert_one_line_error
from dapple import planner


def test_a_mixture_of_experts_holds_every_expert_and_counts_the_active_ones(tmp_path):
    moe = planner.transformer_profile("mixtral-8x7b", gpu="h100", seq_len=4096, micro_batch_sizes=[1])
    blocks = [layer for layer in moe.data["layers"] if layer.get("kind") == "block"]
    assert len(blocks) == 32
    params = sum(layer["param_bytes"] for layer in moe.data["layers"]) / 2
    assert abs(params / 46.7e9 - 1) < 0.01, params
    # Model FLOPs (what MFU counts) follow the 12.9B parameters a token uses.
    flops_per_token = moe.data["model_flops_per_sample"] / 3 / 4096
    assert 2 * 12.9e9 < flops_per_token < 2 * 12.9e9 * 1.15, flops_per_token
    # Mixtral's attention is Mistral 7B's: a block only the MLP sets apart
    # from one of the same attention and one 14336-wide dense MLP.
    config = tmp_path / "mistral-like.json"
    config.write_text(json.dumps({"hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
                                  "num_key_value_heads": 8, "num_hidden_layers": 32, "vocab_size": 32000}))
    dense = planner.transformer_profile(config, gpu="h100", seq_len=4096, micro_batch_sizes=[1])
    moe_block, dense_block = blocks[0], dense.data["layers"][1]
    assert moe_block["param_bytes"] > 7 * dense_block["param_bytes"] * 0.9
    slower = moe_block["measurements"][0]["fwd_ms"] / dense_block["measurements"][0]["fwd_ms"]
    assert 1.5 < slower < 4, slower


def test_qwen3_moe_plans_with_every_expert_on_its_stage(tmp_path):
    profile = planner.transformer_profile("qwen3-30b-a3b", gpu="h100", seq_len=4096, micro_batch_sizes=[1, 2])
    plan = planner.plan(profile, "2x8-h100", 64)
    assert plan.estimate["fits_memory"]
    assert 0 < plan.estimate["mfu"] < 1


def test_a_bad_moe_config_is_one_line_naming_the_field(tmp_path, dapple):
    config = tmp_path / "moe.json"
    config.write_text(json.dumps({"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
                                  "num_hidden_layers": 2, "vocab_size": 100, "num_experts": 4,
                                  "num_experts_per_tok": 6}))
    r = dapple("profile", "transformer", "--config", config, "--gpu", "h100", "--seq-len", 128,
               "--out", tmp_path / "p.json")
    assert_one_line_error(r, 3, "num_experts_per_tok: value 6 is more than the 4 routed experts")
    assert not (tmp_path / "p.json").exists()


def test_deepseek_v3_has_latent_attention_dense_first_blocks_and_shared_experts(dapple, tmp_path):
    out = tmp_path / "deepseek.json"
    r = dapple("profile", "transformer", "--config", "deepseek-v3", "--gpu", "h100", "--seq-len", 4096,
               "--micro-batch-sizes", "1", "--out", out)
    assert r.returncode == 0, r.stderr
    layers = json.loads(out.read_text())["layers"]
    blocks = [layer for layer in layers if layer.get("kind") == "block"]
    assert len(blocks) == 61
    # Three dense first blocks, then 58 of 256 routed experts and a shared one.
    sizes = [b["param_bytes"] for b in blocks]
    assert len(set(sizes[:3])) == 1 and len(set(sizes[3:])) == 1 and sizes[3] > 15 * sizes[0]
    assert abs(sum(layer["param_bytes"] for layer in layers) / 2 / 671e9 - 1) < 0.01
    # The latent down projections stay whole on every shard of a split.
    split = blocks[0]["split"][0]
    assert {d["what"] for d in split["divides"]} == {"attention heads", "KV heads"}
    assert split["replicated_param_fraction"] > 0.01
