"""Running real PyTorch models: model factories (:mod:`dapple.planner.runtime.models`).

Import-light on purpose: importing this package does not import torch, so
planning (``from dapple import planner``) never needs it. ``ModelSpec`` and
``load_model`` are loaded from :mod:`dapple.planner.runtime.models` (which imports
torch) on first use.
"""

from __future__ import annotations

__all__ = ["ModelSpec", "load_model"]


def __getattr__(name: str):
    if name in __all__:
        from . import models

        return getattr(models, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
