"""benchmarks/deepspeed_sends.py: DeepSpeed's TrainSchedule as a literal
table, and its replay against 1F1B's closed form."""

from __future__ import annotations

import sys

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
from deepspeed_sends import replay, train_schedule  # noqa: E402


def test_train_schedule_is_deepspeeds_order_for_two_stages_and_three_micro_batches():
    # Stage 0 runs forwards on even steps, stage 1 on odd steps; each step
    # first exchanges what the step before made (deepspeed/runtime/pipe/schedule.py).
    assert train_schedule(0, 2, 3) == [
        ("F", 0),
        ("send", 1, ("activation", 0)),
        ("F", 1),
        ("send", 1, ("activation", 1)), ("recv", 1, ("gradient", 0)), ("B", 0),
        ("F", 2),
        ("send", 1, ("activation", 2)), ("recv", 1, ("gradient", 1)), ("B", 1),
        ("recv", 1, ("gradient", 2)), ("B", 2),
    ]
    assert train_schedule(1, 2, 3) == [
        ("recv", 0, ("activation", 0)), ("F", 0),
        ("B", 0),
        ("recv", 0, ("activation", 1)), ("send", 0, ("gradient", 0)), ("F", 1),
        ("B", 1),
        ("recv", 0, ("activation", 2)), ("send", 0, ("gradient", 1)), ("F", 2),
        ("B", 2),
        ("send", 0, ("gradient", 2)),
    ]


@pytest.mark.parametrize("blocking", [True, False])
def test_free_transfers_replay_as_1f1b(blocking):
    stages, micro_batches = 4, 6
    ms = replay([1.0] * stages, [2.0] * stages, [(0.0, 0.0)] * (stages - 1), micro_batches, blocking)
    assert ms == (micro_batches + stages - 1) * 3.0


def test_blocking_transfers_cost_more_than_overlapped_ones():
    args = ([1.0] * 4, [2.0] * 4, [(0.5, 0.5)] * 3, 8)
    assert replay(*args, blocking=True) > replay(*args, blocking=False) > (8 + 3) * 3.0
