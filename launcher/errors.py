"""Errors a user can act on. The CLI turns them into one line and an exit code."""

from __future__ import annotations


class InputError(Exception):
    """Bad input: what is wrong and what is accepted. Exit code 2."""

    exit_code = 2


class NotFitError(Exception):
    """A plan that does not fit the hardware. Exit code 3."""

    exit_code = 3
