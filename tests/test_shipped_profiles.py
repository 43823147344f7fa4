"""The shipped profiles are exactly what the conversion script makes from the artifact."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import PROFILES, ROOT, SHARED

ARTIFACT = SHARED / "profiles" / "dapple-artifact"


def test_shipped_profiles_are_reproducible(tmp_path):
    if not ARTIFACT.exists():
        pytest.skip("../shared/profiles/dapple-artifact is not beside the checkout")
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    subprocess.run(["bash", ROOT / "profiles" / "convert_artifact.sh", ARTIFACT, tmp_path], check=True,
                   capture_output=True, env=env)
    made = sorted(p.name for p in tmp_path.glob("*.json"))
    shipped = sorted(p.name for p in PROFILES.glob("*.json"))
    assert made == shipped and len(made) == 13
    for name in made:
        assert (tmp_path / name).read_text() == (PROFILES / name).read_text(), name


def test_every_shipped_profile_loads_and_names_its_source():
    for path in PROFILES.glob("*.json"):
        from dapple import planner

        prof = planner.Profile.load(path)
        assert "DAPPLE artifact" in prof.data["source"]
        assert prof.data["device"] == "V100-16GB"
