"""Peak memory of one worker process, measured rather than estimated.

On a GPU the CUDA caching allocator counts every tensor byte
(``torch.cuda.max_memory_allocated``). On the CPU nothing counts tensor bytes,
so we measure the process: Linux keeps the high-water mark of its resident
set (``VmHWM`` in ``/proc/self/status``) and resets it to the current size
when ``5`` is written to ``/proc/self/clear_refs``. That lets a run measure
the peak of its training iterations alone, apart from the interpreter, torch
and the model built before them.

The resident set only falls when the C allocator gives freed memory back to
the system. glibc keeps small freed blocks in its heap, and by default raises
its ``mmap`` threshold after each large free, so later large tensors land in
the heap too and stay resident after they die. :func:`return_freed_memory`
fixes the threshold (``mallopt``), so tensors of 64 KiB and more are mapped
and unmapped one by one and the resident set follows the live tensors. It
costs a page-fault per 4 KiB on first touch; runs only call it when asked to
measure memory exactly.

Otherwise the CPU's runs and the profiler call :func:`keep_freed_memory`,
the other end of the same two settings: freed blocks stay in the heap for
the next step, as CUDA's caching allocator keeps them on a GPU. glibc's own
moving threshold sits in between, and it makes step times bimodal: each
freed gradient and each of Adam's temporaries comes back either from the
heap or as fresh pages the kernel zeroes on first touch. On the CI VM,
Adam's step on GPT 4 x 192 read 4.3 ms or 7.0 ms from one step to the next
under glibc's default, and 4.3-4.9 ms with the heap kept (docs/fidelity.md).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import resource
import sys

_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter numbers (malloc.h)
_M_TRIM_THRESHOLD = -1
MMAP_THRESHOLD_BYTES = 64 * 1024
#: The largest mmap threshold glibc accepts on a 64-bit machine
#: (``DEFAULT_MMAP_THRESHOLD_MAX``): blocks above it are always mapped.
KEPT_MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024
#: The heap's free top is never given back below this (mallopt takes an int).
KEPT_TRIM_THRESHOLD_BYTES = 2**31 - 1


def return_freed_memory() -> bool:
    """Make glibc return freed blocks of ``MMAP_THRESHOLD_BYTES`` or more to
    the system at once. Returns False where that is not possible (not
    glibc)."""
    return _mallopt(MMAP_THRESHOLD_BYTES, MMAP_THRESHOLD_BYTES)


def keep_freed_memory() -> bool:
    """Make glibc keep freed blocks of up to ``KEPT_MMAP_THRESHOLD_BYTES`` in
    its heap for reuse, and keep the heap's free top: steady step times on
    the CPU, at the price of a resident set that stays at its high-water
    mark. Returns False where that is not possible (not glibc)."""
    return _mallopt(KEPT_MMAP_THRESHOLD_BYTES, KEPT_TRIM_THRESHOLD_BYTES)


def set_host_allocator(device: str, exact_memory: bool) -> None:
    """A run's choice: freed memory returned at once where it measures
    memory exactly, kept where it runs on the CPU; glibc's default on a GPU
    (whose tensors are not the C allocator's)."""
    if exact_memory:
        return_freed_memory()
    elif device == "cpu":
        keep_freed_memory()


def _mallopt(mmap_threshold_bytes: int, trim_threshold_bytes: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = libc.mallopt(_M_MMAP_THRESHOLD, mmap_threshold_bytes)
        ok = ok and libc.mallopt(_M_TRIM_THRESHOLD, trim_threshold_bytes)
    except (OSError, AttributeError):
        return False
    return bool(ok)


def _status_bytes(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024  # the file says kB
    except OSError:
        return None
    return None


class PeakMemory:
    """The peak memory of this process since :meth:`reset`.

    ``source`` says what is measured: ``"cuda-allocated"`` (tensor bytes on
    the current GPU), ``"rss-since-reset"`` (Linux resident set) or
    ``"rss-since-start"`` (``ru_maxrss``, where the high-water mark cannot be
    reset: the peak then includes everything before the reset)."""

    def __init__(self, cuda: bool = False):
        self.cuda = cuda
        if cuda:
            self.source = "cuda-allocated"
        elif _status_bytes("VmHWM") is not None and self._clear_refs():
            self.source = "rss-since-reset"
        else:
            self.source = "rss-since-start"
        self.reset()

    @staticmethod
    def _clear_refs() -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset the peak resident set size to the current one
            return True
        except OSError:
            return False

    def current_bytes(self) -> int:
        if self.cuda:
            import torch

            return int(torch.cuda.memory_allocated())
        now = _status_bytes("VmRSS")
        if now is not None:
            return now
        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024

    def reset(self) -> None:
        """Start a new peak from the current size; remember that size as
        :attr:`baseline_bytes`."""
        if self.cuda:
            import torch

            torch.cuda.reset_peak_memory_stats()
        elif self.source == "rss-since-reset":
            self._clear_refs()
        self.baseline_bytes = self.current_bytes()

    def peak_bytes(self) -> int:
        if self.cuda:
            import torch

            return int(torch.cuda.max_memory_allocated())
        if self.source == "rss-since-reset":
            hwm = _status_bytes("VmHWM")
            if hwm is not None:
                return hwm
        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # kB on Linux
