"""The front door tells the truth (issue 68): the docs' shown commands and
figures are what the code gives, the reference is generated from the
commands, the README's Python runs as written, and one sentence says what
dapple is everywhere it is said."""

from __future__ import annotations

import doctest
import os
import re
import subprocess
import sys
import tomllib

import pytest

from conftest import DAPPLE, ROOT
from dapple import planner
from dapple.cli.main import cli
from dapple.cli.plan import PANELS

#: The documents whose shown output and figures cog writes (cog blocks).
COGGED = ["README.md", "docs/cli.md", "docs/schedules.md", "docs/export.md", "docs/published-runs.md"]


def _cog(*args: str, cwd=ROOT) -> subprocess.CompletedProcess:
    """cog as the docs' own check runs it, with the installed `dapple` first on the path."""
    env = {**os.environ, "PATH": f"{DAPPLE.parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    return subprocess.run([sys.executable, "-m", "cogapp", "-I", str(ROOT / "docs"), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=900)


def test_the_docs_are_what_their_commands_and_results_give():
    done = _cog("--check", "--diff", *COGGED)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:] + "\nrun: cog -I docs -r " + " ".join(COGGED)


def test_the_check_fails_where_a_figure_was_changed(tmp_path):
    # The check itself: one figure changed in a copy of the reference fails it.
    changed = tmp_path / "cli.md"
    text = (ROOT / "docs" / "cli.md").read_text()
    assert "default 10,000,000" in text
    changed.write_text(text.replace("default 10,000,000", "default 10,000,001", 1))
    assert _cog("--check", str(changed)).returncode != 0


def _pycon_examples(path) -> list[str]:
    return re.findall(r"```pycon\n(.*?)```", path.read_text(), flags=re.S)


@pytest.mark.parametrize("where", ["root", "elsewhere"])
def test_the_readmes_python_prints_what_it_says(where, tmp_path):
    # From the checkout's root, the source tree must not shadow the
    # installed package; from anywhere else, its profile must be found.
    examples = _pycon_examples(ROOT / "README.md")
    assert examples
    program = (
        "import doctest, sys\n"
        "parser, runner = doctest.DocTestParser(), doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)\n"
        "for i, text in enumerate(sys.argv[1:]):\n"
        "    runner.run(parser.get_doctest(text, {}, f'README example {i}', 'README.md', 0))\n"
        "sys.exit(1 if runner.summarize(verbose=False).failed else 0)\n"
    )
    cwd = ROOT if where == "root" else tmp_path
    done = subprocess.run([sys.executable, "-c", program, *examples], cwd=cwd, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr


def test_one_sentence_says_what_dapple_is():
    sentence = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["description"]
    said = {
        "README.md's first paragraph": (ROOT / "README.md").read_text().split("\n\n")[1],
        "dapple --help": subprocess.run([str(DAPPLE), "--help"], capture_output=True, text=True,
                                        env={**os.environ, "COLUMNS": "1000"}).stdout,
        "dapple/__init__.py": __import__("dapple").__doc__,
        "dapple/planner/__init__.py": planner.__doc__,
    }
    for where, text in said.items():
        assert sentence in " ".join(text.replace("│", " ").split()), where


def test_plan_help_lists_every_option_in_a_panel_a_screen_each():
    plan = cli.commands["plan"]
    options = {name for p in plan.params for name in p.opts}
    # Every option, literally, by panel: a new one needs a panel and a line here.
    assert PANELS == {
        "Inputs": ["--profile", "--topology", "--global-batch-size", "--for"],
        "Search space": ["--search-space", "--stage-shapes", "--min-micro-batch-size", "--refine"],
        "Memory": ["--max-shard-level", "--max-context-parallel"],
        "Schedule": ["--schedule", "--chunks", "--warmup-policy"],
        "Overlap (--for sets its runtime's)": ["--overlap-grad-reduce", "--overlap-param-gather"],
        "Hints (Whale's; docs/hints.md)": ["--stages", "--micro-batches", "--pin-cut", "--replicate", "--split",
                                           "--from-layout"],
        "Work limits (exit 9 past them)": ["--max-search-gib", "--max-search-steps", "--max-search-machines",
                                           "--max-passes"],
        "Output": ["--out", "--json", "--quiet", "--help"],
    }
    paneled = [name for names in PANELS.values() for name in names]
    assert sorted(paneled) == sorted(options | {"--help"}), set(paneled) ^ (options | {"--help"})
    assert all("No effect" not in (p.help or "") for p in plan.params)
    shown = subprocess.run([str(DAPPLE), "plan", "--help"], capture_output=True, text=True,
                           env={**os.environ, "COLUMNS": "100"}).stdout
    heights, current = {}, None
    for line in shown.splitlines():
        if line.startswith("╭─"):
            current = line.strip("╭─ ").split(" ─")[0]
            heights[current] = 0
        if current is not None:
            heights[current] += 1
        if line.startswith("╰"):
            current = None
    assert set(heights) == set(PANELS), heights
    assert max(heights.values()) <= 40, heights  # a screen of 40 lines at 100 columns


def test_the_example_profiles_ship_inside_the_package():
    assert "artifact/bert-48-pbs-2" in planner.EXAMPLE_PROFILES and "whale/resnet50-fc1000k" in planner.EXAMPLE_PROFILES
    for name in planner.EXAMPLE_PROFILES:
        assert planner.Profile.example(name).layers
    with pytest.raises(planner.InvalidInputError, match="not shipped"):
        planner.Profile.example("artifact/no-such")
    assert (ROOT / "profiles").resolve() == (ROOT / "dapple" / "profiles").resolve()
