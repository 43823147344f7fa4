"""``dapple sweep``: how many GPUs, and of which type: one model planned on
a range of cluster sizes and GPU types, with what training a token budget
takes on each."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import sys
from pathlib import Path

import rich_click as click
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from dapple import planner
from dapple.planner.errors import InvalidInputError
from dapple.planner.files import check_writable, path_text, write_all_atomic
from dapple.planner.limits import MAX_COUNT
from dapple.planner.pictures import picture_format
from dapple.planner.sweep import (
    KNEE_EFFICIENCY,
    amount_text,
    check_prices,
    duration_text,
    gpu_type_name,
    iterations_to_train,
    profile_gpu_type,
    recorded_sequence_length,
    tokens_per_iteration,
    usd_text,
)
from dapple.planner.sweep_plot import plot

from .options import FILE_PATH, count_option_type, json_option, reports_errors
from .progress import quiet_option
from .render import console

#: Token suffixes: K, M, B (or G) and T in powers of 1000, Ki, Mi, Gi and Ti in powers of 1024.
TOKEN_SUFFIXES = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12,
                  "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


class TokenCount(click.ParamType):
    """A positive number of tokens, with a suffix: ``2M``, ``1.5T``, ``2Mi``."""

    name = "TOKENS"

    def convert(self, value, param, ctx):
        if isinstance(value, int):
            return value
        match = re.fullmatch(r"\s*([0-9.eE+-]+?)\s*([kKmMbBgGtT][iI]?)?\s*", str(value))
        try:
            number = float(match.group(1)) * TOKEN_SUFFIXES[(match.group(2) or "").lower()] if match else None
        except ValueError:
            number = None
        if number is None or not math.isfinite(number) or number < 1:
            self.fail(f"{value!r} is not a positive number of tokens, e.g. 2M (2,000,000), 1.5T or 2Mi (2 x 2^20)",
                      param, ctx)
        return round(number)


class MachineCounts(click.ParamType):
    """``A..B``: A, 2A, 4A, ... up to B; or a comma list ``8,16,32``."""

    name = "A..B|N,N,..."

    def convert(self, value, param, ctx):
        if isinstance(value, list):
            return value
        text = str(value).strip()
        if not text:
            self.fail("'' is empty; give a range A..B or a comma list of machine counts, e.g. 8..256", param, ctx)
        first, dots, last = text.partition("..")
        try:
            if dots:
                low, high = int(first), int(last)
                counts = []
                while low >= 1 and low <= high:
                    counts.append(low)
                    low *= 2
                if not counts:
                    self.fail(f"{value!r} is an empty range; give A..B with 1 <= A <= B, e.g. 8..256", param, ctx)
            else:
                counts = [int(part) for part in text.split(",")]
        except ValueError:
            self.fail(f"{value!r} is neither a range A..B nor a comma list of machine counts, e.g. 8..256 or 8,16,32",
                      param, ctx)
        if any(not 1 <= m <= MAX_COUNT for m in counts):
            self.fail(f"{value!r}: machine counts are in 1..{MAX_COUNT}", param, ctx)
        return sorted(set(counts))


class Price(click.ParamType):
    """``TYPE=USD``: a GPU type's price a GPU-hour, at least 0."""

    name = "TYPE=USD"

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        name, sep, usd_given = str(value).partition("=")
        try:
            gpu_type = gpu_type_name(name)
        except InvalidInputError as e:
            self.fail(f"{value!r}: {e}", param, ctx)
        try:
            usd = float(usd_given)
        except ValueError:
            usd = None
        if not sep or usd is None or not math.isfinite(usd):
            self.fail(f"{value!r} is not TYPE=USD, e.g. H100-80GB=2.5 (USD a GPU-hour)", param, ctx)
        if usd < 0:
            self.fail(f"{value!r}: a price below 0", param, ctx)
        return gpu_type, usd


def _cores() -> int:
    return len(os.sched_getaffinity(0))


@click.command("sweep")
@click.option("--profile", "profile_paths", multiple=True, type=FILE_PATH,
              help="Profile JSON to sweep, planned on clusters of its own GPU type (its device); repeatable, one a "
                   "GPU type. Or --config with --gpu.")
@click.option("--config", default=None, metavar="NAME|config.json",
              help=f"A shipped model config ({', '.join(planner.MODEL_CONFIGS)}) or a Hugging Face config.json, "
                   "profiled on each --gpu as `dapple profile transformer` does by default.")
@click.option("--gpu", "gpu_names", default=None, metavar="TYPE[,TYPE...]",
              help="With --config: the GPU types to sweep, e.g. H100-80GB,A100-80GB (dapple topology gpus).")
@click.option("--seq-len", type=count_option_type(), default=None,
              help="Tokens a sample: with --config, its sequence length; with --profile, only for a profile that "
                   "records none (artifact profiles).")
@click.option("--machines", "machine_counts", required=True, type=MachineCounts(),
              help="Machine counts to plan: A..B for A, 2A, 4A, ... up to B, or a comma list, e.g. 8..256 or 8,12,16.")
@click.option("--gpus-per-machine", type=count_option_type(), default=8, show_default=True,
              help="GPUs of a machine; each size is the spec MxG-TYPE, with the links of the type's usual server.")
@click.option("--tokens-per-batch", type=TokenCount(), default=None,
              help="The global batch in tokens, the same at every size: the nearest whole number of samples is "
                   "planned. K, M, B (or G), T are powers of 1000, Ki, Mi, Gi, Ti of 1024: 2M is 2,000,000, 2Mi "
                   "2,097,152 (512 samples of 4,096). Or --global-batch-size.")
@click.option("--global-batch-size", type=count_option_type(), default=None,
              help="The global batch in samples, the same at every size. Or --tokens-per-batch.")
@click.option("--train-tokens", required=True, type=TokenCount(),
              help="The token budget, e.g. 1T (suffixes as --tokens-per-batch): training takes the iterations that "
                   "reach it, the last one whole.")
@click.option("--price", "prices", multiple=True, type=Price(), metavar="TYPE=USD",
              help="Your price of a GPU-hour of a GPU type, in USD (dapple ships none), e.g. H100-80GB=2.5; "
                   "repeatable, one for every type swept. Adds the cost; the cheapest point is then the lowest cost, "
                   "else each type's fewest GPU-hours.")
@click.option("--knee-efficiency", type=click.FloatRange(0, 1, min_open=True), default=KNEE_EFFICIENCY, metavar="SHARE",
              show_default=True,
              help="The knee of a GPU type is its largest size up to which every step to a larger size kept at least "
                   "this share of the added GPUs' ideal speed-up: (speed-up - 1) / (GPU ratio - 1), the table's "
                   "'step' column; 0.5: a doubling at least 1.5 times as fast.")
@click.option("--plot", "plot_path", type=FILE_PATH, default=None,
              help="Write a picture of time to train and cost (GPU-hours without --price) against GPUs (.png or .svg).")
@click.option("--out", "out_path", type=FILE_PATH, default=None, help="Write the rows as JSON here (as --json prints).")
@click.option("--jobs", type=count_option_type(), default=None,
              help="Sizes planned at a time, each in a process of its own. Default: the cores.")
@json_option
@quiet_option
@reports_errors
def sweep_command(profile_paths, config, gpu_names, seq_len, machine_counts, gpus_per_machine, tokens_per_batch,
                  global_batch_size, train_tokens, prices, knee_efficiency, plot_path, out_path, jobs, as_json, quiet):
    """Plan a model on a range of cluster sizes and GPU types, and say what
    training a token budget takes on each: iteration time, tokens a second,
    MFU, time to train, GPU-hours and (at your --price) cost.

    Every size plans the same global batch, with `dapple plan`'s defaults;
    training takes ceil(train tokens / tokens a batch) iterations, each of
    the plan's simulated time, on every GPU of the cluster. A size without
    a plan is a row saying why. The notes mark each GPU type's knee (see
    --knee-efficiency) and the cheapest points. Sizes plan side by side in
    processes (--jobs); each size searches afresh, only the profiles are
    made once."""
    if bool(profile_paths) == (config is not None):
        raise click.UsageError("give --profile (one a GPU type) or --config with --gpu, one of them")
    if (config is None) != (gpu_names is None):
        raise click.UsageError("--config and --gpu go together" if config is not None
                               else "--gpu goes with --config (a profile names its own GPU type)")
    if config is not None and seq_len is None:
        raise click.UsageError("--config needs --seq-len, the tokens of a sample")
    if (tokens_per_batch is None) == (global_batch_size is None):
        raise click.UsageError("give --tokens-per-batch or --global-batch-size, one of them")
    if plot_path is not None:
        picture_format(plot_path)
    for path in (plot_path, out_path):
        if path is not None:
            check_writable(path)  # before the sweep, not after it
    profiles = _profiles(profile_paths, config, gpu_names, seq_len)
    if seq_len is None and not any(recorded_sequence_length(p) for p in profiles):
        raise click.UsageError(f"{path_text(profile_paths[0])} records no sequence length; give --seq-len, the tokens "
                               "of a sample")
    gpu_types = [profile_gpu_type(p) for p in profiles]
    if prices:
        _check_prices(dict(prices), gpu_types)
    sizes = len(profiles) * len(machine_counts)
    with _sizes_bar(sizes, quiet) as advance:
        result = planner.sweep(
            profiles, machine_counts, train_tokens, gpus_per_machine=gpus_per_machine,
            global_batch_size=global_batch_size, tokens_per_batch=tokens_per_batch, tokens_per_sample=seq_len,
            usd_per_gpu_hour=dict(prices) if prices else None, knee_efficiency=knee_efficiency,
            jobs=jobs or _cores(), on_point=advance)
    if not any(p.plan is not None for p in result.points):
        _print_rows(result, as_json)
        raise planner.InfeasibleError("no size of the sweep has a plan; each row says why")
    document = json.dumps(result.to_dict(), indent=1) + "\n"
    outputs = [(path, write) for path, write in (
        (out_path, lambda tmp: Path(tmp).write_text(document, encoding="utf-8")),
        (plot_path, lambda tmp: plot(result, tmp)),
    ) if path is not None]
    write_all_atomic(outputs)  # the rows and the picture, both or neither
    _print_rows(result, as_json, document)
    if tokens_per_batch is not None:
        planned = tokens_per_iteration(result.global_batch_size, result.tokens_per_sample)
        if planned != tokens_per_batch:
            click.echo(f"--tokens-per-batch {tokens_per_batch:,} is {tokens_per_batch / result.tokens_per_sample:,.2f} "
                       f"samples of {result.tokens_per_sample:,} tokens; planned {result.global_batch_size:,} "
                       f"({planned:,} tokens a batch)", err=True)
    for path, what in ((out_path, "rows"), (plot_path, "plot")):
        if path is not None:
            click.echo(f"{what} written to {path_text(path)}", err=True)


def _profiles(profile_paths, config, gpu_names, seq_len) -> list[planner.Profile]:
    """The profiles given, or the config's on each GPU type (each made once)."""
    if profile_paths:
        return [planner.Profile.load(path) for path in profile_paths]
    gpu_types = []
    for name in gpu_names.split(","):
        try:
            gpu_types.append(gpu_type_name(name))
        except InvalidInputError as e:
            raise click.BadParameter(str(e), param_hint="'--gpu'") from None
    return [planner.transformer_profile(config, gpu=gpu_type, seq_len=seq_len)
            for gpu_type in dict.fromkeys(gpu_types)]


def _check_prices(prices: dict[str, float], gpu_types: list[str]) -> None:
    """A price for every GPU type swept, and none for another (a usage error
    naming --price)."""
    try:
        check_prices(prices, gpu_types)
    except InvalidInputError as e:
        raise click.BadParameter(str(e), param_hint="'--price'") from None


@contextlib.contextmanager
def _sizes_bar(total: int, quiet: bool):
    """A function that advances a bar of ``total`` sizes on stderr (a
    terminal only, and not ``quiet``); a no-op elsewhere."""
    if quiet or not sys.stderr.isatty():
        yield lambda point: None
        return
    progress = Progress(TextColumn("planning"), BarColumn(), TextColumn("{task.completed}/{task.total} sizes"),
                        TimeElapsedColumn(), console=Console(stderr=True), transient=True)
    task = progress.add_task("sweep", total=total)
    with progress:
        yield lambda point: progress.advance(task)


def _print_rows(result: planner.Sweep, as_json: bool, document: str | None = None) -> None:
    if as_json:
        click.echo(document or json.dumps(result.to_dict(), indent=1) + "\n", nl=False)
        return
    table = sweep_table(result)
    out = console(fit=table)
    per_iteration = tokens_per_iteration(result.global_batch_size, result.tokens_per_sample)
    iterations = iterations_to_train(result.train_tokens, per_iteration)
    out.print(f"{result.model}: {result.global_batch_size:,} samples of {result.tokens_per_sample:,} tokens a batch "
              f"({per_iteration:,} tokens), {result.train_tokens:,} tokens to train: {iterations:,} iterations")
    out.print(table)
    out.print(f"knee: each GPU type's largest size up to which every step to a larger size kept at least "
              f"{result.knee_efficiency:g} of the added GPUs' ideal speed-up (step: (speed-up - 1) / (GPU ratio - 1))")
    priced = any(p.cost_usd is not None for p in result.points)
    out.print("cheapest: the lowest cost" if priced else "cheapest: each GPU type's fewest GPU-hours (no --price)")


def sweep_table(result: planner.Sweep) -> Table:
    """One row a point: the plan's figures, what training takes, the notes."""
    priced = any(p.cost_usd is not None for p in result.points)
    table = Table(show_edge=False, pad_edge=False)
    columns = ["GPU type", "GPUs", "layout", "iteration ms", "tokens/s", "MFU", "time to train", "GPU-hours",
               *(["cost"] if priced else []), "step", "note"]
    for col in columns:
        table.add_column(col, justify="left" if col in ("GPU type", "layout", "note") else "right",
                         overflow="fold")
    for p in result.points:
        size = f"{p.gpus} ({p.machines}x{p.gpus_per_machine})"
        if p.plan is None:
            table.add_row(p.gpu_type, size, *[""] * (len(columns) - 3), f"no plan: {p.why_not}")
            continue
        table.add_row(
            p.gpu_type, size, p.layout, f"{p.iteration_ms:,.1f}", f"{p.tokens_per_s:,.0f}",
            "-" if p.mfu is None else f"{p.mfu:.3f}", duration_text(p.train_hours),
            amount_text(p.gpu_hours), *([usd_text(p.cost_usd)] if priced else []),
            "" if p.step_efficiency is None else f"{p.step_efficiency:.2f}", ", ".join(result.notes(p)),
        )
    return table
