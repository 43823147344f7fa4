import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROFILES = ROOT / "profiles" / "artifact"
SHARED = ROOT.parent / "shared"


DAPPLE = Path(sys.executable).parent / "dapple"


def run_dapple(*args, cwd=None, timeout=None):
    """Run the installed `dapple` command as users do, in its own process,
    from the repository root (relative profile paths work as in the README)."""
    return subprocess.run(
        [str(DAPPLE), *map(str, args)],
        capture_output=True,
        text=True,
        cwd=cwd or ROOT,
        timeout=timeout,
    )


@pytest.fixture
def dapple():
    return run_dapple


@pytest.fixture
def small_profile(tmp_path):
    """A valid 4-layer profile file; tests break it on purpose."""
    data = {
        "format": "dapple.profile",
        "schema_version": 1,
        "model": "tiny",
        "optimizer": "adam",
        "layers": [
            {
                "name": f"l{i}",
                "param_bytes": 1_000_000,
                "measurements": [{"batch_size": 1, "fwd_ms": 1.0, "bwd_ms": 2.0, "activation_bytes": 1000}],
            }
            for i in range(4)
        ],
    }

    def write(mutate=None, name="tiny.json", raw=None):
        d = json.loads(json.dumps(data))
        if mutate:
            mutate(d)
        path = tmp_path / name
        path.write_text(raw if raw is not None else json.dumps(d))
        return path

    return write


def write_hand_plan(data: dict, path: Path) -> Path:
    """Write plan ``data`` as a user's hand-written plan: without the
    estimate and selection the planner would have written."""
    data.pop("estimate", None)
    data.pop("selection", None)
    path.write_text(json.dumps(data))
    return path


def hand_plan(mbs: int, stages: list, gbs: int, kind: str = "early-backward-1f1b", chunks: int | None = None):
    """A checked hand-written plan on one 8-GPU machine; ``stages`` are
    (layer_start, layer_end, devices, shape fields: split degree, ZeRO-1,
    experts, ...); ``chunks``: each pipeline rank's stages under a chunked
    ``kind``."""
    from dapple import planner

    m = gbs // mbs
    schedule = {"kind": kind, "warmup_policy": "A", **({"chunks": chunks} if chunks else {})}
    return planner.Plan.from_dict({
        "planner_version": "test",
        "inputs": {"model": "tiny", "profile_sha256": "", "topology": planner.Topology.from_spec("1x8-pcie").data,
                   "global_batch_size": gbs, "options": {"min_micro_batch_size": 1}},
        "micro_batch_size": mbs,
        "micro_batches": m,
        "schedule": schedule,
        "stages": [{"layer_start": a, "layer_end": b, "devices": devs,
                    "warmup_micro_batches": min(len(stages) - i, m), **shape}
                   for i, (a, b, devs, shape) in enumerate(stages)],
    })


def max_diff(a: dict, b: dict) -> float:
    """The largest difference between two states of the same parameters."""
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def assert_trains_as_one_process(result, reference: dict, name: str) -> None:
    """A run's parameters (every rank's gathered back whole) within 1e-5 of
    single-process training's, and every replica's alike."""
    diff = max_diff(result.params, reference)
    print(f"{name}: max parameter difference {diff:.2e}")
    assert diff < 1e-5
    assert result.replicas_agree(atol=1e-6)


def assert_one_line_error(result, exit_code, *needles):
    """The CLI failed with `exit_code` and one stderr line holding every needle."""
    assert result.returncode == exit_code, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    for n in needles:
        assert n in lines[0], lines[0]


@pytest.fixture
def shaped_plan(tmp_path):
    """(plan, profile) paths: a small Llama-style transformer on one 8-GPU
    machine in two stages written by hand, stage 0 split 2 ways over 2
    replicas with ZeRO-1, stage 1 four plain replicas that re-compute."""
    from dapple import planner

    config = tmp_path / "shaped-config.json"
    config.write_text(json.dumps({
        "model_type": "llama", "hidden_act": "silu", "hidden_size": 256, "intermediate_size": 688,
        "num_attention_heads": 8, "num_key_value_heads": 4, "num_hidden_layers": 4, "vocab_size": 1000,
    }))
    profile = tmp_path / "shaped-profile.json"
    r = run_dapple("profile", "transformer", "--config", config, "--gpu", "a100", "--seq-len", 128, "--out", profile)
    assert r.returncode == 0, r.stderr
    data = planner.layout_plan(str(profile), "1x8-a100-80gb", 64, [(0, 3, [0, 1, 2, 3]), (3, 6, [4, 5, 6, 7])]).data
    data["stages"][0].update(tensor_parallel=2, shard_level=1)
    data["stages"][1].update(recompute="full")
    return write_hand_plan(data, tmp_path / "shaped-plan.json"), profile
