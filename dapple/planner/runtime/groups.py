"""A rank's place in one of its process groups: the one shape the split,
expert and context groups share (``tensor_parallel.SplitGroup``,
``experts.ExpertGroup``, ``context_parallel.ContextGroup``). No torch here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class GroupMember:
    """This rank is member ``index`` of the ``size`` ranks of process group
    ``group``."""

    group: Any
    index: int
    size: int
