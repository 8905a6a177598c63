"""The `vlaunch` command line: thin wrappers that parse, call the library, and print.

Errors a user can fix become one line on stderr and exit code 2 (3 for a plan that
does not fit); never a traceback.
"""

from __future__ import annotations

import sys

import click

from . import __version__
from .errors import InputError, NotFitError


class _Group(click.Group):
    """Turns vlaunch's own errors into one line and an exit code."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except InputError as e:
            click.echo(f"vlaunch: error: {e}", err=True)
            ctx.exit(e.exit_code)
        except NotFitError as e:
            click.echo(f"vlaunch: {e}", err=True)
            ctx.exit(e.exit_code)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="vlaunch")
def cli() -> None:
    """Plan, start and watch vLLM deployments that fit the first time."""


def main() -> None:
    try:
        cli(prog_name="vlaunch")
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
