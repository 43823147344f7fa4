"""Number formats training computes in (``--dtype`` of ``dapple profile
model`` and ``dapple run``): the names are the core's (``PRECISIONS``); this
module holds torch's dtype for each. Torch-free until asked for a dtype."""

from __future__ import annotations

from . import _core
from .errors import InvalidInputError

PRECISIONS: tuple[str, ...] = _core.PRECISIONS

#: torch's dtype attribute for each name; fp32 runs without autocast.
_TORCH_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def check_precision(name: str) -> str:
    """``name`` if it is a number format, else a one-line InvalidInputError."""
    if name not in PRECISIONS:
        raise InvalidInputError(f"--dtype {name}: not a number format; use one of {', '.join(PRECISIONS)}")
    return name


def torch_dtype(torch, name: str):
    """torch's dtype for ``name`` (``torch.bfloat16`` for ``bf16``)."""
    return getattr(torch, _TORCH_NAMES[check_precision(name)])


def autocast_parameter_state(optimizer: str) -> dict:
    """Bytes per parameter of each state training under torch's autocast
    holds with ``optimizer`` (the core's rule; the profile's
    ``parameter_state``)."""
    state = _core.autocast_parameter_state(optimizer)
    if state is None:
        raise InvalidInputError(f"optimizer {optimizer!r} is unknown to the profile format")
    return state
