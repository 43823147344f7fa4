"""Per-layer profiles (format ``dapple.profile``, see docs/formats.md)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from . import _core
from .files import read_text, write_atomic


@dataclass(frozen=True)
class Profile:
    """A validated profile. Build with :meth:`load`, :meth:`from_json` or
    :func:`import_artifact_profile`; the Rust core checks every field."""

    text: str
    path: str | None = None
    data: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "data", json.loads(self.text))

    @classmethod
    def from_json(cls, text: str, source: str | None = None) -> "Profile":
        return cls(_core.profile_canonical(text, source), source)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Profile":
        return cls.from_json(read_text(path), str(path))

    def save(self, path: str | os.PathLike) -> None:
        write_atomic(path, self.text)

    @property
    def model(self) -> str:
        return self.data["model"]

    @property
    def layers(self) -> list[dict]:
        return self.data["layers"]

    @property
    def batch_sizes(self) -> list[int]:
        return [m["batch_size"] for m in self.layers[0]["measurements"]]

    @property
    def sha256(self) -> str:
        return _core.profile_sha256(self.text)


def import_artifact_profile(
    path: str | os.PathLike,
    *,
    model: str,
    batch_size: int,
    param_bytes_scale: float = 1.0,
    block_pattern: str | None = None,
    origin: str | None = None,
    device: str | None = None,
    optimizer: str = "adam",
) -> Profile:
    """Read a DAPPLE artifact profile (PipeDream graph.txt) into a Profile.

    The graph is ordered topologically into a chain (ties in file order);
    every layer keeps its graph inputs so cuts carry all crossing tensors."""
    text = _core.import_artifact_profile(
        read_text(path),
        model=model,
        batch_size=batch_size,
        source=str(path),
        param_bytes_scale=param_bytes_scale,
        block_pattern=block_pattern,
        origin=origin,
        device=device,
        optimizer=optimizer,
    )
    return Profile(text)
