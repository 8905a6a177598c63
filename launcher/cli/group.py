"""The `vlaunch` group: turns vlaunch's own errors into one line and an exit code.

Errors a user can fix become one line on stderr and exit code 2 (3 for a plan that does not
fit); never a traceback. Commands live in the modules beside this one, one per kind of work.
"""

from __future__ import annotations

import click

from .. import __version__, term
from ..errors import InputError, NotFitError


class _Group(click.Group):
    """Turns vlaunch's own errors into one line and an exit code."""

    def invoke(self, ctx: click.Context):
        from ..printable import guarded

        with guarded():  # nothing from a config, log or plan drives the terminal (printable.py)
            try:
                return super().invoke(ctx)
            except InputError as e:
                term.echo(f"vlaunch: error: {e}", err=True)
                ctx.exit(e.exit_code)
            except NotFitError as e:
                term.echo(f"vlaunch: {e}", err=True)
                ctx.exit(e.exit_code)
            except OSError as e:  # a path the user gave that cannot be read or written
                where = f" {e.filename}" if e.filename else ""
                term.echo(f"vlaunch: error: cannot use{where}: {e.strerror or e}; check the "
                          "path and its permissions", err=True)
                ctx.exit(2)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="vlaunch")
def cli() -> None:
    """Plan, start and watch vLLM deployments that fit the first time."""


def format_option(help: str, *extra: str):
    """`--format` as every command spells it: text (the default) and json, plus `extra`."""
    return click.option("--format", "fmt", type=click.Choice(["text", "json", *extra]),
                        default="text", show_default=True, help=help)

