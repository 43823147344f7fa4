"""``dapple run``: train a model following a plan, one local process per
device of the plan: gloo on the CPU, or NCCL with ``--device cuda``."""

from __future__ import annotations

import dataclasses
import functools
import math
import logging
import os
import sys

import click

from dapple import planner
from dapple.planner.errors import DappleIOError, IncompatibleInputsError, InvalidInputError, RunFailedError
from dapple.planner.files import check_writable, path_text, write_atomic

from dapple.planner.precision import PRECISIONS
from dapple.planner.runtime.optimizers import OPTIMIZERS

from .options import FILE_PATH, count_option_type, max_passes_option, model_kwargs, model_options, reports_errors, require_torch


@click.command("run")
@click.option("--plan", "plan_path", required=True, type=FILE_PATH, help="Plan JSON (dapple.plan).")
@model_options
@click.option("--steps", type=count_option_type(), required=True, help="Total training steps (including resumed ones).")
@click.option("--lr", type=float, default=0.1, show_default=True, help="Learning rate.")
@click.option("--optimizer", type=click.Choice(tuple(OPTIMIZERS)), default="sgd", show_default=True,
              help="sgd, momentum (SGD with momentum 0.9), rmsprop (momentum 0.9) or adam.")
@click.option("--schedule", type=click.Choice(planner.ASYNCHRONOUS_SCHEDULES), default=None,
              help="Train asynchronously instead of with the plan's schedule: xpipe (Adam-based weight "
                   "prediction), pipedream (weight stashing), spectrain (momentum-based prediction, needs "
                   "--optimizer momentum) or async (no prediction); docs/xpipe.md.")
# torch takes seeds of 64 bits; past them it raised an overflow (issue 29's fuzz).
@click.option("--seed", type=click.IntRange(0, 2**63 - 1), default=0, show_default=True,
              help="Seed of the data generator and of torch.")
@click.option("--eval-every", type=click.IntRange(min=1), default=None, metavar="K",
              help="Score the model on the validation split its factory declares after every K steps "
                   "(e.g. dapple.planner.runtime.models:digits); the results go to --metrics.")
@click.option("--metrics", "metrics_path", type=FILE_PATH, default=None,
              help="Write per-iteration and per-rank measurements to this JSON file.")
@click.option("--profile", "profile_path", type=FILE_PATH, default=None,
              help="Profile to estimate and simulate the plan with, recorded in the metrics.")
@click.option("--checkpoint-dir", type=click.Path(file_okay=False), default=None,
              help="Folder for checkpoints (D/step-<n>/rank-<r>.pt, D/latest).")
@click.option("--checkpoint-every", type=click.IntRange(min=1), default=None, help="Save a checkpoint every K steps.")
@click.option("--resume", is_flag=True, help="Continue from the latest complete checkpoint in --checkpoint-dir.")
@click.option("--threads", type=click.IntRange(min=1), default=1, show_default=True, help="torch threads per worker.")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
              help="cpu: gloo processes; cuda: NCCL, rank r on GPU r (run once on one GPU, docs/runtime.md; not in CI).")
@click.option("--dtype", type=click.Choice(PRECISIONS), default="fp32", show_default=True,
              help="What the forwards and the loss compute in: bf16 or fp16 under torch.autocast (parameters and "
                   "optimizer state stay fp32; fp16 with loss scaling, asynchronous schedules on one process "
                   "only), or fp32 (docs/runtime.md).")
@click.option("--recompute", is_flag=True,
              help="Keep only each stage's input during the forward; re-run the stage's forward in its backward.")
@click.option("--exact-memory", is_flag=True,
              help="Return freed memory to the system at once, so the measured peak follows live tensors "
                   "(glibc only; slower).")
@click.option("--slowdown", "slowdowns", multiple=True, metavar="RANK=FACTOR",
              help="Experiment only: rank RANK's forwards and backwards take FACTOR times as long (it sleeps "
                   "the difference), so one machine can stand for GPUs of unequal speed (docs/heterogeneous.md).")
@max_passes_option
@reports_errors
def run_command(plan_path, model_spec, model_args, steps, lr, optimizer, schedule, seed, eval_every, metrics_path,
                profile_path,
                checkpoint_dir, checkpoint_every, resume, threads, device, dtype, recompute, exact_memory, slowdowns):
    """Train a model following a plan, on CPU or CUDA: a process per device.

    gloo on the CPU; NCCL with --device cuda.

    Prints one line per iteration (step, loss, time) on stderr and a summary
    on stdout. If a worker fails or dies, the others are stopped and the
    command exits non-zero naming the rank.

    Started by torchrun (torchrun --nproc-per-node N --no-python dapple run
    ...), each process runs its own rank instead of starting workers, and
    rank 0 prints and writes the results.
    """
    if (checkpoint_every or resume) and not checkpoint_dir:
        raise click.UsageError("--checkpoint-every and --resume need --checkpoint-dir")
    kwargs = model_kwargs(model_args)
    slowdown = slowdown_of(slowdowns)
    if metrics_path:
        check_writable(metrics_path)  # before the run, not after it
    torch = require_torch("run")

    from dapple.planner.profiler import check_device
    from dapple.planner.runtime import checkpoint as ckpt
    from dapple.planner.runtime.config import RunConfig
    from dapple.planner.runtime.data import SeededBatches
    from dapple.planner.runtime.launcher import WorkerFailed, launch, median_iteration_ms
    from dapple.planner.runtime.layout import Layout
    from dapple.planner.runtime.models import load_model

    check_device(device)
    plan = planner.Plan.load(plan_path)
    lay = Layout.of(plan)
    factory = functools.partial(load_model, model_spec, **kwargs)
    # The loss and the batches come with the model, built once the options pass their checks.
    config = RunConfig(
        factory, None, None, steps, lr, optimizer=optimizer, seed=seed, threads=threads,
        start_method="fork" if sys.platform.startswith("linux") else "spawn",
        checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every or 0, log=True, recompute=recompute,
        exact_memory=exact_memory, device=device, slowdown=slowdown, schedule=schedule, eval_every=eval_every or 0,
        dtype=dtype,
    ).for_plan(plan)
    spec = _checked_model(config, lay, plan_path, model_spec)

    start = 0
    if resume:
        start = ckpt.latest_step(checkpoint_dir, lay.world_size)
        if start > steps:
            raise InvalidInputError(f"{checkpoint_dir}: the latest checkpoint is at step {start}, past --steps {steps}")
    if checkpoint_dir:
        try:
            os.makedirs(checkpoint_dir, exist_ok=True)
        except OSError as e:  # a file, or a link to nothing, where the folder would be (fuzz campaign: exit 1)
            what = "a link to nothing" if os.path.islink(checkpoint_dir) else e.strerror
            raise DappleIOError(f"--checkpoint-dir {path_text(checkpoint_dir)}: cannot make the folder: {what}") from None
    estimate, simulated = _predictions(plan, profile_path, config.schedule, recompute)
    torch.manual_seed(seed)
    batches = SeededBatches(factory, lay.global_batch_size, steps, seed)
    if start == steps:
        click.echo(f"nothing to do: the checkpoint is already at step {steps}")
        return
    # torch logs a warning for each worker it stops after a failure; the
    # one-line error below says what happened.
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    try:
        result = launch(plan, dataclasses.replace(config, loss_fn=spec.loss, batches=batches, start_step=start), lay)
    except WorkerFailed as e:
        raise RunFailedError(str(e)) from None
    if result is None:
        return  # a rank other than 0 under torchrun: rank 0 reports
    median = median_iteration_ms(result.metrics[0]["iteration_ms"])
    _report(result, config, start, lay, estimate, simulated, median)
    if metrics_path:
        data = {"plan": plan_path, "model": model_spec,
                "model_args": {k: repr(v) if not isinstance(v, (int, float, str, bool)) else v
                               for k, v in kwargs.items()},
                **run_metrics(result, config, start, lay.global_batch_size, estimate, simulated, median)}
        write_atomic(metrics_path, planner.RunMetrics.from_dict(data, metrics_path).to_json())


def _checked_model(config, lay, plan_path, model_spec):
    """The run's model, built once the options passed their checks against
    the plan (``config.check_run``, before the model is built), and checked
    to fit the plan."""
    from dapple.planner.runtime.config import check_model, check_run
    from dapple.planner.runtime.evaluation import declares_validation
    from dapple.planner.runtime.launcher import visible_gpus

    try:
        check_run(config, lay, visible_gpus=visible_gpus(config.device))
    except InvalidInputError as e:
        if e.field not in ("slowdown", "dtype"):
            raise
        raise click.BadParameter(str(e), param_hint=f"'--{e.field}'") from None
    except IncompatibleInputsError as e:
        raise IncompatibleInputsError(f"{plan_path}: {e}") from None
    spec = config.layers_factory()
    if config.eval_every and not declares_validation(spec):
        raise IncompatibleInputsError(f"--eval-every: model {model_spec} declares no validation split")
    try:
        check_model(lay, [layer for _, layer in spec.layers], spec.config.get("seq"), model_spec)
    except IncompatibleInputsError as e:
        raise IncompatibleInputsError(f"{plan_path}: {e}") from None
    return spec


def _predictions(plan, profile_path, schedule, recompute):
    """(estimate_ms, simulated_ms) of the run's schedule: the plan's bound
    describes its own schedule, none for another one."""
    own_schedule = schedule is None or schedule == plan.core.schedule_kind
    estimate = plan.estimate["latency_ms"] if plan.estimate and own_schedule else None
    simulated = None
    if profile_path:
        profile = planner.Profile.load(profile_path)
        if own_schedule:
            estimate = planner.evaluate(plan, profile).estimate["latency_ms"]
        simulated = planner.simulate(plan, profile, schedule=schedule, recompute=recompute).iteration_ms
    return estimate, simulated


def _report(result, config, start, lay, estimate, simulated, median):
    """The step lines of an asynchronous run (only its end knows them), then
    the summary on stdout. ``median``: ``median_iteration_ms`` of the run."""
    from dapple.planner.runtime.evaluation import eval_line

    m0 = result.metrics[0]
    losses, iter_ms = result.losses, m0["iteration_ms"]
    if config.schedule is not None:
        evaluated = {e["step"]: e for e in m0["evaluations"]}
        for i, (loss, ms) in enumerate(zip(losses, iter_ms)):
            click.echo(f"step {start + i + 1}/{config.steps} loss {loss:.6f} {ms:.1f} ms", err=True)
            if start + i + 1 in evaluated:
                click.echo(eval_line(evaluated[start + i + 1]), err=True)
    how = f", {config.schedule}" if config.schedule else ""
    median_ms, left_out = median
    line = (f"ran steps {start + 1}..{config.steps} on {lay.world_size} processes in {config.dtype}{how}: "
            f"final loss {losses[-1]:.6f}, "
            f"median iteration {median_ms:.1f} ms over steps {start + 1 + left_out}..{config.steps}")
    if estimate is not None:
        line += f" (estimate {estimate:.1f} ms"
        line += f", simulated {simulated:.1f} ms)" if simulated is not None else ")"
    click.echo(line)
    for r, m in rank_entries(result).items():
        click.echo(f"rank {r} (stage {m['stage']}): compute {m['compute_ms']:.1f} ms, bubbles "
                   f"{m['bubble_fraction'] * 100:.1f}%, peak memory {m['peak_memory_bytes'] / 2**20:.1f} MiB "
                   f"({(m['peak_memory_bytes'] - m['memory_before_bytes']) / 2**20:+.1f} MiB in training)")


def rank_entries(result) -> dict[str, dict]:
    """Each rank's entry of the metrics file (``dapple.run-metrics``), from
    its measurements (``worker.rank_metrics``)."""
    kept = ("stage", "replica", "peak_memory_bytes", "memory_before_bytes", "memory_source", "compute_ms",
            "bubble_ms")
    return {str(r): {**{k: m[k] for k in kept},
                     "bubble_fraction": m["bubble_ms"] / max(sum(m["iteration_ms"]), 1e-9),
                     "phase_ms": m["phase_ms"]}
            for r, m in sorted(result.metrics.items())}


def run_metrics(result, config, start: int, global_batch_size: int, estimate, simulated, median) -> dict:
    """The run's part of the metrics file: its options, its steps and its ranks."""
    m0 = result.metrics[0]
    iter_ms = m0["iteration_ms"]
    median_ms, left_out = median
    return {
        "first_step": start + 1,
        "steps": config.steps,
        "global_batch_size": global_batch_size,
        "recompute": config.recompute,
        "optimizer": config.optimizer,
        "schedule": config.schedule,
        "dtype": config.dtype,
        "exact_memory": config.exact_memory,
        "iteration_ms": iter_ms,
        "losses": [loss if math.isfinite(loss) else None for loss in result.losses],
        "mean_iteration_ms": sum(iter_ms) / len(iter_ms),
        "median_iteration_ms": median_ms,
        "first_steps_left_out": left_out,
        "estimate_ms": estimate,
        "simulated_ms": simulated,
        "ranks": rank_entries(result),
        "evaluations": m0["evaluations"],
    }


def slowdown_of(values: tuple[str, ...]) -> dict[int, float]:
    """``{rank: factor}`` from --slowdown RANK=FACTOR items (factor >= 1)."""
    out: dict[int, float] = {}
    for item in values:
        rank, sep, factor = item.partition("=")
        try:
            r, f = int(rank), float(factor)
        except ValueError:
            r, f = -1, 0.0
        if not sep or r < 0 or not 1.0 <= f <= 1000.0:
            raise click.BadParameter(f"{item!r} is not RANK=FACTOR with a rank >= 0 and a factor in 1..1000",
                                     param_hint="'--slowdown'")
        out[r] = f
    return out
