"""The JSON Schemas in profiles/schema/ match what dapple reads and writes."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

jsonschema = pytest.importorskip("jsonschema")
from jsonschema import Draft202012Validator  # noqa: E402

from dapple import planner  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SCHEMAS = ROOT / "profiles" / "schema"
ARTIFACT_PROFILES = sorted((ROOT / "profiles" / "artifact").glob("*.json"))
BERT = ROOT / "profiles" / "artifact" / "bert-48-pbs-2.json"


def load_schema(name: str) -> dict:
    return json.loads((SCHEMAS / f"{name}.schema.json").read_text(encoding="utf-8"))


def validator(name: str) -> Draft202012Validator:
    schema = load_schema(name)
    Draft202012Validator.check_schema(schema)
    return Draft202012Validator(schema)


def errors(name: str, instance) -> list[str]:
    return [e.message for e in validator(name).iter_errors(instance)]


@pytest.mark.parametrize("name", ["profile", "topology", "plan"])
def test_schema_is_valid_draft_2020_12(name):
    schema = load_schema(name)
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    Draft202012Validator.check_schema(schema)


def test_there_are_artifact_profiles():
    assert len(ARTIFACT_PROFILES) >= 10


@pytest.mark.parametrize("path", ARTIFACT_PROFILES, ids=lambda p: p.name)
def test_artifact_profiles_validate(path):
    data = json.loads(path.read_text(encoding="utf-8"))
    assert errors("profile", data) == []


@pytest.mark.parametrize("spec", ["2x8-nvlink", "16x1-25gbps", "A"])
def test_topologies_from_specs_validate(spec):
    assert errors("topology", planner.Topology.from_spec(spec).data) == []


@pytest.fixture(scope="module")
def bert_plan():
    return planner.plan(str(BERT), "2x8-nvlink", 64)


def test_plan_validates(bert_plan):
    assert "estimate" in bert_plan.data
    assert errors("plan", bert_plan.data) == []


def test_a_chunked_plan_validates():
    # ZB-V: two chunks a rank, each listing its rank's devices.
    chunked = planner.plan(str(BERT), "2x8-nvlink", 64, schedule="zb-v")
    assert chunked.data["schedule"]["chunks"] == 2
    assert errors("plan", chunked.data) == []


def test_plan_without_estimate_validates(bert_plan):
    data = copy.deepcopy(bert_plan.data)
    del data["estimate"]
    assert errors("plan", data) == []


def test_plan_embeds_the_topology_schema():
    """plan.schema.json carries a copy of topology.schema.json; keep them equal."""
    plan = load_schema("plan")
    topo = load_schema("topology")
    body = {k: v for k, v in topo.items() if k not in ("$schema", "title", "$defs")}
    assert plan["$defs"]["topology"] == body
    for name, definition in topo["$defs"].items():
        assert plan["$defs"][name] == definition, name


# The schemas are not vacuous: each broken file below is rejected both by the
# schema and by the Rust reader, which names the offending field.


def _extra_top_level_field(d):
    d["comment"] = "not part of the format"


def _extra_measurement_field(d):
    d["layers"][0]["measurements"][0]["flops"] = 1


def _negative_fwd_ms(d):
    d["layers"][1]["measurements"][0]["fwd_ms"] = -1.0


def _schema_version_2(d):
    d["schema_version"] = 2


def _wrong_format(d):
    d["format"] = "dapple.plan"


def _missing_bwd_ms(d):
    del d["layers"][0]["measurements"][0]["bwd_ms"]


def _unknown_optimizer(d):
    d["optimizer"] = "adafactor"


def _zero_batch_size(d):
    for layer in d["layers"]:
        layer["measurements"][0]["batch_size"] = 0


@pytest.fixture(scope="module")
def bert_profile():
    return json.loads(BERT.read_text(encoding="utf-8"))


@pytest.mark.parametrize(
    "mutate, field",
    [
        (_extra_top_level_field, "comment"),
        (_extra_measurement_field, "flops"),
        (_negative_fwd_ms, "fwd_ms"),
        (_schema_version_2, "schema_version"),
        (_wrong_format, "format"),
        (_missing_bwd_ms, "bwd_ms"),
        (_unknown_optimizer, "optimizer"),
        (_zero_batch_size, "batch_size"),
    ],
    ids=lambda x: getattr(x, "__name__", "").strip("_") or None,
)
def test_broken_profile_fails_schema_and_reader(bert_profile, mutate, field):
    bad = copy.deepcopy(bert_profile)
    mutate(bad)
    assert errors("profile", bad), "the schema accepted a broken profile"
    with pytest.raises(planner.InvalidInputError, match=field):
        planner.Profile.from_json(json.dumps(bad))


def test_topology_with_zero_bandwidth_fails():
    bad = copy.deepcopy(planner.Topology.from_spec("2x8-nvlink").data)
    bad["inter_machine"]["bandwidth_gbps"] = 0
    assert errors("topology", bad)


def test_topology_gpu_type_is_spelled_type():
    bad = copy.deepcopy(planner.Topology.from_spec("2x8-nvlink").data)
    gpu = bad["machine_groups"][0]["gpu"]
    gpu["gpu_type"] = gpu.pop("type")
    assert errors("topology", bad)


def test_topology_defaults_may_be_omitted():
    data = copy.deepcopy(planner.Topology.from_spec("2x8-nvlink").data)
    # A spec says nothing of speed: its GPUs run at the profile's times.
    assert "relative_speed" not in data["machine_groups"][0]["gpu"]
    del data["inter_machine"]["latency_us"]
    assert errors("topology", data) == []


def test_plan_with_bad_embedded_topology_fails(bert_plan):
    bad = copy.deepcopy(bert_plan.data)
    bad["inputs"]["topology"]["machine_groups"][0]["gpu"]["relative_speed"] = 0
    assert errors("plan", bad)


def test_plan_with_unknown_field_fails(bert_plan):
    bad = copy.deepcopy(bert_plan.data)
    bad["stages"][0]["replicas"] = 8
    assert errors("plan", bad)


def test_the_plan_schema_names_every_schedule_kind_the_core_reads():
    kinds = load_schema("plan")["$defs"]["schedule"]["properties"]["kind"]["enum"]
    assert kinds == list(planner._core.SCHEDULE_KINDS)
