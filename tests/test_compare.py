"""Baselines and `dapple compare`."""

import json
import re

import pytest

from dapple import planner
from conftest import PROFILES, ROOT

BERT = PROFILES / "bert-48-pbs-2.json"


def test_every_baseline_is_a_plan_that_evaluates_to_its_own_estimate():
    prof = planner.Profile.load(BERT)
    for kind in planner.BASELINES:
        p = planner.baseline(kind, prof, "A", 64)
        assert sum(len(s["devices"]) for s in p.stages) <= 16
        again = planner.evaluate(p, prof)
        assert again.estimate == p.estimate, kind
    assert planner.baseline("data-parallel", prof, "A", 64).kind == "data parallel"
    assert planner.baseline("gpipe", prof, "A", 64).data["schedule"]["kind"] == "gpipe"


def test_unknown_baseline_is_an_input_error():
    # (This asked for "megatron" until Megatron-LM's shape became a baseline.)
    with pytest.raises(planner.InvalidInputError) as e:
        planner.baseline("alpa", BERT, "A", 64)
    assert "alpa" in str(e.value) and "megatron" in str(e.value)


def quality_cases():
    """(id, profile path, topology, global batch): the paper's Table V cases
    (the regress suite), every shipped artifact profile on 2x8-nvlink and
    16x1-25gbps at its largest profiled batch size per GPU, and Whale's
    ResNet-50s on 4x8 V100s."""
    suite_path = ROOT / "profiles" / "regress" / "paper-table-v.json"
    suite = json.loads(suite_path.read_text())
    cases = [
        pytest.param(suite_path.parent / c["profile"], c["topology"], c["global_batch_size"], id=c["name"])
        for c in suite["cases"]
    ]
    for path in sorted(PROFILES.glob("*.json")):
        gbs = max(planner.Profile.load(path).batch_sizes) * 16
        for topo in ("2x8-nvlink", "16x1-25gbps"):
            cases.append(pytest.param(path, topo, gbs, id=f"{path.stem} {topo}"))
    # Whale's ResNet-50s on the cluster of its runs: one stage split 32
    # ways, whose layers cut into chunks on one rank reduce their gradients
    # behind the chunks still running (issue 67: auto took early backward,
    # 102.5 ms, where interleaved 1F1B ran 101.1).
    for name in ("resnet50-fc100k", "resnet50-fc1000k"):
        path = ROOT / "profiles" / "whale" / f"{name}.json"
        cases.append(pytest.param(path, "4x8-v100-32gb-nvlink-50gbps", 512, id=f"{name} 4x8-v100"))
    return cases


@pytest.mark.parametrize("profile, topology, gbs", quality_cases())
def test_dapple_plan_simulates_no_slower_than_any_baseline(profile, topology, gbs):
    rows = planner.compare(profile, topology, gbs)
    assert rows[0].strategy == "dapple" and rows[0].error is None
    ours = rows[0].simulated_ms
    # The asynchronous rows train another way (stale or predicted weights):
    # DAPPLE's plan is the best synchronous one that fits, not faster than
    # those.
    for r in rows[1:]:
        if r.error is None and r.fits_memory and r.schedule not in planner.ASYNCHRONOUS_SCHEDULES:
            assert ours <= r.simulated_ms * (1 + 1e-9), (r.strategy, r.shape, r.simulated_ms, ours)
    # --schedule auto is no slower than the search for any one kind alone
    # (where that kind has a plan that fits: ZB-V's two chunks a rank may not).
    for kind in planner._core.SEARCHED_SCHEDULES:
        try:
            alone = planner.plan(profile, topology, gbs, schedule=kind)
        except planner.InfeasibleError:
            continue
        assert ours <= alone.iteration_ms * (1 + 1e-9), kind
        # (interleaved zero bubble at one chunk a rank is recorded as ZB-H1)
        one_chunk = kind in planner.CHUNKED_SCHEDULES and alone.core.chunks == 1
        assert alone.core.schedule_kind == kind or one_chunk, (kind, alone.core.schedule_kind)
    # Overlapping the AllReduce can only help data parallelism.
    by_name = {r.strategy: r for r in rows}
    dp, plain = by_name["data-parallel"], by_name["data-parallel (no overlap)"]
    if dp.error is None:
        assert dp.simulated_ms <= plain.simulated_ms


@pytest.mark.parametrize("name, topology, gbs", [("bert-48-pbs-2", "B", 64), ("bert-48-pbs-2", "C", 64),
                                                 ("vgg-19-pbs-32", "B", 2048)])
def test_fixed_policy_plans_are_no_slower_than_its_baselines(name, topology, gbs):
    # Under a fixed warm-up policy the baselines' layouts are candidates of
    # the search too, costed with the same policy.
    prof = planner.Profile.load(PROFILES / f"{name}.json")
    ours = planner.plan(prof, topology, gbs, warmup_policy="A")
    assert ours.data["schedule"]["warmup_policy"] == "A"
    compared = 0
    for kind in ("straight", "pipedream-planner"):
        try:
            theirs = planner.baseline(kind, prof, topology, gbs, warmup_policy="A")
        except planner.InfeasibleError:
            continue  # e.g. PipeDream's 11:4:1 for VGG-19 on B holds too much under policy A
        compared += 1
        assert ours.iteration_ms <= theirs.iteration_ms * (1 + 1e-9), (kind, theirs.shape)
    assert compared >= 1


def test_compare_command(dapple):
    r = dapple("compare", "--profile", BERT, "--topology", "B", "--global-batch-size", "64", "--json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert rows[0]["strategy"] == "dapple" and "data-parallel (no overlap)" in {row["strategy"] for row in rows}
    # DAPPLE's layout as each other kind the search chooses among, right after it.
    others = [k for k in planner._core.SEARCHED_SCHEDULES if k != rows[0]["schedule"]]
    assert [row["strategy"] for row in rows[1:1 + len(others)]] == [f"dapple as {k}" for k in others]
    # A chunked row is DAPPLE's layout of one stage a rank (early backward's
    # where the plan is chunked), its ranks' layers cut into chunks.
    searched = planner.plan(BERT, "B", 64)
    if searched.core.schedule_kind in planner.CHUNKED_SCHEDULES:
        searched = planner.plan(BERT, "B", 64, schedule="early-backward-1f1b")
    for row in rows[1:1 + len(others)]:
        if row["schedule"] in planner.CHUNKED_SCHEDULES and row["error"] is None:
            run = planner.chunked(searched, BERT, row["schedule"])
            assert row["simulated_ms"] == run.iteration_ms and row["shape"] == run.shape
    assert all(row["simulated_ms"] > 0 for row in rows if row["error"] is None)
    table = dapple("compare", "--profile", BERT, "--topology", "B", "--global-batch-size", "64")
    assert "pipedream-planner" in table.stdout
    # A fixed warm-up policy applies to DAPPLE's plan and the early-backward baselines.
    fixed = dapple("compare", "--profile", BERT, "--topology", "B", "--global-batch-size", "64",
                   "--warmup-policy", "A", "--json")
    assert fixed.returncode == 0, fixed.stderr
    by_name = {row["strategy"]: row for row in json.loads(fixed.stdout)}
    auto = {row["strategy"]: row for row in rows}
    assert by_name["dapple"]["simulated_ms"] >= auto["dapple"]["simulated_ms"] - 1e-6


def test_a_kind_that_cannot_run_dapples_plan_is_an_error_row():
    # Three stages of 16 micro-batches: torch's ZB-H1 order takes them in 5
    # rounds, which 16 does not split into.
    bert = PROFILES / "bert-48-pbs-2.json"
    rows = {r.strategy: r for r in planner.compare(bert, "3x1-25gbps", 32)}
    assert rows["dapple"].error is None and rows["dapple"].schedule != "zb-h1"
    searched = planner.plan(bert, "3x1-25gbps", 32, schedule="early-backward-1f1b")  # the layout the rows run
    assert (searched.micro_batches, len(searched.stages)) == (16, 3)
    assert "equal rounds" in rows["dapple as zb-h1"].error


@pytest.mark.parametrize("gbs", [256, 1024, 2048])
@pytest.mark.parametrize("profile", ["resnet50-fc100k", "resnet50-fc1000k"])
def test_whales_profiles_compare_with_a_megatron_row_whose_slices_fit(dapple, profile, gbs):
    # Megatron's uniform shapes split the classifier 8 ways over 32 GPUs: at
    # a micro-batch of 128 the layers that do not split got 4 samples a GPU,
    # below the profile's 8, and the whole command failed with exit 3.
    path = ROOT / "profiles" / "whale" / f"{profile}.json"
    r = dapple("compare", "--profile", path, "--topology", "4x8-v100-32gb-nvlink-50gbps",
               "--global-batch-size", gbs, "--json")
    assert r.returncode == 0, r.stderr
    rows = {row["strategy"]: row for row in json.loads(r.stdout)}
    assert rows["megatron"]["error"] is None, rows["megatron"]["error"]
    megatron = planner.baseline("megatron", path, "4x8-v100-32gb-nvlink-50gbps", gbs)
    assert planner.evaluate(megatron, path).estimate == megatron.estimate


def test_a_strategy_that_fails_for_any_reason_is_a_row(monkeypatch):
    import sys

    compare_module = sys.modules["dapple.planner.compare"]  # the package's `compare` is the function
    real = compare_module.baseline

    def broken(kind, *args, **kwargs):
        if kind == "megatron":
            raise planner.InvalidInputError("field stages[0].devices: made up by the test")
        return real(kind, *args, **kwargs)

    monkeypatch.setattr(compare_module, "baseline", broken)
    rows = {r.strategy: r for r in planner.compare(BERT, "A", 64)}
    assert "made up by the test" in rows["megatron"].error
    assert rows["dapple"].error is None and rows["gpipe"].error is None


def test_inputs_no_strategy_can_use_are_an_error(dapple):
    from conftest import assert_one_line_error

    r = dapple("compare", "--profile", PROFILES / "bert-48-pbs-2.json", "--topology", "A", "--global-batch-size", 1)
    assert_one_line_error(r, 4, "global batch size 1")


@pytest.mark.parametrize("name", ["vgg-19-pbs-32", "bert-48-pbs-2"])
def test_asynchronous_rows_run_gpipes_plan_without_its_flush_both_ways(name):
    profile = PROFILES / f"{name}.json"
    gbs = max(planner.Profile.load(profile).batch_sizes) * 4
    rows = {r.strategy: r for r in planner.compare(profile, "1x4-nvlink", gbs)}
    on = planner._core.ASYNCHRONOUS_ROWS_ON
    gpipe = planner.baseline(on, profile, "1x4-nvlink", gbs)
    # GPipe's plan both ways: as planned, and with every stage re-computing.
    flushed = {False: rows[on], True: rows[f"{on} rc"]}
    assert flushed[True].simulated_ms == planner.simulate(gpipe, profile, recompute=True).iteration_ms
    assert flushed[True].simulated_ms > flushed[False].simulated_ms
    assert (flushed[False].recompute, flushed[True].recompute) == (False, True)
    for kind in planner.ASYNCHRONOUS_SCHEDULES:
        for recompute, rc in [(False, ""), (True, " rc")]:
            r = rows[f"{kind}{rc} on {on}"]
            assert (r.schedule, r.shape, r.micro_batches, r.estimated_ms) == (kind, gpipe.shape, gpipe.micro_batches, None)
            assert r.recompute == recompute
            sim = planner.simulate(gpipe, profile, schedule=kind, recompute=recompute)
            assert (r.simulated_ms, r.fits_memory) == (sim.iteration_ms, sim.fits_memory)
            # The same passes as GPipe's with the same re-computation: once
            # the pipeline is full there is no flush to wait for.
            assert r.simulated_ms < flushed[recompute].simulated_ms, (kind, recompute)
        # Keeping activations costs no re-run forward.
        assert rows[f"{kind} on {on}"].simulated_ms < rows[f"{kind} rc on {on}"].simulated_ms


@pytest.fixture(scope="module")
def llama_70b(tmp_path_factory):
    """Llama 2 70B timed on A100s: too big for plain stages on 4 x 8 A100s."""
    from conftest import run_dapple

    out = tmp_path_factory.mktemp("llama") / "llama-2-70b.json"
    r = run_dapple("profile", "transformer", "--config", "llama-2-70b", "--gpu", "A100-80GB", "--seq-len", 4096,
                   "--out", out)
    assert r.returncode == 0, r.stderr
    return out


def test_compare_rows_show_each_stages_shape(llama_70b):
    from dapple.planner.plan import shape_label

    rows = {r.strategy: r for r in planner.compare(llama_70b, "4x8-a100-80gb", 256)}
    megatron = planner.baseline("megatron", llama_70b, "4x8-a100-80gb", 256)
    assert rows["megatron"].stage_shapes == [shape_label(s) for s in megatron.stage_shapes]
    for name in ("dapple", "megatron"):
        r = rows[name]
        # A chunked plan ("8:8:8:8 (v=5)") lists a shape for each of its ranks' chunks, stage s on rank s mod ranks.
        ranks, _, chunks = r.shape.partition(" (v=")
        gpus = [int(g) for g in ranks.split(":")] * (int(chunks.rstrip(")")) if chunks else 1)
        assert len(r.stage_shapes) == len(gpus), r
        for label, g in zip(r.stage_shapes, gpus):
            # 70B does not fit plain stages here: each stage splits, shards or re-computes,
            # its split degree times its context degree times its replicas being its GPUs.
            m = re.fullmatch(r"t(\d+)\u00d7(?:c(\d+)\u00d7)?r(\d+)( sp)?( zero)?( rc( per-layer| selective)?)?", label)
            assert m and int(m[1]) * int(m[2] or 1) * int(m[3]) == g, (name, label, g)
    # DAPPLE's own baselines run plain stages.
    assert rows["straight"].stage_shapes == [""] * len(rows["straight"].shape.split(":"))
    assert rows["gpipe"].stage_shapes is None and rows["gpipe"].error


def test_compare_command_lists_stage_shapes_under_the_table_where_a_stage_is_not_plain(dapple, llama_70b):
    r = dapple("compare", "--profile", llama_70b, "--topology", "4x8-a100-80gb", "--global-batch-size", 256)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("stage shapes (t"))
    # Each line: the strategy (which may hold single spaces), two spaces, its shapes.
    shapes = dict(re.split(r"\s{2,}", line.strip(), maxsplit=1) for line in lines[start + 1:] if line.strip())
    assert shapes["dapple"].startswith("s0") and "\u00d7r" in shapes["dapple"]
    assert shapes["megatron"].startswith("s0") and "\u00d7r" in shapes["megatron"]
    assert shapes["straight"] == "s0-31 plain"
    # rows without a plan have no shapes to show
    assert "gpipe" not in shapes
    js = dapple("compare", "--profile", llama_70b, "--topology", "4x8-a100-80gb", "--global-batch-size", 256, "--json")
    from dapple.planner.plan import stage_shapes_text

    for row in json.loads(js.stdout):
        if row["stage_shapes"] is not None:
            assert stage_shapes_text(row["stage_shapes"]) == shapes[row["strategy"]], row


def test_a_plain_comparison_prints_no_stage_shapes(dapple):
    table = dapple("compare", "--profile", BERT, "--topology", "A", "--global-batch-size", "64")
    assert table.returncode == 0, table.stderr
    assert "stage shapes" not in table.stdout and "\u00d7" not in table.stdout


def test_compare_takes_plans_default_global_batch(dapple):
    # Without --global-batch-size, compare plans what dapple plan would:
    # the profile's largest measured batch on every GPU, said on stderr.
    profile = PROFILES / "bert-48-pbs-2.json"
    r = dapple("compare", "--profile", profile, "--topology", "A", "--json")
    assert r.returncode == 0, r.stderr
    gbs = max(planner.Profile.load(profile).batch_sizes) * 16
    assert f"global batch size not given; used {gbs}" in r.stderr
    dapple_row = json.loads(r.stdout)[0]
    assert dapple_row["micro_batches"] * dapple_row["micro_batch_size"] == gbs
    planned = dapple("plan", "--profile", profile, "--topology", "A", "--json")
    assert f"used {gbs}" in planned.stderr
    # Said once the plan is made: a failure stays one line.
    failed = dapple("plan", "--profile", profile, "--topology", "A", "--stages", 99)
    assert failed.returncode == 3 and len(failed.stderr.strip().splitlines()) == 1, failed.stderr


def test_compares_table_cuts_no_name_piped_or_on_a_narrow_terminal():
    """Issue 67: piped, each row of `compare`'s table is one line with its
    strategy and schedule whole; on an 80-column terminal the cells wrap,
    and nothing is cut to "…"."""
    import os
    import subprocess

    from conftest import DAPPLE, run_dapple

    args = ("compare", "--profile", ROOT / "profiles" / "whale" / "resnet50-fc100k.json",
            "--topology", "4x8-v100-32gb-nvlink-50gbps", "--global-batch-size", "512", "--quiet")
    piped = run_dapple(*args)
    assert piped.returncode == 0, piped.stderr
    rows = json.loads(run_dapple(*args, "--json").stdout)
    lines = piped.stdout.splitlines()
    for row in rows:
        line = next(line for line in lines if line.startswith(f"{row['strategy']} ") and "│" in line)
        assert row["error"] is not None or row["schedule"] in line, (row, line)
    assert "\u2026" not in piped.stdout
    env = {**os.environ, "TTY_COMPATIBLE": "1", "COLUMNS": "80", "NO_COLOR": "1"}
    narrow = subprocess.run([str(DAPPLE), *map(str, args)], capture_output=True, text=True, env=env, cwd=ROOT)
    assert narrow.returncode == 0, narrow.stderr
    text = re.sub(r"\x1b\[[0-9;]*m", "", narrow.stdout)
    widths = {len(line) for line in text.splitlines() if "│" in line}
    assert widths and max(widths) <= 80, widths
    assert "\u2026" not in text
