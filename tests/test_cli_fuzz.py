"""Fuzzing the command line (issue 12): every numeric option with values
from the edge of its range and past it, and outputs that are special
files, dangling links, names ending in a slash or not UTF-8 (issue 29). The contract: an exit code from the documented table (never 1, an
internal error), no traceback, one line on stderr when it fails, and no
output that replaces a special file or is left half written.

In-process (``dapple.cli.main.main`` with its own argv), a fixed seed and a bounded
number of examples, so CI runs the same cases in about a minute. A longer
local run: ``DAPPLE_CLI_FUZZ_EXAMPLES=2000 pytest tests/test_cli_fuzz.py``.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import stat
import sys
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dapple import planner
from dapple.cli.exit_codes import INTERNAL_ERROR
from dapple.cli.main import main
from conftest import PROFILES
from dapple.planner.limits import MAX_PASSES, set_max_passes

EXAMPLES = int(os.environ.get("DAPPLE_CLI_FUZZ_EXAMPLES", "40"))
CLI_FUZZ = settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
DOCUMENTED = {0, 2, 3, 4, 5, 6, 9}
BERT = PROFILES / "bert-24-pbs-6.json"

# Numbers at and past the edges of every range, and text that is no number.
NUMBERS = st.one_of(
    st.sampled_from(["0", "1", "2", "-1", "4294967295", "4294967296", "99999999999999999999", "1e3", "0.5",
                     "nan", "inf", "-inf", "1e-308", "1e308", "", " ", "abc", "0x10", "16777216", "16777217",
                     "1000000", "1000001", "1024", "1025", "0.001"]),
    st.integers(min_value=-(2**40), max_value=2**40).map(str),
)


def run(*args) -> tuple[int, str]:
    """The dapple command in this process: (exit code, stderr). An exception
    that escapes it fails the test (it would be a traceback)."""
    err, out = io.StringIO(), io.StringIO()
    with mock.patch.object(sys, "argv", ["dapple", *map(str, args)]), \
            contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            main()
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else INTERNAL_ERROR
    set_max_passes(MAX_PASSES)  # --max-passes holds for one command: undo it here
    return code, err.getvalue()


def assert_contract(code: int, stderr: str, args) -> None:
    assert code in DOCUMENTED, (code, stderr, args)
    assert "Traceback" not in stderr and "internal error" not in stderr, (stderr, args)
    if code != 0:
        lines = [line for line in stderr.splitlines() if line.strip()]
        assert len(lines) == 1, (stderr, args)


@pytest.fixture(scope="module")
def places(tmp_path_factory):
    """Output targets: a directory, a FIFO, a device, a dangling and a good
    symlink, a file in a folder that does not exist, an existing file."""
    root = tmp_path_factory.mktemp("outs")
    fifo = root / "fifo"
    os.mkfifo(fifo)
    (root / "dir").mkdir()
    (root / "old.json").write_text("old\n")
    (root / "target.json").write_text("old\n")
    os.symlink(root / "target.json", root / "link.json")
    os.symlink(root / "gone" / "plan.json", root / "dangling.json")
    plan = root / "plan.json"
    planner.plan(BERT, "2x2-nvlink", 24).save(plan)
    return {"root": root, "fifo": fifo, "dir": root / "dir", "device": "/dev/null", "old": root / "old.json",
            "link": root / "link.json", "missing": root / "no" / "such" / "p.json", "new": root / "new.json",
            "empty": "", "plan": plan, "dangling": root / "dangling.json", "slash": f"{root}/folder/",
            # A name that is not UTF-8: written, and named escaped.
            "bytes": root / os.fsdecode(b"new\xff.json")}


def assert_places_intact(places) -> None:
    assert stat.S_ISFIFO(os.stat(places["fifo"]).st_mode)
    assert places["dir"].is_dir()
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)
    assert places["link"].is_symlink()
    # Refused, and nothing written: the link still points nowhere, no
    # file or folder took the slash's name.
    assert places["dangling"].is_symlink() and not places["dangling"].exists()
    assert not (places["root"] / "folder").exists() and not (places["root"] / "gone").exists()
    for name in ("old", "link", "new", "bytes"):
        path = places[name]
        if path.exists():  # untouched, or a whole plan
            text = path.read_text()
            assert text == "old\n" or planner.Plan.from_json(text), name


OUTPUTS = st.sampled_from(["fifo", "dir", "device", "old", "link", "missing", "new", "empty", "dangling", "slash",
                           "bytes"])


@CLI_FUZZ
@given(gbs=NUMBERS, min_slice=st.one_of(st.none(), NUMBERS), gib=st.one_of(st.none(), NUMBERS),
       passes=st.one_of(st.none(), NUMBERS), space=st.sampled_from(["auto", "full", "machine-aligned", "x"]),
       out=st.one_of(st.none(), OUTPUTS))
def test_plan_options_and_outputs_keep_the_contract(places, gbs, min_slice, gib, passes, space, out):
    args = ["plan", "--profile", BERT, "--topology", "2x2-nvlink", "--global-batch-size", gbs,
            "--search-space", space]
    for flag, value in (("--min-micro-batch-size", min_slice), ("--max-search-gib", gib), ("--max-passes", passes)):
        if value is not None:
            args += [flag, value]
    if out is not None:
        args += ["--out", places[out]]
    assert_contract(*run(*args), args)
    assert_places_intact(places)


@CLI_FUZZ
@given(command=st.sampled_from(["estimate", "simulate"]), passes=st.one_of(st.none(), NUMBERS),
       out=st.one_of(st.none(), OUTPUTS))
def test_costing_a_plan_keeps_the_contract(places, command, passes, out):
    args = [command, "--plan", places["plan"], "--profile", BERT]
    if passes is not None:
        args += ["--max-passes", passes]
    if out is not None and command == "simulate":
        args += ["--out", places[out]]
    assert_contract(*run(*args), args)
    assert_places_intact(places)


@CLI_FUZZ
@given(tasks=st.one_of(st.none(), NUMBERS), gantt=OUTPUTS, memory=st.one_of(st.none(), OUTPUTS))
def test_pictures_keep_the_contract_and_write_all_or_none(places, tasks, gantt, memory):
    root = places["root"]
    picture = {"new": root / "g.svg", "old": root / "old.svg"}.get(gantt, places[gantt])
    args = ["show", "--plan", places["plan"], "--profile", BERT, "--gantt", picture]
    if memory is not None:
        args += ["--memory", {"new": root / "m.svg", "old": root / "old.svg"}.get(memory, places[memory])]
    if tasks is not None:
        args += ["--max-tasks-drawn", tasks]
    code, stderr = run(*args)
    assert_contract(code, stderr, args)
    assert_places_intact(places)
    if code != 0:
        assert not (root / "g.svg").exists() and not (root / "m.svg").exists(), args
    for name in ("g.svg", "m.svg"):
        (root / name).unlink(missing_ok=True)


@CLI_FUZZ
@given(spec=st.one_of(st.text(max_size=40), st.from_regex(r"\A[0-9]{1,8}x[0-9]{1,8}(-[a-z0-9]{1,8}){0,3}\Z")))
def test_topology_specs_keep_the_contract(spec):
    code, stderr = run("topology", "show", spec)
    assert_contract(code, stderr, spec)


def test_the_regression_corpus_keeps_the_contract(places, small_profile):
    """The issue's own cases, once each."""
    profile = small_profile()
    fifo = places["fifo"]
    cases = [
        ["plan", "--profile", profile, "--topology", "1x2", "--global-batch-size", "4294967296"],
        ["plan", "--profile", profile, "--topology", "65536x65536-nvlink", "--global-batch-size", "8"],
        ["plan", "--profile", profile, "--topology", "99999x99999", "--global-batch-size", "8"],
        ["plan", "--profile", profile, "--topology", "4294967295x1", "--global-batch-size", "8"],
        ["plan", "--profile", fifo, "--topology", "1x2", "--global-batch-size", "8"],
        ["plan", "--profile", "", "--topology", "1x2", "--global-batch-size", "8"],
        ["plan", "--profile", places["dir"], "--topology", "1x2", "--global-batch-size", "8"],
        ["plan", "--profile", profile, "--topology", "1x2", "--global-batch-size", "8", "--out", ""],
        ["plan", "--profile", profile, "--topology", "1x2", "--global-batch-size", "8", "--out", places["dir"]],
        ["plan", "--profile", profile, "--topology", "1x2", "--global-batch-size", "8", "--out", fifo],
        ["topology", "show", "x" * 300],
        ["show", "--plan", places["plan"], "--gantt", places["root"] / "ok.png", "--memory",
         places["root"] / "missing" / "m.png"],
    ]
    for args in cases:
        code, stderr = run(*args)
        assert code != 0, args
        assert_contract(code, stderr, args)
    assert not (places["root"] / "ok.png").exists()
    assert_places_intact(places)


def test_a_suite_of_extreme_numbers_keeps_the_contract(tmp_path):
    suite = json.loads((PROFILES.parent / "regress" / "paper-table-v.json").read_text())
    suite["cases"] = suite["cases"][:1]
    for value in ("4294967296", "1" + "0" * 5000, "-1", "0"):
        case = dict(suite["cases"][0], global_batch_size=12345)
        path = tmp_path / "s.json"
        path.write_text(json.dumps(dict(suite, cases=[case])).replace("12345", value))
        code, stderr = run("regress", path)
        assert code == 3, (value, stderr)
        assert_contract(code, stderr, value)
