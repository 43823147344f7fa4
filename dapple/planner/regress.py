"""Plan-quality regression suites: plan every case, compare with recorded times.

A suite file (JSON, format ``dapple.regress-suite``, schema_version 2)::

    {"format": "dapple.regress-suite", "schema_version": 2,
     "tolerance": 0.01,
     "cases": [{"name": "bert-48 A", "profile": "../artifact/bert-48-pbs-2.json",
                "topology": "A", "global_batch_size": 64,
                "expected_ms": 834.43, "expected_shape": "8:8"}]}

``profile`` paths are relative to the suite file. A case fails when its plan's
simulated iteration is more than ``tolerance`` (a fraction; per case or
suite-wide) slower than ``expected_ms``, or when no plan is found. A faster
plan passes and is reported, so that ``--update`` can record it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from . import _core
from .errors import DappleError, InfeasibleError
from .files import path_text, read_text, write_atomic
from .plan import plan
from .profile import Profile

@dataclass(frozen=True)
class Outcome:
    name: str
    status: str  # "ok", "faster", "slower", "infeasible", "new"
    expected_ms: float | None
    actual_ms: float | None
    expected_shape: str | None
    actual_shape: str | None
    detail: str = ""

    @property
    def failed(self) -> bool:
        return self.status in ("slower", "infeasible")


def load_suite(path: str | os.PathLike) -> dict:
    """The suite at ``path``, read and checked by the core
    (``rust_core/core/src/search/regress.rs``), as plain data."""
    return _core.RegressSuite.from_json(read_text(path), path_text(path)).to_dict()


def run_suite(path: str | os.PathLike, suite: dict | None = None) -> list[Outcome]:
    """Plan every case of the suite at ``path`` (``suite``: its
    :func:`load_suite` result, if already loaded). A case with no plan that
    fits is an outcome; any other error in a case stops the run, naming it."""
    suite = load_suite(path) if suite is None else suite
    base = Path(path).resolve().parent
    default_tol = suite["tolerance"]
    profiles: dict[Path, Profile] = {}  # cases share profiles; load each once
    outcomes = []
    for case in suite["cases"]:
        expected = case.get("expected_ms")
        tol = case.get("tolerance", default_tol)
        profile_path = (base / case["profile"]).resolve()
        try:
            if profile_path not in profiles:
                profiles[profile_path] = Profile.load(profile_path)
            p = plan(profiles[profile_path], case["topology"], case["global_batch_size"],
                     min_micro_batch_size=case.get("min_micro_batch_size"))
        except InfeasibleError as e:
            outcomes.append(Outcome(case["name"], "infeasible", expected, None, case.get("expected_shape"), None,
                                    str(e)))
            continue
        except DappleError as e:
            raise type(e)(f"{path_text(path)}: case {case['name']!r}: {e}", code=e.code) from None
        actual = p.iteration_ms
        if expected is None:
            status = "new"
        elif actual > expected * (1 + tol):
            status = "slower"
        elif actual < expected * (1 - tol):
            status = "faster"
        else:
            status = "ok"
        outcomes.append(Outcome(case["name"], status, expected, actual, case.get("expected_shape"), p.shape))
    return outcomes


def update_suite(path: str | os.PathLike, outcomes: list[Outcome], suite: dict | None = None) -> None:
    """Record the actual times and shapes as the new expectations."""
    suite = load_suite(path) if suite is None else suite
    by_name = {o.name: o for o in outcomes}
    for case in suite["cases"]:
        o = by_name[case["name"]]
        if o.actual_ms is not None:
            case["expected_ms"] = round(o.actual_ms, 3)
            case["expected_shape"] = o.actual_shape
    write_atomic(path, _core.RegressSuite.from_dict(suite, path_text(path)).to_json())
