"""Megatron-LM's pipeline layout string (``--pipeline-model-parallel-layout``):
read, written, and matched to a profile's layers.

The grammar is Megatron-core's (``PipelineParallelLayerLayout.parse_str_to_list``
in ``megatron/core/transformer/pipeline_parallel_layer_layout.py``): tokens
``E`` (embedding), ``t`` (transformer layer), ``m`` (multi-token prediction
layer) and ``L`` (the loss: final norm, output layer and loss); ``|`` ends a
stage; ``X*N`` repeats one token, ``(...)*N`` a group (not nested); commas
are cosmetic. ``"Et*3|(tt|)*29,m|L"`` is 32 stages: ``E t t t``, 29 times
``t t``, then ``m`` and ``L``. Stages may be empty (``"E||tL"``).

Megatron counts the stages of a layout in layer order; with more stages than
pipeline ranks, stage k runs on rank k mod P (virtual stages). A dapple plan
has one stage a rank, so each stage of the string is one plan stage.

A profile's layers take tokens by what they are (:func:`layer_tokens`): the
model's own blocks (layer kind ``"block"``) are ``t``, the one layer before
them ``E`` and the one after them ``L``; a profile with other layers has no
Megatron layout.
"""

from __future__ import annotations

import re
from itertools import groupby

from .errors import IncompatibleInputsError, InvalidInputError
from .limits import digits_value
from .profile import Profile

#: Megatron-core's tokens and what each stands for (its ``LayerType``).
TOKENS = {"E": "embedding", "t": "transformer layer", "m": "multi-token prediction layer", "L": "loss"}

# Megatron-core unrolls a layout with these two substitutions, in this order;
# reading it the same way accepts exactly the strings Megatron accepts.
_GROUP = re.compile(r"\(([^)]+)\)\*(\d+)")
_REPEAT = re.compile(r"(.)\*(\d+)")
# A layout that would unroll past this many tokens is refused before
# unrolling ("t*999999999" would take gigabytes); real models have thousands.
_MOST_TOKENS = 1_000_000


def parse_layout(text: str, field: str = "layout") -> list[list[str]]:
    """The tokens of each stage of a layout string, as Megatron-core reads
    it: ``parse_layout("Et*2|tL") == [["E", "t", "t"], ["t", "L"]]``.
    Raises :class:`InvalidInputError` naming ``field`` and the offending
    character on a string Megatron would refuse."""
    flat = text.replace(",", "")
    for pattern in (_GROUP, _REPEAT):
        _check_size(flat, pattern, text, field)
        flat = pattern.sub(lambda m: m.group(1) * digits_value(m.group(2)), flat)
    stages = []
    for stage in flat.split("|"):
        for char in stage:
            if char not in TOKENS:
                raise InvalidInputError(
                    f"{field}: value {text!r}: character {char!r} is not a layout token; Megatron's layout has "
                    f"{', '.join(TOKENS)}, '|' between stages, X*N and (...)*N repeats (not nested) and commas")
        stages.append(list(stage))
    return stages


def _check_size(flat: str, pattern: re.Pattern, text: str, field: str) -> None:
    grown = len(flat) + sum(len(m.group(1)) * digits_value(m.group(2)) - len(m.group(0))
                            for m in pattern.finditer(flat))
    if grown > _MOST_TOKENS:
        raise InvalidInputError(f"{field}: value {text!r} unrolls to more than {_MOST_TOKENS:,} characters")


def format_layout(stages: list[list[str]]) -> str:
    """The shortest of the plain forms of ``stages`` Megatron reads back to
    them: runs of three or more of a token as ``X*N``, and runs of equal
    stages as ``(...|)*N`` where shorter: ``[["E", "t", "t", "t"]] + [["t",
    "t"]] * 29 + [["t", "L"]]`` is ``"Et*3|(tt|)*29tL"``."""
    texts = ["".join(token * len(run) if len(run) < 3 else f"{token}*{len(run)}"
                     for token, run in ((token, list(run)) for token, run in groupby(stage)))
             for stage in stages]
    runs = [(text, len(list(run))) for text, run in groupby(texts)]
    pieces = []
    for i, (text, count) in enumerate(runs):
        last = i == len(runs) - 1
        plain = "|".join([text] * count) + ("" if last else "|")
        # A group ends each repeat with its separator, so it cannot end the
        # string: the last stage of a final run stays outside it.
        grouped = (f"({text}|)*{count}" if not last
                   else f"({text}|)*{count - 1}{text}" if count > 2 else plain)
        # Two equal stages read better written out than grouped.
        pieces.append(grouped if text and count > 2 and len(grouped) < len(plain) else plain)
    return "".join(pieces)


def layer_tokens(profile: Profile) -> list[str]:
    """One token a profile layer: ``t`` for the model's blocks (layer kind
    ``"block"``), ``E`` for the one layer before them, ``L`` for the one
    after. A profile of another shape is an :class:`InvalidInputError`
    naming the layer."""
    layers = profile.layers
    blocks = [i for i, layer in enumerate(layers) if layer.get("kind") == "block"]
    model = profile.model
    if not blocks:
        raise InvalidInputError(f"profile {model!r}: no layer of kind \"block\": Megatron's layout needs the "
                                "model's transformer layers marked as blocks")
    first, last = blocks[0], blocks[-1]
    for i in range(first, last + 1):
        if layers[i].get("kind") != "block":
            raise InvalidInputError(f"profile {model!r}: layer {i} {layers[i]['name']!r} lies between blocks but is "
                                    "not one: Megatron's layout has transformer layers (t) only between E and L")
    for side, around, token in (("before", layers[:first], "E"), ("after", layers[last + 1:], "L")):
        if len(around) != 1:
            names = ", ".join(repr(layer["name"]) for layer in around) or "none"
            raise InvalidInputError(f"profile {model!r}: {len(around)} layers {side} the blocks ({names}); Megatron's "
                                    f"layout has one ({token}: {TOKENS[token]})")
    return ["E"] + ["t"] * (last - first + 1) + ["L"]


def plan_layout(stage_ranges: list[tuple[int, int]], profile: Profile) -> str:
    """The layout string of stages given as ``(layer_start, layer_end)``
    (end exclusive, a plan's ``stages[i]``) over ``profile``'s layers."""
    tokens = layer_tokens(profile)
    end = stage_ranges[-1][1] if stage_ranges else 0
    if end != len(tokens):
        raise IncompatibleInputsError(f"the plan's stages end at layer {end}; profile {profile.model!r} has "
                                      f"{len(tokens)} layers")
    return format_layout([tokens[start:stop] for start, stop in stage_ranges])


def stage_ranges(layout: str, profile: Profile, field: str = "layout") -> list[tuple[int, int]]:
    """Each stage of a layout string as ``(layer_start, layer_end)`` over
    ``profile``'s layers (end exclusive, as a plan's stages). The layout
    must hold the profile's layers in order, each once, and no empty stage
    (a plan's stage holds a layer); anything else is an
    :class:`InvalidInputError` naming ``field``, the value and what differs.
    ``stage_ranges("Et*15|t*17L", llama_2_7b) == [(0, 16), (16, 34)]``."""
    stages = parse_layout(layout, field)
    tokens = layer_tokens(profile)
    flat = [token for stage in stages for token in stage]
    for token in TOKENS:
        have, want = flat.count(token), tokens.count(token)
        if have != want:
            raise InvalidInputError(f"{field}: value {layout!r} holds {have} {TOKENS[token]} ({token}); profile "
                                    f"{profile.model!r} has {want}")
    if flat != tokens:
        at = next(i for i, (a, b) in enumerate(zip(flat, tokens)) if a != b)
        raise InvalidInputError(f"{field}: value {layout!r} has {flat[at]} where profile {profile.model!r} has layer "
                                f"{at} {profile.layers[at]['name']!r} ({tokens[at]}): E first, L last")
    ranges, start = [], 0
    for i, stage in enumerate(stages):
        if not stage:
            raise InvalidInputError(f"{field}: value {layout!r}: stage {i} is empty; each stage of a plan holds "
                                    "a layer")
        ranges.append((start, start + len(stage)))
        start += len(stage)
    return ranges
