"""CI tests the wheel users get, not the source tree."""

import os
from pathlib import Path

import pytest

import dapple.cli.main
from dapple import planner
from conftest import ROOT


@pytest.mark.skipif(not os.environ.get("DAPPLE_TEST_INSTALLED"), reason="only when .ci/run installed the wheel")
def test_packages_come_from_the_installed_wheel():
    for module in (planner, dapple.cli.main):
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
    for source in (ROOT / "dapple").rglob("*.py"):
            assert "networkx" not in source.read_text(), source


@pytest.mark.skipif(not os.environ.get("DAPPLE_TEST_INSTALLED"), reason="only when .ci/run installed the wheel")
def test_the_wheel_installs_one_top_level_package():
    # `import cli` or `import planner` would collide with any other package
    # of that name in the user's environment (issue 29): both live under
    # `dapple`, and the wheel's RECORD names no other top-level module.
    from importlib.metadata import files

    top_level = {f.parts[0] for f in files("dapple") if not f.parts[0].endswith(".dist-info") and f.parts[0] != ".."}
    assert top_level == {"dapple"}, top_level
    for gone in ("cli", "planner"):
        with pytest.raises(ModuleNotFoundError):
            __import__(gone)
