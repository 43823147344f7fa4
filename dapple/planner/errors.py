"""Exceptions raised by dapple, one class per stable error code.

The Rust core raises these through the binding (``rust_core/py``); the CLI
turns each into its exit code (see ``cli/exit_codes.py``).
"""

from __future__ import annotations


class DappleError(Exception):
    """Base class. ``code`` is stable across versions; match on it, not on text."""

    code = "dapple_error"

    def __init__(self, message: str, code: str | None = None, source: str | None = None, field: str | None = None):
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        self.source = source
        self.field = field

    def __str__(self) -> str:
        return self.message


class InvalidInputError(DappleError, ValueError):
    """A file or argument that is not valid for its format (also a ValueError)."""

    code = "invalid_input"


class IncompatibleInputsError(DappleError):
    """Inputs valid alone that cannot be used together."""

    code = "incompatible_inputs"


class InfeasibleError(DappleError):
    """No plan fits the devices' memory."""

    code = "infeasible"


class DappleIOError(DappleError):
    """A file could not be read or written."""

    code = "io_error"


class LimitExceededError(DappleError):
    """The work asked for is over a documented limit (e.g. the micro-batch
    passes one simulation runs); the message says which and what to do."""

    code = "limit_exceeded"


class RunFailedError(DappleError):
    """A worker of `dapple run` raised or died; the run was stopped."""

    code = "run_failed"


def class_of_code(code: str) -> type[DappleError]:
    """The exception class of a stable error code: how the binding raises
    the core's errors (each core code has its class; `ERROR_CODES`)."""
    classes = [DappleError]
    while classes:
        cls = classes.pop()
        if cls.code == code:
            return cls
        classes.extend(cls.__subclasses__())
    return DappleError


def naming_keyword(error: DappleError, keywords) -> DappleError:
    """``error``, where it is about a plan field one of the call's
    ``keywords`` set (``stages[0].context_parallel``, set by
    ``context_parallel=``), said of the keyword as the caller typed it:
    "context_parallel=2: ..." (issue 68). Other errors as they are."""
    leaf = (error.field or "").rsplit(".", 1)[-1]
    if leaf not in keywords or error.field == leaf:
        return error
    prefix = f"field {error.field}: "
    text = error.message[len(prefix):] if error.message.startswith(prefix) else error.message
    text = text[len("value "):] if text.startswith("value ") else f": {text}"
    return type(error)(f"{leaf}={text}", code=error.code, source=error.source, field=leaf)
