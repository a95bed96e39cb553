"""Every ```python block of README.md and plugins/*/README.md runs as written.

Each block is a complete program (its imports, model and system included) and runs in an
empty namespace, so a name defined by an earlier block cannot hide a missing one (the
single-process blocks share one interpreter, so torch and mace are imported once; see
readme_snippet_runner.py). A block that joins a process group (`DistributedManager`,
`DomainParallel`) runs on 2 gloo ranks through `mlipdd.testing.spawn.run_ranks` (what
torchrun would start); a block with an ``if __name__ == "__main__":`` guard runs as a script
(it spawns its own ranks).

Model files the blocks load by name (``my_mace.model``, ``aimnet2.pt``, ...) are written into
the blocks' working folder with random weights in the upstream's own file format: a user has
a real one, the code path is the same. A block that cannot run here starts with a visible
``# not run by the tests: <why>`` line and is listed in NOT_RUN, so neither can go unnoticed.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted(ROOT.glob("plugins/*/README.md"))]
RUNNER = Path(__file__).with_name("readme_snippet_runner.py")
NOT_RUN_MARK = "# not run by the tests: "
# (markdown file, the reason its block gives): the blocks that cannot run in this suite
NOT_RUN = {
    ("README.md", "a template for your own plugin package (mlipdd_mymodel)"),
    ("README.md", "needs a fairchem UMA checkpoint (gated download)"),
    ("plugins/mace/README.md", "needs a CUDA GPU"),
}
WORLD_SIZE = 2


def python_blocks(path: Path) -> list[tuple[int, str]]:
    """(line of the opening fence, code) of each ```python block."""
    blocks, lines = [], path.read_text().splitlines()
    start = None
    for number, line in enumerate(lines, 1):
        if start is None and re.fullmatch(r"\s*```python\s*", line):
            start = number
        elif start is not None and line.strip() == "```":
            blocks.append((start, "\n".join(lines[start:number - 1]) + "\n"))
            start = None
    return blocks


def _name(path: Path) -> str:
    return str(path.relative_to(ROOT))


ALL_BLOCKS = [(_name(doc), line, code) for doc in DOCS for line, code in python_blocks(doc)]


def _reason(code: str) -> str | None:
    first = code.lstrip().splitlines()[0]
    return first[len(NOT_RUN_MARK):].strip() if first.startswith(NOT_RUN_MARK) else None


RUN = [pytest.param(code, id=f"{doc}:{line}") for doc, line, code in ALL_BLOCKS if _reason(code) is None]


def test_the_blocks_not_run_are_marked_and_listed():
    marked = {(doc, _reason(code)) for doc, _, code in ALL_BLOCKS if _reason(code) is not None}
    assert marked == NOT_RUN
    assert len(RUN) >= 15  # the extraction itself works


@pytest.fixture(scope="session")
def snippet_dir(tmp_path_factory) -> Path:
    """The blocks' working folder, holding the model files they load by name."""
    import torch
    from mlipdd_aimnet2.building import random_aimnet2, save_checkpoint
    from mlipdd_mace.testing import random_mace

    folder = tmp_path_factory.mktemp("readme")
    mace = random_mace(elements=(1, 6, 8, 11, 17, 29), r_max=4.0, dtype=torch.float64, seed=0)
    torch.save(mace, folder / "my_mace.model")  # what mace's training writes
    aimnet, metadata = random_aimnet2(seed=0)
    for name in ("aimnet2.pt", "aimnet2_wb97m_d3_0.pt"):
        save_checkpoint(aimnet, metadata, folder / name)  # aimnet's released .pt layout
    return folder


def _kind(code: str) -> str:
    if "__main__" in code:
        return "script"  # it starts its own ranks, which re-import it as a file
    return "ranks" if "DistributedManager(" in code or "DomainParallel(" in code else "one process"


def _run(command: list[str], cwd: Path) -> subprocess.CompletedProcess:
    # a user's shell: without the session's preload list (the plugins' conftests add fairchem
    # and aimnet to it; every rank a snippet starts would import them first, ~11 s a program)
    env = {k: v for k, v in os.environ.items() if k != "MLIPDD_SPAWN_PRELOAD"}
    env.update(OMP_NUM_THREADS="1", MPLBACKEND="Agg")
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=900,
                          check=False)


@pytest.fixture(scope="session")
def one_process_results(snippet_dir, tmp_path_factory) -> dict:
    """Every single-process block, run one after the other in one fresh interpreter."""
    folder = tmp_path_factory.mktemp("readme-results")
    blocks = [{"id": p.id, "code": p.values[0]} for p in RUN if _kind(p.values[0]) == "one process"]
    (folder / "blocks.json").write_text(json.dumps(blocks))
    out = _run([sys.executable, str(RUNNER), str(folder / "blocks.json"), str(folder / "results.json")],
               snippet_dir)
    results = json.loads((folder / "results.json").read_text()) if (folder / "results.json").exists() else {}
    return {b["id"]: results.get(b["id"], f"never ran (runner ended):\n{out.stderr[-3000:]}") for b in blocks}


@pytest.mark.parametrize("code", RUN)
def test_block_runs(code, request, snippet_dir, tmp_path):
    kind = _kind(code)
    if kind == "one process":
        failure = request.getfixturevalue("one_process_results")[request.node.callspec.id]
        assert failure is None, f"{code}\n{failure}"
        return
    script = tmp_path / "snippet.py"
    script.write_text(code)
    command = [sys.executable, str(RUNNER), "--ranks", str(WORLD_SIZE), str(script)] if kind == "ranks" \
        else [sys.executable, str(script)]
    out = _run(command, snippet_dir)
    assert out.returncode == 0, f"{code}\n--- stdout\n{out.stdout[-3000:]}\n--- stderr\n{out.stderr[-5000:]}"
