"""`dapple topology measure`: the link between local gloo processes, timed
and written as a topology that plans can use."""

import json

import pytest

from conftest import PROFILES, assert_one_line_error

torch = pytest.importorskip("torch")

from dapple.planner.runtime import links  # noqa: E402


def test_fit_recovers_a_known_link():
    # 50 us + bytes at 8 Gbit/s (1 byte per ns), with +-2% noise
    sizes = [4096, 65536, 1 << 20, 4 << 20]
    noise = [1.02, 0.98, 1.01, 0.99]
    seconds = [(50e-6 + s * 1e-9) * k for s, k in zip(sizes, noise)]
    latency_us, gbps = links.fit_link(sizes, seconds)
    assert latency_us == pytest.approx(50, rel=0.1)
    assert gbps == pytest.approx(8, rel=0.05)


def test_fit_rejects_what_it_cannot_fit():
    with pytest.raises(ValueError, match="two different message sizes"):
        links.fit_link([4096, 4096], [1e-4, 1e-4])
    with pytest.raises(ValueError, match="did not grow"):
        links.fit_link([4096, 1 << 20], [2e-4, 1e-4])


def test_measured_topology_is_valid_and_plans(dapple, tmp_path):
    out = tmp_path / "local.json"
    # Sizes 4,000 times apart, 7 repeats each: on a loaded 2-core machine a
    # ping-pong of 2 MiB took no longer than one of 4 KiB (scheduling noise
    # of about a millisecond); 16 MiB takes several.
    r = dapple("topology", "measure", "--repeats", 7, "--sizes-kib", "4,1024,16384", "--out", out)
    assert r.returncode == 0, r.stderr
    assert r.stdout == ""  # the table and gloo's notices go to stderr
    assert "latency" in r.stderr and "allreduce" in r.stderr
    topo = json.loads(out.read_text())
    group = topo["machine_groups"][0]
    assert (group["machines"], group["gpus_per_machine"]) == (1, 2)
    link = group["intra_machine"]
    assert link["bandwidth_gbps"] > 0 and link["latency_us"] >= 0
    plan = dapple("plan", "--profile", PROFILES / "vgg-19-pbs-32.json", "--topology", out,
                  "--global-batch-size", 64, "--json")
    assert plan.returncode == 0, plan.stderr
    assert json.loads(plan.stdout)["inputs"]["topology"]["name"] == topo["name"]


def test_measure_needs_two_sizes(dapple):
    r = dapple("topology", "measure", "--repeats", 1, "--sizes-kib", "64")
    assert_one_line_error(r, 3, "two different message sizes", "65536")


@pytest.mark.parametrize("option, value", [("--processes", 129), ("--repeats", 10_001),
                                           ("--sizes-kib", "4,1048577")])
def test_measure_work_is_bounded(dapple, option, value):
    # Refused before any process starts: one line, usage exit code.
    r = dapple("topology", "measure", option, value)
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and option in lines[0] and str(value) in lines[0], r.stderr
