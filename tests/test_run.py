"""`dapple run`: a plan trained on local gloo processes, with metrics,
checkpoints that resume exactly, and failures that end the run quickly."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from dapple import planner  # noqa: E402
from conftest import DAPPLE, ROOT  # noqa: E402

MODEL = ["--model", "dapple.planner.runtime.models:gpt", "--model-arg", "n_layers=2", "--model-arg", "d_model=16",
         "--model-arg", "n_heads=2", "--model-arg", "seq=8", "--model-arg", "vocab=32"]
N_LAYERS = 4  # embedding, block0, block1, lm_head


def dapple_cmd(*args):
    """The installed `dapple` command (see conftest.DAPPLE), not the source tree."""
    return [str(DAPPLE), *map(str, args)]


def env(**extra):
    e = dict(os.environ)
    e.update(extra)
    return e


def run(*args, timeout=120, **extra_env):
    t0 = time.monotonic()
    res = subprocess.run(dapple_cmd(*args), capture_output=True, text=True, cwd=ROOT, env=env(**extra_env),
                         timeout=timeout)
    res.elapsed = time.monotonic() - t0
    return res


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A 4-layer profile and a straight 2-stage plan (2 x 4 micro-batches) for it."""
    d = tmp_path_factory.mktemp("run")
    prof = {
        "format": "dapple.profile", "schema_version": 1, "model": "tiny", "optimizer": "sgd",
        "layers": [
            {"name": f"l{i}", "param_bytes": 1000,
             "measurements": [{"batch_size": b, "fwd_ms": 1.0 * b, "bwd_ms": 2.0 * b, "activation_bytes": 1000 * b}
                              for b in (1, 2, 4, 8)]}
            for i in range(N_LAYERS)
        ],
    }
    profile = d / "profile.json"
    profile.write_text(json.dumps(prof))
    p = json.loads(planner.plan(str(profile), "1x2-pcie", global_batch_size=8).text)
    p.pop("estimate", None)
    p["micro_batch_size"], p["micro_batches"] = 2, 4
    p["stages"] = [
        {"layer_start": 0, "layer_end": 2, "devices": [0], "warmup_micro_batches": 2},
        {"layer_start": 2, "layer_end": N_LAYERS, "devices": [1], "warmup_micro_batches": 1},
    ]
    plan = d / "plan.json"
    plan.write_text(planner.Plan.from_json(json.dumps(p)).text)
    return {"plan": plan, "profile": profile}


def one_error_line(stderr):
    lines = [ln for ln in stderr.splitlines() if ln.startswith(("error:", "internal error:"))]
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    return lines[0]


def test_run_prints_steps_and_writes_metrics(files, tmp_path):
    out = tmp_path / "m.json"
    res = run("run", "--plan", files["plan"], *MODEL, "--steps", 3, "--metrics", out, "--profile", files["profile"])
    assert res.returncode == 0, res.stderr
    steps = [ln for ln in res.stderr.splitlines() if ln.startswith("step ")]
    assert [ln.split()[1] for ln in steps] == ["1/3", "2/3", "3/3"]
    assert "final loss" in res.stdout and "simulated" in res.stdout
    assert "Gloo" not in res.stdout  # stdout holds the summary only
    m = json.loads(out.read_text())
    # written by the core's own definition of the format, and read back by it
    assert (m["format"], m["schema_version"], m["dtype"]) == ("dapple.run-metrics", 4, "fp32")
    assert planner.RunMetrics.from_json(out.read_text(), str(out)).steps == 3
    assert len(m["iteration_ms"]) == 3 and all(t > 0 for t in m["iteration_ms"])
    # The first step is left out of the median; the summary quotes it.
    assert m["first_steps_left_out"] == 1
    assert m["median_iteration_ms"] == sum(m["iteration_ms"][1:]) / 2
    assert f"median iteration {m['median_iteration_ms']:.1f} ms over steps 2..3" in res.stdout
    assert len(m["losses"]) == 3 and all(x > 0 for x in m["losses"])
    assert m["estimate_ms"] > 0 and m["simulated_ms"] > 0
    assert set(m["ranks"]) == {"0", "1"}
    for r in m["ranks"].values():
        assert r["peak_memory_bytes"] > 1 << 20
        assert r["compute_ms"] > 0 and r["bubble_ms"] >= 0
        # the phases split every iteration: they add up to its time on rank 0's clock
        assert all(len(v) == 3 for v in r["phase_ms"].values())
        assert sum(r["phase_ms"]["compute"]) == pytest.approx(r["compute_ms"] - sum(
            sum(r["phase_ms"][k]) for k in ("send_wait", "allreduce", "optimizer", "end_sync")), rel=1e-6)
    # the last stage waits for the first one's activations every iteration
    assert m["ranks"]["1"]["bubble_ms"] > 0
    assert m["recompute"] is False


def test_a_chunked_plan_runs_with_the_losses_of_its_layout(files, tmp_path):
    # The 2-stage plan's ranks as ZB-V, two chunks each (a layer a chunk):
    # the same model, data and steps give the same losses.
    chunked = tmp_path / "zbv.json"
    planner.chunked(files["plan"], files["profile"], "zb-v").save(chunked)
    losses = []
    for plan in (files["plan"], chunked):
        out = tmp_path / "m.json"
        res = run("run", "--plan", plan, *MODEL, "--steps", 3, "--metrics", out, "--profile", files["profile"])
        assert res.returncode == 0, res.stderr
        losses.append(json.loads(out.read_text())["losses"])
    assert losses[1] == pytest.approx(losses[0], abs=1e-5)
    assert "as zb-v" not in res.stdout and "simulated" in res.stdout
    # A rank measures its chunks together: no stage's own time to calibrate from.
    res = run("calibrate", "--plan", chunked, "--metrics", out, "--profile", files["profile"],
              "--out", tmp_path / "c.json")
    assert res.returncode == 4 and "measures each rank's chunks together" in one_error_line(res.stderr)
    assert not (tmp_path / "c.json").exists()
    res = run("run", "--plan", chunked, *MODEL, "--steps", 2, "--schedule", "xpipe")
    assert res.returncode == 4 and "xpipe: the plan's ranks hold several stages" in one_error_line(res.stderr)


def test_run_asynchronously(files, tmp_path):
    out = tmp_path / "m.json"
    res = run("run", "--plan", files["plan"], *MODEL, "--steps", 4, "--metrics", out, "--profile", files["profile"],
              "--schedule", "xpipe", "--optimizer", "rmsprop", "--lr", "0.001")
    assert res.returncode == 0, res.stderr
    steps = [ln for ln in res.stderr.splitlines() if ln.startswith("step ")]
    assert [ln.split()[1] for ln in steps] == ["1/4", "2/4", "3/4", "4/4"]
    assert " in fp32, xpipe: final loss" in res.stdout
    m = json.loads(out.read_text())
    # Each backward on its forward's kept activations: no re-computation asked.
    assert (m["schedule"], m["optimizer"], m["recompute"]) == ("xpipe", "rmsprop", False)
    assert len(m["losses"]) == 4 and all(x > 0 for x in m["losses"])
    assert len(m["iteration_ms"]) == 4 and all(t > 0 for t in m["iteration_ms"])
    # the simulated time is the steady state of one mini-batch
    sim = planner.simulate(files["plan"], files["profile"], schedule="xpipe")
    assert m["simulated_ms"] == pytest.approx(sim.iteration_ms)


def test_run_with_recompute(files, tmp_path):
    plain, rc = tmp_path / "plain.json", tmp_path / "rc.json"
    common = ["run", "--plan", files["plan"], *MODEL, "--steps", 2, "--profile", files["profile"], "--exact-memory"]
    for extra, out in (([], plain), (["--recompute"], rc)):
        res = run(*common, *extra, "--metrics", out)
        assert res.returncode == 0, res.stderr
    a, b = json.loads(plain.read_text()), json.loads(rc.read_text())
    assert (a["recompute"], b["recompute"]) == (False, True)
    assert a["losses"] == pytest.approx(b["losses"], abs=1e-6)
    # the simulation of the same plan charges the re-run forwards
    assert b["simulated_ms"] > a["simulated_ms"]
    for r in b["ranks"].values():
        assert r["peak_memory_bytes"] >= r["memory_before_bytes"] > 0


def test_a_bf16_run_has_the_losses_of_one_process_under_the_same_autocast(files, tmp_path):
    # The 2-stage plan (4 micro-batches of 2) against a plain loop over the
    # same batches. Accumulating the same 4 micro-batches, the loop computes
    # the pipeline's very operations: equal within float64's printing
    # (measured 0). Over whole batches of 8, autocast rounds each product to
    # bf16 (2^-9 relative) at other shapes: measured 1.8e-4 on losses near
    # 3.6, held to 1e-3.
    import functools

    from dapple.planner.runtime.data import SeededBatches
    from dapple.planner.runtime.models import gpt
    from dapple.planner.runtime.reference import train_single_process

    out = tmp_path / "m.json"
    res = run("run", "--plan", files["plan"], *MODEL, "--steps", 3, "--dtype", "bf16", "--metrics", out)
    assert res.returncode == 0, res.stderr
    assert "on 2 processes in bf16: final loss" in res.stdout
    m = json.loads(out.read_text())
    assert (m["schema_version"], m["dtype"]) == (4, "bf16")
    factory = functools.partial(gpt, n_layers=2, d_model=16, n_heads=2, seq=8, vocab=32)
    batches = SeededBatches(factory, 8, 3, 0)
    for micro_batches, tolerance in ((4, 1e-6), (1, 1e-3)):
        losses = []
        train_single_process(factory, factory().loss, batches, 3, 0.1, dtype="bf16", micro_batches=micro_batches,
                             losses=losses)
        assert m["losses"] == pytest.approx(losses, abs=tolerance), micro_batches


def test_bad_dtype_is_a_usage_error(files):
    res = run("run", "--plan", files["plan"], *MODEL, "--steps", 1, "--dtype", "fp8")
    assert res.returncode == 2, res.stderr
    line = one_error_line(res.stderr)
    assert "--dtype" in line and "fp8" in line


def test_fp16_with_an_asynchronous_schedule_on_two_processes_is_refused(files):
    res = run("run", "--plan", files["plan"], *MODEL, "--steps", 1, "--dtype", "fp16", "--schedule", "pipedream")
    assert res.returncode == 2, res.stderr
    line = one_error_line(res.stderr)
    assert "--dtype" in line and "'fp16' with schedule pipedream on 2 processes" in line
    assert "step 1/" not in res.stderr  # refused before any process started


def final_states(d, step):
    """Each rank's checkpoint after ``step`` steps, its one stage's ``model`` lifted to the top."""
    saved = {r: torch.load(d / f"step-{step}" / f"rank-{r}.pt", weights_only=True) for r in (0, 1)}
    for held in saved.values():
        (stage,) = held["stages"]
        held["model"] = stage["model"]
    return saved


def test_resume_equals_uninterrupted_run(files, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    common = ["run", "--plan", files["plan"], *MODEL, "--optimizer", "adam", "--lr", "0.01", "--checkpoint-every", 3]
    full = run(*common, "--steps", 6, "--checkpoint-dir", a)
    assert full.returncode == 0, full.stderr
    assert (a / "latest").read_text().strip() == "6"
    first = run(*common, "--steps", 3, "--checkpoint-dir", b)
    assert first.returncode == 0, first.stderr
    assert (b / "latest").read_text().strip() == "3"
    second = run(*common, "--steps", 6, "--checkpoint-dir", b, "--resume")
    assert second.returncode == 0, second.stderr
    assert [ln.split()[1] for ln in second.stderr.splitlines() if ln.startswith("step ")] == ["4/6", "5/6", "6/6"]
    x, y = final_states(a, 6), final_states(b, 6)
    for r in (0, 1):
        assert x[r]["step"] == y[r]["step"] == 6
        assert x[r]["model"].keys() == y[r]["model"].keys()
        for k in x[r]["model"]:
            assert (x[r]["model"][k] - y[r]["model"][k]).abs().max().item() <= 1e-6, (r, k)
    # training moved the weights: the step-3 and step-6 states differ
    s3 = final_states(a, 3)
    assert any((s3[0]["model"][k] - x[0]["model"][k]).abs().max().item() > 1e-4 for k in x[0]["model"])
    # and the run trained like one process on the seeded batches (one a step)
    import functools

    from dapple.planner.runtime import models
    from dapple.planner.runtime.reference import train_single_process

    factory = functools.partial(models.gpt, n_layers=2, d_model=16, n_heads=2, seq=8, vocab=32)
    spec = factory()
    g = torch.Generator().manual_seed(0)
    batches = [spec.make_batch(8, g) for _ in range(6)]
    ref = train_single_process(factory, spec.loss, batches, 6, 0.01, optimizer="adam")
    got = {f"{int(k.split('.', 1)[0]) + first}.{k.split('.', 1)[1]}": v
           for r, first in ((0, 0), (1, 2)) for k, v in x[r]["model"].items()}
    assert got.keys() == ref.keys()
    # (not the attention's in_proj_bias: the key bias gets a zero gradient up
    # to rounding, which Adam scales up to steps of lr in either direction)
    assert max((got[k] - ref[k]).abs().max().item() for k in ref if not k.endswith("in_proj_bias")) < 1e-5
    # the losses of the resumed steps are those of the uninterrupted run
    loss = lambda r: [float(ln.split()[3]) for ln in r.stderr.splitlines() if ln.startswith("step ")]  # noqa: E731
    assert loss(full)[3:] == pytest.approx(loss(second), abs=1e-6)


def torchrun(*args, timeout=180, **extra_env):
    """`dapple run` started by torchrun, one process per rank."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--no-python",
           *dapple_cmd(*args)]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env(**extra_env), timeout=timeout)


def test_torchrun_launch_equals_local_processes(files, tmp_path):
    a, b = tmp_path / "local", tmp_path / "torchrun"
    common = ["run", "--plan", files["plan"], *MODEL, "--optimizer", "adam", "--lr", "0.01", "--steps", 4,
              "--checkpoint-every", 4]
    local = run(*common, "--checkpoint-dir", a)
    assert local.returncode == 0, local.stderr
    launched = torchrun(*common, "--checkpoint-dir", b, "--metrics", tmp_path / "m.json")
    assert launched.returncode == 0, launched.stderr
    # rank 0 alone prints the summary; the step lines went to stderr once
    assert launched.stdout.count("ran steps 1..4 on 2 processes") == 1, launched.stdout
    assert "Gloo" not in launched.stdout
    assert [ln.split()[1] for ln in launched.stderr.splitlines() if ln.startswith("step ")] == ["1/4", "2/4", "3/4", "4/4"]
    assert len(json.loads((tmp_path / "m.json").read_text())["iteration_ms"]) == 4
    x, y = final_states(a, 4), final_states(b, 4)
    for r in (0, 1):
        for k in x[r]["model"]:
            assert (x[r]["model"][k] - y[r]["model"][k]).abs().max().item() <= 1e-6, (r, k)


def test_torchrun_failed_rank_names_itself(files):
    res = torchrun("run", "--plan", files["plan"], *MODEL, "--steps", 50,
                   DAPPLE_TEST_FAIL_RANK="1", DAPPLE_TEST_FAIL_STEP="2")
    assert res.returncode != 0
    ours = [ln for ln in res.stderr.splitlines() if ln.startswith("error: rank 1 failed")]
    assert len(ours) == 1 and "injected failure" in ours[0], res.stderr
    assert "exitcode  : 8" in res.stderr  # torchrun's report of our exit code (run failed)


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs /proc")
def test_resume_after_kill_equals_uninterrupted_run(files, tmp_path):
    """SIGKILL `dapple run` (no chance to clean up) once a checkpoint is
    complete; its workers die with it; --resume then ends where an
    uninterrupted run ends. The run ignores SIGINT, as a job started in the
    background by a shell script does, so torch's own parent-death signal
    (SIGINT) would leave the workers training on."""
    a, b = tmp_path / "a", tmp_path / "b"
    # Room for the kill to land late: a step takes about 17 ms, the poll
    # waits 50 ms, and a loaded machine stretches both.
    steps = 40
    common = ["run", "--plan", files["plan"], *MODEL, "--optimizer", "adam", "--lr", "0.01", "--checkpoint-every", 2]
    full = run(*common, "--steps", steps, "--checkpoint-dir", a)
    assert full.returncode == 0, full.stderr
    log = tmp_path / "stderr.txt"
    with open(log, "w") as err:
        proc = subprocess.Popen(dapple_cmd(*common, "--steps", 100000, "--checkpoint-dir", b),
                                stdout=subprocess.DEVNULL, stderr=err, cwd=ROOT, env=env(),
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            if (b / "latest").exists() and int((b / "latest").read_text()) >= 4:
                break
            time.sleep(0.05)
        workers = children(proc.pid)
        assert len(workers) >= 2, (workers, log.read_text())
        proc.kill()
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{w}").exists() and "Z" not in Path(f"/proc/{w}/stat").read_text().split()[2]
              for w in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    for w in workers:  # the kernel killed them with their parent
        assert not Path(f"/proc/{w}").exists() or "Z" in Path(f"/proc/{w}/stat").read_text().split()[2]
    killed_at = int((b / "latest").read_text())
    assert killed_at >= 4
    assert killed_at < steps, f"the run got to step {killed_at} before the kill (polled every 50 ms)"
    resumed = run(*common, "--steps", steps, "--checkpoint-dir", b, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    first = [ln.split()[1] for ln in resumed.stderr.splitlines() if ln.startswith("step ")][0]
    assert first == f"{killed_at + 1}/{steps}"
    x, y = final_states(a, steps), final_states(b, steps)
    for r in (0, 1):
        for k in x[r]["model"]:
            assert (x[r]["model"][k] - y[r]["model"][k]).abs().max().item() <= 1e-6, (r, k)


def test_resume_without_checkpoint_is_invalid_input(files, tmp_path):
    res = run("run", "--plan", files["plan"], *MODEL, "--steps", 2, "--checkpoint-dir", tmp_path / "none", "--resume")
    assert res.returncode == 3, res.stderr
    assert "no checkpoint" in one_error_line(res.stderr)


def test_a_checkpoint_folder_that_cannot_be_made_is_one_line(files, tmp_path):
    # A link to nothing (issue 29's fuzz campaign: exit 1); a file there is
    # refused by the option's type already (exit 2).
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")
    res = run("run", "--plan", files["plan"], *MODEL, "--steps", 1, "--checkpoint-dir", dangling)
    assert res.returncode == 6, res.stderr
    assert "cannot make the folder: a link to nothing" in one_error_line(res.stderr)
    assert dangling.is_symlink() and not (tmp_path / "nowhere").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_cuda_without_cuda_is_one_line(files):
    res = run("run", "--plan", files["plan"], *MODEL, "--steps", 1, "--device", "cuda")
    assert res.returncode == 3, res.stderr
    assert "CUDA is not available" in one_error_line(res.stderr)


def test_bad_model_is_invalid_input(files):
    res = run("run", "--plan", files["plan"], "--model", "no_such_module:f", "--steps", 1)
    assert res.returncode == 3, res.stderr
    assert "no_such_module" in one_error_line(res.stderr)


def test_model_not_matching_plan_is_incompatible(files):
    res = run("run", "--plan", files["plan"], *MODEL[:-8], "--model-arg", "n_layers=3", "--steps", 1)
    assert res.returncode == 4, res.stderr
    assert "layers" in one_error_line(res.stderr)


def test_raising_worker_fails_the_run(files):
    res = run("run", "--plan", files["plan"], *MODEL, "--steps", 50, timeout=60,
              DAPPLE_TEST_FAIL_RANK="1", DAPPLE_TEST_FAIL_STEP="2")
    assert res.returncode == 8  # run failed
    line = one_error_line(res.stderr)
    assert "rank 1" in line and "injected failure" in line, line
    assert res.elapsed < 60


def test_a_rank_that_only_lost_its_peer_is_not_named_as_the_cause(tmp_path):
    # Rank 0 fails on gloo's closed connection because rank 1 raised: torch
    # may report rank 0 first; the run names rank 1 and its error.
    import pickle
    from types import SimpleNamespace

    from dapple.planner.runtime.launcher import _root_cause

    files = [tmp_path / f"rank-{r}" for r in range(3)]
    traces = ["Traceback ...\nRuntimeError: [pair.cc:547] Connection closed by peer [127.0.0.1]:1",
              "Traceback ...\nRuntimeError: injected failure at step 2"]
    for path, trace in zip(files, traces):
        path.write_bytes(pickle.dumps(trace))
    context = SimpleNamespace(error_files=[str(p) for p in files])
    lost = "RuntimeError: [pair.cc:547] Connection closed by peer [127.0.0.1]:1"
    assert _root_cause(context, 0, lost) == (1, "RuntimeError: injected failure at step 2")
    assert _root_cause(context, 1, "RuntimeError: injected failure at step 2")[0] == 1
    # Only peers lost: the first report stands.
    files[1].write_bytes(pickle.dumps(traces[0]))
    assert _root_cause(context, 0, lost) == (0, lost)


def children(pid):
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs /proc")
def test_killed_worker_fails_the_run(files, tmp_path):
    log = tmp_path / "stderr.txt"
    with open(log, "w") as err:
        proc = subprocess.Popen(dapple_cmd("run", "--plan", files["plan"], *MODEL, "--steps", 100000),
                                stdout=subprocess.DEVNULL, stderr=err, cwd=ROOT, env=env())
    try:
        deadline = time.monotonic() + 60
        while "step 2/" not in log.read_text() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
        workers = children(proc.pid)
        assert len(workers) >= 2, (workers, log.read_text())
        t0 = time.monotonic()
        os.kill(workers[-1], signal.SIGKILL)
        rc = proc.wait(timeout=60)
        assert rc == 8  # run failed
        assert time.monotonic() - t0 < 60
        assert "rank " in one_error_line(log.read_text())
        time.sleep(0.5)
        for w in workers:  # no worker left behind
            assert not Path(f"/proc/{w}").exists() or "Z" in Path(f"/proc/{w}/stat").read_text().split()[2]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_unwritable_metrics_fail_before_the_run(files, tmp_path):
    res = run("run", "--plan", files["plan"], *MODEL, "--steps", 1000, "--metrics", tmp_path / "no" / "m.json")
    assert res.returncode == 6, res.stderr
    assert "cannot write" in one_error_line(res.stderr)
    assert "step 1/" not in res.stderr  # no step ran


@pytest.mark.parametrize("value, needle", [("1=0.5", "factor in 1..1000"), ("one=2", "RANK=FACTOR"),
                                           ("7=2", "rank 7 is not a rank of the plan")])
def test_bad_slowdown_is_a_usage_error(files, value, needle):
    res = run("run", "--plan", files["plan"], *MODEL, "--steps", 1, "--slowdown", value)
    assert res.returncode == 2, res.stderr
    assert needle in one_error_line(res.stderr)


def test_the_median_step_time_leaves_the_first_step_out():
    from dapple.planner.runtime.launcher import median_iteration_ms

    assert median_iteration_ms([50.0, 10.0, 12.0, 11.0]) == (11.0, 1)
    assert median_iteration_ms([50.0, 10.0, 12.0]) == (11.0, 1)
    assert median_iteration_ms([30.0]) == (30.0, 0)  # nothing would be left


def test_nccl_is_bound_to_the_ranks_gpu(monkeypatch):
    from dapple.planner.runtime import rank as rank_module

    joined = []
    monkeypatch.setattr(rank_module.dist, "init_process_group", lambda *a, **kw: joined.append((a, kw)))
    monkeypatch.setattr(rank_module, "rank_device", lambda device, rank: f"{device}:{rank}")
    rank_module.init_process_group("cuda", 3, 4, 60)
    rank_module.init_process_group("cpu", 0, 4, 60)
    (cuda_args, cuda_kw), (cpu_args, cpu_kw) = joined
    assert cuda_args == ("nccl",) and cuda_kw["device_id"] == "cuda:3" and cuda_kw["rank"] == 3
    assert cpu_args == ("gloo",) and "device_id" not in cpu_kw



@pytest.mark.parametrize("option,value", [("--seed", "18446744073709551616"), ("--seed", "-1"),
                                          ("--steps", "99999999999999999999")])
def test_seeds_and_steps_past_their_ranges_are_usage_errors(dapple, option, value):
    # torch takes 64-bit seeds: past them it raised an overflow, exit 1
    # (issue 29's fuzz campaign); steps are counts like every other.
    args = {"--seed": "0", "--steps": "1", option: value}
    r = dapple("run", "--plan", "plan.json", "--model", "dapple.planner.runtime.models:gpt",
               *[word for pair in args.items() for word in pair])
    assert r.returncode == 2 and option in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_more_than_one_thread_per_worker_runs(files):
    # Issue 29's fuzz campaign: `--threads 2` hung for ever. The workers were
    # forked after the parent had used OpenMP's thread pool, and a forked
    # child that asks for two threads waits on it; they are spawned now.
    # Run in a session of its own, to see that nothing of it outlives it:
    # spawned workers start multiprocessing's resource tracker, which
    # lingered a moment after the command had ended.
    proc = subprocess.Popen(dapple_cmd("run", "--plan", files["plan"], *MODEL, "--steps", 2, "--threads", 2),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env(),
                            start_new_session=True)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "final loss" in out
    left = subprocess.run(["pgrep", "-s", str(proc.pid)], capture_output=True, text=True).stdout.split()
    assert left == [], f"processes of the run left running: {left}"
