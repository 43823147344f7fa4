"""Ranges of the numbers dapple accepts, checked where they enter."""

from __future__ import annotations

import operator

from .errors import InvalidInputError

#: The largest batch or micro-batch size: the core counts samples in 32 bits.
MAX_COUNT = 2**32 - 1


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
