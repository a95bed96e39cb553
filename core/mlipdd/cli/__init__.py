"""The ``mlipdd`` command: ``mlipdd run | validate | plugins | plot``.

Each subcommand lives in its own module ``mlipdd.cli.<name>_cmd`` that exposes
``add_parser(subparsers)``; the parser it adds sets ``func`` (``args -> int | None``).
A new subcommand is one module plus its name in `SUBCOMMAND_MODULES`.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import re
import sys
import warnings
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
    with one_line_warnings():  # the parser lists strategies: plugins load (and warn) here
        return _run_command(argv)


def _run_command(argv: Sequence[str] | None) -> int:
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


@contextlib.contextmanager
def one_line_warnings():
    """mlipdd's own warnings as one line, ``mlipdd: warning: ...``; the plugin loader's
    (a plugin skipped, a clash) said once: every rank discovers the same plugins, so a
    rank that ``mlipdd run --nproc`` started leaves them to its launcher, and under
    torchrun rank 0 says them. Warnings of other packages keep Python's format."""
    from mlipdd.distributed.supervise import LAUNCHER_PID_ENV

    plain = warnings.showwarning
    own = f"{os.sep}mlipdd{os.sep}"
    quiet = os.environ.get("RANK", "0") not in ("", "0") or bool(os.environ.get(LAUNCHER_PID_ENV))

    def show(message, category, filename, lineno, file=None, line=None):
        if own not in str(filename):
            return plain(message, category, filename, lineno, file, line)
        if quiet and str(filename).endswith(f"{own}plugins.py"):
            return None
        print(f"mlipdd: warning: {message}", file=file or sys.stderr, flush=True)
        return None

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = plain
