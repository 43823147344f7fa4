"""Optimizers a run can use, and which asynchronous schedules can predict
weights for each: one table, without torch, so the command line checks a
run's options before starting it.

XPipe predicts with Adam's moments whatever the optimizer (the paper's
robustness study trains with momentum SGD, RMSProp and Adam): with Adam it
reads the optimizer's own moments, otherwise it keeps its own.
SpecTrain predicts with the smoothed gradient of momentum SGD, which only
that optimizer has.
"""

from __future__ import annotations

from .. import _core
from ..errors import IncompatibleInputsError

#: name -> (torch.optim class, its arguments besides the learning rate).
OPTIMIZERS: dict[str, tuple[str, dict]] = {
    "sgd": ("SGD", {}),
    "momentum": ("SGD", {"momentum": 0.9}),
    "rmsprop": ("RMSprop", {"momentum": 0.9}),
    "adam": ("Adam", {}),
}

#: Predictors (the core's ``SCHEDULE_PREDICTORS`` names each predicting
#: schedule's), and the optimizers each can predict for.
PREDICTS_FOR: dict[str, tuple[str, ...]] = {
    "adam": tuple(OPTIMIZERS),
    "momentum": ("momentum",),
}


def check_optimizer(schedule: str | None, optimizer: str) -> None:
    """Raise IncompatibleInputsError when ``schedule`` cannot predict
    weights for ``optimizer`` (naming both), or the optimizer is unknown."""
    if optimizer not in OPTIMIZERS:
        raise IncompatibleInputsError(f"--optimizer: value {optimizer!r} is not one of {', '.join(OPTIMIZERS)}")
    predictor = _core.SCHEDULE_PREDICTORS.get(schedule or "")
    if predictor is not None and optimizer not in PREDICTS_FOR[predictor]:
        raise IncompatibleInputsError(
            f"--optimizer: value {optimizer!r}: schedule {schedule} extrapolates the smoothed gradient of "
            f"{' or '.join(PREDICTS_FOR[predictor])}, which {optimizer} does not keep"
        )
