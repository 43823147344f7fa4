"""`dapple run --dtype`: the forwards and the loss under torch.autocast on
every schedule the runtime runs, fp16 with one loss scale all ranks agree
on; and the CUDA event timer's bookkeeping, with a fake event class.

Why the tolerances hold: a plan cuts the model between layers and sends
each activation across in the dtype autocast produced, so a pipeline
computes every micro-batch with the very operations of one process
accumulating the same micro-batches in order (``train_single_process(...,
micro_batches=M)``): equal to fp32's summation-order noise (1e-6). Where a
replica, a shard or a whole-batch loop computes a matrix product at another
shape, autocast rounds its output to bf16 (2^-9 relative) or fp16 (2^-12)
at other places; those runs are held to bounds a few times the differences
measured, and each test also checks that the bound is tighter than what a
run without the mixed precision (or without the agreement it tests) gives.
"""

import pytest

torch = pytest.importorskip("torch")

from dapple import planner  # noqa: E402
from dapple.planner.runtime.launcher import run_plan  # noqa: E402
from dapple.planner.runtime.reference import train_single_process  # noqa: E402
from dapple.planner.runtime.timing import EventTimer  # noqa: E402
from test_runtime import FAST, layout_plan, make_batches, max_diff, mse, tiny_layers  # noqa: E402

LR = 0.1
STEPS = 5
GBS = 12


@pytest.fixture(scope="module")
def batches():
    torch.set_num_threads(1)
    return make_batches(STEPS, GBS)


def run(plan, batches, **options):
    return run_plan(plan, tiny_layers, mse, batches, STEPS, LR, **FAST, **options)


def reference(batches, dtype, micro_batches, layers=tiny_layers, **options):
    losses = []
    state = train_single_process(layers, mse, batches, STEPS, LR, dtype=dtype, micro_batches=micro_batches,
                                 losses=losses, **options)
    return state, losses


STRAIGHT_3 = layout_plan(4, [(0, 1, [0]), (1, 3, [1]), (3, 5, [2])])  # 3 micro-batches of 4


@pytest.mark.parametrize("kind", ["early-backward-1f1b", "gpipe"])
def test_a_bf16_pipeline_computes_as_one_process_under_the_same_autocast(batches, kind):
    p = layout_plan(4, [(0, 1, [0]), (1, 3, [1]), (3, 5, [2])], kind=kind)
    res = run(p, batches, dtype="bf16")
    ref, ref_losses = reference(batches, "bf16", p.micro_batches)
    assert max_diff(res.params, ref) < 1e-6
    assert res.losses == pytest.approx(ref_losses, abs=1e-6)
    # It ran in bf16: fp32's losses differ by far more than the bound.
    _, fp32_losses = reference(batches, "fp32", p.micro_batches)
    assert max(abs(a - b) for a, b in zip(res.losses, fp32_losses)) > 1e-4


@pytest.mark.parametrize("plan_of", [
    lambda: STRAIGHT_3,
    lambda: layout_plan(3, [(0, 2, [0, 1]), (2, 5, [2])], kind="gpipe"),  # 2:1, GPipe
])
def test_recompute_reruns_the_forward_under_its_autocast(batches, plan_of):
    # torch.utils.checkpoint (non-reentrant) records the autocast state and
    # re-runs the stage under it: the gradients are those of the plain run.
    p = plan_of()
    plain = run(p, batches, dtype="bf16")
    rc = run(p, batches, dtype="bf16", recompute=True)
    assert max_diff(plain.params, rc.params) < 1e-6
    assert rc.replicas_agree(atol=1e-6)


def test_bf16_replicas_stay_together(batches):
    # 2:1 with micro-batch 3: stage 0's replicas compute slices of 2 and 1,
    # whose products autocast rounds apart from the micro-batch's (measured
    # 2e-5 here); their AllReduce keeps the replicas equal.
    p = layout_plan(3, [(0, 3, [5, 2]), (3, 5, [7])])
    res = run(p, batches, dtype="bf16")
    ref, _ = reference(batches, "bf16", p.micro_batches)
    assert max_diff(res.params, ref) < 2e-4
    assert res.replicas_agree(atol=1e-6)


@pytest.mark.parametrize("kind", planner.ASYNCHRONOUS_SCHEDULES)
def test_an_asynchronous_backward_replays_the_forward_under_its_autocast(kind, batches):
    # One stage has nothing in flight across an update: each kind is plain
    # training, its backward a re-run of the forward (compute.Replayed).
    # Re-run without autocast it would differentiate another function.
    opt = "momentum" if planner._core.SCHEDULE_PREDICTORS.get(kind) == "momentum" else "sgd"
    p = layout_plan(4, [(0, 5, [0])])
    res = run(p, batches, dtype="bf16", schedule=kind, optimizer=opt)
    ref, ref_losses = reference(batches, "bf16", p.micro_batches, optimizer=opt)
    assert max_diff(res.params, ref) < 1e-6
    assert res.losses == pytest.approx(ref_losses, abs=1e-6)


def test_bf16_activations_cross_asynchronous_stages(batches):
    # XPipe at learning rate 0 computes what the synchronous run computes:
    # the stages' bf16 activations and their gradients cross as sent.
    p = layout_plan(4, [(0, 1, [0]), (1, 3, [1]), (3, 5, [2])])
    sync = run_plan(p, tiny_layers, mse, batches, STEPS, 0.0, optimizer="adam", dtype="bf16", **FAST)
    xpipe = run_plan(p, tiny_layers, mse, batches, STEPS, 0.0, optimizer="adam", dtype="bf16", schedule="xpipe",
                     **FAST)
    assert xpipe.losses == pytest.approx(sync.losses, abs=1e-6)


class _Boost(torch.autograd.Function):
    """Identity forward; the backward multiplies the gradient by ``times``."""

    @staticmethod
    def forward(ctx, x, times):
        ctx.times = times
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g * ctx.times, None


class GradBoost(torch.nn.Module):
    def __init__(self, times: float = 30.0):
        super().__init__()
        self.times = times

    def forward(self, x):
        return _Boost.apply(x, self.times)


def boosted_layers():
    """tiny_layers with stage 0's gradients 30 times larger: at fp16's first
    loss scales they overflow on stage 0 alone."""
    nn = torch.nn
    return [nn.Linear(6, 8), GradBoost(), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)]


def test_fp16_ranks_skip_overflowing_steps_together(batches):
    # Stage 0's gradients overflow at the first scales, the other stage's do
    # not: every rank skips those steps and lowers the scale together, as
    # one process does. Without the ranks' agreement (each its own
    # GradScaler), stage 0 ends at scale 1024 and the last stage at 65536,
    # 0.56 away from the reference.
    p = layout_plan(3, [(0, 3, [0]), (3, 6, [1])])
    res = run_plan(p, boosted_layers, mse, batches, STEPS, LR, dtype="fp16", **FAST)
    losses, scales = [], []
    ref = train_single_process(boosted_layers, mse, batches, STEPS, LR, dtype="fp16", micro_batches=4,
                               losses=losses, loss_scales=scales)
    assert scales[-1] < 65536.0  # steps were skipped
    assert {m["loss_scale"] for m in res.metrics.values()} == {scales[-1]}
    assert max_diff(res.params, ref) < 1e-6
    assert res.losses == pytest.approx(losses, abs=1e-6)


def test_fp16_resumes_with_its_loss_scale(batches, tmp_path):
    # The checkpoint after step 2 holds the lowered scale: the resumed run
    # skips and steps as the uninterrupted one does.
    p = layout_plan(3, [(0, 3, [0]), (3, 6, [1])])
    common = dict(dtype="fp16", checkpoint_every=2, **FAST)
    full = run_plan(p, boosted_layers, mse, batches, STEPS, LR, checkpoint_dir=str(tmp_path / "a"), **common)
    run_plan(p, boosted_layers, mse, batches, 2, LR, checkpoint_dir=str(tmp_path / "b"), **common)
    saved = torch.load(tmp_path / "b" / "step-2" / "rank-1.pt", weights_only=True)
    assert saved["loss_scaler"]["scale"] < 65536.0
    resumed = run_plan(p, boosted_layers, mse, batches, STEPS, LR, checkpoint_dir=str(tmp_path / "b"),
                       start_step=2, **common)
    assert max_diff(resumed.params, full.params) < 1e-6
    assert resumed.metrics[0]["loss_scale"] == full.metrics[0]["loss_scale"]


def test_fp16_replicas_and_a_stage_without_parameters(batches):
    # Replicas of the last stage, and a first stage of one Tanh (no
    # optimizer: it joins the ranks' inf check all the same). The
    # replicas' slices round apart in fp16 (measured 2e-5).
    layers = lambda: [torch.nn.Tanh(), *boosted_layers()]  # noqa: E731
    p = layout_plan(4, [(0, 1, [0]), (1, 4, [1]), (4, 7, [2, 3])])
    res = run_plan(p, layers, mse, batches, STEPS, LR, dtype="fp16", **FAST)
    scales = []
    ref = train_single_process(layers, mse, batches, STEPS, LR, dtype="fp16", micro_batches=3, loss_scales=scales)
    assert {m["loss_scale"] for m in res.metrics.values()} == {scales[-1]}
    assert max_diff(res.params, ref) < 2e-4
    assert res.replicas_agree(atol=1e-6)


def test_fp16_is_refused_for_an_asynchronous_schedule_on_several_processes(batches):
    with pytest.raises(planner.InvalidInputError, match="dtype 'fp16' with schedule xpipe on 3 processes"):
        run(STRAIGHT_3, batches, dtype="fp16", schedule="xpipe", optimizer="adam")
    with pytest.raises(planner.InvalidInputError, match="dtype 'fp8'"):
        run(STRAIGHT_3, batches, dtype="fp8")


def test_fp16_trains_asynchronously_on_one_process(batches):
    p = layout_plan(4, [(0, 6, [0])])
    res = run_plan(p, boosted_layers, mse, batches, STEPS, LR, dtype="fp16", schedule="pipedream", **FAST)
    ref = train_single_process(boosted_layers, mse, batches, STEPS, LR, dtype="fp16", micro_batches=3)
    assert max_diff(res.params, ref) < 1e-6


# ----------------------------------------------------------------------------
# The CUDA event timer, on a fake event class


class FakeEvent:
    """Records the fake stream's clock; counts waits."""

    clock = 0.0
    waits = 0

    def __init__(self, enable_timing=False):
        assert enable_timing
        self.t = None

    def record(self):
        self.t = FakeEvent.clock

    def synchronize(self):
        FakeEvent.waits += 1

    def elapsed_time(self, end):
        return end.t - self.t


def test_the_event_timer_takes_receive_waits_out_of_its_passes():
    timer = EventTimer(FakeEvent)
    FakeEvent.clock, FakeEvent.waits = 0.0, 0

    def advance(ms):
        FakeEvent.clock += ms

    # a forward of 5 ms with a 2 ms wait for its input inside, a gap of 7 ms
    # outside any pass, then a backward of 4 ms with a 1 ms wait
    f = timer.start()
    r = timer.start()
    advance(2.0)
    timer.stop(r, sign=-1)
    advance(3.0)
    timer.stop(f)
    advance(7.0)
    b = timer.start()
    advance(1.0)
    r = timer.start()
    advance(1.0)
    timer.stop(r, sign=-1)
    advance(2.0)
    timer.stop(b)
    assert timer.seconds() == pytest.approx((5.0 - 2.0 + 4.0 - 1.0) / 1e3)
    assert FakeEvent.waits == 1  # one synchronisation for the whole step
    assert timer.seconds() == 0.0 and FakeEvent.waits == 1  # read once: nothing left, no wait


def test_the_executor_times_with_events_only_on_cuda(monkeypatch):
    from types import SimpleNamespace

    from dapple.planner.runtime import executor as ex

    made = []
    monkeypatch.setattr(ex, "EventTimer", lambda: made.append(1) or "timer")
    job = SimpleNamespace(config=None, layout=SimpleNamespace(micro_batches=1, micro_batch_size=1,
                                                              global_batch_size=1))
    for dev, asked, expected in (("cpu", True, None), ("cuda", False, None), ("cuda", True, "timer")):
        ctx = SimpleNamespace(stage=0, dev=torch.device(dev), comm=SimpleNamespace())
        e = ex.Executor(ctx, job, gpu_timing=asked)
        assert e.gpu_timer == expected and ctx.comm.gpu_timer == expected
    assert len(made) == 1
