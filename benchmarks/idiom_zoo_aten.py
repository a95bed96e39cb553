"""The idiom zoo under the aten dispatch: exact / refused / WRONG per case, as a table.

    python benchmarks/idiom_zoo_aten.py [--world-sizes 2,3,4] [--strategies halo,sharded] [--out docs/idiom_zoo_aten.md]

Runs `mlipdd.testing.idiom_zoo.classify` (halo and sharded storage; every rank runs the
aten-level ShardTensor, the only dispatch); the one-process references are the plain
models. Not a test: tests/test_aten_idiom_zoo.py checks the no-WRONG rule.
``python -m mlipdd.testing.idiom_zoo`` writes the full docs/idiom_zoo.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", default="2,3,4")
    parser.add_argument("--models", default="")
    parser.add_argument("--strategies", default="halo,sharded")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from mlipdd.testing.idiom_zoo import classify, markdown_table

    sizes = tuple(int(s) for s in args.world_sizes.split(","))
    models = [m for m in args.models.split(",") if m] or None
    start = time.perf_counter()
    strategies = tuple(args.strategies.split(","))
    results = classify(models=models, world_sizes=sizes, strategies=strategies)
    took = time.perf_counter() - start
    table = markdown_table(results)
    header = (f"# The idiom zoo under the aten dispatch\n\n"
              f"Written by `python benchmarks/idiom_zoo_aten.py --world-sizes {args.world_sizes} "
              f"--strategies {args.strategies}` ({took:.0f} s on {platform.node() or 'this machine'}, "
              f"{os.cpu_count()} CPU cores, gloo ranks). `exact`: energy, forces and "
              "stress within 1e-10 relative of one process; `refused`: an error on the ranks (its first line "
              "below); `WRONG`: a silently different answer (the rule: none).\n\n")
    text = header + table + "\n"
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
