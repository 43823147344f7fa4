"""The JSON Schemas and the core's readers say the same (issue 12): one
corpus of good and bad files goes through both.

The readers also check what a schema cannot say (every layer measured at the
same batch sizes, a stage's devices used once, a plan's profile hash), so
the agreement is one-way on random files: whatever a schema refuses, the
reader refuses too. On the cases the schemas can state (every optional
field given as null, negative estimates, the issue's examples) they agree
both ways. Duplicate keys are refused by the readers alone: a schema sees
the document after a JSON parser kept one of the two values.
"""

from __future__ import annotations

import copy
import json
import os

import pytest

jsonschema = pytest.importorskip("jsonschema")
from hypothesis import HealthCheck, given, settings  # noqa: E402

from dapple import planner  # noqa: E402
from conftest import PROFILES, ROOT  # noqa: E402
from test_fuzz import mutations, mutated  # noqa: E402

EXAMPLES = int(os.environ.get("DAPPLE_FUZZ_EXAMPLES", "150"))
AGREE = settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

WHALE = ROOT / "profiles" / "topologies" / "whale-4v100-4p100.json"
BERT = PROFILES / "bert-48-pbs-2.json"
READERS = {"profile": planner.Profile, "topology": planner.Topology, "plan": planner.Plan}


def _schema(kind: str) -> dict:
    return json.loads((ROOT / "profiles" / "schema" / f"{kind}.schema.json").read_text())


VALIDATORS = {kind: jsonschema.Draft202012Validator(_schema(kind)) for kind in READERS}


def schema_accepts(kind: str, doc) -> bool:
    return VALIDATORS[kind].is_valid(doc)


def reader_accepts(kind: str, doc) -> bool:
    try:
        READERS[kind].from_json(json.dumps(doc))
    except planner.DappleError:
        return False
    return True


def _corpus() -> list[tuple[str, dict]]:
    """Good files of every kind, with every optional field there is."""
    profile = json.loads(BERT.read_text())
    profile["layers"][0]["kind"] = "embedding"
    profile["layers"][0]["measurements"][0]["stored_activation_bytes"] = 10
    timed = copy.deepcopy(profile)
    timed["other_devices"] = [{
        "device": "P100-16GB", "source": "scaled",
        "layers": [{"name": layer["name"], "measurements": [{"batch_size": 2, "fwd_ms": 1.0, "bwd_ms": 2.0}]}
                   for layer in profile["layers"]],
    }]
    plan = planner.plan(BERT, WHALE, 64).data
    return [("profile", profile), ("profile", timed), ("topology", json.loads(WHALE.read_text())), ("plan", plan)]


CORPUS = _corpus()


def test_the_corpus_is_good_for_both():
    for kind, doc in CORPUS:
        assert schema_accepts(kind, doc) and reader_accepts(kind, doc), kind


def _optional_slots(schema, node, doc, path=()):
    """(path of an object in doc, optional property of it) for every object
    of doc the schema describes."""
    while "$ref" in node:
        node = schema["$defs"][node["$ref"].removeprefix("#/$defs/")]
    if isinstance(doc, dict) and "properties" in node:
        required = set(node.get("required", []))
        for prop, sub in node["properties"].items():
            if prop not in required:
                yield path, prop
            if prop in doc:
                yield from _optional_slots(schema, sub, doc[prop], path + (prop,))
    elif isinstance(doc, list) and "items" in node:
        for i, item in enumerate(doc[:2]):
            yield from _optional_slots(schema, node["items"], item, path + (i,))


def _with(doc, path, prop, value):
    doc = copy.deepcopy(doc)
    target = doc
    for key in path:
        target = target[key]
    target[prop] = value
    return doc


def test_null_means_absent_exactly_where_both_say_so():
    """Every optional field set to null: the schema and the reader agree.
    Fields the reader fills with a default (optimizer, latency_us) refuse
    null in both; the others read null as absent in both."""
    checked = 0
    for kind, doc in CORPUS:
        schema = _schema(kind)
        for path, prop in _optional_slots(schema, schema, doc):
            nulled = _with(doc, path, prop, None)
            # A profile timing other devices must name its own: a rule of
            # the reader alone, which the schema cannot tie to another field.
            if kind == "profile" and prop == "device" and doc.get("other_devices"):
                assert schema_accepts(kind, nulled) and not reader_accepts(kind, nulled)
                continue
            assert schema_accepts(kind, nulled) == reader_accepts(kind, nulled), (kind, path, prop)
            checked += 1
    assert checked >= 40


@pytest.mark.parametrize("field", ["latency_ms", "iteration_ms", "speedup", "peak_memory_bytes"])
def test_a_negative_estimate_is_refused_by_both(field):
    plan = copy.deepcopy(CORPUS[-1][1])
    plan["estimate"][field] = -1.0
    assert not schema_accepts("plan", plan)
    with pytest.raises(planner.InvalidInputError, match=f"estimate.{field}: value -1"):
        planner.Plan.from_json(json.dumps(plan))
    plan = copy.deepcopy(CORPUS[-1][1])
    plan["estimate"]["stages"][0]["bwd_ms"] = -2
    assert not schema_accepts("plan", plan) and not reader_accepts("plan", plan)
    plan = copy.deepcopy(CORPUS[-1][1])
    plan["selection"]["simulated_ms"] = -2
    assert not schema_accepts("plan", plan) and not reader_accepts("plan", plan)


def test_duplicate_keys_are_the_readers_to_refuse():
    text = json.dumps(CORPUS[2][1]).replace('"name": ', '"name": "x", "name": ', 1)
    with pytest.raises(planner.InvalidInputError, match="duplicate field `name`"):
        planner.Topology.from_json(text)
    # The schema sees what a JSON parser kept: one value, valid.
    assert schema_accepts("topology", json.loads(text))


@pytest.mark.parametrize("index", range(len(CORPUS)), ids=[f"{k}{i}" for i, (k, _) in enumerate(CORPUS)])
def test_what_a_schema_refuses_the_reader_refuses(index):
    kind, doc = CORPUS[index]

    @AGREE
    @given(mutations(doc))
    def check(mutation):
        bad = mutated(doc, *mutation)
        if not schema_accepts(kind, bad):
            assert not reader_accepts(kind, bad), (kind, mutation)

    check()
