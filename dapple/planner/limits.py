"""Ranges of the numbers dapple accepts, checked where they enter."""

from __future__ import annotations

import operator

from . import _core
from .errors import InvalidInputError, LimitExceededError

#: The largest batch or micro-batch size: the core counts samples in 32 bits.
MAX_COUNT = 2**32 - 1

#: The most bytes dapple reads of one input file (a profile, topology,
#: plan, metrics or suite file, a graph.txt, a model config): 256 MiB, far
#: above any real one (the largest shipped file is under 1 MiB). A larger
#: file is refused (exit 9) before it is read whole: a sparse file of
#: several GiB would otherwise exhaust memory first.
MAX_INPUT_BYTES = 256 * 2**20


def digits_value(digits: str) -> int:
    """Decimal ``digits`` as a number, capped at 10**20, past any count
    dapple takes: Python's ``int`` refuses more than 4,300 digits (leading
    zeros included, which change no value)."""
    significant = digits.lstrip("0") or "0"
    return int(significant) if len(significant) <= 20 else 10**20


def check_count(field: str, value: object, minimum: int = 1) -> int:
    """``value`` as a sample count in ``minimum..MAX_COUNT``, or an
    invalid-input error naming ``field`` (never an overflow in the core)."""
    try:
        count = operator.index(value)  # int and int-like (numpy); not float or text
    except TypeError:
        count = None
    if count is None or isinstance(value, bool) or not minimum <= count <= MAX_COUNT:
        raise InvalidInputError(f"field {field}: value {value!r} must be an integer in {minimum}..{MAX_COUNT}")
    return count


#: Most memory the search's tables may take by default (the core's
#: ``DEFAULT_MAX_SEARCH_BYTES``), in GiB, and the most an option may ask for.
DEFAULT_MAX_SEARCH_GIB = _core.DEFAULT_MAX_SEARCH_BYTES / 2**30
MAX_SEARCH_GIB = 1024.0

#: Most steps the search's DP may take at one micro-batch size by default
#: (the core's ``DEFAULT_MAX_SEARCH_STEPS``): past it that size's other
#: layouts are left to the walk and the plan is the best found.
DEFAULT_MAX_SEARCH_STEPS = _core.DEFAULT_MAX_SEARCH_STEPS

#: Most machines a search takes by default (``--max-search-machines``):
#: the DP's stage sizes grow with the machines, and so does its time past
#: what its step limit bounds. Measured on this 2-core machine with
#: AmoebaNet-6 (complicated) at its default global batch (benchmarks/
#: README.md): 16384x1 plans in 15 s, 30000x1 in 62 s, 100000x1 in 160 s and
#: 1.7 GB; a topology past the limit is refused at once (exit 9).
DEFAULT_MAX_SEARCH_MACHINES = 16_384


def check_search_machines(topology_name: str, machines: int, limit: int | None) -> None:
    """A limit error when a topology of ``machines`` machines is past what
    the search answers in about a minute (``limit``, default
    ``DEFAULT_MAX_SEARCH_MACHINES``)."""
    limit = DEFAULT_MAX_SEARCH_MACHINES if limit is None else check_count("max_search_machines", limit)
    if machines > limit:
        raise LimitExceededError(
            f"topology {topology_name}: {machines} machines are past the {limit} a search takes (its time grows "
            "with the machines: 30000 single-GPU machines took a minute on 2 cores); raise the limit with "
            "--max-search-machines, or plan on fewer, larger machines")


def check_search_gib(field: str, value: object) -> float:
    """``value`` as a search memory limit in GiB, above 0 and at most
    ``MAX_SEARCH_GIB``, or an invalid-input error naming ``field``."""
    try:
        gib = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        gib = float("nan")
    if isinstance(value, bool) or not 0 < gib <= MAX_SEARCH_GIB:
        raise InvalidInputError(f"field {field}: value {value!r} must be a number of GiB in (0, {MAX_SEARCH_GIB:g}]")
    return gib


#: Most tasks a timeline picture (``dapple show --gantt``) draws by default,
#: and the most ``--max-tasks-drawn`` may ask for. matplotlib takes about
#: 0.4-0.6 ms a task here (31,776 tasks in 19.9 s, 127,008 in 54.3 s, load
#: average 4-5), so the default keeps a picture to about 10 s.
MAX_TASKS_DRAWN = 20_000
MAX_TASKS_DRAWN_CEILING = 1_000_000

#: Micro-batch passes (stages x micro-batches) one simulation runs by
#: default, and the most ``--max-passes`` may ask for: the core's
#: (``schedule.rs``), about 1.1 KB of memory a pass.
MAX_PASSES = _core.MAX_PASSES
MAX_PASSES_CEILING = _core.MAX_PASSES_CEILING


def set_max_passes(passes: int) -> None:
    """Raise (or lower) the limit on the micro-batch passes one simulation
    runs, for the rest of this process: plans over it are refused with
    LimitExceededError, and the search leaves out micro-batch sizes over it."""
    _core.set_max_passes(passes)
