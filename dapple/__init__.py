"""dapple. A planner for training large neural networks on many GPUs:
pipeline, data, tensor, context and expert parallelism, ZeRO or FSDP
sharding, re-computation, offloading and the pipeline schedule, after
DAPPLE, Whale and XPipe.

One installed top-level package, so that nothing it ships can collide with
another package of the same name: `dapple.planner` (the plan API, profiler
and runtime) and `dapple.cli` (the `dapple` command). The repository keeps
them as the top-level folders `planner/` and `cli/`, links to these.
"""

import os as _os
import sys as _sys
from importlib.machinery import EXTENSION_SUFFIXES as _EXTENSION_SUFFIXES


def _has_core(package_dir: str) -> bool:
    """Whether ``package_dir`` holds the compiled core (an installed copy,
    or a checkout after ``pip install -e .``)."""
    return any(_os.path.exists(_os.path.join(package_dir, "planner", f"_core{suffix}"))
               for suffix in _EXTENSION_SUFFIXES)


def _installed_copy(here: str) -> str | None:
    """The installed dapple's folder, where ``here`` is a checkout without
    the compiled core. Python run in a checkout's root puts that folder
    first on its path, so that ``import dapple`` finds the source tree
    before the copy ``pip install .`` installed (issue 68)."""
    for entry in _sys.path:
        candidate = _os.path.join(_os.path.abspath(entry or _os.curdir), "dapple")
        if _os.path.realpath(candidate) != _os.path.realpath(here) and _has_core(candidate):
            return candidate
    return None


_here = _os.path.dirname(_os.path.abspath(__file__))
if not _has_core(_here):
    _installed = _installed_copy(_here)
    if _installed is not None:
        __path__[:] = [_installed]  # dapple.planner and dapple.cli: the installed ones
