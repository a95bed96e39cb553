"""The ``mlipdd`` command: ``mlipdd run | validate | plugins | bench``.

Each subcommand lives in its own module ``mlipdd.cli.<name>_cmd`` that exposes
``add_parser(subparsers)``; the parser it adds sets ``func`` (``args -> int | None``).
A subcommand module that is not there is left out of the command, so the CLI keeps
working while subcommands are being written.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Sequence

SUBCOMMAND_MODULES = ("run_cmd", "validate_cmd", "plugins_cmd", "bench_cmd")


def build_parser() -> argparse.ArgumentParser:
    from mlipdd import __version__

    parser = argparse.ArgumentParser(
        prog="mlipdd",
        description="Domain decomposition for machine-learned interatomic potentials.",
    )
    parser.add_argument("--version", action="version", version=f"mlipdd {__version__}")
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND")
    for module_name in SUBCOMMAND_MODULES:
        path = f"{__name__}.{module_name}"
        try:
            module = importlib.import_module(path)
        except ModuleNotFoundError as exc:
            if exc.name == path:
                continue  # subcommand not written yet
            raise
        module.add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "func"):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)
