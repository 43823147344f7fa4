"""The CPU runtime: schedules as action lists, and plans run on gloo processes
train exactly like one process does."""

import time

import pytest

from dapple.planner.runtime import schedule as sch

# ----------------------------------------------------------------------------
# Schedules against literal tables (no torch needed)


def table(text):
    return [
        [(t[0], int(t[1:])) for t in line.split(":", 1)[1].split()]
        for line in text.strip().splitlines()
    ]


def test_early_backward_two_stages():
    assert sch.early_backward(2, 4, [2, 1]) == table(
        """
        stage 0: F0 F1 B0 F2 B1 F3 B2 B3
        stage 1: F0 B0 F1 B1 F2 B2 F3 B3
        """
    )


def layout_plan(mbs, stages, kind="early-backward-1f1b", policy="A", depths=None, gbs=None, slices=None):
    """A validated plan (the core checks it as it would a file) on 8
    devices; stages are (layer_start, layer_end, devices); K_i by ``policy``
    (M for gpipe) unless ``depths`` gives them (policy auto); ``slices``:
    each stage's own slices (None for the even split)."""
    from dapple import planner

    m = (gbs or GBS) // mbs
    s = len(stages)
    fixed = {"A": lambda i: min(s - i, m), "B": lambda i: min(2 * (s - i) - 1, m)}
    depth = (lambda i: m) if kind == "gpipe" else (lambda i: depths[i]) if depths else fixed[policy]
    return planner.Plan.from_dict({
        "planner_version": "test",
        "inputs": {
            "model": "tiny",
            "profile_sha256": "",
            "topology": planner.Topology.from_spec("1x8-pcie").data,
            "global_batch_size": mbs * m,
            "options": {"min_micro_batch_size": 1},
        },
        "micro_batch_size": mbs,
        "micro_batches": m,
        "schedule": {"kind": kind, "warmup_policy": "auto" if depths else policy},
        "stages": [
            {"layer_start": a, "layer_end": b, "devices": devs, "warmup_micro_batches": depth(i),
             **({"slices": slices[i]} if slices and slices[i] else {})}
            for i, (a, b, devs) in enumerate(stages)
        ],
    })


def test_early_backward_three_stages_policy_b():
    # policy B: K = min(2(S-i)-1, M) = [5->4, 3, 1]
    plan = layout_plan(3, [(0, 1, [0]), (1, 2, [1]), (2, 3, [2])], policy="B")
    assert sch.plan_schedule(plan.core) == table(
        """
        stage 0: F0 F1 F2 F3 B0 B1 B2 B3
        stage 1: F0 F1 F2 B0 F3 B1 B2 B3
        stage 2: F0 B0 F1 B1 F2 B2 F3 B3
        """
    )


def test_gpipe_table():
    assert sch.gpipe(2, 3) == table(
        """
        stage 0: F0 F1 F2 B2 B1 B0
        stage 1: F0 F1 F2 B2 B1 B0
        """
    )
    assert sch.plan_schedule(layout_plan(4, [(0, 1, [0]), (1, 2, [1])], kind="gpipe").core) == sch.gpipe(2, 3)


def test_plan_warmup_from_stages_and_format():
    plan = layout_plan(4, [(0, 1, [0]), (1, 2, [1]), (2, 3, [2])])
    assert sch.format_schedule(sch.plan_schedule(plan.core)) == (
        "stage 0: F0 F1 F2 B0 B1 B2\n"
        "stage 1: F0 F1 B0 F2 B1 B2\n"
        "stage 2: F0 B0 F1 B1 F2 B2"
    )


def test_bad_schedules_rejected():
    from dapple import planner

    with pytest.raises(ValueError, match="deadlock"):
        sch.early_backward(2, 4, [1, 2])  # later stage deeper than earlier, < M
    with pytest.raises(ValueError, match="warm-up depth"):
        sch.early_backward(2, 4, [5, 1])
    with pytest.raises(planner.InvalidInputError, match="schedule.kind.*not a schedule"):
        layout_plan(4, [(0, 1, [0])], kind="zigzag")
    # An asynchronous plan warms up one micro-batch per stage from here,
    # whatever M: policy B's depths are not its own.
    with pytest.raises(planner.InvalidInputError, match="warmup_micro_batches.*xpipe runs one micro-batch ahead"):
        Layout.of(layout_plan(2, [(0, 1, [0]), (1, 5, [1])], kind="xpipe", policy="B"))


# ----------------------------------------------------------------------------
# Executor equivalence

torch = pytest.importorskip("torch")

from dapple.planner.runtime.launcher import run_plan  # noqa: E402
from dapple.planner.runtime.layout import Layout  # noqa: E402
from dapple.planner.runtime.reference import train_single_process  # noqa: E402
from dapple.planner.runtime.training import build_layers, prefixed_state  # noqa: E402
from conftest import max_diff  # noqa: E402

LR = 0.1
STEPS = 5
GBS = 12
# fork: no torch import per worker (~0.3 s a run instead of ~10 s on 2 cores);
# test_spawn_start_method covers the default, spawn.
FAST = {"start_method": "fork"}


def tiny_layers():
    """5 layers (3 with parameters), deterministic under torch.manual_seed."""
    nn = torch.nn
    return [
        ("fc1", nn.Linear(6, 8)),
        ("act1", nn.Tanh()),
        ("fc2", nn.Linear(8, 8)),
        ("act2", nn.Tanh()),
        ("head", nn.Linear(8, 3)),
    ]


def deep_layers():
    """9 layers (5 with parameters): enough for 4 ranks of 2 chunks."""
    nn = torch.nn
    layers = []
    for i in range(4):
        layers += [(f"fc{i}", nn.Linear(6 if i == 0 else 8, 8)), (f"act{i}", nn.Tanh())]
    return layers + [("head", nn.Linear(8, 3))]


def deep_profile():
    """A profile of ``deep_layers``' names, every layer alike: chunked
    plans are cut from it."""
    from dapple import planner

    return planner.Profile.from_dict({"model": "tiny", "layers": [
        {"name": name, "param_bytes": 1000,
         "measurements": [{"batch_size": 1, "fwd_ms": 1.0, "bwd_ms": 2.0, "activation_bytes": 100}]}
        for name, _ in deep_layers()]})


def mse(out, target):
    return torch.nn.functional.mse_loss(out, target)


def make_batches(steps=STEPS, gbs=GBS):
    g = torch.Generator().manual_seed(1234)
    return [(torch.randn(gbs, 6, generator=g), torch.randn(gbs, 3, generator=g)) for _ in range(steps)]


def plan(mbs, stages, kind="early-backward-1f1b"):
    return layout_plan(mbs, stages, kind)


CASES = {
    # straight pipelines
    "straight-2": plan(4, [(0, 2, [0]), (2, 5, [1])]),
    "straight-3": plan(4, [(0, 1, [0]), (1, 3, [1]), (3, 5, [2])]),
    # 2:1, micro-batch 3 -> slices 2,1; device ids out of order and sparse
    "2:1": plan(3, [(0, 3, [5, 2]), (3, 5, [7])]),
    # 1:2, slices 2,1 on the second stage
    "1:2": plan(3, [(0, 4, [0]), (4, 5, [1, 2])]),
    # pure data parallelism on 3 processes, micro-batch 4 -> slices 2,1,1
    "dp-3": plan(4, [(0, 5, [0, 1, 2])]),
    # GPipe order, 2:1 replication
    "gpipe-2:1": plan(3, [(0, 2, [0, 1]), (2, 5, [2])], kind="gpipe"),
    # uneven slices (Whale's balancing on mixed GPUs): data parallelism 1+1+2,
    # and 2:1 with the first stage split 3+1 while the second takes all 4
    "dp-3-uneven": layout_plan(4, [(0, 5, [0, 1, 2])], slices=[[1, 1, 2]]),
    "2:1-uneven": layout_plan(4, [(0, 3, [0, 1]), (3, 5, [2])], slices=[[3, 1], None]),
    # searched warm-up depths (policy auto), deeper than policy B and not 1 at the end
    "auto-K-1:1:1": layout_plan(2, [(0, 1, [0]), (1, 3, [1]), (3, 5, [2])], depths=[5, 2, 2]),
}


@pytest.fixture(scope="module")
def batches():
    return make_batches()


@pytest.fixture(scope="module")
def reference(batches):
    torch.set_num_threads(1)
    return train_single_process(tiny_layers, mse, batches, STEPS, LR)


def test_layout_as_the_core_gives_it():
    # micro-batch 3 over devices [5, 2] then [7]: ranks by ascending device
    # id, slices larger first, each sender sending what the receiver needs.
    lay = Layout.of(CASES["2:1"])
    assert lay.devices == (2, 5, 7)
    assert lay.stage_ranks == [[1, 0], [2]]
    assert lay.where(1) == (0, 0) and lay.where(0) == (0, 1) and lay.where(2) == (1, 0)
    assert [(r.start, r.end) for r in lay.stages[0].replicas] == [(0, 2), (2, 3)]
    assert [(p.rank, p.start, p.end) for p in lay.replica(2).receives_from] == [(1, 0, 2), (0, 2, 3)]


def test_reference_really_trains(batches, reference):
    init = prefixed_state(build_layers(tiny_layers, 0), 0)
    assert max_diff(init, reference) > 1e-2


@pytest.mark.parametrize("name", list(CASES))
def test_plan_matches_single_process(name, batches, reference):
    p = CASES[name]
    t0 = time.time()
    res = run_plan(p, tiny_layers, mse, batches, STEPS, LR, world_size=Layout.of(p).world_size, **FAST)
    print(f"{name}: {time.time() - t0:.1f}s")
    assert max_diff(res.params, reference) < 1e-5
    assert res.replicas_agree(atol=1e-6)
    # Each rank ran its stage's schedule, in order, and held no more
    # micro-batches than it allows (K_i for early-backward, M for GPipe).
    lay = Layout.of(p)
    for rank, (stage, _) in res.stage_of_rank.items():
        expected = [f"{k}{m}" for k, m in lay.schedule[stage]]
        expected += ["AR"] if len(lay.stage_ranks[stage]) > 1 else []
        assert res.trace[rank] == expected + ["OPT"]
        assert res.peak_in_flight[rank] == p.stages[stage]["warmup_micro_batches"]


def test_many_to_many_2_to_3():
    # mbs 5: stage 0 slices [0,3) [3,5); stage 1 slices [0,2) [2,4) [4,5):
    # the middle replica of stage 1 receives from both senders.
    gbs = 10
    p = layout_plan(5, [(0, 2, [0, 1]), (2, 5, [2, 3, 4])], gbs=gbs)
    b = make_batches(3, gbs)
    ref = train_single_process(tiny_layers, mse, b, 3, LR)
    res = run_plan(p, tiny_layers, mse, b, 3, LR, **FAST)
    assert max_diff(res.params, ref) < 1e-5


def test_adam_matches_single_process(batches):
    p = CASES["1:2"]
    ref = train_single_process(tiny_layers, mse, batches, 3, 0.01, optimizer="adam")
    res = run_plan(p, tiny_layers, mse, batches, 3, 0.01, optimizer="adam", **FAST)
    assert max_diff(res.params, ref) < 1e-5


def test_without_allreduce_replicas_diverge(batches, reference):
    res = run_plan(CASES["dp-3"], tiny_layers, mse, batches, STEPS, LR, skip_allreduce=True, **FAST)
    assert max_diff(res.params, reference) > 1e-3
    assert not res.replicas_agree(atol=1e-6)


def test_a_slowed_rank_trains_the_same(batches, reference):
    # The experiment hook (docs/heterogeneous.md) only adds time.
    res = run_plan(CASES["dp-3-uneven"], tiny_layers, mse, batches, STEPS, LR, slowdown={2: 3.0}, **FAST)
    assert max_diff(res.params, reference) < 1e-5


def test_world_size_mismatch_rejected(batches):
    with pytest.raises(ValueError, match="world_size"):
        run_plan(CASES["straight-2"], tiny_layers, mse, batches, 1, LR, world_size=3)


def test_spawn_start_method(batches, reference):
    # The default start method, as with torch.multiprocessing.spawn.
    res = run_plan(CASES["straight-2"], tiny_layers, mse, batches, STEPS, LR)
    assert max_diff(res.params, reference) < 1e-5


@pytest.mark.parametrize("factory_name", ["gpt", "hf_gpt2"])
def test_language_model_spec_2_to_1(factory_name):
    # A ModelSpec from dapple.planner.runtime.models: token-id inputs, a transformer
    # block per layer, cross-entropy over tokens. hf_gpt2 is a HuggingFace
    # GPT-2 built from its config (random weights, no hub access), cut into
    # embedding / blocks / head the same way.
    import functools

    if factory_name == "hf_gpt2":
        pytest.importorskip("transformers")
    models = pytest.importorskip("dapple.planner.runtime.models")
    factory = functools.partial(getattr(models, factory_name), n_layers=2, d_model=32, n_heads=4, seq=8, vocab=64)
    spec = factory()
    g = torch.Generator().manual_seed(0)
    b = [spec.make_batch(GBS, g) for _ in range(3)]
    n = len(spec.layers)
    p = plan(3, [(0, 2, [0, 1]), (2, n, [2])])
    ref = train_single_process(factory, spec.loss, b, 3, LR)
    res = run_plan(p, factory, spec.loss, b, 3, LR, **FAST)
    assert max_diff(res.params, ref) < 1e-5


@pytest.mark.parametrize("name", ["straight-3", "gpipe-2:1"])
def test_recompute_matches_single_process(name, batches, reference):
    res = run_plan(CASES[name], tiny_layers, mse, batches, STEPS, LR, recompute=True, **FAST)
    assert max_diff(res.params, reference) < 1e-5
    assert res.replicas_agree(atol=1e-6)


def test_recompute_lowers_measured_peak_memory():
    """GPipe order keeps all 4 micro-batches' activations on stage 0 until
    the backwards begin; with re-computation only the stage inputs are kept.
    Measured as the process's peak resident set over the training iterations
    (memory.PeakMemory), with freed memory returned to the system at once."""
    import functools

    models = pytest.importorskip("dapple.planner.runtime.models")
    from dapple.planner.runtime import memory

    import platform

    # (checked without calling mallopt here: the workers do, not pytest)
    if memory.PeakMemory().source != "rss-since-reset" or platform.libc_ver()[0] != "glibc":
        pytest.skip("needs Linux's resettable VmHWM and glibc")
    factory = functools.partial(models.gpt, n_layers=4, d_model=128, n_heads=4, seq=128, vocab=256)
    spec = factory()
    mbs, m = 8, 4
    g = torch.Generator().manual_seed(0)
    b = [spec.make_batch(mbs * m, g) for _ in range(2)]
    p = layout_plan(mbs, [(0, 3, [0]), (3, 6, [1])], kind="gpipe", gbs=mbs * m)
    # Spawned, not forked: a forked worker inherits this process's heap, and
    # where an earlier test left freed blocks in it (profiling a larger model
    # keeps them, memory.keep_freed_memory) the run reuses pages already
    # counted before its peak was reset.
    runs = {rc: run_plan(p, factory, spec.loss, b, 2, LR, recompute=rc, exact_memory=True, start_method="spawn")
            for rc in (False, True)}
    assert max_diff(runs[False].params, runs[True].params) < 1e-6

    def training_peak(rc, rank):
        mt = runs[rc].metrics[rank]
        assert mt["memory_source"] == "rss-since-reset"
        return mt["peak_memory_bytes"] - mt["memory_before_bytes"]

    # Stage 0 holds 4 micro-batches x 2 blocks of activations without
    # re-computation (about 90 MiB measured), 4 inputs plus one micro-batch's
    # re-run with it (about 48 MiB).
    plain, rc = training_peak(False, 0), training_peak(True, 0)
    assert plain > 40 * 2**20, plain
    assert rc < 0.75 * plain, (rc, plain)
