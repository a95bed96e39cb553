"""Runs README blocks for tests/test_readme_snippets.py, each in a fresh namespace.

    python readme_snippet_runner.py BLOCKS.json RESULTS.json  # one process, block after block
    python readme_snippet_runner.py --ranks N BLOCK.py         # one block on N gloo ranks

One process for all single-process blocks: torch, mace and fairchem are imported once instead
of once per block (minutes on 2 cores), while each block still gets an empty namespace, so a
name it does not define or import itself fails it. On ranks (`mlipdd.testing.spawn.run_ranks`,
what torchrun would start) any rank's exception fails the run with every rank's traceback.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path


def run_block(code: str, filename: str) -> None:
    exec(compile(code, filename, "exec"), {"__name__": "__readme_block__"})  # noqa: S102


def run_block_on_rank(rank: int, world_size: int, path: str) -> None:
    with open(path) as source:
        run_block(source.read(), path)


def run_all(blocks_json: str, results_json: str) -> None:
    results = {}
    for block in json.loads(Path(blocks_json).read_text()):
        try:
            run_block(block["code"], block["id"])
            results[block["id"]] = None
        except BaseException:  # noqa: BLE001 - reported per block
            results[block["id"]] = traceback.format_exc()
        with open(results_json, "w") as out:  # after each block: a crash still reports the rest
            json.dump(results, out)


if __name__ == "__main__":
    if sys.argv[1] == "--ranks":
        from mlipdd.testing.spawn import run_ranks

        run_ranks(run_block_on_rank, int(sys.argv[2]), sys.argv[3], timeout=300)
    else:
        run_all(sys.argv[1], sys.argv[2])
