"""The `vlaunch` command line: thin wrappers that parse, call the library, and print.

Errors a user can fix become one line on stderr and exit code 2 (3 for a plan that does not
fit); never a traceback (launcher/cli/group.py). The commands that plan live in plan_cmd.py,
those that run vLLM in run_cmd.py, the options they share in options.py.
"""

from __future__ import annotations

import sys

from . import plan_cmd, run_cmd  # noqa: F401 - registers the commands on the group
from .group import cli, format_option
from .run_cmd import exec_cmd

__all__ = ["cli", "exec_cmd", "format_option", "main"]


def main() -> None:
    try:
        cli(prog_name="vlaunch")
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
