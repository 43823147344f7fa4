"""Inputs and outputs that are not plain files (issue 12, outputs slice):
special files are refused without blocking and never replaced, an empty
path is a usage error, symlinks are followed, and several outputs are
written all or none."""

import os
import subprocess

import pytest

from dapple import planner
from dapple.planner.errors import DappleIOError
from dapple.planner.files import read_text, write_all_atomic, write_atomic
from conftest import PROFILES, assert_one_line_error

BERT = PROFILES / "bert-48-pbs-2.json"
PLAN_ARGS = ["plan", "--profile", BERT, "--topology", "A", "--global-batch-size", "64"]


def test_a_fifo_as_input_is_refused_without_blocking(dapple, tmp_path):
    fifo = tmp_path / "profile.json"
    os.mkfifo(fifo)
    try:
        r = dapple("plan", "--profile", fifo, "--topology", "A", "--global-batch-size", "64", timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail("reading a FIFO blocked")
    assert_one_line_error(r, 6, str(fifo), "FIFO")


def test_a_directory_as_input_or_output_is_one_line(dapple, tmp_path):
    r = dapple("plan", "--profile", tmp_path, "--topology", "A", "--global-batch-size", "64")
    assert_one_line_error(r, 6, str(tmp_path), "directory")
    r = dapple(*PLAN_ARGS, "--out", tmp_path)
    assert_one_line_error(r, 6, str(tmp_path), "directory")


def test_an_empty_path_is_a_usage_error(dapple):
    for args in (["plan", "--profile", "", "--topology", "A"], [*PLAN_ARGS, "--out", ""]):
        r = dapple(*args)
        assert r.returncode == 2, r.stderr
        assert "empty path" in r.stderr and "Traceback" not in r.stderr


def test_special_outputs_are_refused_and_left_alone(dapple, tmp_path):
    fifo = tmp_path / "plan.json"
    os.mkfifo(fifo)
    r = dapple(*PLAN_ARGS, "--out", fifo)
    assert_one_line_error(r, 6, str(fifo), "FIFO")
    assert fifo.is_fifo()
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]  # no temporary file left


def test_a_symlink_output_replaces_its_target_and_stays(dapple, tmp_path):
    (tmp_path / "results").mkdir()
    target = tmp_path / "results" / "plan.json"
    target.write_text("old")
    link = tmp_path / "latest.json"
    link.symlink_to(target)
    r = dapple(*PLAN_ARGS, "--out", link)
    assert r.returncode == 0, r.stderr
    assert link.is_symlink() and link.resolve() == target.resolve()
    assert planner.Plan.load(target).shape == planner.Plan.load(link).shape


def test_pictures_are_written_all_or_none(dapple, tmp_path):
    plan = tmp_path / "plan.json"
    assert dapple(*PLAN_ARGS, "--out", plan).returncode == 0
    gantt = tmp_path / "gantt.png"
    r = dapple("show", "--plan", plan, "--gantt", gantt, "--memory", tmp_path / "missing" / "memory.png")
    assert_one_line_error(r, 6, "missing")
    assert not gantt.exists()
    # The failure comes after the first picture was drawn: nothing is left.
    blocked = tmp_path / "memory.png"
    blocked.mkdir()
    r = dapple("show", "--plan", plan, "--gantt", gantt, "--memory", blocked)
    assert_one_line_error(r, 6, "directory")
    assert not gantt.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["memory.png", "plan.json"]


def test_write_all_atomic_leaves_nothing_when_one_write_fails(tmp_path):
    first, second = tmp_path / "a.txt", tmp_path / "b.txt"
    first.write_text("old a")

    def fail(path):
        raise DappleIOError("drawing failed")

    with pytest.raises(DappleIOError):
        write_all_atomic([(first, lambda p: write_atomic(p, "new a")), (second, fail)])
    assert first.read_text() == "old a"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt"]
    write_all_atomic([(first, lambda p: write_atomic(p, "new a")), (second, lambda p: write_atomic(p, "b"))])
    assert (first.read_text(), second.read_text()) == ("new a", "b")


def test_reading_refuses_special_files(tmp_path):
    fifo = tmp_path / "f"
    os.mkfifo(fifo)
    with pytest.raises(DappleIOError, match="FIFO"):
        read_text(fifo)
    with pytest.raises(DappleIOError, match="empty input path"):
        read_text("")
    with pytest.raises(DappleIOError, match="File name too long"):
        read_text("x" * 5000)


def test_a_long_topology_spec_is_an_invalid_spec_not_a_file_error(dapple):
    r = dapple("topology", "show", "9" * 300)
    assert_one_line_error(r, 3, "topology spec")


def test_file_names_that_are_not_utf8_are_named_escaped(dapple, tmp_path):
    # A name's byte 0xff is no UTF-8: Python holds it as a lone surrogate,
    # which once reached the core as text and ended in an internal error.
    bad = tmp_path / os.fsdecode(b"bad\xff.json")
    bad.write_bytes(BERT.read_bytes())
    for args in (["estimate", "--plan", bad], ["simulate", "--plan", bad], ["topology", "show", bad]):
        r = dapple(*args)
        assert_one_line_error(r, 3, "bad\\xff.json", "not a dapple.")
    r = dapple("plan", "--profile", bad, "--topology", "A", "--global-batch-size", "64")
    assert r.returncode == 0, r.stderr
    missing = tmp_path / os.fsdecode(b"graph\xfe.txt")
    r = dapple("profile", "import-artifact", missing, "--model", "m", "--batch-size", "2", "--out", tmp_path / "p.json")
    assert_one_line_error(r, 6, "graph\\xfe.txt", "no such file")
    out = tmp_path / os.fsdecode(b"plan\xff.json")
    r = dapple(*PLAN_ARGS, "--out", out)
    assert r.returncode == 0 and "plan written to" in r.stderr and "plan\\xff.json" in r.stderr, r.stderr
    assert planner.Plan.load(out).shape


def test_an_output_ending_in_a_slash_is_refused_and_nothing_written(dapple, tmp_path):
    # Path("out/") is Path("out"): the plan once went to a file named out.
    r = dapple(*PLAN_ARGS, "--out", f"{tmp_path}/out/")
    assert_one_line_error(r, 6, "out/", "slash")
    assert list(tmp_path.iterdir()) == []


def test_a_dangling_symlink_output_is_refused_and_left_dangling(dapple, tmp_path):
    link = tmp_path / "latest.json"
    link.symlink_to(tmp_path / "results" / "plan.json")
    r = dapple(*PLAN_ARGS, "--out", link)
    assert_one_line_error(r, 6, "latest.json", "does not exist")
    assert link.is_symlink() and not link.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["latest.json"]


def test_an_input_over_the_size_limit_is_refused_unread(dapple, tmp_path):
    from dapple.planner.limits import MAX_INPUT_BYTES

    huge = tmp_path / "plan.json"
    with open(huge, "wb") as f:
        f.truncate(4 * 2**30)  # sparse: 4 GiB of zeros in no disk space
    r = dapple("estimate", "--plan", huge, timeout=60)
    assert_one_line_error(r, 9, "plan.json", f"more than {MAX_INPUT_BYTES // 2**20} MiB")
