"""Commands a doc shows, run, with what they printed: the helper of the
docs' cog blocks (`cog -I docs -r README.md docs/*.md` writes them;
tests/test_docs.py fails where a doc differs from what it gives).

Each doc's commands run in order in one scratch folder, as a reader would
type them in an empty one: a file a later command reads is made by a
command the doc shows. The repository's `profiles/` is linked there, so
that a shipped profile is named as in a checkout."""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import cog

ROOT = Path(__file__).resolve().parent.parent
#: The terminal width the outputs are shown at.
COLUMNS = 100

#: Lines left out of what a command printed: the search's counts of
#: states and stages, which vary with its threads' timing (the plan does not).
VARYING = ("searched micro-batch sizes ",)

_folders: dict[str, Path] = {}


def _folder() -> Path:
    """The scratch folder of the doc being written (one per input file)."""
    doc = cog.inFile
    if doc not in _folders:
        folder = Path(tempfile.mkdtemp(prefix="dapple-doc-"))
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        (folder / "profiles").symlink_to(ROOT / "profiles")
        _folders[doc] = folder
    return _folders[doc]


def run(command: str) -> str:
    """``command`` run by bash in the doc's folder: its stdout and stderr,
    in the order written, less the ``VARYING`` lines. A failing command
    fails the doc."""
    env = {**os.environ, "COLUMNS": str(COLUMNS), "PYTHONUNBUFFERED": "1", "NO_COLOR": "1"}
    env.pop("TTY_COMPATIBLE", None)
    done = subprocess.run(["bash", "-c", command], cwd=_folder(), env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"{cog.inFile}: `{command}` exited {done.returncode}: {done.stdout}")
    return "".join(line for line in done.stdout.splitlines(keepends=True) if not line.startswith(VARYING))


def shell(*commands: str, show: bool = True) -> None:
    """Write a console block: each command after ``$ ``, and (``show``)
    what it printed."""
    cog.outl("```console")
    for command in commands:
        printed = run(command)
        cog.outl(f"$ {command}")
        if show and printed:
            cog.out(printed if printed.endswith("\n") else printed + "\n")
    cog.outl("```")
