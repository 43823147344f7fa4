"""Per-stage action lists of a plan, generated and checked by the Rust core
(``rust_core/core/src/schedule.rs``), so that the runtime executes the same
lists the simulator runs. Actions cross the binding typed
(``dapple.planner._core.Action``, and ``dapple.planner._core.Pass`` with the weights of
each forward and backward): nothing here reads action text.

- early-backward (DAPPLE 1F1B): stage i runs K_i forwards, then alternates
  one backward and one forward until the forwards run out, then the
  remaining backwards.
- GPipe: F0 .. F(M-1), then B(M-1) .. B0 on every stage.
- ZB-H1: 1F1B with each backward split into its input gradient ``I`` and
  its weight gradient ``W``, deferred into the waits (torch's order).
- asynchronous kinds (``_core.ASYNCHRONOUS_SCHEDULES``): one list over many
  mini-batches with ``AR`` and ``OPT`` after each, and the weights of each
  pass (:func:`run_lists`).

Every list ends each mini-batch with the stage's gradient AllReduce and its
optimizer step; every replica of a stage runs the same list on its slice of
each micro-batch. The table helpers (:func:`early_backward`, :func:`gpipe`,
:func:`plan_schedule`) give the forwards and backwards as ``(kind,
micro-batch)`` pairs, for tests and tables.

No torch here. Errors are ``planner.InvalidInputError`` (a ``ValueError``).
"""

from __future__ import annotations

from .. import _core
from ..errors import LimitExceededError

#: A forward ("F", m) or backward ("B", m) of micro-batch m, as tables write it.
Pair = tuple[str, int]

#: The synchronous kinds of one stage a rank, in the core's order: early
#: backward, GPipe, ZB-H1, ZB-H2.
EARLY_BACKWARD, GPIPE, ZERO_BUBBLE_H1, ZERO_BUBBLE_H2 = (
    k for k in _core.SCHEDULE_KINDS if k not in _core.ASYNCHRONOUS_SCHEDULES + _core.CHUNKED_SCHEDULES)


def pairs(lists) -> list[list[Pair]]:
    """The forwards and backwards of typed lists (AR and OPT left out)."""
    return [[(a.kind, a.micro_batch) for a in actions if a.micro_batch is not None] for actions in lists]


def early_backward(num_stages: int, micro_batches: int, warmup: list[int]) -> list[list[Pair]]:
    """Early-backward 1F1B with warm-up depth ``warmup[i]`` = K_i, each in 1..=M."""
    return pairs(_core.schedule_actions(EARLY_BACKWARD, num_stages, micro_batches, list(warmup)))


def gpipe(num_stages: int, micro_batches: int) -> list[list[Pair]]:
    """GPipe: all forwards in order, then all backwards in reverse order."""
    return pairs(_core.schedule_actions(GPIPE, num_stages, micro_batches))


def plan_schedule(plan: _core.Plan) -> list[list[Pair]]:
    """The action lists of a plan, one per stage: the core's, which the
    simulator runs too (each stage's own K_i)."""
    return pairs(plan.actions())


def validate(lists: list[list[Pair]], micro_batches: int) -> None:
    """Each list runs every F and B of 0..M once, B_m after F_m, and the
    stages together finish without deadlock (checked by the core)."""
    end = [_core.Action("AR"), _core.Action("OPT")]
    _core.schedule_validate([[_core.Action(k, m) for k, m in pairs] + end for pairs in lists], micro_batches)


def format_schedule(lists: list[list[Pair]]) -> str:
    """``stage 0: F0 F1 B0 ...`` lines, as the core prints them, without AR/OPT."""
    return "\n".join(f"stage {s}: " + " ".join(str(_core.Action(k, m)) for k, m in pairs)
                     for s, pairs in enumerate(lists))


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


def run_segments(start: int, steps: int, schedule: str | None, checkpoint_every: int,
                 eval_every: int) -> list[tuple[int, int]]:
    """The lists a run walks, as ``[a, b)`` ranges of steps: one step each
    under a synchronous schedule (the pipeline flushes every step), else cut
    at every checkpoint and evaluation (:func:`segments`)."""
    if schedule is None:
        return [(i, i + 1) for i in range(start, steps)]
    return segments(start, steps, checkpoint_every, eval_every)


def run_lists(plan: _core.Plan, schedule: str | None, lengths: set[int]) -> dict[int, list[list[_core.Pass]]]:
    """Each stage's list of passes (``_core.Pass``: the action, the stage
    and the weights it computes with), for a list of each length in
    ``lengths`` mini-batches: the plan's own synchronous schedule when
    ``schedule`` is None (one mini-batch), else asynchronous ``schedule``.
    Under a chunked kind every stage gets its rank's list of its chunks'
    passes, each naming its stage."""
    if plan.schedule_kind in _core.CHUNKED_SCHEDULES:
        # Each stage is given its pipeline rank's list, passes naming their chunk.
        ranks = plan.pass_weights()
        return {n: [ranks[r] for r in plan.stage_ranks] for n in lengths}
    try:
        return {n: plan.pass_weights(schedule, n) for n in sorted(lengths, reverse=True)}
    except LimitExceededError as e:
        # A segment (the steps between two checkpoints or evaluations) is one list.
        raise LimitExceededError(f"--steps: {e}; cut the run with --checkpoint-every or --eval-every "
                                 "(each drains the pipeline)") from None


def run_schedule(plan: _core.Plan, schedule: str | None) -> str | None:
    """The asynchronous schedule a run of ``plan`` trains with: ``schedule``
    when given, else the plan's own kind when it is asynchronous (a plan
    made by ``dapple plan --schedule``), else None (the plan's synchronous
    schedule)."""
    if schedule is None and plan.schedule_kind in _core.ASYNCHRONOUS_SCHEDULES:
        return plan.schedule_kind
    return schedule
