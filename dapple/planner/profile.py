"""Per-layer profiles (format ``dapple.profile``, see docs/formats.md)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from . import _core
from .fileobject import FileObject
from .errors import InvalidInputError
from .files import path_text, read_text
from .limits import check_count

#: The folder of the profiles shipped in the package (the checkout's
#: ``profiles/`` is a link to it).
EXAMPLE_PROFILE_DIR = Path(__file__).resolve().parent.parent / "profiles"
#: Their names, "artifact/bert-48-pbs-2" for profiles/artifact/bert-48-pbs-2.json
#: (the DAPPLE artifact's and Whale's; models/ holds configs, not profiles).
EXAMPLE_PROFILES: tuple[str, ...] = tuple(sorted(
    str(path.relative_to(EXAMPLE_PROFILE_DIR).with_suffix(""))
    for path in [*(EXAMPLE_PROFILE_DIR / "artifact").glob("*.json"), *(EXAMPLE_PROFILE_DIR / "whale").glob("resnet*.json")]
))


@dataclass(frozen=True)
class Profile(FileObject):
    """A validated profile: the core's own object (``core``), parsed and
    checked once. Build with :meth:`load`, :meth:`from_json` or
    :func:`import_artifact_profile`."""

    core_class = _core.Profile
    core: _core.Profile

    @classmethod
    def example(cls, name: str) -> "Profile":
        """A profile shipped inside the package, by name (``EXAMPLE_PROFILES``:
        ``"artifact/bert-48-pbs-2"``), so that examples run from any folder;
        the checkout's ``profiles/`` links to the same files."""
        if name not in EXAMPLE_PROFILES:
            raise InvalidInputError(f"example profile {name!r}: not shipped; one of {', '.join(EXAMPLE_PROFILES)}")
        return cls.load(EXAMPLE_PROFILE_DIR / f"{name}.json")

    @property
    def path(self) -> str | None:
        """The file it was read from."""
        return self.core.source

    @property
    def model(self) -> str:
        return self.core.model

    @property
    def layers(self) -> list[dict]:
        return self.data["layers"]

    @property
    def batch_sizes(self) -> list[int]:
        return self.core.batch_sizes

    @property
    def sha256(self) -> str:
        return self.core.sha256

    @property
    def devices(self) -> list[str | None]:
        """GPU types whose layer times it holds: its own ``device`` first,
        then ``other_devices``."""
        return self.core.devices


def merge_profiles(profiles: list[Profile]) -> Profile:
    """One profile holding every profile's layer times, each as those of
    its GPU type (``other_devices``): the first gives the memory figures and
    is the device topologies' ``relative_speed`` refers to. The profiles
    must be of one model (same layers and parameters) and name their
    device; an error names the file it is about."""
    merged = profiles[0].core
    for other in profiles[1:]:
        merged = merged.with_times_of(other.core)
    return Profile(merged)


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
    core = _core.import_artifact_profile(
        read_text(path),
        model=model,
        batch_size=check_count("batch_size", batch_size),
        source=path_text(path),
        param_bytes_scale=param_bytes_scale,
        block_pattern=block_pattern,
        origin=origin,
        device=device,
        optimizer=optimizer,
    )
    return Profile(core)


#: Model configs shipped with dapple (Hugging Face config.json files), by name.
MODEL_CONFIGS: tuple[str, ...] = _core.MODEL_CONFIGS
#: What an eager runtime's host takes to issue one kernel, us (the core's source beside it).
HOST_US_PER_KERNEL: float = _core.HOST_US_PER_KERNEL

#: How a generated profile's attention core runs (the core's table).
ATTENTION_KERNELS: tuple[str, ...] = _core.ATTENTION_KERNELS

#: How a generated profile's mixtures of experts exchange their tokens (the core's table).
TOKEN_DISPATCHERS: tuple[str, ...] = _core.TOKEN_DISPATCHERS

#: The precisions a generated profile's runtime may keep gradients in (the core's table).
GRADIENT_PRECISIONS: tuple[str, ...] = _core.GRADIENT_PRECISIONS


def transformer_profile(
    config: str | os.PathLike,
    *,
    gpu: str,
    seq_len: int,
    micro_batch_sizes: list[int] | tuple[int, ...] = (1, 2, 4, 8),
    efficiency: float | None = None,
    attention: str | None = None,
    expert_imbalance: float = 1.0,
    dispatcher: str = "all-to-all",
    gradients: str = "bf16",
    model: str | None = None,
    host_us_per_kernel: float | None = None,
) -> Profile:
    """A profile of a decoder-only transformer without a GPU: ``config`` is a
    shipped name (``MODEL_CONFIGS``) or a Hugging Face ``config.json``. Each
    layer is timed operator by operator on ``gpu`` (matrix products by their
    shapes, memory-bound operators by their bytes, the attention core as
    ``attention`` runs it: ``"flash"`` or ``"unfused"``, by default flash
    where the GPU type has FlashAttention measured), or, where
    ``efficiency`` is given, as its FLOPs over the bf16 peak times it
    (docs/cost-model.md, "Transformer profiles"). ``expert_imbalance`` is
    the router's imbalance its blocks with experts record (>= 1; 1:
    balanced), and ``dispatcher`` how they exchange tokens with their
    experts: ``"all-to-all"`` (a copy an expert) or ``"deepep"`` (a token
    once to each machine and GPU it reaches; docs/cost-model.md, "Expert
    parallelism"). ``gradients`` is the precision the runtime accumulates
    and reduces gradients in: ``"bf16"``, as the weights, or ``"fp32"``
    (Megatron-LM under bf16, DeepSpeed's bf16 optimizer, Llama 3): their
    memory, their reduction's bytes and Adam's read of them.
    ``host_us_per_kernel`` is what the runtime's host takes to issue one
    kernel (None: ``HOST_US_PER_KERNEL``, an eager PyTorch's): each pass
    operator by operator takes no less than its kernels issued one after
    another (docs/cost-model.md, "Transformer profiles")."""
    sizes = [check_count("micro_batch_sizes", b) for b in micro_batch_sizes]
    common = dict(gpu=gpu, seq_len=check_count("seq_len", seq_len), micro_batch_sizes=sizes, efficiency=efficiency,
                  attention=attention, expert_imbalance=float(expert_imbalance), dispatcher=dispatcher,
                  gradients=gradients, host_us_per_kernel=host_us_per_kernel)
    if str(config) in MODEL_CONFIGS:
        core = _core.transformer_profile(model=model or str(config), name=str(config), **common)
    else:
        name = model or path_text(os.path.splitext(os.path.basename(config))[0])
        core = _core.transformer_profile(model=name, text=read_text(config), source=path_text(config), **common)
    return Profile(core)


def calibrate_stored_activations(profile: Profile, peak_memory_bytes: float, batch_size: int) -> Profile:
    """Scale every layer's stored-activation bytes so that one GPU training
    the whole model at ``batch_size`` needs ``peak_memory_bytes``.

    Profiles that only record layer outputs miss what layers keep inside
    (attention maps, dropout masks, gates): a transformer layer keeps many
    times its output. A measured whole-model peak pins the total down; it is
    spread over layers in proportion to their outputs, after the model state
    (weights, gradients, optimizer slots) is taken off."""
    return Profile(profile.core.calibrated_stored_activations(peak_memory_bytes, check_count("batch_size", batch_size)))
