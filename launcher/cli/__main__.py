"""`python -m launcher.cli`: the console script's entry point."""

from . import main

main()
