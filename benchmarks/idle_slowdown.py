"""How much slower this machine computes right after an idle wait.

    python benchmarks/idle_slowdown.py

A pipeline stage alternates work with waits in receives. This times the
first 3 layers of the shipped GPT-style model (batch 8, one thread), forward
then backward, with a sleep of 0, 3 or 10 ms after each, as a stage's waits
would be, and prints the median time of the work alone. On a dedicated
machine the three should be equal. docs/runtime.md quotes the result.
"""

from __future__ import annotations

import statistics
import time

import torch
from torch import nn

from dapple.planner.runtime import models


def main() -> None:
    torch.set_num_threads(1)
    spec = models.gpt()
    stage = nn.Sequential(*[m for _, m in spec.layers[:3]])
    x, _ = spec.make_batch(8, torch.Generator().manual_seed(0))
    print("| idle after each pass | forward + backward, median of 60 |")
    print("|--:|--:|")
    for pause_ms in (0, 3, 10):
        times = []
        for _ in range(65):
            t0 = time.perf_counter()
            h = stage(x)
            work = time.perf_counter() - t0
            time.sleep(pause_ms / 1e3)
            t0 = time.perf_counter()
            h.backward(torch.ones_like(h))
            work += time.perf_counter() - t0
            time.sleep(pause_ms / 1e3)
            times.append(work * 1e3)
        print(f"| {pause_ms} ms | {statistics.median(times[5:]):.2f} ms |")


if __name__ == "__main__":
    main()
