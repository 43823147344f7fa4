"""CI tests the wheel users get, not the source tree."""

import os
from pathlib import Path

import pytest

import cli.main
import planner
from conftest import ROOT


@pytest.mark.skipif(not os.environ.get("DAPPLE_TEST_INSTALLED"), reason="only when .ci/run installed the wheel")
def test_packages_come_from_the_installed_wheel():
    for module in (planner, cli.main):
        assert ROOT not in Path(module.__file__).resolve().parents, module.__file__
    assert (Path(planner.__file__).parent / "_core.pyi").exists()


@pytest.mark.skipif(not os.environ.get("DAPPLE_TEST_INSTALLED"), reason="only when .ci/run installed the wheel")
def test_networkx_is_a_test_dependency_only():
    # Planning runs no graph algorithm a topology or a profile needs
    # networkx for (docs/architecture.md, Dependencies); the structure test
    # finds import circles with it.
    from importlib.metadata import requires

    networkx = [r for r in requires("dapple") if r.startswith("networkx")]
    assert networkx and all("extra == 'test'" in r.replace('"', "'") for r in networkx), networkx
    for package in ("planner", "cli"):
        for source in (ROOT / package).rglob("*.py"):
            assert "networkx" not in source.read_text(), source
