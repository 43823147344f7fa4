"""Exit codes of the ``dapple`` command. Stable: scripts may rely on them.

| code | meaning |
|------|---------|
| 0 | success |
| 1 | internal error (a bug: please report it) |
| 2 | usage error: unknown option, missing argument (click) |
| 3 | invalid input: a file or value that is not valid for its format |
| 4 | incompatible inputs: valid alone, unusable together (e.g. batch size vs GPUs) |
| 5 | infeasible: no plan fits in the GPUs' memory |
| 6 | I/O error: a file could not be read or written |
| 7 | regression: `dapple regress` found a slower or infeasible plan |
| 8 | run failed: a worker of `dapple run` raised or died |
| 9 | limit: the work asked for is over a documented limit, each with an option to raise it (the micro-batch passes one simulation runs, `MAX_PASSES` in `schedule.rs`, `--max-passes`; the tasks a timeline draws, `MAX_TASKS_DRAWN` in `limits.py`, `--max-tasks-drawn`; the memory of the search's tables, `DEFAULT_MAX_SEARCH_BYTES` in `search.rs`, `--max-search-gib`; the steps of its DP at one micro-batch size where no plan was found, `DEFAULT_MAX_SEARCH_STEPS` in `search/mod.rs`, `--max-search-steps`), or an input file over `MAX_INPUT_BYTES` (`limits.py`, 256 MiB, no option: no real input comes near it); the message says what to do |
"""

from dapple.planner import errors

OK = 0
INTERNAL_ERROR = 1
USAGE_ERROR = 2
INVALID_INPUT = 3
INCOMPATIBLE_INPUTS = 4
INFEASIBLE = 5
IO_ERROR = 6
REGRESSION = 7
RUN_FAILED = 8
LIMIT_EXCEEDED = 9

_BY_CLASS = [
    (errors.InvalidInputError, INVALID_INPUT),
    (errors.IncompatibleInputsError, INCOMPATIBLE_INPUTS),
    (errors.InfeasibleError, INFEASIBLE),
    (errors.DappleIOError, IO_ERROR),
    (errors.RunFailedError, RUN_FAILED),
    (errors.LimitExceededError, LIMIT_EXCEEDED),
]


def exit_code_for(error: errors.DappleError) -> int:
    for cls, code in _BY_CLASS:
        if isinstance(error, cls):
            return code
    return INTERNAL_ERROR
