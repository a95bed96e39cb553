"""``python -m mlipdd.testing.idiom_zoo [--world-sizes 2,3,4] [--models A,B] [--output FILE]
[--json FILE] [--note TEXT]``: classify the zoo and print the markdown table; ``--output``
writes it as the whole of docs/idiom_zoo.md, ``--json`` every case."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import subprocess
from pathlib import Path

from mlipdd.testing.idiom_zoo import ZOO
from mlipdd.testing.idiom_zoo.classifier import (
    TOLERANCE,
    WORLD_SIZES,
    markdown_table,
    timed_classify,
)

INTRO = """# The idiom zoo: ordinary model code under domain decomposition

`mlipdd.testing.idiom_zoo` holds {n_models} small potentials, each written the ordinary
single-process way (SchNet/PaiNN/DimeNet/GAT/AIMNet/MEGNet/TorchANI-like plain torch,
never shaped to fit mlipdd) around ONE idiom: a reduction over the atoms through a
view, a segment sum spelled without `index_add`, a row read by position, a dense
atoms x atoms matrix, a scripted scatter, and so on (the `idiom` column). Most run a
message-passing layer, the idiom, and a second layer that reads the idiom's result
from the neighbours, so a wrong ghost row or a per-rank value reaches the energy. The
controls use only what the decomposition plainly supports.

Each case is one model, one strategy (halo or sharded storage, the presets
`SPEC_MPNN_HALO` and `SPEC_MPNN_SHARDED`), one system and one rank count, in float64:

* `triclinic`: 64 atoms (H, O) in a periodic cell with angles of about 60-70 degrees;
* `own_images`: 27 atoms in a periodic cell so small that a rank sees its own images;
* `slab`: 54 atoms in six layers, periodic in x and y, cut along its vacuum axis z
  (grid (1, 1, N)); at 2 ranks no rank's owned atoms and ghosts cover the slab, at 4
  some ranks own no atom.

The model runs on one process and on N spawned gloo ranks (`DistributedModel`, skin 0
so the lists hold exactly the pairs within the cutoff). Outcomes:

* **exact**: energy, forces and stress within {tolerance:g} relative of one process;
* **refused**: an error on the ranks (the first line of the originating rank's message
  is listed below the table);
* **WRONG**: a silently different answer (the worst output and its relative difference);
* **HANG**: a collective that only some ranks issued (timed out), or ranks out of step;
* **CRASH**: a rank died (gloo aborts the process on collectives of mismatched sizes).

`tests/test_idiom_zoo.py` runs the same classification and fails on any WRONG, HANG or
CRASH not listed in its xfail sets (strict for WRONG: a fixed case must leave the
list). Regenerate this file with

    OMP_NUM_THREADS=1 python -m mlipdd.testing.idiom_zoo --output docs/idiom_zoo.md
"""


def _commit() -> str:
    try:
        here = Path(__file__).resolve().parent
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True,
                             text=True, timeout=10, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "."], cwd=here.parents[1],
                               capture_output=True, text=True, timeout=10, check=False).stdout.strip()
        return out.stdout.strip() + (" with uncommitted changes in core/mlipdd" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown (not a git checkout)"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mlipdd.testing.idiom_zoo", description=__doc__)
    parser.add_argument("--world-sizes", default=",".join(map(str, WORLD_SIZES)))
    parser.add_argument("--models", default=None, help=f"comma separated, from: {', '.join(ZOO)}")
    parser.add_argument("--output", default=None, help="write the table, with its introduction, to this file")
    parser.add_argument("--json", default=None, help="also write every case's result to this JSON file")
    parser.add_argument("--note", default=None, help="a line for the header (e.g. which code was classified)")
    args = parser.parse_args(argv)
    world_sizes = tuple(int(n) for n in args.world_sizes.split(","))
    models = args.models.split(",") if args.models else None
    results, seconds = timed_classify(models=models, world_sizes=world_sizes)
    import torch

    header = (f"Classified on {datetime.date.today().isoformat()}: {len(results)} cases in {seconds:.0f} s "
              f"on {platform.node() or 'this machine'} ({os.cpu_count()} CPU cores, {platform.machine()}, "
              f"torch {torch.__version__}, gloo, one thread per rank); code: {args.note or _commit()}.")
    table = header + "\n\n" + markdown_table(results) + "\n"
    print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([dataclasses.asdict(r) for r in results], f, indent=0)
    if args.output:
        intro = INTRO.format(n_models=len(ZOO), tolerance=TOLERANCE)
        Path(args.output).write_text(intro + "\n## Classification\n\n" + table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
