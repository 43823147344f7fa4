"""Training data for runs: global batches drawn on demand, the same in every
process and after a resume."""

from __future__ import annotations

from typing import Any, Callable

import torch


class SeededBatches:
    """``steps`` global batches made on demand by ``model_factory().make_batch(
    batch_size, generator)`` from one ``torch.Generator`` seeded with ``seed``:
    batch i is the i-th one drawn, so a run resumed at step s sees the batches
    of an uninterrupted run (the skipped ones are regenerated and dropped).
    Picklable when ``model_factory`` is."""

    def __init__(self, model_factory: Callable[[], Any], batch_size: int, steps: int, seed: int = 0):
        self.model_factory = model_factory
        self.batch_size = batch_size
        self.steps = steps
        self.seed = seed
        self._make = None
        self._gen = None
        self._next = 0
        self._last = None

    def __len__(self) -> int:
        return self.steps

    def use_maker(self, make_batch: Callable | None) -> None:
        """Draw batches with ``make_batch`` from a model this process has
        built already, instead of building another one on first use."""
        if self._make is None and make_batch is not None:
            self._make = make_batch

    def __getstate__(self):
        d = dict(self.__dict__)
        d.update(_make=None, _gen=None, _next=0, _last=None)
        return d

    def __getitem__(self, i: int):
        if not 0 <= i < self.steps:
            raise IndexError(i)
        if self._make is None:
            self._make = self.model_factory().make_batch
        if self._gen is None or i < self._next - 1:
            self._gen = torch.Generator().manual_seed(self.seed)
            self._next, self._last = 0, None
        while self._next <= i:
            self._last = self._make(self.batch_size, self._gen)
            self._next += 1
        return self._last
