"""The ``mlipdd`` command: ``mlipdd run | validate | plugins | plot``.

Each subcommand lives in its own module ``mlipdd.cli.<name>_cmd`` that exposes
``add_parser(subparsers)``; the parser it adds sets ``func`` (``args -> int | None``).
A new subcommand is one module plus its name in `SUBCOMMAND_MODULES`.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Sequence

SUBCOMMAND_MODULES = ("run_cmd", "validate_cmd", "plugins_cmd", "plot_cmd")


def build_parser() -> argparse.ArgumentParser:
    from mlipdd import __version__

    parser = argparse.ArgumentParser(
        prog="mlipdd",
        description="Domain decomposition for machine-learned interatomic potentials.",
    )
    parser.add_argument("--version", action="version", version=f"mlipdd {__version__}")
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND")
    for module_name in SUBCOMMAND_MODULES:
        importlib.import_module(f"{__name__}.{module_name}").add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "func"):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)
