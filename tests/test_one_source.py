"""Each rule lives in one place: the Python package asks the core instead of
keeping its own copy. These checks read the source (not the installed
wheel's behaviour), so a copy that comes back fails here by name."""

import ast
import re
from pathlib import Path

import pytest

from dapple import planner
import dapple.planner._core as core

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sorted((ROOT / "dapple" / "planner").rglob("*.py")) + sorted((ROOT / "dapple" / "cli").glob("*.py"))


def code_strings(path: Path) -> list[tuple[int, str]]:
    """String constants of a module's code: docstrings left out."""
    tree = ast.parse(path.read_text())
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
    ]


def offenders(predicate) -> list[str]:
    return [
        f"{path.relative_to(ROOT)}:{line}: {text!r}"
        for path in PYTHON
        for line, text in code_strings(path)
        if predicate(text)
    ]


def test_the_sources_are_here():
    assert len(PYTHON) > 30, PYTHON


def test_no_file_format_is_spelled_in_python():
    names = set(core.FORMATS)
    assert len(names) == 6
    assert offenders(lambda s: s in names or s in ("format", "schema_version")) == []


def test_no_preset_table_in_python():
    specs = set(core.PRESETS.values())
    assert planner.PRESETS == core.PRESETS
    assert offenders(lambda s: s in specs) == []


@pytest.mark.parametrize(
    "table",
    [core.BASELINES, core.SEARCH_SPACES, core.SCHEDULE_KINDS, core.PLACEMENT_POLICIES],
    ids=["baselines", "search spaces", "schedule kinds", "placement policies"],
)
def test_no_name_table_in_python(table):
    # A single default ("auto") may be written as a default argument; no
    # module lists the names.
    for path in PYTHON:
        found = {text for _, text in code_strings(path) if text in table and text != "auto"}
        assert len(found) <= 1, (path, found)
    assert offenders(lambda s: s == "pipedream-planner") == []


def test_no_allreduce_formula_or_slicing_in_python():
    ring = re.compile(r"2\s*\*\s*\(\s*\w+\s*-\s*1\s*\)")
    for path in PYTHON:
        text = path.read_text()
        assert not ring.search(text), path
        assert "divmod(" not in text, path  # micro-batch slices come from the core's layout


def test_no_private_helper_crosses_a_module():
    private_import = re.compile(r"^\s*from\s+\S+\s+import\s+(.*)$", re.M)
    for path in PYTHON:
        for names in private_import.findall(path.read_text()):
            imported = [n.strip().split(" as ")[0] for n in names.strip("()").split(",")]
            assert not [n for n in imported if n.startswith("_") and not n.startswith("__") and n != "_core"], (
                path, names)


def test_cli_choices_are_the_cores():
    from click import Choice

    from dapple.cli.main import cli

    choices = {}
    for name, command in cli.commands.items():
        for sub in getattr(command, "commands", {}).values() or [command]:
            for param in sub.params:
                if isinstance(param.type, Choice):
                    choices[(name, param.name)] = tuple(param.type.choices)
    assert choices[("plan", "search_space")] == core.SEARCH_SPACES
    assert choices[("plan", "warmup_policy")] == core.WARMUP_POLICIES
    assert choices[("simulate", "schedule")] == core.SCHEDULE_KINDS
    assert choices[("show", "schedule")] == core.SCHEDULE_KINDS


def test_every_core_error_code_has_its_class_and_only_errors_py_spells_them():
    from dapple.planner import errors

    for code in core.ERROR_CODES:
        cls = errors.class_of_code(code)
        assert cls is not errors.DappleError and cls.code == code, code
    assert errors.class_of_code("no such code") is errors.DappleError
    # "infeasible" is also a regression case's status, so only the codes
    # that are no English word are looked for.
    codes = {code for code in core.ERROR_CODES if "_" in code}
    assert len(codes) >= 4
    spelled = [found for found in offenders(lambda s: s in codes) if not found.startswith("dapple/planner/errors.py")]
    assert spelled == []
