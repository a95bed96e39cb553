"""``python -m mlipdd.testing.idiom_zoo [--world-sizes 2,3,4] [--models A,B] [--output FILE]``:
classify the zoo and print the markdown table (and write it to FILE)."""

from __future__ import annotations

import argparse
import datetime
import platform

from mlipdd.testing.idiom_zoo import ZOO
from mlipdd.testing.idiom_zoo.classifier import WORLD_SIZES, markdown_table, timed_classify


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mlipdd.testing.idiom_zoo", description=__doc__)
    parser.add_argument("--world-sizes", default=",".join(map(str, WORLD_SIZES)))
    parser.add_argument("--models", default=None, help=f"comma separated, from: {', '.join(ZOO)}")
    parser.add_argument("--output", default=None, help="also write the table to this file")
    args = parser.parse_args(argv)
    world_sizes = tuple(int(n) for n in args.world_sizes.split(","))
    models = args.models.split(",") if args.models else None
    results, seconds = timed_classify(models=models, world_sizes=world_sizes)
    import torch

    header = (f"Classified {len(results)} cases in {seconds:.0f} s on {platform.node() or 'this machine'} "
              f"({platform.processor() or platform.machine()}, torch {torch.__version__}, gloo), "
              f"{datetime.date.today().isoformat()}.")
    text = header + "\n\n" + markdown_table(results) + "\n"
    print(text)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
