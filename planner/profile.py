"""Per-layer profiles (format ``dapple.profile``, see docs/formats.md)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from . import _core
from .files import read_text, write_atomic
from .limits import check_count


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
        batch_size=check_count("batch_size", batch_size),
        source=str(path),
        param_bytes_scale=param_bytes_scale,
        block_pattern=block_pattern,
        origin=origin,
        device=device,
        optimizer=optimizer,
    )
    return Profile(text)


def calibrate_stored_activations(profile: Profile, peak_memory_bytes: float, batch_size: int) -> Profile:
    """Scale every layer's stored-activation bytes so that one GPU training
    the whole model at ``batch_size`` needs ``peak_memory_bytes``.

    Profiles that only record layer outputs miss what layers keep inside
    (attention maps, dropout masks, gates): a transformer layer keeps many
    times its output. A measured whole-model peak pins the total down; it is
    spread over layers in proportion to their outputs. The model state
    (weights, gradients, optimizer slots) is taken off first."""
    from .errors import InvalidInputError

    data = json.loads(profile.text)
    if batch_size not in profile.batch_sizes:
        raise InvalidInputError(
            f"batch size {batch_size} is not a profiled batch size ({profile.batch_sizes}); cannot calibrate"
        )
    k = profile.batch_sizes.index(batch_size)
    state = _core.profile_model_state_bytes(profile.text)  # the cost model's own count
    outputs = sum(layer["measurements"][k]["activation_bytes"] for layer in data["layers"])
    if peak_memory_bytes <= state or outputs == 0:
        raise InvalidInputError(
            f"measured peak memory {peak_memory_bytes / 2**30:.2f} GiB is not above the model state "
            f"{state / 2**30:.2f} GiB (weights, gradients and {data['optimizer']} state); cannot calibrate"
        )
    factor = (peak_memory_bytes - state) / outputs
    for layer in data["layers"]:
        for m in layer["measurements"]:
            m["stored_activation_bytes"] = round(m["activation_bytes"] * factor)
    note = (
        f"stored activations = {factor:.2f} x layer outputs, so that the whole model at batch {batch_size} "
        f"needs {peak_memory_bytes / 2**30:.2f} GiB"
    )
    data["source"] = f"{data['source']}; {note}" if data.get("source") else note
    return Profile.from_json(json.dumps(data))
