"""``mlipdd validate MODEL``: check a registered model distributed vs one process.

Runs `trace_and_validate` on spawned CPU ranks under one strategy (``--strategy halo``,
``sharded`` or ``graph_partition``), prints the summary and exits 0 when the distributed
run matches (1 otherwise). ``--save`` writes the working spec.
"""

from __future__ import annotations

import argparse
import functools

from mlipdd.cli.run_cmd import parse_model_args
from mlipdd.data import InputError


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "validate",
        help="check that a model runs distributed exactly as single-process; find its spec",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add("model", metavar="MODEL", help="registered model name (see `mlipdd plugins`)")
    add("--model-arg", dest="model_arg", action="append", default=[], metavar="KEY=VALUE",
        help="keyword argument for the model factory; repeat for several (values parsed as JSON)")
    add("--world-size", type=int, default=2, help="number of spawned ranks (default 2)")
    add("--strategy", default="halo", metavar="NAME",
        help="decomposition strategy the ranks run: a registered name (halo, sharded, "
             "graph_partition or a plugin's; `mlipdd plugins` lists them; default halo)")
    add("--spec", metavar="FILE", help="start from this spec file instead of the model's own")
    add("--system", default=None, metavar="NAME",
        help="sample cell from mlipdd.testing.systems (cubic, triclinic, small_cell, slab, "
             "two_systems); default: a long triclinic cell sized to the model's cutoff and the "
             "world size, so that no rank sees every atom (a smaller cell is run with a warning)")
    add("--species", type=int, nargs="+", default=None, metavar="Z",
        help="atomic numbers for the sample cell (default: the elements the model declares, two of "
             "them in the default cell; else 18, argon)")
    add("--max-attempts", type=int, default=4, help="spec candidates to try (default 4)")
    add("--device", default=None, help="also check one rank on this device (e.g. cuda)")
    add("--save", metavar="PATH", help="write the working spec here (JSON) when validation passes")
    parser.set_defaults(func=run)
    return parser


def _samples(args, model) -> list:
    """The named cell, or validation's default cells for the model (NOTE [conclusive
    sample] in mlipdd.validate.coverage) with the species asked for."""
    if args.system is None:
        from mlipdd.validate.coverage import default_samples

        return default_samples(model, args.world_size, species=args.species)
    from mlipdd.testing.systems import AWKWARD_CELLS

    if args.system not in AWKWARD_CELLS:
        raise InputError(f"unknown --system {args.system!r}; use one of {sorted(AWKWARD_CELLS)}")
    return [AWKWARD_CELLS[args.system](species=tuple(args.species or (18,)))]


def _split_next(report, args: argparse.Namespace) -> tuple[str, str | None]:
    """The summary without its ``Next:`` line, and that line in shell terms: the report
    speaks Python (``report.spec.save(...)``, ``sample_batch``), the user here is at a
    shell, and the advice belongs at the end, after the rank checks."""
    from mlipdd.validate.report import SAVE_HINT

    summary = report.summary().replace("leave sample_batch out", "leave --system out")
    lines = summary.splitlines()
    nexts = [i for i, line in enumerate(lines) if line.startswith("Next: ")]
    if not nexts:
        return summary, None
    advice = lines.pop(nexts[-1])
    if SAVE_HINT in advice and report.warnings:  # passed, but on a sample too small to tell
        advice = ("Next: the sample was too small to prove the model exact; validate on the default "
                  f"sample, sized to the model's cutoff: {_command_with_save(args, keep_system=False)}")
    elif SAVE_HINT in advice:
        advice = None if args.save else f"Next: save the spec: {_command_with_save(args)}"
    return "\n".join(lines), advice


def _command_with_save(args: argparse.Namespace, keep_system: bool = True) -> str:
    """This validation as a command line again, with ``--save`` (and without ``--system``
    unless ``keep_system``)."""
    system = args.system if keep_system else None
    words = ["mlipdd", "validate", args.model, *(f"--model-arg {a}" for a in args.model_arg)]
    for flag, value, default in (("--world-size", args.world_size, 2), ("--strategy", args.strategy, "halo"),
                                 ("--system", system, None), ("--spec", args.spec, None)):
        if value != default:
            words.append(f"{flag} {value}")
    return " ".join([*words, "--save", args.save or "model_spec.json"])


def run(args: argparse.Namespace) -> int:
    from mlipdd.plugins import create_model
    from mlipdd.spec import MLIPSpec
    from mlipdd.validate import trace_and_validate

    if args.world_size < 1:
        raise InputError(f"--world-size must be at least 1, got {args.world_size}")
    # a partial of a module-level function pickles, so each spawned rank can build the model
    factory = functools.partial(create_model, args.model, **parse_model_args(args.model_arg))
    from mlipdd.testing.conformance import build_model
    from mlipdd.validate import rank_checks  # weights agree across ranks, skin edges ignored

    model = build_model(factory)
    args.species = args.species or rank_checks.model_species(model)
    spec = MLIPSpec.load(args.spec) if args.spec else None
    samples = _samples(args, model)
    report = trace_and_validate(factory, samples, world_size=args.world_size, spec=spec,
                                max_attempts=args.max_attempts, device=args.device, strategy=args.strategy)
    summary, advice = _split_next(report, args)
    print(summary)
    checks = rank_checks.run_all(factory, samples[0], max(2, args.world_size))
    if report.ok and args.save:
        report.spec.save(args.save)
        print(f"spec written to {args.save}")
    elif args.save:
        print(f"no spec written to {args.save}: validation failed")
    if advice:
        print(advice)
    return 0 if report.ok and all(check.ok for check in checks) else 1
