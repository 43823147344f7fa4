"""The ``dapple`` command line: one module per command."""

from __future__ import annotations

import click

import planner

from .compare import compare_command
from .estimate import estimate_command
from .plan import plan_command
from .profile import profile_group
from .regress import regress_command
from .run import run_command
from .show import show_command
from .simulate import simulate_command
from .topology import topology_group


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(planner.__version__, prog_name="dapple")
def cli():
    """Plan synchronous pipeline + data parallel training (DAPPLE).

    Exit codes: 0 ok, 1 internal error, 2 usage, 3 invalid input,
    4 incompatible inputs, 5 infeasible, 6 I/O error, 7 plan-quality regression, 8 run failed.
    """


cli.add_command(plan_command)
cli.add_command(estimate_command)
cli.add_command(compare_command)
cli.add_command(simulate_command)
cli.add_command(topology_group)
cli.add_command(profile_group)
cli.add_command(regress_command)
cli.add_command(show_command)
cli.add_command(run_command)


def main():
    cli(prog_name="dapple")


if __name__ == "__main__":
    main()
