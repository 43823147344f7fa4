"""The Python face of the core's file objects (``Profile``, ``Topology``,
``Plan``, ``Simulation``): each wraps the core's own validated object,
``core``, and meets JSON only where a file is read or written."""

from __future__ import annotations

import os
from functools import cached_property
from typing import Any, ClassVar

from .files import path_text, read_text, write_atomic


class FileObject:
    """Mixed into a frozen dataclass whose first field is ``core``."""

    #: The binding's class this one wraps (``dapple.planner._core.Plan``, ...).
    core_class: ClassVar[Any]
    core: Any

    @classmethod
    def from_json(cls, text: str, source: str | None = None):
        """Parse and check JSON text; ``source`` names it in errors."""
        return cls(cls.core_class.from_json(text, source))

    @classmethod
    def from_dict(cls, data: dict, source: str | None = None):
        """Check plain data as the core checks a file; ``format`` and
        ``schema_version`` may be left out (the core fills them in)."""
        return cls(cls.core_class.from_dict(data, source))

    @classmethod
    def load(cls, path: str | os.PathLike):
        return cls.from_json(read_text(path), path_text(path))

    def save(self, path: str | os.PathLike) -> None:
        write_atomic(path, self.text)

    @property
    def text(self) -> str:
        """Canonical JSON, as files hold it."""
        return self.core.to_json()

    @cached_property
    def data(self) -> dict:
        """Plain data (a read-only view: changing it changes nothing)."""
        return self.core.to_dict()
