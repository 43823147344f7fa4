"""``dapple sweep`` and ``planner.sweep`` (issue 68): the arithmetic of time
to train and cost on literal numbers, the knee and the cheapest point, a
small sweep end to end against ``planner.plan``, a size without a plan as a
row, and bad input as one line naming its flag."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest

from conftest import assert_one_line_error
from dapple import planner
from dapple.cli.sweep import MachineCounts, TokenCount
from dapple.planner.sweep import (
    Sweep,
    cost_usd,
    global_batch_for_tokens,
    gpu_hours,
    iterations_to_train,
    planned_point,
    step_efficiency,
    tokens_per_iteration,
    tokens_per_s,
    train_hours,
    usd_text,
    with_step_efficiencies,
)

# A small Llama-style model: plans in a few hundredths of a second a size.
TINY_CONFIG = {"model_type": "llama", "hidden_act": "silu", "hidden_size": 256, "intermediate_size": 688,
               "num_attention_heads": 8, "num_key_value_heads": 4, "num_hidden_layers": 4, "vocab_size": 1000}


@pytest.fixture
def tiny_config(tmp_path):
    path = tmp_path / "tiny-llama.json"
    path.write_text(json.dumps(TINY_CONFIG))
    return path


@pytest.fixture
def big_layers(tmp_path):
    """Four layers of 8 GB of weights each on H100s, no sequence length and
    no FLOPs: one GPU holds no plan (119 GiB), two do."""
    path = tmp_path / "big4.json"
    path.write_text(json.dumps({
        "format": "dapple.profile", "schema_version": 1, "model": "big4", "optimizer": "adam", "device": "H100-80GB",
        "layers": [{"name": f"l{i}", "param_bytes": 8 * 10**9,
                    "measurements": [{"batch_size": 1, "fwd_ms": 10.0, "bwd_ms": 20.0, "activation_bytes": 10**6}]}
                   for i in range(4)],
    }))
    return path


def fake_plan(iteration_ms: float, mfu: float | None = None):
    """What a point reads of a plan: its iteration time and estimate."""
    return SimpleNamespace(iteration_ms=iteration_ms, estimate={"mfu": mfu}, layout="stand-in")


def test_time_to_train_and_cost_arithmetic_by_hand():
    # 512 samples of 4,096 tokens a batch, 1.5 s an iteration, 10^12 tokens,
    # 64 GPUs at 2.5 USD a GPU-hour:
    #   tokens a batch  512 x 4096              = 2,097,152
    #   tokens a second 2,097,152 / 1.5         = 1,398,101.33...
    #   iterations      ceil(10^12 / 2,097,152) = ceil(476,837.16) = 476,838
    #   hours           476,838 x 1.5 s / 3600  = 198.6825
    #   GPU-hours       198.6825 x 64           = 12,715.68
    #   cost            12,715.68 x 2.5         = 31,789.20 USD
    assert tokens_per_iteration(512, 4096) == 2_097_152
    assert tokens_per_s(2_097_152, 1500.0) == pytest.approx(1_398_101.3333, rel=1e-9)
    assert iterations_to_train(10**12, 2_097_152) == 476_838
    assert train_hours(476_838, 1500.0) == pytest.approx(198.6825, rel=1e-12)
    assert gpu_hours(198.6825, 64) == pytest.approx(12_715.68, rel=1e-12)
    assert cost_usd(12_715.68, 2.5) == pytest.approx(31_789.2, rel=1e-12)
    # The same through a point, as the sweep makes it.
    point = planned_point("H100-80GB", 8, 8, "8x8-h100-80gb", 512, 4096, 10**12, fake_plan(1500.0, 0.41), 2.5)
    assert (point.gpus, point.tokens_per_iteration, point.iterations) == (64, 2_097_152, 476_838)
    assert point.train_hours == pytest.approx(198.6825)
    assert point.gpu_hours == pytest.approx(12_715.68)
    assert point.cost_usd == pytest.approx(31_789.2)
    assert point.mfu == 0.41 and usd_text(point.cost_usd) == "$31,789"
    # No price: no cost (none is shipped).
    unpriced = planned_point("H100-80GB", 8, 8, "8x8-h100-80gb", 512, 4096, 10**12, fake_plan(1500.0), None)
    assert unpriced.cost_usd is None


def test_the_last_iteration_runs_whole():
    assert iterations_to_train(2 * 2048, 2048) == 2
    assert iterations_to_train(2 * 2048 + 1, 2048) == 3
    assert iterations_to_train(1, 2048) == 1


def test_a_batch_in_tokens_is_the_nearest_whole_number_of_samples():
    assert global_batch_for_tokens(2**21, 4096) == 512
    assert global_batch_for_tokens(2_000_000, 4096) == 488  # 488.28
    assert global_batch_for_tokens(100, 4096) == 1


@pytest.mark.parametrize("text, tokens", [("2M", 2_000_000), ("2Mi", 2**21), ("1.5T", 1_500_000_000_000),
                                          ("1e12", 10**12), ("32ki", 32768), ("4096", 4096), ("15t", 15 * 10**12)])
def test_token_counts_take_decimal_and_binary_suffixes(text, tokens):
    assert TokenCount().convert(text, None, None) == tokens


def test_machine_counts_double_from_a_up_to_b_or_are_listed():
    assert MachineCounts().convert("8..256", None, None) == [8, 16, 32, 64, 128, 256]
    assert MachineCounts().convert("3..20", None, None) == [3, 6, 12]
    assert MachineCounts().convert("16,8,8,12", None, None) == [8, 12, 16]


def points_of(gpu_type: str, hours_by_gpus: dict[int, float | None], price: float | None = None):
    """One GPU type's points (None: no plan) on machines of 8 GPUs, with
    their step efficiencies: a budget of one iteration that takes ``hours``."""
    points = []
    for gpus, hours in hours_by_gpus.items():
        if hours is None:
            points.append(planner.SweepPoint(gpu_type=gpu_type, machines=gpus // 8, gpus_per_machine=8, topology="",
                                             global_batch_size=8, tokens_per_iteration=8, plan=None, why_not="no fit"))
        else:
            points.append(planned_point(gpu_type, gpus // 8, 8, "", 8, 1, 8, fake_plan(hours * 3.6e6), price))
    return with_step_efficiencies(points)


def test_step_efficiency_by_hand():
    assert step_efficiency(100.0, 8, 50.0, 16) == pytest.approx(1.0)  # halved: all of the ideal
    assert step_efficiency(50.0, 16, 30.0, 32) == pytest.approx(2 / 3)  # 1.667x of 2x
    assert step_efficiency(30.0, 32, 24.0, 64) == pytest.approx(0.25)  # 1.25x of 2x
    assert step_efficiency(100.0, 8, 40.0, 32) == pytest.approx(0.5)  # 2.5x of 4x
    assert step_efficiency(10.0, 8, 12.0, 16) == pytest.approx(-1 / 6)  # slower


def test_the_knee_is_the_last_size_before_a_step_keeps_under_the_share():
    # 8 -> 16 halves the time (1.0), 16 -> 32 keeps 0.67, 32 -> 64 0.25.
    points = points_of("H100-80GB", {8: 100.0, 16: 50.0, 32: 30.0, 64: 24.0})
    assert [p.step_efficiency for p in points] == [None, pytest.approx(1.0), pytest.approx(2 / 3),
                                                   pytest.approx(0.25)]
    at = lambda share: Sweep("m", tuple(points), 8, 1, 8, share).knees  # noqa: E731
    assert [p.gpus for p in at(0.5)] == [32]
    assert [p.gpus for p in at(0.7)] == [16]
    assert [p.gpus for p in at(0.2)] == [64]
    # A size without a plan is stepped over: 8 -> 32 keeps (100/30 - 1)/3 = 0.78.
    holed = points_of("H100-80GB", {8: 100.0, 16: None, 32: 30.0, 64: 24.0})
    assert holed[2].step_efficiency == pytest.approx((100 / 30 - 1) / 3)
    assert [p.gpus for p in Sweep("m", tuple(holed), 8, 1, 8, 0.5).knees] == [32]
    # One size with a plan: no step, no knee.
    assert Sweep("m", tuple(points_of("H100-80GB", {8: 10.0, 16: None})), 8, 1, 8, 0.5).knees == []


def test_the_cheapest_point_is_the_lowest_cost_else_each_types_fewest_gpu_hours():
    # GPU-hours: 800, 800, 960 (H100); 1200, 1120 (A100).
    h100 = {8: 100.0, 16: 50.0, 32: 30.0}
    a100 = {8: 150.0, 16: 70.0}
    unpriced = Sweep("m", tuple(points_of("H100-80GB", h100) + points_of("A100-80GB", a100)), 8, 1, 8, 0.5)
    # A tie (800 GPU-hours at 8 and 16) goes to the shorter time to train.
    assert [(p.gpu_type, p.gpus) for p in unpriced.cheapest] == [("H100-80GB", 16), ("A100-80GB", 16)]
    # Priced: H100 800 x 2.5 = 2,000 USD against A100 1,120 x 1.5 = 1,680 USD.
    priced = Sweep("m", tuple(points_of("H100-80GB", h100, 2.5) + points_of("A100-80GB", a100, 1.5)), 8, 1, 8, 0.5)
    assert [(p.gpu_type, p.gpus, p.cost_usd) for p in priced.cheapest] == [("A100-80GB", 16, pytest.approx(1680.0))]
    assert priced.notes(priced.cheapest[0]) == ["knee", "cheapest"]


def table_rows(stdout: str, gpu_type: str) -> list[list[str]]:
    """The cells of the table's rows of ``gpu_type``."""
    return [[cell.strip() for cell in line.split("\u2502")] for line in stdout.splitlines()
            if line.startswith(gpu_type)]


def test_a_small_sweep_prints_planner_plans_figures_and_writes_its_plot(dapple, tiny_config, tmp_path):
    picture, rows = tmp_path / "sweep.png", tmp_path / "sweep.json"
    args = ["sweep", "--config", tiny_config, "--gpu", "h100", "--seq-len", 256, "--machines", "1..4",
            "--gpus-per-machine", 2, "--global-batch-size", 16, "--train-tokens", "10M", "--price", "H100-80GB=2"]
    r = dapple(*args, "--plot", picture, "--out", rows, "--jobs", 1)
    assert r.returncode == 0, r.stderr
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    profile = planner.transformer_profile(tiny_config, gpu="H100-80GB", seq_len=256)
    expected = {m: planner.plan(profile, f"{m}x2-h100-80gb", 16) for m in (1, 2, 4)}
    cells = table_rows(r.stdout, "H100-80GB")
    assert [row[1] for row in cells] == ["2 (1x2)", "4 (2x2)", "8 (4x2)"]
    data = json.loads(rows.read_text())
    assert [p["machines"] for p in data["points"]] == [1, 2, 4]
    for row, point, m in zip(cells, data["points"], (1, 2, 4)):
        plan = expected[m]
        assert point["iteration_ms"] == plan.iteration_ms and point["layout"] == plan.layout
        assert point["mfu"] == plan.estimate["mfu"]
        assert row[3] == f"{plan.iteration_ms:,.1f}"
        iterations = -(-10_000_000 // (16 * 256))  # 2,442
        assert point["iterations"] == iterations
        gpus, usd_per_gpu_hour = 2 * m, 2.0
        assert point["cost_usd"] == pytest.approx(iterations * plan.iteration_ms / 3.6e6 * gpus * usd_per_gpu_hour)
        assert row[8] == usd_text(point["cost_usd"])
    noted = [p["notes"] for p in data["points"]]
    assert ["cheapest" in n for n in noted].count(True) == 1 and ["knee" in n for n in noted].count(True) <= 1
    # Two processes plan the same rows, which --json prints as --out wrote them.
    parallel = dapple(*args, "--json", "--jobs", 2)
    assert parallel.returncode == 0, parallel.stderr
    assert json.loads(parallel.stdout) == data


def test_without_a_price_there_is_no_cost(dapple, tiny_config):
    r = dapple("sweep", "--config", tiny_config, "--gpu", "h100", "--seq-len", 256, "--machines", "1,2",
               "--gpus-per-machine", 2, "--tokens-per-batch", "2K", "--train-tokens", "1M", "--json", "--jobs", 1)
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert {p["cost_usd"] for p in data["points"]} == {None}
    # 2,000 tokens are 7.8 samples of 256: 8 planned, and said.
    assert data["global_batch_size"] == 8
    assert "planned 8 (2,048 tokens a batch)" in r.stderr


def test_a_size_without_a_plan_is_a_row_saying_why(dapple, big_layers):
    args = ["sweep", "--profile", big_layers, "--seq-len", 1024, "--gpus-per-machine", 1, "--global-batch-size", 16,
            "--train-tokens", "1G", "--jobs", 1]
    r = dapple(*args, "--machines", "1..4")
    assert r.returncode == 0, r.stderr
    one, two, four = table_rows(r.stdout, "H100-80GB")
    assert one[1] == "1 (1x1)" and one[-1].startswith("no plan: no plan fits in GPU memory")
    assert two[2] and two[5] == "-"  # planned; the profile gives no FLOPs, so no MFU
    # 2 -> 4 GPUs keeps 0.9 of the ideal; 2 GPUs take the fewest GPU-hours.
    assert (two[-1], four[-1]) == ("cheapest", "knee")
    # No size with a plan: the rows, then one line and exit 5.
    alone = dapple(*args, "--machines", "1")
    assert_one_line_error(alone, 5, "no size of the sweep has a plan")
    assert "no plan: no plan fits in GPU memory" in alone.stdout


BAD_INPUT = [
    (["--machines", "256..8"], "'--machines'", "empty range"),
    (["--machines", ""], "'--machines'", "empty"),
    (["--price", "H100-80GB=-1"], "'--price'", "below 0"),
    (["--price", "A100-80GB=1"], "'--price'", "plans no A100-80GB"),
    (["--train-tokens", "0"], "'--train-tokens'", "not a positive number"),
    (["--train-tokens", "abc"], "'--train-tokens'", "not a positive number"),
    (["--train-tokens", "-1T"], "'--train-tokens'", "not a positive number"),
    (["--train-tokens", "nan"], "'--train-tokens'", "not a positive number"),
    (["--tokens-per-batch", "0"], "'--tokens-per-batch'", "not a positive number"),
]


@pytest.mark.parametrize("change, flag, says", BAD_INPUT, ids=[" ".join(c) or "empty" for c, _, _ in BAD_INPUT])
def test_bad_input_is_one_line_naming_its_flag(dapple, tiny_config, change, flag, says):
    given = {"--machines": "1..2", "--train-tokens": "1M", "--tokens-per-batch": "4K"}
    given.update({k: v for k, v in zip(change[::2], change[1::2]) if k != "--price"})
    prices = [a for k, v in zip(change[::2], change[1::2]) if k == "--price" for a in (k, v)]
    r = dapple("sweep", "--config", tiny_config, "--gpu", "h100", "--seq-len", 256, "--gpus-per-machine", 2,
               *[a for kv in given.items() for a in kv], *prices, "--jobs", 1)
    assert_one_line_error(r, 2, flag, says)


def test_profile_or_config_one_of_them(dapple, tiny_config, big_layers):
    common = ["--machines", "1", "--global-batch-size", 8, "--train-tokens", "1M"]
    assert_one_line_error(dapple("sweep", *common), 2, "--profile", "--config")
    assert_one_line_error(dapple("sweep", "--profile", big_layers, "--config", tiny_config, "--gpu", "h100",
                                 "--seq-len", 256, *common), 2, "one of them")
    assert_one_line_error(dapple("sweep", "--profile", big_layers, *common), 2, "--seq-len")
    assert_one_line_error(dapple("sweep", "--config", tiny_config, "--gpu", "h100", "--seq-len", 256,
                                 "--machines", "1", "--train-tokens", "1M"), 2, "--tokens-per-batch",
                          "--global-batch-size")


def test_the_progress_bar_shows_on_a_terminal_only(tiny_config):
    import pty
    import subprocess

    from conftest import DAPPLE, ROOT

    def shown_on_a_terminal(*extra) -> str:
        main, tty = pty.openpty()
        args = ["sweep", "--config", tiny_config, "--gpu", "h100", "--seq-len", 256, "--machines", "1..2",
                "--gpus-per-machine", 2, "--global-batch-size", 8, "--train-tokens", "1M", "--jobs", 1, *extra]
        proc = subprocess.Popen([str(DAPPLE), *map(str, args)], stdout=subprocess.DEVNULL, stderr=tty,
                                stdin=subprocess.DEVNULL, cwd=ROOT, env={**os.environ, "TERM": "xterm"})
        os.close(tty)
        shown = b""
        while True:
            try:
                chunk = os.read(main, 65536)
            except OSError:  # the terminal closed with the process
                break
            if not chunk:
                break
            shown += chunk
        os.close(main)
        assert proc.wait(timeout=60) == 0, shown
        return shown.decode("utf-8", "replace")

    assert "sizes" in shown_on_a_terminal()
    assert "sizes" not in shown_on_a_terminal("--quiet")
