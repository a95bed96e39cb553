"""Checkpoint files after an interrupted write (catalogue entries C4, C5).

A writer killed with SIGKILL in the middle of a write cannot clean up after itself; the
previous checkpoint must stay readable and the next write must remove the leftover.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import torch
from mlipdd.distributed import load_checkpoint, save_checkpoint
from mlipdd.distributed.checkpoint import checkpoint_payload, write_atomically
from mlipdd.dynamics import NVE
from mlipdd.lattices import lj_liquid
from mlipdd.models.lj import LennardJones

# a writer that hangs between writing the bytes and the rename (as a slow disk would)
_KILLED_WRITER = """
import os, sys, time
import torch
from mlipdd.distributed.checkpoint import write_atomically
os.fsync = lambda fd: (print("writing", flush=True), time.sleep(60))
write_atomically({"format": "mlipdd-checkpoint", "big": torch.zeros(1000)}, sys.argv[1])
"""


def _state():
    dyn = NVE(LennardJones(epsilon=0.0104, sigma=3.4, cutoff=5.5), 2.0)
    batch = lj_liquid(3, temperature=300.0, seed=2)
    dyn.run(batch, 3)
    return batch, dyn


def test_a_write_killed_midway_leaves_the_old_checkpoint_and_the_next_write_cleans_up(tmp_path):
    path = tmp_path / "state.pt"
    batch, dyn = _state()
    save_checkpoint(path, batch, dyn)
    writer = subprocess.Popen(
        [sys.executable, "-c", _KILLED_WRITER, str(path)], stdout=subprocess.PIPE, text=True
    )
    assert writer.stdout.readline().strip() == "writing"
    os.kill(writer.pid, signal.SIGKILL)
    writer.wait(timeout=30)
    leftovers = list(tmp_path.glob(".state.pt.*.tmp"))
    assert len(leftovers) == 1  # what kill -9 leaves
    assert load_checkpoint(path).step == 3  # the old checkpoint is whole

    dyn.run(batch, 2)
    write_atomically(checkpoint_payload(batch, dyn), path)
    assert not list(tmp_path.glob(".state.pt.*.tmp"))
    assert load_checkpoint(path).step == 5


def test_a_checkpoint_file_has_the_permissions_of_any_new_file(tmp_path):
    path = tmp_path / "state.pt"
    batch, dyn = _state()
    save_checkpoint(path, batch, dyn)
    reference = tmp_path / "plain"
    reference.write_bytes(b"")
    assert (path.stat().st_mode & 0o777) == (reference.stat().st_mode & 0o777)
    assert torch.load(path, weights_only=True)["format"] == "mlipdd-checkpoint"
