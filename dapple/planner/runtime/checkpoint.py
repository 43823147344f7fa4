"""Checkpoints of a pipeline run: one file per rank per saved step.

Layout under a checkpoint folder ``D``::

    D/step-<n>/rank-<r>.pt   # rank r after n steps: "step", "stages" (each stage it holds: "stage",
                             # "layer_range", "model", "optimizer"), fp16's "loss_scaler"
    D/latest                 # "<n>\\n": the last step every rank finished saving

Each rank file is written whole or not at all (``torch.save`` to a temporary
file in the same folder, then ``os.replace``). ``latest`` is written by rank 0
only after a barrier that every rank passes once its file is saved, so the
step it names is complete.
"""

from __future__ import annotations

import os

import torch

from ..errors import InvalidInputError
from ..files import read_text, write_atomic, write_atomic_with

LATEST = "latest"


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step-{step}")


def rank_file(root: str, step: int, rank: int) -> str:
    return os.path.join(step_dir(root, step), f"rank-{rank}.pt")


def save_rank(root: str, step: int, rank: int, state: dict) -> str:
    """Write ``state`` to ``D/step-<step>/rank-<rank>.pt`` atomically."""
    os.makedirs(step_dir(root, step), exist_ok=True)
    target = rank_file(root, step, rank)
    write_atomic_with(target, lambda f: torch.save(state, f))
    return target


def load_rank(root: str, step: int, rank: int) -> dict:
    return torch.load(rank_file(root, step, rank), weights_only=True)


def write_latest(root: str, step: int) -> None:
    write_atomic(os.path.join(root, LATEST), f"{step}\n")


def latest_step(root: str, world_size: int | None = None) -> int:
    """The step ``D/latest`` names, checked to have a file for every rank.

    Raises InvalidInputError when there is no complete checkpoint."""
    path = os.path.join(root, LATEST)
    if not os.path.exists(path):
        raise InvalidInputError(f"{root}: no checkpoint to resume from (no file {LATEST})")
    text = read_text(path).strip()
    try:
        step = int(text)
    except ValueError:
        raise InvalidInputError(f"{path}: expected a step number, found {text[:40]!r}") from None
    if step < 0:
        raise InvalidInputError(f"{path}: step {step} is negative")
    if world_size is not None:
        missing = [r for r in range(world_size) if not os.path.exists(rank_file(root, step, r))]
        if missing:
            raise InvalidInputError(
                f"{step_dir(root, step)}: checkpoint incomplete, no file for rank(s) {', '.join(map(str, missing))}"
            )
    return step
