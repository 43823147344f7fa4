"""`dapple regress`: plan-quality regression suites."""

import json

import pytest

from conftest import PROFILES, ROOT
from dapple import planner

SUITE = ROOT / "profiles" / "regress" / "paper-table-v.json"


def write_suite(tmp_path, cases, **extra):
    suite = {"format": "dapple.regress-suite", "schema_version": 2, "tolerance": 0.01, "cases": cases, **extra}
    path = tmp_path / "suite.json"
    path.write_text(json.dumps(suite))
    return path


def bert_case(**over):
    case = {"name": "bert A", "profile": str(PROFILES / "bert-48-pbs-2.json"), "topology": "A", "global_batch_size": 64}
    case.update(over)
    return case


def test_shipped_suite_passes(dapple):
    r = dapple("regress", SUITE)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "15 passed, 0 failed" in r.stderr


def test_a_worsened_plan_fails_with_a_readable_diff(dapple, tmp_path):
    # Recorded expectation from a better plan than today's: today's is slower.
    shipped = json.loads(SUITE.read_text())
    bert = next(c for c in shipped["cases"] if c["name"] == "BERT-48 A")
    path = write_suite(tmp_path, [bert_case(expected_ms=bert["expected_ms"] * 0.8, expected_shape="1:15")])
    r = dapple("regress", path)
    assert r.returncode == 7
    line = next(l for l in r.stdout.splitlines() if "bert A" in l)
    assert line.startswith("SLOWER") and "+25.0%" in line and f"plan 1:15 -> {bert['expected_shape']}" in line


def test_infeasible_case_fails(dapple, tmp_path):
    # The same cluster with 128 MiB GPUs: no BERT-48 layer fits in one.
    topo = json.loads(dapple("topology", "show", "A", "--json").stdout)
    topo["machine_groups"][0]["gpu"]["memory_bytes"] = 2**27
    small = tmp_path / "small-gpus.json"
    small.write_text(json.dumps(topo))
    path = write_suite(tmp_path, [bert_case(topology=str(small), expected_ms=100.0)])
    r = dapple("regress", path)
    assert r.returncode == 7
    assert "INFEASIBLE" in r.stdout and "GiB" in r.stdout


def test_update_records_todays_plans(dapple, tmp_path):
    path = write_suite(tmp_path, [bert_case(expected_ms=1.0)])
    assert dapple("regress", path, "--update").returncode == 0
    case = json.loads(path.read_text())["cases"][0]
    today = planner.plan(PROFILES / "bert-48-pbs-2.json", "A", 64)
    assert case["expected_shape"] == today.shape and case["expected_ms"] == pytest.approx(today.iteration_ms)
    assert dapple("regress", path).returncode == 0


def test_bad_suite_names_the_field(dapple, tmp_path):
    path = write_suite(tmp_path, [bert_case(global_batch_size="many")])
    r = dapple("regress", path)
    assert r.returncode == 3
    assert "cases[0].global_batch_size" in r.stderr and "many" in r.stderr and "Traceback" not in r.stderr


def test_bad_case_input_is_invalid_input_not_a_failed_plan(dapple, tmp_path):
    from conftest import assert_one_line_error

    path = write_suite(tmp_path, [bert_case(topology="2x8-nvlnk")])
    assert_one_line_error(dapple("regress", path), 3, "case 'bert A'", "2x8-nvlnk")
    path = write_suite(tmp_path, [bert_case(min_micro_batch_size="2")])
    assert_one_line_error(dapple("regress", path), 3, "cases[0].min_micro_batch_size", '"2"')
    path = write_suite(tmp_path, [bert_case(), bert_case(expected_ms=1.0)])
    assert_one_line_error(dapple("regress", path), 3, "field cases", '"bert A"', "unique")
