"""Measured training runs (a layout, a model, a cluster and the iteration
time a runtime measured) costed by the cost model, scored against what was
measured, and the runtime's figures fitted to them: ``dapple calibrate
--runs``, ``benchmarks/measured_runs.py``.

A run file is a CSV with vTrain's columns (``COLUMNS``: GPUs, global batch,
micro batch per data-parallel rank, hidden size, attention heads, layers,
sequence length, tensor, data and pipeline parallelism, iteration time in
ms), one row per run, each a GPT model (FFN 4h, GPT-2's vocabulary) trained
by Megatron's layout of equal pipeline stages (``planner.megatron_plan``).
How the runs were trained that the file does not say (GPU type, attention
kernel, re-computation, gradient precision, GPUs a machine) is a
``RunCosting``.

The fitted figures are named in ``FITTED``, each with the range it is
searched in. The fit minimizes the mean absolute percentage error; its
held-out error is measured by k-fold cross-validation (fit on k - 1 folds,
score the one left out), so what it reports is the error on runs the fit
did not see."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
import random
import statistics
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Callable, Sequence

from . import errors
from .compare import megatron_plan
from .files import path_text, read_text
from .profile import HOST_US_PER_KERNEL, transformer_profile
from .simulation import simulate

#: A run file's columns, as vTrain's ground_truth_single.csv names them, by field.
COLUMNS = {
    "gpus": "# GPUs",
    "global_batch": "global batch",
    "micro_batch": "micro batch",
    "hidden": "hidden size",
    "heads": "attention heads",
    "layers": "# layers",
    "seq_len": "sequence length",
    "tensor": "tensor parallelism",
    "data": "data parallelism",
    "pipeline": "pipeline parallelism",
    "iteration_ms": "iteration time (ms)",
}

#: GPT-2's vocabulary (vTrain's src/config.py default), which Megatron pads.
GPT2_VOCABULARY = 50257

#: The figures a fit may change, each with the range it is searched in:
#: what the runtime's host takes to issue one kernel, us (``transformer_profile``).
FITTED = {"host_us_per_kernel": (0.1, 1000.0)}

#: Golden-section steps of a one-figure fit: the range shrinks by 0.618 a
#: step, 9.2 (ln of 1000 / 0.1) to 5e-5 in 25, which is what converged means.
FIT_STEPS = 25
CONVERGED_LOG_WIDTH = 1e-4


@dataclasses.dataclass(frozen=True)
class MeasuredRun:
    gpus: int
    global_batch: int
    micro_batch: int
    hidden: int
    heads: int
    layers: int
    seq_len: int
    tensor: int
    data: int
    pipeline: int
    iteration_ms: float

    @property
    def model(self) -> tuple[int, int, int, int]:
        return (self.hidden, self.heads, self.layers, self.seq_len)

    @property
    def group(self) -> tuple:
        """Runs that answer one question: which layout for this model, GPUs and batch."""
        return (self.model, self.gpus, self.global_batch)


@dataclasses.dataclass(frozen=True)
class RunCosting:
    """How the runs were trained, where the run file does not say."""

    gpu: str = "A100-80GB"
    attention: str = "unfused"
    recompute: str = "per-layer"
    gradients: str = "fp32"
    gpus_per_machine: int = 8
    vocabulary: int = GPT2_VOCABULARY


def read_runs(path: str | os.PathLike) -> list[MeasuredRun]:
    """The runs of a CSV file, each checked: a missing column, a value that
    is not a positive whole number (the time: a positive number), or a
    layout whose degrees do not multiply to its GPUs is a one-line error
    naming the file, row and field."""
    text = read_text(path)
    name = path_text(path)
    rows = list(csv.reader(text.splitlines()))
    if not rows:
        raise errors.InvalidInputError(f"{name}: empty: expected a header row with {', '.join(COLUMNS.values())}")
    header = [h.strip() for h in rows[0]]
    missing = [c for c in COLUMNS.values() if c not in header]
    if missing:
        raise errors.InvalidInputError(f"{name}: row 1: missing column {missing[0]!r}")
    index = {field: header.index(column) for field, column in COLUMNS.items()}
    runs = []
    for number, row in enumerate(rows[1:], start=2):
        if not any(cell.strip() for cell in row):
            continue
        values = {}
        for field, i in index.items():
            cell = row[i].strip() if i < len(row) else ""
            where = f"{name}: row {number}: field {COLUMNS[field]!r}"
            try:
                value = float(cell) if field == "iteration_ms" else int(cell)
            except ValueError:
                raise errors.InvalidInputError(f"{where}: value {cell!r} is not a number") from None
            if not (value > 0 and math.isfinite(value)):
                raise errors.InvalidInputError(f"{where}: value {cell} must be > 0")
            values[field] = value
        run = MeasuredRun(**values)
        if run.tensor * run.data * run.pipeline != run.gpus:
            raise errors.IncompatibleInputsError(
                f"{name}: row {number}: field {COLUMNS['gpus']!r}: value {run.gpus} is not tensor x data x pipeline "
                f"({run.tensor} x {run.data} x {run.pipeline})")
        if run.global_batch % (run.micro_batch * run.data):
            raise errors.IncompatibleInputsError(
                f"{name}: row {number}: field {COLUMNS['global_batch']!r}: value {run.global_batch} is not a multiple "
                f"of micro batch x data parallelism ({run.micro_batch} x {run.data})")
        runs.append(run)
    if not runs:
        raise errors.InvalidInputError(f"{name}: no runs after the header")
    return runs


def topology_of(run: MeasuredRun, costing: RunCosting) -> str:
    per_machine = min(run.gpus, costing.gpus_per_machine)
    return f"{math.ceil(run.gpus / per_machine)}x{per_machine}-{costing.gpu.lower()}"


def cost_runs(runs: Sequence[MeasuredRun], costing: RunCosting, figures: dict[str, float]) -> list[float]:
    """Each run's simulated iteration time, ms, with the fitted ``figures``
    (``FITTED``'s names) where given and the defaults elsewhere."""
    host_us = figures.get("host_us_per_kernel", HOST_US_PER_KERNEL)
    sizes: dict[tuple, set[int]] = defaultdict(set)
    for run in runs:
        sizes[run.model].add(run.micro_batch)
    profiles = {}
    with tempfile.TemporaryDirectory() as folder:
        for model, micro_batches in sizes.items():
            hidden, heads, layers, seq_len = model
            config = {"n_embd": hidden, "n_inner": 4 * hidden, "n_head": heads, "n_layer": layers,
                      "vocab_size": costing.vocabulary, "n_positions": seq_len, "activation_function": "gelu_new"}
            path = Path(folder) / f"gpt-{hidden}-{heads}-{layers}-{seq_len}.json"
            path.write_text(json.dumps(config))
            profiles[model] = transformer_profile(path, gpu=costing.gpu, seq_len=seq_len,
                                                  micro_batch_sizes=sorted(micro_batches),
                                                  attention=costing.attention, gradients=costing.gradients,
                                                  host_us_per_kernel=host_us)
    predicted = []
    for run in runs:
        profile = profiles[run.model]
        plan = megatron_plan(profile, topology_of(run, costing), run.global_batch, tensor_parallel=run.tensor,
                             pipeline_parallel=run.pipeline, micro_batch_size=run.micro_batch,
                             recompute=costing.recompute)
        predicted.append(simulate(plan, profile).iteration_ms)
    return predicted


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's rank correlation (ties ranked by their mean rank)."""
    def ranks(x):
        order = sorted(range(len(x)), key=lambda i: x[i])
        r = [0.0] * len(x)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and x[order[j + 1]] == x[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r
    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    var = math.sqrt(sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb))
    return cov / var if var > 0 else 1.0


def score(runs: Sequence[MeasuredRun], predicted: Sequence[float]) -> dict:
    """MAPE and the ratios over every run; and per group of the same model,
    GPUs and batch (two runs or more): Spearman of predicted against
    measured, and regret, the measured time of the layout predicted fastest
    over the best measured."""
    ratios = [p / r.iteration_ms for r, p in zip(runs, predicted)]
    groups: dict[tuple, list[int]] = defaultdict(list)
    for i, run in enumerate(runs):
        groups[run.group].append(i)
    spearmans, regrets = [], []
    for members in groups.values():
        if len(members) < 2:
            continue
        measured = [runs[i].iteration_ms for i in members]
        guessed = [predicted[i] for i in members]
        spearmans.append(spearman(guessed, measured))
        chosen = min(range(len(members)), key=lambda k: guessed[k])
        regrets.append(measured[chosen] / min(measured))
    return {
        "runs": len(runs),
        "mape_percent": 100 * statistics.fmean(abs(x - 1) for x in ratios),
        "median_ratio": statistics.median(ratios),
        "within_10_percent": sum(abs(x - 1) <= 0.10 for x in ratios),
        "groups": len(spearmans),
        "median_spearman": statistics.median(spearmans) if spearmans else None,
        "worst_regret": max(regrets) if regrets else None,
        "median_regret": statistics.median(regrets) if regrets else None,
    }


def mape(runs: Sequence[MeasuredRun], predicted: Sequence[float]) -> float:
    return 100 * statistics.fmean(abs(p / r.iteration_ms - 1) for r, p in zip(runs, predicted))


def check_enough(runs: Sequence[MeasuredRun], source: str | None = None) -> None:
    """A fit needs at least as many runs as it fits figures."""
    if len(runs) < len(FITTED):
        where = f"{source}: " if source else ""
        raise errors.IncompatibleInputsError(
            f"{where}{len(runs)} runs cannot fit {len(FITTED)} figures ({', '.join(FITTED)}): "
            f"give at least {len(FITTED)}")


@dataclasses.dataclass(frozen=True)
class Fit:
    figures: dict[str, float]
    mape_percent: float
    steps: int
    converged: bool


def fit(runs: Sequence[MeasuredRun], costing: RunCosting, step: Callable[[], None] | None = None) -> Fit:
    """The ``FITTED`` figures that cost ``runs`` with the least MAPE: a
    golden-section search in the logarithm of each figure over its range
    (one figure today). ``step`` is called after each costing of the runs
    (a progress bar). Fewer runs than figures is an error."""
    check_enough(runs)
    (name, (low, high)), = FITTED.items()
    cache: dict[float, float] = {}

    def error_at(log_value: float) -> float:
        if log_value not in cache:
            cache[log_value] = mape(runs, cost_runs(runs, costing, {name: math.exp(log_value)}))
            if step:
                step()
        return cache[log_value]

    a, b = math.log(low), math.log(high)
    ratio = (math.sqrt(5) - 1) / 2
    c, d = b - ratio * (b - a), a + ratio * (b - a)
    for _ in range(FIT_STEPS):
        if error_at(c) <= error_at(d):
            b, d = d, c
            c = b - ratio * (b - a)
        else:
            a, c = c, d
            d = a + ratio * (b - a)
    best = min(cache, key=cache.get)
    converged = (b - a) <= CONVERGED_LOG_WIDTH and math.log(low) < best < math.log(high)
    return Fit({name: math.exp(best)}, cache[best], len(cache), converged)


def folds_of(runs: Sequence[MeasuredRun], folds: int, seed: int = 0) -> list[list[int]]:
    """The runs' indices dealt into ``folds`` folds at random (``seed``)."""
    order = list(range(len(runs)))
    random.Random(seed).shuffle(order)
    return [sorted(order[k::folds]) for k in range(folds)]


def cross_validate(runs: Sequence[MeasuredRun], costing: RunCosting, folds: int = 5, seed: int = 0,
                   step: Callable[[], None] | None = None) -> dict:
    """k-fold cross-validation of ``fit``: each fold's runs costed with the
    figures fitted on the others, scored together (``score``), with each
    fold's figures."""
    if folds < 2 or folds > len(runs):
        raise errors.IncompatibleInputsError(f"{len(runs)} runs cannot make {folds} folds: give 2 to {len(runs)}")
    predicted = [0.0] * len(runs)
    fitted = []
    for held in folds_of(runs, folds, seed):
        held_set = set(held)
        result = fit([r for i, r in enumerate(runs) if i not in held_set], costing, step)
        if not result.converged:
            raise errors.InfeasibleError(f"the fit did not converge on fold {len(fitted) + 1} of {folds}")
        fitted.append(result.figures)
        for i, p in zip(held, cost_runs([runs[i] for i in held], costing, result.figures)):
            predicted[i] = p
    return {"folds": folds, "seed": seed, "fold_figures": fitted, "held_out": score(runs, predicted),
            "predicted_ms": predicted}
