"""Context parallelism runs (issue 47, item 3): a stage that cuts its
sequences over c ranks (2c chunks, rank k holding chunks k and 2c-1-k,
keys and values gathered over the context group) trains as one process
does: after 5 steps every parameter within 1e-5 of single-process training
from the same seed (CPU, gloo), beside tensor parallelism, a pipeline,
split backwards, re-computation, FSDP, chunked stages and experts."""

import functools

import pytest

from conftest import assert_one_line_error, assert_trains_as_one_process, hand_plan

torch = pytest.importorskip("torch")

from dapple.planner.runtime.context_parallel import ContextGroup  # noqa: E402
from dapple.planner.runtime.launcher import run_plan  # noqa: E402
from dapple.planner.runtime.models import gpt_moe  # noqa: E402
from dapple.planner.runtime.reference import train_single_process  # noqa: E402
# The shaped stages' GPT (8 tokens: chunks of 2 tokens at c = 2, of 1 at c = 4), batches and reference.
from test_shaped_run import GBS, GPT, LR, STEPS, batches, reference  # noqa: E402, F401

C2 = {"context_parallel": 2}
TWO_STAGES = [(0, 2, [0, 1], C2), (2, 4, [2, 3], C2)]
CASES = {
    "c2": hand_plan(4, [(0, 4, [0, 1], C2)], GBS),
    # 2 replicas of 2 context ranks: gradients summed over all 4
    "c2-r2": hand_plan(4, [(0, 4, [0, 1, 2, 3], C2)], GBS),
    "c4": hand_plan(4, [(0, 4, [0, 1, 2, 3], {"context_parallel": 4})], GBS),
    # each context rank's 2 shards gather their heads' keys and values
    "t2-c2": hand_plan(4, [(0, 4, [0, 1, 2, 3], {"tensor_parallel": 2, **C2})], GBS),
    "c2-p2": hand_plan(2, TWO_STAGES, GBS),
    "c2-p2-zb-h1": hand_plan(2, TWO_STAGES, GBS, kind="zb-h1"),
    "c2-p2-recompute": hand_plan(2, [(0, 2, [0, 1], {"recompute": "full", **C2}),
                                     (2, 4, [2, 3], {"recompute": "per-layer", **C2})], GBS),
    # FSDP over the replicas' context ranks
    "c2-r2-zero3": hand_plan(4, [(0, 4, [0, 1, 2, 3], {"shard_level": 3, "reshard_after_forward": True, **C2})],
                             GBS),
    # 4 one-layer stages on 2 pipeline ranks of 2 context ranks each
    "c2-interleaved": hand_plan(2, [(i, i + 1, [0, 1] if i % 2 == 0 else [2, 3], C2) for i in range(4)], GBS,
                                kind="interleaved-1f1b", chunks=2),
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_stage_that_cuts_its_sequences_trains_as_one_process(name, batches, reference):
    res = run_plan(CASES[name], GPT, GPT().loss, batches, STEPS, LR, start_method="fork")
    assert_trains_as_one_process(res, reference, name)


def test_experts_beside_cut_sequences_train_as_one_process():
    moe = functools.partial(gpt_moe, n_layers=2, d_model=16, n_heads=2, seq=8, vocab=32, experts=4,
                            experts_per_token=2, expert_ffn=16)
    g = torch.Generator().manual_seed(7)
    data = [moe().make_batch(GBS, g) for _ in range(STEPS)]
    res = run_plan(hand_plan(4, [(0, 4, [0, 1], C2)], GBS), moe, moe().loss, data, STEPS, LR, start_method="fork")
    assert_trains_as_one_process(res, train_single_process(moe, moe().loss, data, STEPS, LR), "moe-c2")


def test_each_context_rank_holds_its_two_chunks_of_every_sequence():
    rows = torch.arange(16).repeat(2, 1)  # 2 samples of 16 tokens: 8 chunks of 2 at c = 4
    cut = [ContextGroup(None, k, 4).cut(rows)[0].tolist() for k in range(4)]
    assert cut == [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]
    group = ContextGroup(None, 1, 4)
    assert group.key_positions(4, torch.device("cpu")).tolist() == sum(cut, [])


def test_what_the_runtime_cannot_cut_is_refused_in_one_line(tmp_path, dapple):
    def refused(stages, model, *needles, **args):
        path = tmp_path / "plan.json"
        hand_plan(4, stages, GBS).save(path)
        options = [x for k, v in args.items() for x in ("--model-arg", f"{k}={v}")]
        r = dapple("run", "--plan", path, "--model", f"dapple.planner.runtime.models:{model}", *options,
                   "--steps", 1)
        assert_one_line_error(r, 4, *needles)

    small = {"n_layers": 2, "d_model": 16, "n_heads": 2, "seq": 8, "vocab": 32}
    # Neighbouring stages that cut their sequences differently.
    refused([(0, 2, [0, 1], C2), (2, 4, [2], {})], "gpt", "stages[1].context_parallel", "neighbouring stages",
            **small)
    # 16 chunks of 8 tokens.
    refused([(0, 4, list(range(8)), {"context_parallel": 8})], "gpt", "stages[0].context_parallel",
            "cannot cut the 8-token sequences", **small)
    # BERT's classifier reads the first token, which one context rank holds.
    refused([(0, 4, [0, 1], C2)], "bert", "stages[0].context_parallel", "layer 3", "does not cut its sequence",
            **small)
