"""Clusters as short specs (``2x8-nvlink``), presets (``A``) or files."""

from __future__ import annotations

import os
from dataclasses import dataclass

from . import _core
from .fileobject import FileObject
from .files import path_text

#: The paper's clusters by preset name, as specs (the core's table).
PRESETS: dict[str, str] = dict(_core.PRESETS)

#: GPU types specs may name, with memory, peaks, links and sources (the core's catalog).
GPU_TYPES: dict[str, dict] = dict(_core.GPU_TYPES)


@dataclass(frozen=True)
class Topology(FileObject):
    """A validated cluster: the core's own object (``core``)."""

    core_class = _core.Topology
    core: _core.Topology

    @classmethod
    def from_spec(cls, spec: str) -> "Topology":
        return cls(_core.Topology.from_spec(spec))

    @classmethod
    def resolve(cls, spec_or_path: "str | os.PathLike | Topology") -> "Topology":
        """A Topology from a spec, a preset name or a JSON file path."""
        if isinstance(spec_or_path, Topology):
            return spec_or_path
        s = str(spec_or_path)
        # os.path.isfile is False, not an error, for names too long to be files.
        if s.endswith(".json") or os.sep in s or os.path.isfile(s):
            return cls.load(s)
        return cls.from_spec(path_text(s))  # a spec is text: a name's stray bytes escaped

    @property
    def name(self) -> str:
        return self.core.name

    @property
    def num_devices(self) -> int:
        return self.core.num_devices

    def describe(self) -> str:
        return self.core.describe()
