"""``python -m mlipdd.testing.real_packages [--world-sizes 2,3,4] [--models A,B] [--output FILE]``:
classify every real package's model (`classify`) and validate each with its default
sample; print the markdown table, ``--output`` writes it as the whole of docs/real_packages.md."""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
from importlib import metadata
from pathlib import Path

from mlipdd.testing.idiom_zoo.__main__ import _commit
from mlipdd.testing.idiom_zoo.classifier import TOLERANCE, WORLD_SIZES, _shortened
from mlipdd.testing.real_packages import REAL_MODELS, available
from mlipdd.testing.real_packages.classify import (
    classify_world_size,
    references,
    validation,
)

INTRO = """# Real packages' models under domain decomposition

`mlipdd.testing.real_packages` builds models of real MLIP packages from their own
configuration with random weights, the way each package's users build them, and wraps
each as an ordinary mlipdd model (`ModelWrapper`; no shaping to the framework). Each
case is one model, one storage (`halo`, `sharded`), one
system (the idiom zoo's: `triclinic` 64 atoms, `own_images` 27 atoms where a rank sees
its own images, `slab` cut along its vacuum) and one rank count, float64, spawned gloo
ranks against one process. **exact**: energy, forces and stress within {tolerance:g}
relative; **refused**: an error on every rank (its first line below the table);
**WRONG**: a silently different answer, which the first rule forbids.

Packages not in the table, and why: {missing}

`tests/test_real_packages.py` runs the same classification. Regenerate with

    OMP_NUM_THREADS=1 python -m mlipdd.testing.real_packages --output docs/real_packages.md
"""

NOT_INSTALLABLE = (
    "nequip 0.19 (torchmetrics>=1.6) and schnetpack 2.0.4 (torchmetrics==1.0.1) cannot be installed "
    "together, and schnetpack 2.1 needs sympy<=1.12 where torch 2.13 needs >=1.13.3: the test extra "
    "holds schnetpack (nequip's NequIP, `nequip_models`, classified beside it in an environment of its "
    "own on 2026-12-03: exact at 2 and 3 ranks in all six storage x system cases). orb-models stays "
    "at 0.5.5 on Python 3.11 (0.6 needs 3.12)."
)


def markdown_table(results) -> str:
    world_sizes = sorted({r.world_size for r in results})
    columns = list(dict.fromkeys((r.strategy, r.system) for r in results))
    by_key = {(r.model, r.strategy, r.system, r.world_size): r for r in results}
    notes: dict[str, int] = {}
    examples: dict[str, str] = {}

    def short(r) -> str:
        if r.outcome == "exact":
            return "exact"
        if r.outcome == "WRONG":
            return f"**WRONG** {r.detail}"
        key = re.sub(r"\d+", "#", r.detail)
        examples.setdefault(key, r.detail)
        return f"{r.outcome} [{notes.setdefault(key, len(notes) + 1)}]"

    counts = {o: sum(r.outcome == o for r in results) for o in ("exact", "refused", "WRONG", "HANG", "CRASH")}
    lines = [f"{len(results)} cases at {', '.join(map(str, world_sizes))} ranks: "
             + ", ".join(f"{n} {o}" for o, n in counts.items()) + ".", "",
             "| model | " + " | ".join(" ".join(c) for c in columns) + " |", "|---|" + "---|" * len(columns)]
    for model in dict.fromkeys(r.model for r in results):
        cells = []
        for column in columns:
            per_ws = [(ws, short(by_key[(model, *column, ws)])) for ws in world_sizes if (model, *column, ws) in by_key]
            texts = {t for _, t in per_ws}
            cells.append(per_ws[0][1] if len(texts) == 1 else "<br>".join(f"{ws}: {t}" for ws, t in per_ws))
        lines.append(f"| {model} | " + " | ".join(cells) + " |")
    if notes:
        lines += ["", "Errors on the ranks (the originating rank's first line):", ""]
        lines += [f"{n}. `{_shortened(examples[key])}`" for key, n in notes.items()]
    return "\n".join(lines)


def validation_table(models) -> str:
    lines = ["| model | what it builds | halo | sharded |", "|---|---|---|---|"]
    for model in models:
        got = validation(model)
        cells = [("passed" if ok else f"failed: `{_shortened(text, 300)}`") for ok, text in got.values()]
        lines.append(f"| {model} | {REAL_MODELS[model].what} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mlipdd.testing.real_packages", description=__doc__)
    parser.add_argument("--world-sizes", default=",".join(map(str, WORLD_SIZES)))
    parser.add_argument("--models", default=None, help=f"comma separated, from: {', '.join(REAL_MODELS)}")
    parser.add_argument("--output", default=None, help="write the tables, with their introduction, to this file")
    args = parser.parse_args(argv)
    names = args.models.split(",") if args.models else list(REAL_MODELS)
    missing = {name: why for name in names if (why := available(name))}
    models = [n for n in names if n not in missing]
    import torch

    start = datetime.datetime.now()
    refs = references(models)
    results = [r for ws in map(int, args.world_sizes.split(",")) for r in classify_world_size(models, ws, refs)]
    seconds = (datetime.datetime.now() - start).total_seconds()
    versions = ", ".join(f"{p} {metadata.version(p)}" for p in dict.fromkeys(REAL_MODELS[m].package for m in models))
    header = (f"Classified on {datetime.date.today().isoformat()}: {len(results)} cases in {seconds:.0f} s on "
              f"{platform.node() or 'this machine'} ({os.cpu_count()} CPU cores, torch {torch.__version__}, "
              f"{versions}); code: {_commit()}.")
    text = (header + "\n\n" + markdown_table(results) + "\n\n## `trace_and_validate` with its default sample\n\n"
            + validation_table(models) + "\n")
    print(text)
    if args.output:
        skipped = "; ".join(f"{n}: {why}" for n, why in missing.items())
        intro = INTRO.format(tolerance=TOLERANCE, missing=" ".join(x for x in (NOT_INSTALLABLE, skipped) if x))
        Path(args.output).write_text(intro + "\n## Classification\n\n" + text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
