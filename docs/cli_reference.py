"""docs/cli.md's body, written from the click commands themselves (cog:
`cog -I docs -r docs/cli.md`; tests/test_docs.py fails where it is out of
date), so that the reference cannot drift from `dapple COMMAND --help`."""

from __future__ import annotations

import inspect

import click
import cog

from dapple.cli.main import cli


def _commands(group: click.Group, path: str):
    """(``dapple plan``, command) for every command, groups' in order."""
    for name in sorted(group.commands):
        command = group.commands[name]
        if isinstance(command, click.Group):
            yield from _commands(command, f"{path} {name}")
        else:
            yield f"{path} {name}", command


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _option_row(param: click.Parameter, ctx: click.Context) -> str:
    names = ", ".join(f"`{name}`" for name in (*param.opts, *param.secondary_opts))
    kind = "flag" if getattr(param, "is_flag", False) else param.make_metavar(ctx)
    what = getattr(param, "help", None) or ""
    extras = []
    if getattr(param, "required", False):
        extras.append("required")
    if getattr(param, "multiple", False):
        extras.append("repeatable")
    if getattr(param, "show_default", False) and param.default not in (None, False, ()):
        extras.append(f"default: {param.default}")
    if extras:
        what = f"{what} ({'; '.join(extras)})" if what else "; ".join(extras)
    return f"| {names} | `{_cell(kind)}` | {_cell(what)} |"


def _panels(command: click.Command) -> list[tuple[str, list[click.Parameter]]]:
    """The command's options by rich-click panel (plan's), else one panel."""
    options = [p for p in command.params if isinstance(p, click.Option) and not p.hidden]
    panels = getattr(command, "panels", None) or []
    grouped, placed = [], set()
    for panel in panels:
        members = [p for p in options if set(p.opts) & set(panel.options)]
        placed.update(id(p) for p in members)
        grouped.append((panel.name, members))
    rest = [p for p in options if id(p) not in placed]
    if rest:
        grouped.append(("Options" if not grouped else "Other options", rest))
    return grouped


def reference() -> None:
    """Every command: its usage, its help, and its options in a table a panel."""
    for path, command in _commands(cli, "dapple"):
        ctx = click.Context(command, info_name=path)
        cog.outl(f"## `{path}`")
        cog.outl("")
        cog.outl("    " + " ".join(command.collect_usage_pieces(ctx)).join((f"{path} ", "")))
        cog.outl("")
        cog.outl(inspect.cleandoc(command.help or ""))
        cog.outl("")
        arguments = [p for p in command.params if isinstance(p, click.Argument)]
        if arguments:
            cog.outl("Arguments: " + ", ".join(f"`{p.make_metavar(ctx)}`" for p in arguments) + ".")
            cog.outl("")
        for name, params in _panels(command):
            cog.outl(f"**{name}**")
            cog.outl("")
            cog.outl("| option | value | what |")
            cog.outl("|---|---|---|")
            for param in params:
                cog.outl(_option_row(param, ctx))
            cog.outl("")
