"""ZB-H1 and ZB-H2 (Zero Bubble, Qi et al., ICLR 2024) planned, simulated
and run: each backward split into its input gradient (I), sent on at once,
and its weight gradient (W), deferred. The orders themselves are tested as
literal tables in the core (``rust_core/core/src/schedule/pipeline_order.rs``), ZB-H1
against torch's own class (``tests/test_pipeline_order.py``); torch has no
ZB-H2 class."""

from __future__ import annotations

import pytest
from conftest import PROFILES

from dapple import planner

BERT = PROFILES / "bert-48-pbs-2.json"


def test_a_plan_simulated_as_zb_h1_fills_its_waits_with_weight_gradients():
    plan = planner.baseline("straight", BERT, "1x4-nvlink", 32)
    one_f_one_b = planner.simulate(plan, BERT, schedule="early-backward-1f1b")
    zb = planner.simulate(plan, BERT, schedule="zb-h1")
    assert zb.schedule == "zb-h1"
    kinds = {t["kind"] for t in zb.tasks}
    assert {"input_gradient", "weight_gradient"} <= kinds and "backward" not in kinds
    # The same passes, the waits filled: faster, and each stage busy as long.
    assert zb.iteration_ms < one_f_one_b.iteration_ms
    for a, b in zip(zb.stages, one_f_one_b.stages):
        assert a["compute_ms"] == pytest.approx(b["compute_ms"])
    # Activations stay until W: the last stage holds as many micro-batches as the first.
    assert [s["peak_in_flight"] for s in zb.stages] == [min(len(plan.stages), plan.micro_batches)] * len(plan.stages)


def test_zb_h2_holds_up_to_2s_minus_1_micro_batches_to_fill_zb_h1s_waits():
    # BERT-48 straight on 16 GPUs, 64 micro-batches: the same passes, each
    # stage holding 2S - 1 micro-batches where ZB-H1's hold S, the Ws
    # filling what ZB-H1's ranks wait in its fill and drain.
    plan = planner.baseline("straight", BERT, "2x8-nvlink", 128)
    s, m = len(plan.stages), plan.micro_batches
    assert (s, m) == (16, 64)
    zb1 = planner.simulate(plan, BERT, schedule="zb-h1")
    zb2 = planner.simulate(plan, BERT, schedule="zb-h2")
    assert zb2.schedule == "zb-h2"
    assert [t["peak_in_flight"] for t in zb2.stages] == [2 * s - 1] * s
    assert [t["peak_in_flight"] for t in zb1.stages] == [s] * s
    for a, b in zip(zb2.stages, zb1.stages):
        assert a["compute_ms"] == pytest.approx(b["compute_ms"])
    assert zb2.iteration_ms < zb1.iteration_ms


# ----------------------------------------------------------------------------
# The runtime

torch = pytest.importorskip("torch")

from dapple.planner.runtime.launcher import run_plan  # noqa: E402
from dapple.planner.runtime.reference import train_single_process  # noqa: E402
from test_runtime import FAST, layout_plan, make_batches, max_diff, mse, tiny_layers  # noqa: E402

STEPS = 5


@pytest.mark.parametrize("kind,policy", [("zb-h1", "A"), ("zb-h2", "B")])
@pytest.mark.parametrize("stages", [
    [(0, 3, [0]), (3, 5, [1])],
    [(0, 1, [0]), (1, 2, [1]), (2, 4, [2]), (4, 5, [3])],
    [(0, 3, [0, 1]), (3, 5, [2, 3])],
], ids=["2 ranks", "4 ranks", "2 stages of 2 replicas"])
def test_zero_bubble_trains_like_one_process(stages, kind, policy):
    # Each kind's depths are a fixed policy's: ZB-H1's A's, ZB-H2's B's.
    torch.set_num_threads(1)
    batches = make_batches(STEPS)
    ref = train_single_process(tiny_layers, mse, batches, STEPS, 0.1)
    plan = layout_plan(2, stages, kind=kind, policy=policy)
    r = run_plan(plan, tiny_layers, mse, batches, STEPS, 0.1, **FAST)
    assert max_diff(r.params, ref) < 1e-5
    # It ran the core's lists: every micro-batch's I, then later its W.
    first = r.trace[0]
    assert "B0" not in first and first.index("I0") < first.index("W0")


@pytest.mark.parametrize("stages", [
    # a split stage feeding a plain one, and two split stages
    "t2-then-1", "t2-p2",
    # a plain stage feeding a re-computed one, whose I runs on the checkpoint
    "1-then-recompute",
])
def test_zb_h1_trains_shaped_stages_like_one_process(stages):
    import test_shaped_run as shaped

    torch.set_num_threads(1)
    plans = {**shaped.CASES,
             "1-then-recompute": shaped.shaped_plan(2, [(0, 2, [0], {}), (2, 4, [1], {"recompute": "full"})])}
    data = plans[stages].core.to_dict()
    data["schedule"]["kind"] = "zb-h1"
    plan = planner.Plan.from_dict(data)
    g = torch.Generator().manual_seed(7)
    batches = [shaped.GPT().make_batch(shaped.GBS, g) for _ in range(shaped.STEPS)]
    ref = train_single_process(shaped.GPT, shaped.GPT().loss, batches, shaped.STEPS, shaped.LR)
    r = run_plan(plan, shaped.GPT, shaped.GPT().loss, batches, shaped.STEPS, shaped.LR, **FAST)
    assert max_diff(r.params, ref) < 1e-5
