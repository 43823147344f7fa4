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

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

from .errors import DappleError, InfeasibleError, InvalidInputError
from .files import read_text, write_atomic
from .plan import plan
from .profile import Profile

SUITE_FORMAT = "dapple.regress-suite"
# Version 2: expected_ms is the plan's simulated iteration (version 1 held
# formula (2) estimates, which are lower; its times cannot be compared).
SUITE_VERSION = 2
CASE_FIELDS = {"name", "profile", "topology", "global_batch_size", "expected_ms", "expected_shape", "tolerance",
               "min_micro_batch_size"}


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
    text = read_text(path)
    try:
        suite = json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidInputError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    except RecursionError:
        raise InvalidInputError(f"{path}: JSON nested too deeply to read") from None
    except ValueError as e:  # e.g. an integer of thousands of digits
        raise InvalidInputError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(suite, dict):
        raise InvalidInputError(f"{path}: expected a JSON object")
    if suite.get("format") != SUITE_FORMAT:
        raise InvalidInputError(f"{path}: field format: value {suite.get('format')!r} is not {SUITE_FORMAT!r}")
    if suite.get("schema_version") != SUITE_VERSION:
        hint = (
            ": version 1 recorded formula (2) estimates, version 2 simulated iterations; "
            "set it to 2 and re-record with dapple regress --update"
            if suite.get("schema_version") == 1
            else ""
        )
        raise InvalidInputError(
            f"{path}: field schema_version: value {suite.get('schema_version')!r} is not supported "
            f"(supported: {SUITE_VERSION}){hint}"
        )
    unknown = set(suite) - {"format", "schema_version", "tolerance", "cases", "about"}
    if unknown:
        raise InvalidInputError(f"{path}: field {sorted(unknown)[0]}: unknown field")
    _number(path, "tolerance", suite.get("tolerance", 0.01))
    cases = suite.get("cases")
    if not isinstance(cases, list) or not cases:
        raise InvalidInputError(f"{path}: field cases: needs a non-empty list of cases")
    for i, case in enumerate(cases):
        at = f"cases[{i}]"
        if not isinstance(case, dict):
            raise InvalidInputError(f"{path}: field {at}: expected an object")
        unknown = set(case) - CASE_FIELDS
        if unknown:
            raise InvalidInputError(f"{path}: field {at}.{sorted(unknown)[0]}: unknown field")
        for key in ("name", "profile", "topology"):
            if not isinstance(case.get(key), str) or not case[key]:
                raise InvalidInputError(f"{path}: field {at}.{key}: value {case.get(key)!r} must be a non-empty string")
        gbs = case.get("global_batch_size")
        if not isinstance(gbs, int) or isinstance(gbs, bool) or gbs < 1:
            raise InvalidInputError(f"{path}: field {at}.global_batch_size: value {gbs!r} must be an integer >= 1")
        if "expected_ms" in case:
            _number(path, f"{at}.expected_ms", case["expected_ms"])
        if "tolerance" in case:
            _number(path, f"{at}.tolerance", case["tolerance"])
        mbs = case.get("min_micro_batch_size")
        if mbs is not None and (not isinstance(mbs, int) or isinstance(mbs, bool) or mbs < 1):
            raise InvalidInputError(f"{path}: field {at}.min_micro_batch_size: value {mbs!r} must be an integer >= 1")
    names = [case["name"] for case in cases]
    dup = next((n for i, n in enumerate(names) if n in names[:i]), None)
    if dup is not None:
        raise InvalidInputError(f"{path}: field cases: value {dup!r} names two cases; names must be unique")
    return suite


def _number(path, field, value) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
        raise InvalidInputError(f"{path}: field {field}: value {value!r} must be a finite number >= 0")


def run_suite(path: str | os.PathLike, suite: dict | None = None) -> list[Outcome]:
    """Plan every case of the suite at ``path`` (``suite``: its
    :func:`load_suite` result, if already loaded). A case with no plan that
    fits is an outcome; any other error in a case stops the run, naming it."""
    suite = load_suite(path) if suite is None else suite
    base = Path(path).resolve().parent
    default_tol = suite.get("tolerance", 0.01)
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
            raise type(e)(f"{path}: case {case['name']!r}: {e}", code=e.code) from None
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
    write_atomic(path, json.dumps(suite, indent=1) + "\n")
