"""Clusters as short specs (``2x8-nvlink``), presets (``A``) or files."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from . import _core
from .files import read_text

PRESETS = {"A": "2x8-nvlink-25gbps", "B": "16x1-25gbps", "C": "16x1-10gbps"}


@dataclass(frozen=True)
class Topology:
    text: str
    data: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "data", json.loads(self.text))

    @classmethod
    def from_spec(cls, spec: str) -> "Topology":
        return cls(_core.topology_from_spec(spec))

    @classmethod
    def from_json(cls, text: str, source: str = "<json>") -> "Topology":
        """A Topology from ``dapple.topology`` JSON text, validated;
        ``source`` names it in errors."""
        return cls(_core.topology_canonical(text, source))

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Topology":
        return cls(_core.topology_canonical(read_text(path), str(path)))

    @classmethod
    def resolve(cls, spec_or_path: "str | os.PathLike | Topology") -> "Topology":
        """A Topology from a spec, a preset name or a JSON file path."""
        if isinstance(spec_or_path, Topology):
            return spec_or_path
        s = str(spec_or_path)
        # os.path.isfile is False, not an error, for names too long to be files.
        if s.endswith(".json") or os.sep in s or os.path.isfile(s):
            return cls.load(s)
        return cls.from_spec(s)

    @property
    def name(self) -> str:
        return self.data["name"]

    @property
    def num_devices(self) -> int:
        return sum(g["machines"] * g["gpus_per_machine"] for g in self.data["machine_groups"])

    def describe(self) -> str:
        return _core.topology_describe(self.text)
