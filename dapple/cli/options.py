"""Options shared by several commands, and the error boundary."""

from __future__ import annotations

import ast
import functools
import os
import sys
import traceback

import click

from dapple import planner
from dapple.planner.errors import DappleError, DappleIOError, IncompatibleInputsError, InvalidInputError
from dapple.planner.files import path_text
from dapple.planner.limits import MAX_COUNT, MAX_PASSES, MAX_PASSES_CEILING, set_max_passes

from .exit_codes import INTERNAL_ERROR, exit_code_for


class Count(click.IntRange):
    """A count in minimum..MAX_COUNT, shown in help as ``N``: its range is
    said in an error, where it matters."""

    def get_metavar(self, param, ctx=None):
        return "N"


def count_option_type(minimum: int = 1) -> click.IntRange:
    """A sample count in minimum..MAX_COUNT (the core's range): a larger
    value is a usage error, not an overflow."""
    return Count(min=minimum, max=MAX_COUNT)


class FilePath(click.ParamType):
    """A file name: any text but the empty one. Whether it exists and is a
    regular file is checked where it is read or written (planner.files),
    with one-line errors and exit 6, not click's usage message."""

    name = "path"

    def convert(self, value, param, ctx):
        if value == "":
            self.fail("empty path; give a file name", param, ctx)
        return value


FILE_PATH = FilePath()


def global_batch_size_or_default(global_batch_size: int | None, profile: planner.Profile,
                                 topology: planner.Topology) -> tuple[int, str | None]:
    """The global batch asked for, or by default the profile's largest
    measured batch on every GPU, with a note saying so for stderr. The
    caller prints the note once it has succeeded: a failure is one line."""
    if global_batch_size is not None:
        return global_batch_size, None
    global_batch_size = max(profile.batch_sizes) * topology.num_devices
    return global_batch_size, f"global batch size not given; used {global_batch_size}"


def profile_option(f):
    return click.option(
        "--profile",
        "profile_path",
        required=True,
        type=FILE_PATH,
        help="Profile JSON (dapple.profile), e.g. profiles/artifact/bert-48-pbs-2.json.",
    )(f)


def topology_option(f):
    return click.option(
        "--topology",
        required=True,
        help="Cluster: a spec like 2x8-nvlink or 16x1-25gbps, a preset A/B/C, or a topology JSON file.",
    )(f)


def plan_options(f=None, *, required: bool = True):
    """--plan, and --profile defaulting to the profile the plan records.
    ``@plan_options(required=False)`` where a command can do without a plan."""
    if f is None:
        return lambda g: plan_options(g, required=required)
    f = click.option(
        "--profile",
        "profile_path",
        type=FILE_PATH,
        default=None,
        help="Profile to cost with. Default: the path recorded in the plan.",
    )(f)
    return click.option(
        "--plan", "plan_path", required=required, type=FILE_PATH, help="Plan JSON (dapple.plan)."
    )(f)


def load_plan_and_profile(plan_path: str, profile_path: str | None) -> tuple[planner.Plan, planner.Profile]:
    """The plan, and the profile given or else the one the plan records."""
    plan = planner.Plan.load(plan_path)
    return plan, profile_for(plan, plan_path, profile_path)


def covering_profile(plan: planner.Plan, plan_path: str, profile: planner.Profile) -> planner.Profile:
    """``profile``, where the plan's stages cover its layers; else an
    incompatible-inputs error naming both. For readers of a profile the
    core does not check against the plan (its hash): a picture's labels."""
    end = plan.stages[-1]["layer_end"] if plan.stages else 0
    if end != len(profile.layers):
        raise IncompatibleInputsError(f"{path_text(plan_path)}: the plan's stages end at layer {end}; profile "
                                      f"{profile.model!r} has {len(profile.layers)} layers")
    return profile


def profile_for(plan: planner.Plan, plan_path: str, profile_path: str | None) -> planner.Profile:
    """The profile given, or else the one ``plan`` (read from ``plan_path``)
    records in ``inputs.profile_path``."""
    if profile_path is not None:
        return planner.Profile.load(profile_path)
    path = plan.data["inputs"].get("profile_path")
    if path is None:
        raise InvalidInputError(f"{plan_path}: field inputs.profile_path: missing; pass --profile")
    if path == "":
        raise InvalidInputError(f"{plan_path}: field inputs.profile_path: value '' is empty; pass --profile")
    if not os.path.isabs(path) and not os.path.exists(path):
        # A relative path in the plan is relative to where planning ran;
        # fall back to the plan file's folder.
        beside = os.path.join(os.path.dirname(plan_path), path)
        path = beside if os.path.exists(beside) else path
    if not os.path.exists(path):
        raise DappleIOError(f"{plan_path}: field inputs.profile_path: value {path!r}: no such file; pass --profile")
    return planner.Profile.load(path)


class PositiveIntList(click.ParamType):
    """Comma-separated positive integers up to ``most``, e.g. ``1,2,4,8``;
    sorted, duplicates dropped."""

    name = "SIZES"

    def __init__(self, most: int = MAX_COUNT):
        self.most = most

    def convert(self, value, param, ctx):
        if isinstance(value, list):
            return value
        parts = [p.strip() for p in str(value).split(",")]
        try:
            sizes = [int(p) for p in parts]
        except ValueError:
            sizes = None
        if not sizes or any(b < 1 or b > self.most for b in sizes):
            self.fail(f"{value!r} is not a comma-separated list of integers in 1..{self.most}, e.g. 1,2,4,8",
                      param, ctx)
        return sorted(set(sizes))


def model_options(f):
    """--model MODULE:FUNCTION and repeatable --model-arg KEY=VALUE."""
    f = click.option("--model-arg", "model_args", multiple=True, metavar="KEY=VALUE",
                     help="Argument for the factory, repeatable, e.g. --model-arg n_layers=8 "
                          "(values are Python literals).")(f)
    return click.option("--model", "model_spec", required=True, metavar="MODULE:FUNCTION",
                        help="Model factory returning a dapple.planner.runtime.models.ModelSpec, e.g. "
                             "dapple.planner.runtime.models:gpt (also :bert, :vgg, :hf_gpt2 with transformers "
                             "installed).")(f)


def model_kwargs(values: tuple[str, ...]) -> dict:
    """The factory's keyword arguments from --model-arg KEY=VALUE items
    (a value that is not a Python literal is a plain string)."""
    kwargs = {}
    for item in values:
        key, sep, text = item.partition("=")
        if not sep or not key.strip().isidentifier():
            raise click.BadParameter(f"{item!r} is not KEY=VALUE", param_hint="'--model-arg'")
        try:
            kwargs[key.strip()] = ast.literal_eval(text.strip())
        except (ValueError, SyntaxError):
            kwargs[key.strip()] = text.strip()
    return kwargs


def require_torch(command: str):
    """torch, or an invalid-input error saying that ``command`` needs it."""
    try:
        import torch
    except ImportError as e:
        raise InvalidInputError(
            f"dapple {command} needs torch, which is not installed ({e}); pip install 'dapple[torch]'"
        ) from None
    return torch


def warmup_policy_option(f):
    return click.option(
        "--warmup-policy",
        type=click.Choice(planner.WARMUP_POLICIES, case_sensitive=False),
        default=planner.WARMUP_POLICIES[0],
        show_default=True,
        help="Warm-up depth K_i of each stage: auto = searched per stage within memory; "
        "A = S-i, B = 2(S-i)-1 micro-batches (section V-C).",
    )(f)


def max_passes_option(f):
    """``--max-passes``: the limit on the micro-batch passes one simulation
    runs, for this command (set before anything else runs)."""

    def set_limit(ctx, param, value):
        if value is not None:
            set_max_passes(value)
        return value

    return click.option(
        "--max-passes", type=click.IntRange(min=1, max=MAX_PASSES_CEILING), default=None, expose_value=False,
        is_eager=True, callback=set_limit,
        help=f"Most micro-batch passes (stages x micro-batches) one simulation runs (default {MAX_PASSES}); "
             "a plan over it is refused with exit 9, and the search leaves out micro-batch sizes over it. "
             "About 1.1 KB of memory a pass.",
    )(f)


def chunked_kinds() -> str:
    """The chunked schedule kinds, for help and messages (the core's list)."""
    return ", ".join(planner.CHUNKED_SCHEDULES)


def check_chunks_go_with(chunks: int | None, schedule: str | None) -> None:
    """``--chunks`` is a count for a chunked ``--schedule`` only."""
    if chunks is not None and schedule not in planner.CHUNKED_SCHEDULES:
        raise click.UsageError(f"--chunks goes with a chunked --schedule ({chunked_kinds()})")


def json_option(f):
    return click.option("--json", "as_json", is_flag=True, help="Print JSON on stdout instead of a table.")(f)


def one_line(text: str) -> str:
    """``text`` with its control characters escaped (``\\n``): an error
    quotes names as given, and a file name may hold a newline."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def reports_errors(f):
    """Turn dapple errors into one line on stderr and their exit code.

    Unexpected exceptions are bugs: one line too, unless DAPPLE_DEBUG=1 asks
    for the traceback."""

    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        try:
            return f(*args, **kwargs)
        except DappleError as e:
            click.echo(f"error: {one_line(str(e))}", err=True)
            sys.exit(exit_code_for(e))
        except (click.exceptions.Exit, click.ClickException, click.exceptions.Abort):
            raise
        except Exception as e:  # noqa: BLE001 - the boundary of the program
            if os.environ.get("DAPPLE_DEBUG"):
                traceback.print_exc()
            click.echo(f"internal error: {type(e).__name__}: {one_line(str(e))} (set DAPPLE_DEBUG=1 for details; please report it)", err=True)
            sys.exit(INTERNAL_ERROR)

    return wrapper
