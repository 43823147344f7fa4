"""The ``dapple`` command line: one module per command."""

from __future__ import annotations

import sys

import rich_click as click

from dapple import planner

from .calibrate import calibrate_command
from .compare import compare_command
from .exit_codes import USAGE_ERROR
from .options import one_line
from .estimate import estimate_command
from .export import export_command
from .plan import plan_command
from .profile import profile_group
from .regress import regress_command
from .run import run_command
from .show import show_command
from .simulate import simulate_command
from .sweep import sweep_command
from .topology import topology_group


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
# Help in rich-click's panels; ranges are said in errors, not beside every count.
@click.rich_config(help_config=click.RichHelpConfiguration(range_string="", max_width=100))
@click.version_option(planner.__version__, prog_name="dapple")
def cli():
    """A planner for training large neural networks on many GPUs:
    pipeline, data, tensor, context and expert parallelism, ZeRO or FSDP
    sharding, re-computation, offloading and the pipeline schedule, after
    DAPPLE, Whale and XPipe.

    Exit codes: 0 ok, 1 internal error, 2 usage, 3 invalid input,
    4 incompatible inputs, 5 infeasible, 6 I/O error, 7 plan-quality regression, 8 run failed,
    9 over a work limit (each has an option to raise it).
    """


cli.add_command(plan_command)
cli.add_command(estimate_command)
cli.add_command(calibrate_command)
cli.add_command(compare_command)
cli.add_command(simulate_command)
cli.add_command(topology_group)
cli.add_command(profile_group)
cli.add_command(regress_command)
cli.add_command(show_command)
cli.add_command(run_command)
cli.add_command(export_command)
cli.add_command(sweep_command)


def main():
    # Usage errors (unknown option, bad value, missing argument) are one
    # line on stderr and exit 2, like every other error; --help shows usage.
    try:
        # Commands end by returning (success) or by sys.exit (errors); what
        # comes back here is a return value or --help/--version's exit code
        # 0, never a failure, so success is 0 either way.
        cli.main(prog_name="dapple", standalone_mode=False)
    except click.exceptions.NoArgsIsHelpError as e:
        click.echo(e.format_message(), err=True)  # `dapple` alone: the help
        sys.exit(USAGE_ERROR)
    except click.exceptions.UsageError as e:
        hint = f" (see: {e.ctx.command_path} --help)" if e.ctx is not None else ""
        click.echo(f"error: {one_line(e.format_message())}{hint}", err=True)
        sys.exit(USAGE_ERROR)
    except click.exceptions.Abort:
        click.echo("Aborted!", err=True)  # as click says it (Ctrl-C)
        sys.exit(1)
    except click.ClickException as e:
        click.echo(f"error: {one_line(e.format_message())}", err=True)
        sys.exit(e.exit_code)
    sys.exit(0)


if __name__ == "__main__":
    main()
