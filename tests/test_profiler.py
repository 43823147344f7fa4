"""Profiling real PyTorch models: the model factories, the profiler, `dapple profile model`."""

import json
import statistics
import subprocess
import sys
import time

import pytest

torch = pytest.importorskip("torch")

from dapple import planner  # noqa: E402
from conftest import assert_one_line_error  # noqa: E402
from dapple.planner.profiler import profile_model  # noqa: E402
from dapple.planner.runtime.models import ModelSpec, bert, gpt, gpt_moe, load_model, vgg  # noqa: E402

FACTORIES = {"gpt": gpt, "bert": bert, "vgg": vgg, "gpt_moe": gpt_moe}




@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_layer_chain_equals_the_model(name):
    spec = FACTORIES[name]()
    assert isinstance(spec, ModelSpec)
    inputs, targets = spec.make_batch(3, torch.Generator().manual_seed(1))
    chained = spec.forward(inputs)
    torch.testing.assert_close(chained, spec.model(inputs), rtol=0, atol=0)
    loss = spec.loss(chained, targets)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    assert all(p.grad is not None for p in spec.parameters())
    # Same seed, same weights and batch: runs are reproducible.
    again = FACTORIES[name]()
    for p, q in zip(spec.parameters(), again.parameters()):
        assert torch.equal(p, q)
    inputs2, targets2 = again.make_batch(3, torch.Generator().manual_seed(1))
    assert torch.equal(inputs, inputs2) and torch.equal(targets, targets2)
    # Every module the model has is in exactly one layer.
    assert sum(p.numel() for p in spec.parameters()) == sum(p.numel() for p in spec.model.parameters())


def test_gpt_is_causal_and_predicts_next_tokens():
    spec = gpt(n_layers=2)
    inputs, targets = spec.make_batch(2, torch.Generator().manual_seed(0))
    assert inputs.shape == (2, 32) and torch.equal(inputs[:, 1:], targets[:, :-1])
    changed = inputs.clone()
    changed[:, 20] = (changed[:, 20] + 1) % 256
    with torch.no_grad():
        a, b = spec.forward(inputs), spec.forward(changed)
    assert a.shape == (2, 32, 256)
    torch.testing.assert_close(a[:, :20], b[:, :20])
    assert not torch.allclose(a[:, 20:], b[:, 20:])


def test_load_model_names_the_spec_in_errors():
    spec = load_model("dapple.planner.runtime.models:gpt", n_layers=2)
    assert spec.layer_names == ["embedding", "block0", "block1", "lm_head"]
    for bad, needle in [
        ("dapple.planner.runtime.models", "expected package.module:function"),
        ("dapple.planner.runtime.nosuch:gpt", "no module named dapple.planner.runtime.nosuch"),
        ("dapple.planner.runtime.models:nosuch", "has no function nosuch"),
        ("dapple.planner.topology:PRESETS", "is not a function"),
        ("dapple.planner.profiler:cpu_name", "returned str, not a dapple.planner.runtime.models.ModelSpec"),
    ]:
        with pytest.raises(planner.InvalidInputError) as e:
            load_model(bad)
        assert bad in str(e.value) and needle in str(e.value), str(e.value)
    with pytest.raises(planner.InvalidInputError, match="unexpected keyword argument 'depth'"):
        load_model("dapple.planner.runtime.models:gpt", depth=3)


def test_profile_of_gpt_is_valid_and_measures_sizes():
    spec = gpt()
    prof = profile_model(spec, "gpt-test", [2, 1], warmup=1, repeats=3, progress=False)
    assert isinstance(prof, planner.Profile)
    assert prof.model == "gpt-test" and prof.batch_sizes == [1, 2]
    assert prof.data["format"] == "dapple.profile" and prof.data["optimizer"] == "adam"
    assert prof.data["source"].startswith("measured by dapple profile on CPU")
    assert [layer["name"] for layer in prof.layers] == ["embedding", "block0", "block1", "block2", "block3", "lm_head"]
    assert [layer.get("kind") for layer in prof.layers] == [None, "block", "block", "block", "block", None]
    for (name, module), layer in zip(spec.layers, prof.layers):
        assert layer["param_bytes"] == sum(p.numel() * 4 for p in module.parameters()), name
        for m in layer["measurements"]:
            assert m["fwd_ms"] > 0 and m["bwd_ms"] > 0, (name, m)
    for b, m in zip([1, 2], prof.layers[1]["measurements"]):
        assert m["activation_bytes"] == b * 32 * 64 * 4
        # A block keeps far more than its output for backward (attention, MLP hidden).
        assert m["stored_activation_bytes"] > 4 * m["activation_bytes"]
    head = prof.layers[-1]["measurements"]
    assert [m["activation_bytes"] for m in head] == [b * 32 * 256 * 4 for b in (1, 2)]
    # The head is measured with the loss: the cross-entropy keeps its
    # log-probabilities (b x 32 positions x 256 classes, fp32) beside what the
    # head keeps (its input, b x 32 x 64, at least).
    for b, m in zip([1, 2], head):
        assert m["stored_activation_bytes"] >= b * 32 * 256 * 4 + b * 32 * 64 * 4
        # What the loss keeps is also recorded apart: under re-computation
        # it stays outside the checkpoint.
        assert b * 32 * 256 * 4 <= m["loss_stored_bytes"] < m["stored_activation_bytes"]
    # A layer's re-run under a checkpoint is measured for every layer.
    assert all(m["recompute_fwd_ms"] >= 0 for layer in prof.layers for m in layer["measurements"])
    assert all("loss_stored_bytes" not in m for layer in prof.layers[:-1] for m in layer["measurements"])
    # The backward's weight gradient is part of it; the embedding reads
    # token ids, so its whole backward is its weight gradient.
    assert all(0 <= m["bwd_weight_ms"] <= m["bwd_ms"] for layer in prof.layers for m in layer["measurements"])
    assert all(m["bwd_weight_ms"] == m["bwd_ms"] for m in prof.layers[0]["measurements"])
    # The head's backward starts from the loss's gradient of the logits
    # (b x 32 x 256 fp32), which it needs on top of what it holds.
    for b, m in zip([1, 2], head):
        assert m["backward_working_bytes"] >= b * 32 * 256 * 4
    assert prof.data["dtype"] == "fp32" and not any("weight_copy_bytes" in layer for layer in prof.layers)
    assert prof.data["parameter_state"] == {
        "weight_bytes": 4.0, "gradient_bytes": 4.0, "master_weight_bytes": 0.0, "optimizer_bytes": 8.0}
    # Adam's step over every parameter is timed, and a plan of the whole
    # model on one device simulates its forward, backward and that step.
    step_ms = prof.data["optimizer_step_ms"]
    assert step_ms > 0
    # And what the step allocates on top: on the CPU torch's Adam loops over
    # the parameters, each step's temporaries a few copies of one (2 of the
    # largest, measured); on a GPU its foreach form holds about one copy of
    # them all.
    largest = max(p.numel() * 4 for p in spec.parameters())
    assert largest <= prof.data["optimizer_step_bytes"] <= 3 * largest
    one = planner.plan(prof, "1x1", global_batch_size=2, micro_batch_sizes=[2])
    passes = sum(layer["measurements"][1]["fwd_ms"] + layer["measurements"][1]["bwd_ms"] for layer in prof.layers)
    assert one.iteration_ms == pytest.approx(passes + step_ms, rel=1e-6)
    # The profiler leaves the model clean, and planning takes the profile.
    assert all(p.grad is None for p in spec.parameters())
    plan = planner.plan(prof, "1x2-nvlink", global_batch_size=4)
    assert plan.estimate["latency_ms"] > 0
    # Its estimate gives each stage's simulated peak in terms that add up,
    # the running backward's or the optimizer step's working memory among
    # them, at most the cost model's count (gradients held all the time).
    for m, st in zip(plan.estimate["memory"], plan.estimate["stages"]):
        named = m["model_state_bytes"] + m["micro_batches_in_flight"] * m["per_micro_batch_bytes"]
        assert m["peak_bytes"] == pytest.approx(named + m["working_bytes"] + m["other_bytes"])
        assert m["working_bytes"] > 0 and m["peak_bytes"] <= st["memory_bytes"] * (1 + 1e-9)


def _whole_model_ms(spec, batch_size: int, repeats: int) -> float:
    """Median time of the whole model's forward, loss and backward as one
    call, the way a single-stage run does it."""
    inputs, targets = spec.make_batch(batch_size, torch.Generator().manual_seed(batch_size))
    times = []
    for _ in range(repeats + 2):
        start = time.perf_counter()
        spec.loss(spec.forward(inputs), targets).backward()
        times.append((time.perf_counter() - start) * 1000.0)
        for p in spec.parameters():
            p.grad = None
    return statistics.median(times[2:])


def test_layer_times_add_up_to_the_whole_model_at_batch_1():
    # Layers are timed inside whole passes, so their sum has no per-layer
    # floor: close to the whole model timed as one call. Seven rounds, each
    # timing the whole model just before and just after the profile and
    # comparing the profile's sum with the mean of the two, and the median
    # round's ratio compared: a round's sides share the machine's load, and
    # the median drops the rounds a burst of load hit on one side only. The
    # bounds, 0.8-1.25, are this shared 2-core machine's noise at these
    # 7 ms passes, not the profiler's error (CI, stop 51: single rounds
    # 0.80-1.29 with the whole timed after the profile only, their median
    # 1.105); a layer or a pass counted twice or left out, which this test
    # is for, moves the ratio by half or more.
    spec = gpt(n_layers=2, d_model=128, seq=64)
    ratios = []
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(7):
            before = _whole_model_ms(spec, 1, 9)
            prof = profile_model(spec, "gpt", [1], warmup=2, repeats=9, progress=False)
            after = _whole_model_ms(spec, 1, 9)
            layer_sum = sum(m["fwd_ms"] + m["bwd_ms"] for layer in prof.layers for m in layer["measurements"])
            ratios.append(layer_sum / ((before + after) / 2))
    finally:
        torch.set_num_threads(old)
    assert 0.8 <= statistics.median(ratios) <= 1.25, ratios


def test_bf16_profile_records_autocast_weight_copies():
    prof = profile_model(gpt(n_layers=1), "gpt", [1, 2], warmup=0, repeats=1, progress=False, dtype="bf16")
    assert prof.data["dtype"] == "bf16"
    assert "bf16" in prof.data["source"]
    # The block's four matrices (64x192, 64x64, 64x256, 256x64: 49,152
    # weights) and the head's (64x256) cast to bf16, 2 bytes each, kept for
    # the backward; LayerNorms and the embedding are not cast.
    copies = {layer["name"]: layer.get("weight_copy_bytes") for layer in prof.layers}
    assert copies == {"embedding": None, "block0": 49_152 * 2, "lm_head": 64 * 256 * 2}
    # Autocast keeps activations in bf16: the block's stored bytes are below fp32's.
    fp32 = profile_model(gpt(n_layers=1), "gpt", [2], warmup=0, repeats=1, progress=False)
    assert prof.layers[1]["measurements"][1]["stored_activation_bytes"] < fp32.layers[1]["measurements"][0][
        "stored_activation_bytes"]
    # Planning takes it, weight copies counted per micro-batch in flight.
    plan = planner.plan(prof, "1x1", global_batch_size=2)
    assert plan.estimate["latency_ms"] > 0
    with pytest.raises(planner.InvalidInputError, match="--dtype fp8: not a number format"):
        profile_model(gpt(n_layers=1), "gpt", [1], progress=False, dtype="fp8")


@pytest.mark.parametrize("name", ["bert", "vgg"])
def test_profile_of_bert_and_vgg(name):
    prof = profile_model(FACTORIES[name](), name, [1], warmup=0, repeats=1, progress=False)
    blocks = [layer for layer in prof.layers if layer.get("kind") == "block"]
    assert len(blocks) >= 3
    assert all(m["stored_activation_bytes"] > 0 for layer in prof.layers for m in layer["measurements"])


def test_cli_profile_then_plan(dapple, tmp_path):
    out = tmp_path / "gpt.json"
    r = dapple("profile", "model", "--model", "dapple.planner.runtime.models:gpt", "--model-arg", "n_layers=2",
               "--batch-sizes", "1,2", "--repeats", "2", "--warmup", "1", "--out", out)
    assert r.returncode == 0, r.stderr
    assert "4 layers (2 blocks)" in r.stderr
    data = json.loads(out.read_text())
    assert data["model"] == "gpt-2x64" and [m["batch_size"] for m in data["layers"][0]["measurements"]] == [1, 2]
    r = dapple("plan", "--profile", out, "--topology", "1x2-nvlink", "--global-batch-size", "8")
    assert r.returncode == 0, r.stderr
    assert "gpt-2x64 on 1x2-nvlink" in r.stdout
    assert "peak memory per GPU, GiB" in r.stdout and "working" in r.stdout


def test_cli_bad_model_spec_is_one_line(dapple, tmp_path):
    out = tmp_path / "p.json"
    r = dapple("profile", "model", "--model", "dapple.planner.runtime.models:nosuch", "--batch-sizes", "1", "--out", out)
    assert_one_line_error(r, 3, "dapple.planner.runtime.models:nosuch", "no function nosuch")
    r = dapple("profile", "model", "--model", "no_such_package.models:gpt", "--batch-sizes", "1", "--out", out)
    assert_one_line_error(r, 3, "no_such_package.models:gpt", "no module named no_such_package")
    assert not out.exists()


def test_cli_bad_batch_sizes_is_a_usage_error(dapple, tmp_path):
    r = dapple("profile", "model", "--model", "dapple.planner.runtime.models:gpt", "--batch-sizes", "1,two",
               "--out", tmp_path / "p.json")
    assert r.returncode == 2
    assert "'1,two'" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cli_cuda_without_cuda_is_one_line(dapple, tmp_path):
    r = dapple("profile", "model", "--model", "dapple.planner.runtime.models:gpt", "--batch-sizes", "1",
               "--device", "cuda", "--out", tmp_path / "p.json")
    assert_one_line_error(r, 3, "--device cuda", "CUDA is not available")


def test_hf_gpt2_when_transformers_is_installed():
    pytest.importorskip("transformers")
    spec = load_model("dapple.planner.runtime.models:hf_gpt2", n_layers=2)
    assert spec.layer_names == ["embedding", "block0", "block1", "lm_head"]
    inputs, _ = spec.make_batch(2, torch.Generator().manual_seed(0))
    changed = inputs.clone()
    changed[:, 20] = (changed[:, 20] + 1) % 256
    with torch.no_grad():
        a, b = spec.forward(inputs), spec.forward(changed)
    torch.testing.assert_close(a[:, :20], b[:, :20])  # causal
    prof = profile_model(spec, "hf", [1], warmup=0, repeats=1, progress=False)
    assert prof.layers[1]["measurements"][0]["activation_bytes"] == 32 * 64 * 4


def test_planning_and_the_runtime_package_do_not_import_torch():
    code = "import sys, dapple.planner, dapple.planner.runtime, dapple.planner.profiler; assert 'torch' not in sys.modules, 'torch imported'"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
