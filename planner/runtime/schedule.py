"""Per-stage action orders of a plan, generated and checked by the Rust core
(``rust_core/core/src/schedule.rs``), so that the runtime executes the same
lists the simulator runs.

Each stage's list holds ``("F", m)`` and ``("B", m)`` actions; the gradient
AllReduce and the optimizer step that end every list in the core are left to
the executor. Every replica of a stage runs the same list on its slice of
each micro-batch.

- early-backward (DAPPLE 1F1B): stage i runs K_i forwards, then alternates
  one backward and one forward until the forwards run out, then the
  remaining backwards.
- GPipe: F0 .. F(M-1), then B(M-1) .. B0 on every stage.
- asynchronous kinds (``_core.ASYNCHRONOUS_SCHEDULES``): one list over many
  mini-batches with ``AR`` and ``OPT`` after each, and the weights of each
  pass (:func:`asynchronous_passes`).

No torch here. Errors are ``planner.InvalidInputError`` (a ``ValueError``).
"""

from __future__ import annotations

from typing import Any

from .. import _core

Action = tuple[str, int]

#: One action of an asynchronous list: ("F" | "B" | "AR" | "OPT", micro-batch
#: of the run, its mini-batch, the stage's live version when it runs, the
#: weight version the pass starts from, updates predicted ahead of it); the
#: last five are None for AR and OPT.
Pass = tuple[str, Any, Any, Any, Any, Any]

EARLY_BACKWARD, GPIPE = (k for k in _core.SCHEDULE_KINDS if k not in _core.ASYNCHRONOUS_SCHEDULES)


def _compute_actions(tokens: list[list[str]]) -> list[list[Action]]:
    """Forward and backward actions of core token lists ("F3", "B2"; AR/OPT dropped)."""
    return [[(t[0], int(t[1:])) for t in stage if t[0] in "FB"] for stage in tokens]


def early_backward(num_stages: int, micro_batches: int, warmup: list[int]) -> list[list[Action]]:
    """Early-backward 1F1B with warm-up depth ``warmup[i]`` = K_i, each in 1..=M."""
    return _compute_actions(_core.schedule_actions(EARLY_BACKWARD, num_stages, micro_batches, list(warmup)))


def gpipe(num_stages: int, micro_batches: int) -> list[list[Action]]:
    """GPipe: all forwards in order, then all backwards in reverse order."""
    return _compute_actions(_core.schedule_actions(GPIPE, num_stages, micro_batches))


def plan_schedule(plan: _core.Plan) -> list[list[Action]]:
    """The action lists of a plan, one per stage: the core's, which the
    simulator runs too (each stage's own K_i)."""
    return _compute_actions(plan.actions())


def validate(lists: list[list[Action]], micro_batches: int) -> None:
    """Each list runs every F and B of 0..M once, B_m after F_m, and the
    stages together finish without deadlock (checked by the core)."""
    _core.schedule_validate([[f"{k}{m}" for k, m in actions] + ["AR", "OPT"] for actions in lists], micro_batches)


def format_schedule(lists: list[list[Action]]) -> str:
    """``stage 0: F0 F1 B0 ...`` lines, as the core prints them, without AR/OPT."""
    return "\n".join(f"stage {s}: " + " ".join(f"{k}{m}" for k, m in actions) for s, actions in enumerate(lists))


def asynchronous_passes(plan: _core.Plan, schedule: str, mini_batches: int) -> list[list[Pass]]:
    """Each stage's list under asynchronous ``schedule`` over
    ``mini_batches``, with the weights of every pass (the core's
    ``pass_weights``)."""
    return [[(kind, *(weights or (None,) * 5)) for kind, weights in stage]
            for stage in plan.pass_weights(schedule, mini_batches)]


def segments(start: int, steps: int, *every: int) -> list[tuple[int, int]]:
    """``[a, b)`` ranges of mini-batches from ``start`` to ``steps``, cut at
    every multiple of each positive number in ``every``: an asynchronous
    run drains at each cut (a checkpoint, an evaluation)."""
    cuts = {steps}
    for k in every:
        if k > 0:
            cuts.update(range((start // k + 1) * k, steps, k))
    out, a = [], start
    for b in sorted(cuts):
        if b > a:
            out.append((a, b))
            a = b
    return out


def run_schedule(plan: _core.Plan, schedule: str | None) -> str | None:
    """The asynchronous schedule a run of ``plan`` trains with: ``schedule``
    when given, else the plan's own kind when it is asynchronous (a plan
    made by ``dapple plan --schedule``), else None (the plan's synchronous
    schedule)."""
    if schedule is None and plan.schedule_kind in _core.ASYNCHRONOUS_SCHEDULES:
        return plan.schedule_kind
    return schedule
