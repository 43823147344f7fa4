"""Numbers beyond what dapple can count are refused where they enter, with
the usual one-line errors (issue 12): sample counts beyond 32 bits, GPU
counts that would wrap or exhaust memory."""

import pytest

import planner
from conftest import PROFILES, assert_one_line_error

BERT = PROFILES / "bert-48-pbs-2.json"
PLAN_ARGS = ["plan", "--profile", BERT, "--topology", "A"]


@pytest.mark.parametrize("value", ["4294967296", "99999999999999999999"])
def test_counts_beyond_32_bits_are_usage_errors_not_overflows(dapple, value):
    r = dapple(*PLAN_ARGS, "--global-batch-size", value)
    assert r.returncode == 2, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "4294967295" in lines[0] and "Traceback" not in r.stderr


def test_counts_beyond_32_bits_through_the_api_name_the_field(tmp_path):
    with pytest.raises(planner.InvalidInputError, match="field global_batch_size: value 4294967296"):
        planner.plan(BERT, "A", 2**32)
    with pytest.raises(planner.InvalidInputError, match="field min_micro_batch_size"):
        planner.baseline("gpipe", BERT, "A", 64, min_micro_batch_size=-1)


def test_usage_errors_are_one_line(dapple):
    r = dapple("plan", "--topology", "A")
    assert r.returncode == 2
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "--profile" in lines[0] and "dapple plan --help" in lines[0]


@pytest.mark.parametrize("spec", ["65536x65536-nvlink", "99999x99999", "4294967295x1", "1x2000-nvlink"])
def test_gpu_counts_that_would_wrap_are_invalid_specs(dapple, spec):
    r = dapple("topology", "show", spec)
    assert_one_line_error(r, 3, spec)
