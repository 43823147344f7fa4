"""The `pipedream-planner` baseline beyond its reference plans.

That it returns the plans of PipeDream's own optimizer on the DAPPLE
artifact profiles is checked without Python, by
`rust_core/core/tests/pipedream_reference.rs` against
`tests/data/pipedream-reference.json`.
"""

import json

import pytest

from dapple import planner
from conftest import PROFILES, ROOT

REFERENCE = ROOT / "tests" / "data" / "pipedream-reference.json"


def test_reference_records_how_it_was_made():
    ref = json.loads(REFERENCE.read_text())
    assert ref["pipedream"]["commit"].startswith("7db6a1c")
    finished = [c for c in ref["cases"] if c["finished"]]
    assert {(c["model"], c["configuration"]) for c in finished} == {
        (m, cfg) for m in ("VGG-19", "BERT-24", "BERT-48", "XLNet-36", "AmoebaNet-36") for cfg in ("A", "B")
    }
    for case in finished:
        assert "optimizer_graph_hierarchical.py" in case["command"]
        assert all(p["hash_seeds"] for p in case["plans"])
        # States that are prefixes of dapple's layer order map to layer
        # ranges, in order; the others (None) are antichains no dapple plan
        # can cut at.
        n = len(json.loads((ROOT / case["dapple_profile"]).read_text())["layers"])
        ends = [m[1] for m in case["state_to_layers"] if m is not None]
        assert ends == sorted(ends) and ends[-1] <= n


def test_gnmt_on_a_gets_a_plan_where_pipedream_does_not_finish():
    # PipeDream enumerates GNMT-16's antichains for more than ten minutes;
    # the baseline plans over prefixes of dapple's layer order.
    ref = json.loads(REFERENCE.read_text())
    gnmt = next(c for c in ref["cases"] if c["model"] == "GNMT-16")
    assert gnmt["finished"] is False
    p = planner.baseline("pipedream-planner", PROFILES / "gnmt-16-pbs-64.json", "A", 1024)
    ranges = [(s["layer_start"], s["layer_end"]) for s in p.stages]
    assert ranges[0][0] == 0 and ranges[-1][1] == 96
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert sorted(d for s in p.stages for d in s["devices"]) == list(range(16))


def test_machines_of_unequal_size_have_no_pipedream_plan(tmp_path, dapple):
    topo = {
        "format": "dapple.topology",
        "schema_version": 1,
        "name": "8+4",
        "machine_groups": [
            {"machines": 1, "gpus_per_machine": g, "gpu": {"type": "V100-16GB", "memory_bytes": 17179869184},
             "intra_machine": {"kind": "nvlink", "bandwidth_gbps": 1040.0}}
            for g in (8, 4)
        ],
        "inter_machine": {"kind": "ethernet", "bandwidth_gbps": 25.0},
    }
    path = tmp_path / "mixed.json"
    path.write_text(json.dumps(topo))
    with pytest.raises(planner.IncompatibleInputsError) as e:
        planner.baseline("pipedream-planner", PROFILES / "bert-48-pbs-2.json", str(path), 64)
    assert "equal GPU counts" in str(e.value) and "\n" not in str(e.value)
    # `compare` shows it as that row's error; DAPPLE still plans.
    r = dapple("compare", "--profile", PROFILES / "bert-48-pbs-2.json", "--topology", path,
               "--global-batch-size", "64", "--json")
    assert r.returncode == 0, r.stderr
    rows = {row["strategy"]: row for row in json.loads(r.stdout)}
    assert "equal GPU counts" in rows["pipedream-planner"]["error"]
    assert rows["dapple"]["error"] is None


def test_too_many_machines_is_refused_not_run():
    # PipeDream's table is quadratic in the machines: 2048 machines would
    # take minutes, so the baseline says so at once.
    with pytest.raises(planner.IncompatibleInputsError) as e:
        planner.baseline("pipedream-planner", PROFILES / "bert-48-pbs-2.json", "2048x8-nvlink-25gbps", 16384)
    assert "planning steps" in str(e.value)
