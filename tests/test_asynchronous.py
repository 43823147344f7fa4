"""Asynchronous schedules (XPipe, PipeDream's weight stashing, SpecTrain,
asynchronous without prediction) in the simulator and on the command line.
The schedules themselves are tested as literal tables in the core
(``rust_core/core/src/schedule.rs``)."""

from __future__ import annotations

import json
import pathlib

import pytest
from conftest import PROFILES, assert_one_line_error

from dapple import planner

BERT = PROFILES / "bert-48-pbs-2.json"


@pytest.fixture(scope="module")
def gpipe_plan(tmp_path_factory):
    path = tmp_path_factory.mktemp("plans") / "gpipe.json"
    planner.baseline("gpipe", BERT, "1x4-nvlink", 32).save(path)
    return path


def test_asynchronous_simulation_is_a_steady_state_over_many_mini_batches(gpipe_plan):
    plan = planner.Plan.load(gpipe_plan)
    for recompute in (False, True):
        flushed = planner.simulate(plan, BERT, recompute=recompute)
        for kind in planner.ASYNCHRONOUS_SCHEDULES:
            sim = planner.simulate(plan, BERT, schedule=kind, recompute=recompute)
            assert (sim.schedule, sim.recompute) == (kind, recompute)
            assert sim.mini_batches > 1 and sim.span_ms > sim.iteration_ms * (sim.mini_batches - 1)
            # Every pass of every mini-batch ran.
            passes = [t for t in sim.tasks if t["kind"] in ("forward", "backward")]
            assert len(passes) == 2 * len(plan.stages) * plan.micro_batches * sim.mini_batches
            assert sim.iteration_ms < flushed.iteration_ms
            # The last stage never holds another version of its weights.
            assert sim.stages[-1]["peak_weight_copies"] == 0
        stash = planner.simulate(plan, BERT, schedule="pipedream", recompute=recompute)
        live = planner.simulate(plan, BERT, schedule="async", recompute=recompute)
        assert stash.stages[0]["peak_weight_copies"] >= 1
        assert stash.stages[0]["peak_memory_bytes"] > live.stages[0]["peak_memory_bytes"]


def test_an_asynchronous_plan_on_unlike_gpus_keeps_its_stages_plain():
    # A stage over V100s and P100s may not re-compute on its own; the
    # planner leaves out that candidate rather than failing.
    topology = planner.Topology.resolve(str(PROFILES.parent / "topologies" / "whale-4v100-4p100.json"))
    for gbs in (64, 256):
        plan = planner.plan(BERT, topology, gbs, schedule="pipedream")
        assert plan.estimate["fits_memory"]


def test_xpipe_without_re_computation_beats_gpipe_without_it_on_bert_24():
    # The case: BERT-24 on 1x4-pcie at a global batch of 96. When
    # XPipe always re-computed it read 2861 ms on GPipe's plan, against
    # 2455 ms for GPipe without re-computation (3376 ms with it).
    profile = PROFILES / "bert-24-pbs-6.json"
    gpipe = planner.baseline("gpipe", profile, "1x4-pcie", 96)
    for recompute in (False, True):
        # Like for like: the same plan, the same re-computation.
        flushed = planner.simulate(gpipe, profile, recompute=recompute)
        xpipe = planner.simulate(gpipe, profile, schedule="xpipe", recompute=recompute)
        assert xpipe.iteration_ms < flushed.iteration_ms, recompute
    # XPipe's own plan fits without re-computing and is faster still.
    own = planner.plan(profile, "1x4-pcie", 96, schedule="xpipe")
    assert all(s.recompute == "none" for s in own.stage_shapes)
    assert own.iteration_ms <= planner.simulate(gpipe, profile, schedule="xpipe").iteration_ms


def test_simulate_command_reports_the_steady_state_and_the_weights_of_each_pass(dapple, gpipe_plan):
    r = dapple("simulate", "--plan", gpipe_plan, "--profile", BERT, "--schedule", "xpipe")
    assert r.returncode == 0, r.stderr
    assert "steady state:" in r.stdout and "per mini-batch" in r.stdout and "weight copies" in r.stdout
    r = dapple("simulate", "--plan", gpipe_plan, "--profile", BERT, "--schedule", "xpipe", "--json")
    data = json.loads(r.stdout)
    version = planner._core.FORMATS["dapple.simulation"][0]
    assert (data["format"], data["schema_version"], data["schedule"]) == ("dapple.simulation", version, "xpipe")
    assert data["mini_batches"] > 1
    # The table is the core's: stage 0 warms up one micro-batch per stage,
    # and its fifth forward (mini-batch 0 of 16 micro-batches) needs no
    # prediction yet.
    r = dapple("simulate", "--plan", gpipe_plan, "--profile", BERT, "--schedule", "xpipe", "--actions")
    lines = r.stdout.splitlines()
    assert len(lines) == 4 and lines[0].startswith("stage 0: F0@0 F1@0 F2@0 F3@0 B0@0 F4@0 ")
    assert " AR OPT " in lines[0] and "+1" in lines[0]


def test_a_plan_for_an_asynchronous_schedule(dapple, gpipe_plan, tmp_path):
    # dapple plan --schedule xpipe: the uniform pipeline with the fastest
    # steady state that fits, which simulates, estimates and runs as xpipe.
    out = tmp_path / "xpipe.json"
    r = dapple("plan", "--profile", BERT, "--topology", "1x4-nvlink", "--global-batch-size", 32,
               "--schedule", "xpipe", "--out", out)
    assert r.returncode == 0, r.stderr
    plan = planner.Plan.load(out)
    assert plan.core.schedule_kind == "xpipe"
    assert [s["warmup_micro_batches"] for s in plan.stages] == list(range(len(plan.stages), 0, -1))
    sim = planner.simulate(plan, BERT)
    assert (sim.schedule, sim.mini_batches > 1) == ("xpipe", True)
    assert plan.iteration_ms == pytest.approx(sim.iteration_ms)
    assert plan.estimate["latency_ms"] <= plan.iteration_ms * (1 + 1e-9)
    # It records its profile's file, as the search's plans do, so that the
    # commands reading the plan find the profile without being told.
    recorded = plan.core.to_dict()["inputs"]["profile_path"]
    assert pathlib.Path(recorded).resolve() == pathlib.Path(BERT).resolve()
    r = dapple("estimate", "--plan", out)
    assert r.returncode == 0, r.stderr
    # no synchronous plan of the same inputs runs xpipe faster in its steady state
    for kind in ("gpipe", "straight", "data-parallel"):
        other = planner.baseline(kind, BERT, "1x4-nvlink", 32)
        assert plan.iteration_ms <= planner.simulate(other, BERT, schedule="xpipe").iteration_ms * (1 + 1e-9), kind
    # The synchronous search's options do not apply: asked for, they are refused by name.
    r = dapple("plan", "--profile", BERT, "--topology", "1x4-nvlink", "--global-batch-size", 32,
               "--schedule", "xpipe", "--warmup-policy", "B")
    assert_one_line_error(r, 4, "warmup_policy", "'B'", "schedule xpipe")
    with pytest.raises(planner.IncompatibleInputsError, match="search_space: value 'full'"):
        planner.plan(BERT, "1x4-nvlink", 32, schedule="xpipe", search_space="full")
    with pytest.raises(planner.IncompatibleInputsError, match="refine: value False"):
        planner.plan(BERT, "1x4-nvlink", 32, schedule="xpipe", refine=False)
    # A hand-edited asynchronous plan with another schedule's depths is refused by name.
    d = planner.Plan.load(gpipe_plan).core.to_dict()
    d["schedule"]["kind"] = "xpipe"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(d))
    r = dapple("simulate", "--plan", bad, "--profile", BERT)
    assert_one_line_error(r, 3, str(bad), "stages[0].warmup_micro_batches", "xpipe runs one micro-batch ahead")


# ----------------------------------------------------------------------------
# The runtime: dapple run --schedule

torch = pytest.importorskip("torch")

from dapple.planner.runtime.launcher import run_plan  # noqa: E402
from dapple.planner.runtime.prediction import PREDICTORS, AdamPrediction, MomentumPrediction  # noqa: E402
from dapple.planner.runtime.reference import train_single_process  # noqa: E402
from test_runtime import FAST, layout_plan, make_batches, max_diff, mse, tiny_layers  # noqa: E402

STEPS = 6
THREE_STAGES = [(0, 1, [0]), (1, 3, [1]), (3, 5, [2])]


def optimizer_for(kind):
    return "momentum" if planner._core.SCHEDULE_PREDICTORS.get(kind) == "momentum" else "sgd"


def test_predictors_are_the_cores_and_the_optimizer_tables():
    from dapple.planner.runtime.optimizers import PREDICTS_FOR

    assert set(PREDICTORS) == set(PREDICTS_FOR) == set(planner._core.SCHEDULE_PREDICTORS.values())


def test_adam_prediction_against_a_hand_computation():
    # One parameter w = 1.0, Adam (lr 0.1) after gradients 0.5 then -0.2:
    #   m = 0.9 * (0.1 * 0.5) + 0.1 * -0.2 = 0.025, v = 0.999 * 0.001 * 0.25 + 0.001 * 0.04 = 0.00028975
    #   m_hat = 0.025 / (1 - 0.81) = 0.131578947, v_hat = 0.00028975 / (1 - 0.998001) = 0.144947474
    #   3 updates ahead: w - 3 * 0.1 * m_hat / (sqrt(v_hat) + 1e-8) = w - 0.103679...
    w = torch.nn.Parameter(torch.tensor([1.0], dtype=torch.float64))
    opt = torch.optim.Adam([w], lr=0.1)
    predictor = AdamPrediction([w], opt)
    assert predictor.predict(3)[0].item() == 1.0  # nothing to extrapolate yet
    for g in (0.5, -0.2):
        w.grad = torch.tensor([g], dtype=torch.float64)
        predictor.observe()
        opt.step()
    m_hat, v_hat = 0.025 / 0.19, 0.00028975 / (1 - 0.999**2)
    expected = w.item() - 3 * 0.1 * m_hat / (v_hat**0.5 + 1e-8)
    assert predictor.predict(3)[0].item() == pytest.approx(expected, abs=1e-12)
    assert predictor.predict(0)[0].item() == w.item()
    # With momentum SGD the predictor keeps the same moments itself.
    v = torch.nn.Parameter(torch.tensor([1.0], dtype=torch.float64))
    sgd = torch.optim.SGD([v], lr=0.1, momentum=0.9)
    own = AdamPrediction([v], sgd)
    for g in (0.5, -0.2):
        v.grad = torch.tensor([g], dtype=torch.float64)
        own.observe()
        sgd.step()
    assert own.predict(3)[0].item() == pytest.approx(v.item() - 3 * 0.1 * m_hat / (v_hat**0.5 + 1e-8), abs=1e-12)
    # SpecTrain: the momentum buffer after 0.5 then -0.2 is 0.9 * 0.5 - 0.2 = 0.25.
    spec = MomentumPrediction([v], sgd)
    assert spec.predict(2)[0].item() == pytest.approx(v.item() - 2 * 0.1 * 0.25, abs=1e-12)
    with pytest.raises(ValueError, match="momentum"):
        MomentumPrediction([w], opt)


@pytest.fixture(scope="module")
def batches():
    torch.set_num_threads(1)
    return make_batches(STEPS)


@pytest.mark.parametrize("kind", planner.ASYNCHRONOUS_SCHEDULES)
def test_one_stage_trains_like_one_process(kind, batches):
    # One stage has nothing in flight across an update: every kind is plain training.
    opt = optimizer_for(kind)
    ref = train_single_process(tiny_layers, mse, batches, STEPS, 0.1, optimizer=opt)
    r = run_plan(layout_plan(4, [(0, 5, [0])]), tiny_layers, mse, batches, STEPS, 0.1, schedule=kind,
                 optimizer=opt, **FAST)
    assert max_diff(r.params, ref) < 1e-6
    assert len(r.losses) == STEPS


def test_xpipe_with_learning_rate_zero_is_plain_training(batches):
    ref = train_single_process(tiny_layers, mse, batches, STEPS, 0.0, optimizer="adam")
    sync = run_plan(layout_plan(4, THREE_STAGES), tiny_layers, mse, batches, STEPS, 0.0, optimizer="adam", **FAST)
    r = run_plan(layout_plan(4, THREE_STAGES), tiny_layers, mse, batches, STEPS, 0.0, schedule="xpipe",
                 optimizer="adam", **FAST)
    assert max_diff(r.params, ref) < 1e-6
    assert r.losses == pytest.approx(sync.losses, abs=1e-6)


class Shift(torch.nn.Module):
    """y = x + b: with a loss linear in the output, every gradient is constant."""

    def __init__(self):
        super().__init__()
        self.b = torch.nn.Parameter(torch.zeros(4))

    def forward(self, x):
        return x + self.b


def shifts():
    return [Shift() for _ in range(4)]


def linear_loss(out, target):
    return (out * target).mean()


def test_adam_prediction_is_exact_when_gradients_are_constant():
    # Constant gradients make Adam's bias-corrected moments exact from the
    # first step, so XPipe predicts every version without error once there
    # are moments: each forward sees the weights synchronous training would,
    # and so do the losses. Mini-batch 1's bellwether runs before the first
    # update (4 stages, 4 micro-batches: s = 1, no moments yet) and uses the
    # initial weights. Without prediction (and with stale stashed weights)
    # the losses differ throughout.
    g = torch.Generator().manual_seed(7)
    one = (torch.randn(8, 4, generator=g), torch.randn(8, 4, generator=g))
    data = [one] * STEPS
    stages = [(0, 1, [0]), (1, 2, [1]), (2, 3, [2]), (3, 4, [3])]
    plan = layout_plan(2, stages, gbs=8)
    sync = run_plan(plan, shifts, linear_loss, data, STEPS, 0.05, optimizer="adam", **FAST)
    xpipe = run_plan(plan, shifts, linear_loss, data, STEPS, 0.05, optimizer="adam", schedule="xpipe", **FAST)
    assert xpipe.losses[:1] + xpipe.losses[2:] == pytest.approx(sync.losses[:1] + sync.losses[2:], abs=1e-6)
    assert abs(xpipe.losses[1] - sync.losses[1]) > 1e-3
    for kind in ("pipedream", "async"):
        stale = run_plan(plan, shifts, linear_loss, data, STEPS, 0.05, optimizer="adam", schedule=kind, **FAST)
        assert max(abs(a - b) for a, b in zip(stale.losses, sync.losses)) > 1e-3, kind
    # All kinds take the same (constant) gradients, so the weights agree.
    assert max_diff(xpipe.params, sync.params) < 1e-6


def test_replicated_stages_reduce_each_mini_batch(batches):
    # 2:1 with micro-batch 3 split 2 + 1: the replicas end equal.
    plan = layout_plan(3, [(0, 3, [0, 1]), (3, 5, [2])])
    r = run_plan(plan, tiny_layers, mse, batches, STEPS, 0.1, schedule="pipedream", **FAST)
    assert r.replicas_agree(atol=1e-6) and len(r.losses) == STEPS
    assert r.trace[2][:4] == ["F0", "B0", "F1", "B1"]


def test_a_plan_made_for_an_asynchronous_schedule_trains_with_it(batches):
    from dapple.planner.runtime.schedule import run_schedule

    own = layout_plan(4, THREE_STAGES, kind="xpipe")
    sync = layout_plan(4, THREE_STAGES)
    assert (run_schedule(own.core, None), run_schedule(sync.core, None)) == ("xpipe", None)
    assert run_schedule(own.core, "async") == "async"
    r = run_plan(own, tiny_layers, mse, batches, STEPS, 0.1, **FAST)
    given = run_plan(sync, tiny_layers, mse, batches, STEPS, 0.1, schedule="xpipe", **FAST)
    assert r.metrics[0]["asynchronous"] and max_diff(r.params, given.params) == 0.0


def dropout_layers():
    """tiny_layers with dropout: each forward draws a mask."""
    nn = torch.nn
    return [("fc1", nn.Linear(6, 8)), ("drop", nn.Dropout(0.3)), ("fc2", nn.Linear(8, 8)), ("act", nn.Tanh()),
            ("head", nn.Linear(8, 3))]


def test_without_re_computation_pipedreams_stash_is_exact(batches):
    # PipeDream's backward uses the weights its forward used (the stash), so
    # keeping the forward's graph gives the gradients that re-running the
    # forward (with its dropout masks) gives. Stage 0 holds two linear
    # layers: the second one's input depends on the first one's weights.
    stages = [(0, 3, [0]), (3, 5, [1])]
    runs = {rc: run_plan(layout_plan(4, stages), dropout_layers, mse, batches, STEPS, 0.1,
                         schedule="pipedream", recompute=rc, **FAST)
            for rc in (False, True)}
    assert max_diff(runs[False].params, runs[True].params) < 1e-6
    assert runs[False].losses == pytest.approx(runs[True].losses, abs=1e-6)
    assert runs[False].peak_in_flight[0] == runs[True].peak_in_flight[0] == 2
    # Without a stash, a backward after an update runs on other weights than
    # its forward: the kept activations come from the forward's, the re-run's
    # from the backward's, so the two modes train apart.
    for kind, optimizer in (("async", "sgd"), ("xpipe", "adam")):
        apart = {rc: run_plan(layout_plan(4, stages), dropout_layers, mse, batches, STEPS, 0.1,
                              schedule=kind, optimizer=optimizer, recompute=rc, **FAST)
                 for rc in (False, True)}
        assert max_diff(apart[False].params, apart[True].params) > 1e-6, kind


@pytest.mark.parametrize("kind", planner.ASYNCHRONOUS_SCHEDULES)
def test_a_stage_without_parameters_runs(kind, batches):
    # Stage 1 is a Tanh alone: no weights to stash or predict, no optimizer.
    plan = layout_plan(3, [(0, 1, [0]), (1, 2, [1]), (2, 5, [2])])
    r = run_plan(plan, tiny_layers, mse, batches, STEPS, 0.1, schedule=kind, optimizer=optimizer_for(kind), **FAST)
    assert len(r.losses) == STEPS and all(loss == loss for loss in r.losses)


def test_resume_from_a_checkpoint_equals_the_uninterrupted_run(batches, tmp_path):
    plan = layout_plan(4, THREE_STAGES)
    common = dict(schedule="xpipe", optimizer="momentum", checkpoint_every=3, **FAST)
    full = run_plan(plan, tiny_layers, mse, batches, STEPS, 0.1, checkpoint_dir=str(tmp_path / "a"), **common)
    run_plan(plan, tiny_layers, mse, batches, 3, 0.1, checkpoint_dir=str(tmp_path / "b"), **common)
    saved = torch.load(tmp_path / "b" / "step-3" / "rank-0.pt", weights_only=True)
    assert saved["predictor"]["step"] == 3  # XPipe's own moments travel with the checkpoint
    resumed = run_plan(plan, tiny_layers, mse, batches, STEPS, 0.1, checkpoint_dir=str(tmp_path / "b"),
                       start_step=3, **common)
    assert max_diff(resumed.params, full.params) < 1e-6
    assert resumed.losses == pytest.approx(full.losses[3:], abs=1e-6)


def test_spectrain_without_momentum_is_refused(dapple, tmp_path):
    path = tmp_path / "plan.json"
    layout_plan(4, THREE_STAGES).save(path)
    r = dapple("run", "--plan", path, "--model", "dapple.planner.runtime.models:gpt", "--steps", 2,
               "--schedule", "spectrain", "--optimizer", "adam")
    assert_one_line_error(r, 4, "--optimizer", "'adam'", "spectrain")


# ----------------------------------------------------------------------------
# Learning curves: a model that declares a data set, --eval-every, --curves


def digits_factory():
    from dapple.planner.runtime import models

    return models.load_model("dapple.planner.runtime.models:digits")


def test_the_digits_model_declares_its_split():
    spec = digits_factory()
    x_val, y_val = spec.validation()
    assert (spec.train_size, len(y_val), x_val.shape[1]) == (1438, 359, 64)
    assert spec.classifies and len(spec.layers) == 4 and float(x_val.max()) <= 1.0
    x, y = spec.make_batch(32, torch.Generator().manual_seed(0))
    assert x.shape == (32, 64) and set(y.tolist()) <= set(range(10))
    # the split is fixed: the same digits whatever the seed of the model
    from dapple.planner.runtime import models

    assert torch.equal(models.digits(seed=3).validation()[0], x_val)


@pytest.mark.parametrize("schedule", [None, "xpipe"])
def test_evaluations_score_the_model_trained_so_far(schedule):
    from dapple.planner.runtime.data import SeededBatches
    from dapple.planner.runtime.training import layers_of

    spec = digits_factory()
    plan = layout_plan(8, [(0, 2, [0]), (2, 4, [1])], gbs=16)
    batches = SeededBatches(digits_factory, 16, 6, 0)
    r = run_plan(plan, digits_factory, spec.loss, batches, 6, 0.05, optimizer="adam", schedule=schedule,
                 eval_every=3, **FAST)
    evaluations = r.metrics[0]["evaluations"]
    assert [e["step"] for e in evaluations] == [3, 6]
    model = torch.nn.Sequential(*layers_of(digits_factory()))
    model.load_state_dict(r.params)
    x, y = spec.validation()
    with torch.no_grad():
        out = model(x)
    assert evaluations[-1]["loss"] == pytest.approx(float(spec.loss(out, y)), abs=1e-6)
    assert evaluations[-1]["accuracy"] == pytest.approx(float((out.argmax(-1) == y).float().mean()))
    assert evaluations[0]["loss"] != evaluations[1]["loss"]


def test_curves_are_drawn_from_run_metrics(dapple, tmp_path):
    plan = tmp_path / "plan.json"
    layout_plan(8, [(0, 2, [0]), (2, 4, [1])], gbs=16).save(plan)
    model = ["--model", "dapple.planner.runtime.models:digits", "--optimizer", "adam", "--lr", "0.01", "--steps", 4,
             "--eval-every", 2]
    files = []
    for schedule in (None, "xpipe"):
        out = tmp_path / f"{schedule}.json"
        extra = ["--schedule", schedule] if schedule else []
        r = dapple("run", "--plan", plan, *model, *extra, "--metrics", out)
        assert r.returncode == 0, r.stderr
        assert sum(line.startswith("eval after step") for line in r.stderr.splitlines()) == 2
        data = json.loads(out.read_text())
        assert [e["step"] for e in data["evaluations"]] == [2, 4]
        files += ["--metrics", out]
    picture = tmp_path / "curves.png"
    r = dapple("show", *files, "--curves", picture, "--steps-per-epoch", 2)
    assert r.returncode == 0, r.stderr
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # bad requests: one line each, and nothing written
    r = dapple("show", "--curves", tmp_path / "c2.png")
    assert r.returncode == 2 and "--metrics" in r.stderr
    r = dapple("show", *files, "--gantt", tmp_path / "g.png")
    assert r.returncode == 2 and "--plan" in r.stderr
    # Epochs of almost no steps overflowed the axis (fuzz seed 20261141): refused.
    r = dapple("show", *files, "--curves", tmp_path / "c2.png", "--steps-per-epoch", "1e-308")
    assert r.returncode == 2 and "--steps-per-epoch" in r.stderr and "1e-308" in r.stderr
    bare = json.loads((tmp_path / "None.json").read_text())
    del bare["evaluations"]
    (tmp_path / "bare.json").write_text(json.dumps(bare))
    r = dapple("show", "--metrics", tmp_path / "bare.json", "--curves", tmp_path / "c3.png")
    assert_one_line_error(r, 3, "no evaluations", "--eval-every")
    assert not (tmp_path / "c2.png").exists() and not (tmp_path / "c3.png").exists()
    # A plan that names no profile: the diagram's note comes after success,
    # never before the one line of a failure.
    unnamed = json.loads(plan.read_text())
    unnamed["inputs"].pop("profile_path", None)
    (tmp_path / "unnamed.json").write_text(json.dumps(unnamed))
    diagram = ["--plan", tmp_path / "unnamed.json", "--diagram", tmp_path / "d.png"]
    r = dapple("show", *diagram, "--metrics", tmp_path / "bare.json", "--curves", tmp_path / "c4.png")
    assert_one_line_error(r, 3, "no evaluations", "--eval-every")
    assert not (tmp_path / "d.png").exists() and not (tmp_path / "c4.png").exists()
    r = dapple("show", *diagram)
    assert r.returncode == 0, r.stderr
    assert r.stderr.splitlines()[-1].startswith("note: the plan's profile is not available")
    r = dapple("run", "--plan", plan, "--model", "dapple.planner.runtime.models:gpt", "--steps", 2, "--eval-every", 1)
    assert_one_line_error(r, 4, "--eval-every", "declares no validation split")


def test_a_run_too_long_to_list_at_once_is_a_limit_error(dapple, tmp_path):
    # 2 stages x 2 micro-batches: one asynchronous list holds at most
    # MAX_PASSES / 4 = 65,536 mini-batches; checkpoints or evaluations cut it.
    plan = tmp_path / "plan.json"
    layout_plan(8, [(0, 2, [0]), (2, 4, [1])], gbs=16).save(plan)
    r = dapple("run", "--plan", plan, "--model", "dapple.planner.runtime.models:digits", "--steps", 70_000,
               "--schedule", "xpipe")
    assert_one_line_error(r, 9, "--steps", "70000 mini-batches", "at most 65536", "--checkpoint-every")
