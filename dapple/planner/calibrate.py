"""Calibration (``dapple calibrate``): a profile corrected by what a run of
one of its plans measured, per stage: compute time scales the stage's layer
times, an allocator's peak memory its layers' stored activations. The rule
is the core's (``rust_core/core/src/simulation/calibrate.rs``; docs/runtime.md)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from . import _core
from .files import path_text, read_text
from .plan import Plan
from .profile import Profile

#: The memory source whose peaks are the tensors' own (a CUDA allocator's):
#: only these calibrate stored activations.
EXACT_MEMORY_SOURCE: str = _core.EXACT_MEMORY_SOURCE


@dataclass(frozen=True)
class Calibration:
    """The corrected profile and, per stage of the plan, what was measured
    and predicted and the factors applied: ``layer_start``, ``layer_end``,
    ``measured_compute_ms``, ``predicted_compute_ms``, ``time_factor``,
    ``measured_peak_bytes``, ``predicted_peak_bytes``, ``memory_source``,
    ``memory_factor`` (None where memory was left alone, with
    ``memory_note`` saying why)."""

    profile: Profile
    stages: list[dict]

    @property
    def memory_notes(self) -> list[str]:
        """Why memory was left alone, once per reason."""
        notes = [s["memory_note"] for s in self.stages if s.get("memory_note")]
        return list(dict.fromkeys(notes))


def load_metrics(path: str | os.PathLike) -> _core.RunMetrics:
    """A ``dapple.run-metrics`` file, checked by the core."""
    return _core.RunMetrics.from_json(read_text(path), path_text(path))


def calibrate(plan: Plan | str | os.PathLike, metrics: _core.RunMetrics | str | os.PathLike,
              profile: Profile | str | os.PathLike) -> Calibration:
    """``profile`` (the one ``plan`` was made from) corrected by ``metrics``,
    what ``dapple run --metrics`` wrote for a synchronous run of ``plan``.
    Metrics of another plan raise ``IncompatibleInputsError`` naming the
    metrics file and field."""
    p = plan if isinstance(plan, Plan) else Plan.load(plan)
    m = metrics if isinstance(metrics, _core.RunMetrics) else load_metrics(metrics)
    prof = profile if isinstance(profile, Profile) else Profile.load(profile)
    core, stages = _core.calibrate(p.core, m, prof.core)
    return Calibration(Profile(core), stages)
