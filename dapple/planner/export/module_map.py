"""Which modules of a model hold each profile layer: torchtitan's
``module_fqns_per_model_part`` names a stage by its modules
(``named_modules()`` names), where a plan names it by profile layers.

A map is a JSON object of profile layer names to module names; ``{i}`` in a
key matches a layer number and stands for it in the module names::

    {"modules": {"embedding": ["tok_embeddings"], "block_{i}": ["layers.{i}"],
                 "lm_head": ["norm", "output"]}}

Two maps are built in (:data:`MODULE_MAPS`); ``--module-map FILE`` reads
another.
"""

from __future__ import annotations

import json
import re

from ..errors import IncompatibleInputsError, InvalidInputError
from ..files import path_text, read_text
from ..profile import Profile

#: The maps dapple knows by name. Profile layers as ``dapple profile
#: transformer`` names them (``embedding``, ``block_<i>``, ``lm_head``) and,
#: for dapple's GPT, as ``dapple profile model`` does (``block<i>``).
MODULE_MAPS: dict[str, dict[str, list[str]]] = {
    # torchtitan's Llama 3 (torchtitan/models/llama3/model/model.py,
    # `Transformer`): the LM head is the final norm and the output layer.
    "torchtitan-llama": {"embedding": ["tok_embeddings"], "block_{i}": ["layers.{i}"],
                         "lm_head": ["norm", "output"]},
    # dapple.planner.runtime.models:gpt, its whole model (`ModelSpec.model`).
    "dapple-gpt": {"embedding": ["embedding"], "block{i}": ["blocks.{i}"], "block_{i}": ["blocks.{i}"],
                   "lm_head": ["head"]},
}

_INDEX = "{i}"


def load_module_map(name_or_path: str) -> tuple[str, dict[str, list[str]]]:
    """(what to call it in messages, the map): a built-in map by name, or a
    map file (``{"modules": {...}}``, optionally with ``"about"``)."""
    if name_or_path in MODULE_MAPS:
        return name_or_path, MODULE_MAPS[name_or_path]
    source = path_text(name_or_path)
    try:
        data = json.loads(read_text(name_or_path))
    except json.JSONDecodeError as e:
        raise InvalidInputError(f"{source}: not JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    if not isinstance(data, dict) or not isinstance(data.get("modules"), dict):
        raise InvalidInputError(f"{source}: field modules: missing; a module map is {{\"modules\": {{\"layer\": "
                                "[\"module\", ...]}}}}")
    unknown = sorted(set(data) - {"modules", "about"})
    if unknown:
        raise InvalidInputError(f"{source}: field {unknown[0]}: unknown field (a module map has modules and about)")
    for key, modules in data["modules"].items():
        if not (isinstance(modules, list) and modules and all(isinstance(m, str) and m for m in modules)):
            raise InvalidInputError(f"{source}: field modules.{key}: value {modules!r} is not a list of module names")
        if key.count(_INDEX) > 1 or (_INDEX not in key and any(_INDEX in m for m in modules)):
            raise InvalidInputError(f"{source}: field modules.{key}: {_INDEX} may appear once in a layer name, and "
                                    "in module names only where the layer name has it")
    return source, data["modules"]


def _pattern(key: str) -> re.Pattern:
    before, index, after = key.partition(_INDEX)
    return re.compile(re.escape(before) + ("(0|[1-9][0-9]*)" if index else "") + re.escape(after))


def layer_modules(name: str, module_map: dict[str, list[str]], map_name: str) -> list[str]:
    """The modules of the profile layer called ``name``; exactly one key of
    the map must match it."""
    found = []
    for key, modules in module_map.items():
        match = _pattern(key).fullmatch(name)
        if match:
            index = match.group(1) if match.groups() else ""
            found.append([m.replace(_INDEX, index) for m in modules])
    if len(found) != 1:
        how = "matches no key" if not found else f"matches {len(found)} keys"
        raise IncompatibleInputsError(f"module map {map_name}: profile layer {name!r} {how} "
                                      f"({', '.join(module_map)}); pass --module-map with a map of this model")
    return found[0]


def modules_per_stage(stage_ranges, profile: Profile, map_name_or_path: str) -> list[list[str]]:
    """One list of module names per stage (torchtitan's
    ``module_fqns_per_model_part``), for stages given as ``(layer_start,
    layer_end)`` over ``profile``'s layers."""
    map_name, module_map = load_module_map(map_name_or_path)
    names = [layer["name"] for layer in profile.layers]
    end = stage_ranges[-1][1]
    if end != len(names):
        raise IncompatibleInputsError(f"the plan's stages end at layer {end}; profile {profile.model!r} has "
                                      f"{len(names)} layers")
    return [[m for name in names[start:stop] for m in layer_modules(name, module_map, map_name)]
            for start, stop in stage_ranges]
