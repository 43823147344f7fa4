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


def assert_one_line_error(result, exit_code, *needles):
    """The CLI failed with `exit_code` and one stderr line holding every needle."""
    assert result.returncode == exit_code, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    for n in needles:
        assert n in lines[0], lines[0]
