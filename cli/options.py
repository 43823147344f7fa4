"""Options shared by several commands, and the error boundary."""

from __future__ import annotations

import functools
import os
import sys
import traceback

import click

from planner.errors import DappleError

from .exit_codes import INTERNAL_ERROR, exit_code_for


def profile_option(f):
    return click.option(
        "--profile",
        "profile_path",
        required=True,
        type=click.Path(dir_okay=False),
        help="Profile JSON (dapple.profile), e.g. profiles/bert-48.json.",
    )(f)


def topology_option(f):
    return click.option(
        "--topology",
        required=True,
        help="Cluster: a spec like 2x8-nvlink or 16x1-25gbps, a preset A/B/C, or a topology JSON file.",
    )(f)


def json_option(f):
    return click.option("--json", "as_json", is_flag=True, help="Print JSON on stdout instead of a table.")(f)


def reports_errors(f):
    """Turn dapple errors into one line on stderr and their exit code.

    Unexpected exceptions are bugs: one line too, unless DAPPLE_DEBUG=1 asks
    for the traceback."""

    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        try:
            return f(*args, **kwargs)
        except DappleError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(exit_code_for(e))
        except (click.exceptions.Exit, click.ClickException, click.exceptions.Abort):
            raise
        except Exception as e:  # noqa: BLE001 - the boundary of the program
            if os.environ.get("DAPPLE_DEBUG"):
                traceback.print_exc()
            click.echo(f"internal error: {type(e).__name__}: {e} (set DAPPLE_DEBUG=1 for details; please report it)", err=True)
            sys.exit(INTERNAL_ERROR)

    return wrapper
