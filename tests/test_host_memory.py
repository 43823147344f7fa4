"""The C allocator's two settings (``dapple.planner.runtime.memory``): freed memory
kept in the heap (runs and profiles on the CPU), or given back at once
(``--exact-memory``). Each case runs in its own process: mallopt is global."""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")

# Allocates and touches 8 MiB with the C allocator, frees it, and prints the
# resident set's growth then what is left of it, in MiB.
FREED = """
import ctypes, ctypes.util
from dapple.planner.runtime import memory
assert memory.{setting}()
libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
libc.malloc.restype = ctypes.c_void_p
rss = lambda: memory._status_bytes("VmRSS") / 2**20
before = rss()
block = libc.malloc(8 * 2**20)
ctypes.memset(block, 1, 8 * 2**20)
grown = rss() - before
libc.free(ctypes.c_void_p(block))
print(grown, rss() - before)
"""


def rss_after_free(setting: str) -> tuple[float, float]:
    out = subprocess.run([sys.executable, "-c", FREED.format(setting=setting)], capture_output=True, text=True,
                         check=True).stdout
    grown, left = map(float, out.split())
    return grown, left


def test_kept_memory_stays_resident_after_free():
    grown, left = rss_after_free("keep_freed_memory")
    assert grown >= 7.5
    assert left >= 7.5  # in the heap, ready for the next step's tensors


def test_returned_memory_leaves_the_resident_set_at_free():
    grown, left = rss_after_free("return_freed_memory")
    assert grown >= 7.5
    assert left <= 1.0
