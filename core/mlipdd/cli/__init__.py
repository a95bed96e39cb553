"""The ``mlipdd`` command: ``mlipdd run | validate | plugins | plot``.

Each subcommand lives in its own module ``mlipdd.cli.<name>_cmd`` that exposes
``add_parser(subparsers)``; the parser it adds sets ``func`` (``args -> int | None``).
A new subcommand is one module plus its name in `SUBCOMMAND_MODULES`.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
from collections.abc import Sequence

SUBCOMMAND_MODULES = ("run_cmd", "validate_cmd", "plugins_cmd", "plot_cmd")


class OneLineErrorParser(argparse.ArgumentParser):
    """Usage mistakes as one line (``mlipdd run: error: ...``) and exit code 2, like
    every other input error of the command; help text without the docstrings' markup
    (subcommands use their module docstring as description)."""

    def format_help(self) -> str:
        text = super().format_help()
        return re.sub(r"`{1,2}([^`]+)`{1,2}", r"\1", text)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    from mlipdd import __version__

    parser = OneLineErrorParser(
        prog="mlipdd",
        description="Domain decomposition for machine-learned interatomic potentials.",
    )
    parser.add_argument("--version", action="version", version=f"mlipdd {__version__}")
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND")
    for module_name in SUBCOMMAND_MODULES:
        importlib.import_module(f"{__name__}.{module_name}").add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Exit codes: 0 done, 1 a check failed or a rank failed, 2 bad input (one line on
    stderr, the same on one rank as on many)."""
    from mlipdd.data import InputError
    from mlipdd.plugins import UnknownNameError

    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "func"):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except (InputError, UnknownNameError) as exc:  # a typo in a model/strategy name is bad input too
        command = args.func.__module__.rsplit(".", 1)[-1].removesuffix("_cmd")
        print(f"mlipdd {command}: error: {exc}", file=sys.stderr, flush=True)
        return 2
