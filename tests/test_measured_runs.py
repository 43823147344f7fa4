"""Measured runs costed, scored and fitted (`dapple calibrate --runs`,
`dapple.planner.measured_runs`): the fit recovers a figure from runs the
cost model made itself, and bad run files are one-line errors."""

import csv
import json

import pytest

from dapple import planner
from dapple.planner import measured_runs as runs_api

HEADER = list(runs_api.COLUMNS.values())

# Small GPT models on 1-4 GPUs of one machine, one sample a micro-batch:
# their kernels are short, so what the host takes to issue them sets the time.
LAYOUTS = [
    # gpus, global batch, micro batch, hidden, heads, layers, seq, t, d, p
    (2, 4, 1, 256, 4, 4, 256, 1, 2, 1),
    (2, 4, 1, 256, 4, 4, 256, 2, 1, 1),
    (2, 4, 2, 256, 4, 4, 256, 1, 1, 2),
    (4, 8, 1, 256, 4, 4, 256, 2, 2, 1),
    (4, 8, 2, 256, 4, 4, 256, 4, 1, 1),
    (4, 8, 1, 512, 8, 4, 256, 1, 2, 2),
]


def write_runs(path, rows):
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(HEADER)
        writer.writerows(rows)


def runs_made_at(host_us: float):
    runs = [runs_api.MeasuredRun(*layout, iteration_ms=1.0) for layout in LAYOUTS]
    times = runs_api.cost_runs(runs, runs_api.RunCosting(), {"host_us_per_kernel": host_us})
    return [(*layout, ms) for layout, ms in zip(LAYOUTS, times)]


def test_the_fit_recovers_the_figure_the_runs_were_made_with(tmp_path, dapple):
    path = tmp_path / "runs.csv"
    write_runs(path, runs_made_at(200.0))
    runs = runs_api.read_runs(path)
    # The default figure prices these runs too fast, by the host it leaves out.
    before = runs_api.score(runs, runs_api.cost_runs(runs, runs_api.RunCosting(), {}))
    assert before["median_ratio"] < 0.5
    result = runs_api.fit(runs, runs_api.RunCosting())
    assert result.converged
    assert result.figures["host_us_per_kernel"] == pytest.approx(200.0, rel=0.02)
    assert result.mape_percent < 1.0

    out = tmp_path / "fit.json"
    done = dapple("calibrate", "--runs", path, "--folds", "3", "--out", out)
    assert done.returncode == 0, done.stderr
    fitted = json.loads(out.read_text())
    assert fitted["figures"]["host_us_per_kernel"] == pytest.approx(200.0, rel=0.02)
    assert fitted["defaults"]["host_us_per_kernel"] == planner.HOST_US_PER_KERNEL
    held = fitted["cross_validation"]["held_out"]
    assert held["mape_percent"] < 2.0 and held["runs"] == len(LAYOUTS)
    assert "host_us_per_kernel" in done.stdout and "calibrated, 3-fold" in done.stdout


def test_scores_rank_each_group_and_price_the_chosen_layout():
    runs = [runs_api.MeasuredRun(*layout, iteration_ms=ms)
            for layout, ms in zip(LAYOUTS[:3], (10.0, 20.0, 30.0))]
    # The same order: Spearman 1, the fastest chosen.
    s = runs_api.score(runs, [1.0, 2.0, 3.0])
    assert (s["groups"], s["median_spearman"], s["worst_regret"]) == (1, 1.0, 1.0)
    # Reversed: the slowest chosen, three times the best.
    s = runs_api.score(runs, [3.0, 2.0, 1.0])
    assert (s["median_spearman"], s["worst_regret"]) == (-1.0, 3.0)
    assert s["mape_percent"] == pytest.approx(100 * ((1 - 0.3) + (1 - 0.1) + (1 - 1 / 30)) / 3)


@pytest.mark.parametrize("change, code, message", [
    (lambda h, r: (h[:-1], [row[:-1] for row in r]), 3, "row 1: missing column 'iteration time (ms)'"),
    (lambda h, r: (h, [r[0][:7] + ["2", "2"] + r[0][9:]] + r[1:]), 4,
     "row 2: field '# GPUs': value 2 is not tensor x data x pipeline (2 x 2 x 1)"),
    (lambda h, r: (h, r[:1] + [r[1][:-1] + ["-3"]]), 3, "row 3: field 'iteration time (ms)': value -3 must be > 0"),
    (lambda h, r: (h, []), 3, "no runs after the header"),
    (lambda h, r: (h, [r[0][:1] + ["x"] + r[0][2:]]), 3, "row 2: field 'global batch': value 'x' is not a number"),
])
def test_bad_run_files_are_one_line_errors_and_write_nothing(tmp_path, dapple, change, code, message):
    rows = [[str(v) for v in layout] + ["10.0"] for layout in LAYOUTS]
    header, rows = change(HEADER, rows)
    path = tmp_path / "runs.csv"
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(rows)
    out = tmp_path / "fit.json"
    done = dapple("calibrate", "--runs", path, "--out", out)
    assert done.returncode == code, done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert f"runs.csv: {message}" in done.stderr
    assert not out.exists()


def test_more_folds_than_runs_is_refused_and_plan_mode_needs_its_files(tmp_path, dapple):
    path = tmp_path / "runs.csv"
    write_runs(path, [[*layout, 10.0] for layout in LAYOUTS[:2]])
    done = dapple("calibrate", "--runs", path, "--folds", "3", "--out", tmp_path / "fit.json")
    assert done.returncode == 4 and "2 runs cannot make 3 folds" in done.stderr
    done = dapple("calibrate", "--out", tmp_path / "p.json")
    assert done.returncode == 2 and "give --plan and --metrics" in done.stderr
