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
