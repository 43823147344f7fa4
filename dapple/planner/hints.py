"""Whale's annotations as search constraints (``docs/hints.md``).

What ``dapple plan --stages --micro-batches --pin-cut --replicate --split
--from-layout`` and :func:`dapple.planner.plan`'s keywords of the same names
say, read into the core's hints (``rust_core/core/src/plan/hints.rs``, which
checks them against the model and the cluster and keeps the search to
them). Here only the spelling is read: layers by index or by the
profile's layer name, ranges as ``START..END`` (end excluded, as a plan's
stages) with ``:N`` for a degree.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from .errors import IncompatibleInputsError, InvalidInputError
from .limits import MAX_COUNT, check_count, digits_value
from .profile import Profile


@dataclass(frozen=True)
class Hints:
    """The hints of one search, as the core's ``search`` takes them."""

    stages: int | None = None
    micro_batches: int | None = None
    #: Layers a stage must start at.
    cuts: tuple[int, ...] = ()
    #: (layer_start, layer_end, split degree, replicas or None): one stage each.
    ranges: tuple[tuple[int, int, int, int | None], ...] = ()

    def as_search_options(self) -> dict:
        return {"stages": self.stages, "micro_batches": self.micro_batches,
                "cuts": list(self.cuts), "ranges": list(self.ranges)}


def _digits(text: str) -> bool:
    """Decimal digits only (``str.isdigit`` also takes other scripts' digits)."""
    return text.isascii() and text.isdigit()


def _layer(text: str, names: list[str], option: str, value: str, *, end: bool = False) -> int:
    """A layer given by index or by name (a name the profile gives one layer
    only); an end may be the layer count."""
    text = text.strip()
    if _digits(text):
        index = digits_value(text)
        if index <= len(names) if end else index < len(names):
            return index
        raise InvalidInputError(f"{option} {value}: layer {text} is past the profile's {len(names)} layers")
    at = [i for i, name in enumerate(names) if name == text]
    if len(at) > 1:
        raise InvalidInputError(f"{option} {value}: {len(at)} layers are named {text!r} (layers "
                                f"{', '.join(map(str, at))}); give the index")
    if at:
        return at[0] + (1 if end else 0)
    raise InvalidInputError(f"{option} {value}: {text!r} is neither a layer index nor a layer name of the profile")


def _range(value: str, names: list[str], option: str, degree: str) -> tuple[int, int, int | None]:
    """``START..END[:N]``: layers START to END (excluded), by index or name
    (a name as END includes that layer), and the degree N where given."""
    # N after the last colon, where digits follow it (layer names may hold colons).
    layers, colon, number = str(value).rpartition(":")
    if not colon or not _digits(number):
        layers, number = str(value), ""
    start, dots, end = layers.partition("..")
    if not dots or not start or not end:
        raise InvalidInputError(f"{option} {value}: expected START..END[:N], e.g. 0..12:{degree}")
    n = None
    if number:
        try:
            n = check_count(degree, digits_value(number))
        except InvalidInputError:
            raise InvalidInputError(f"{option} {value}: {degree} {number} must be a whole number from 1 to "
                                    f"{MAX_COUNT}") from None
    return _layer(start, names, option, value), _layer(end, names, option, value, end=True), n


def read_hints(
    profile: Profile,
    *,
    stages: int | None = None,
    micro_batches: int | None = None,
    pin_cuts: Iterable[int | str] = (),
    replicate: Iterable[str] = (),
    split: Iterable[str] = (),
    from_layout: str | None = None,
) -> Hints:
    """The hints as the core takes them. ``replicate``: ``START..END`` or
    ``START..END:REPLICAS``; ``split``: ``START..END:DEGREE``;
    ``from_layout``: a Megatron-LM ``--pipeline-model-parallel-layout``
    string, whose stages become boundaries and the stage count."""
    if stages is not None:
        stages = check_count("stages", stages)
    if micro_batches is not None:
        micro_batches = check_count("micro_batches", micro_batches)
    names = [layer["name"] for layer in profile.layers]
    cuts = [_layer(str(c), names, "--pin-cut", str(c)) for c in pin_cuts]
    ranges = []
    for value in replicate:
        start, end, replicas = _range(value, names, "--replicate", "replicas")
        ranges.append((start, end, 1, replicas))
    for value in split:
        start, end, degree = _range(value, names, "--split", "degree")
        if degree is None:
            raise InvalidInputError(f"--split {value}: expected START..END:DEGREE, the split degree")
        ranges.append((start, end, degree, None))
    if from_layout is not None:
        from .megatron_layout import stage_ranges

        layout = stage_ranges(from_layout, profile, field="--from-layout")
        if stages is not None and stages != len(layout):
            raise IncompatibleInputsError(f"--stages {stages}: --from-layout has {len(layout)} stages")
        stages = len(layout)
        cuts += [start for start, _ in layout[1:]]
    return Hints(stages, micro_batches, tuple(sorted(set(cuts))), tuple(ranges))
