"""Two runs given the same ``--checkpoint`` path (catalogue entry C10).

Before: both ran; each write's clean-up deleted the other's temporary file, so one
crashed mid-write, and the survivor's checkpoint mixed two runs. Now the writing process
holds an ``flock`` on ``.NAME.lock`` beside the checkpoint (NOTE [checkpoint lock]), and
the second run is refused in one line naming the first one's pid. Real launched runs.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch
from fault_helpers import LONG, SMALL_RUN, finish, rank_pids, start_run, stderr_of, wait_for_file

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc (Linux)")

WRITES = ["--trajectory", "md.extxyz", "--trajectory-every", "2", "--checkpoint", "state.pt",
          "--checkpoint-every", "3"]


def test_a_second_run_on_the_same_checkpoint_is_refused_naming_the_first(tmp_path):
    """A second run of one process, then one of two ranks, against one first run (each
    refusal is its own launch; the first run need not be started twice to be held)."""
    first_dir = tmp_path / "first"
    first_dir.mkdir()
    first = start_run(first_dir, "--nproc", "2", *SMALL_RUN, *LONG, *WRITES)
    writer = rank_pids(first, 2)[0]  # rank 0 writes the checkpoint
    wait_for_file(first_dir / "state.pt", first)
    try:
        for second_nproc in (1, 2):
            second_dir = tmp_path / f"second{second_nproc}"
            second_dir.mkdir()
            second = start_run(second_dir, "--nproc", str(second_nproc), *SMALL_RUN, "--steps", "6",
                               "--checkpoint", str(first_dir / "state.pt"))
            assert finish(second, timeout=180) == 2, f"--nproc {second_nproc}"
            lines = stderr_of(second_dir).strip().splitlines()
            assert len(lines) == 1 and f"pid {writer}" in lines[0], (second_nproc, lines)
            assert str(first_dir / "state.pt") in lines[0] and "another --checkpoint path" in lines[0]
            assert first.poll() is None  # the first run goes on, untouched
    finally:
        os.kill(first.pid, signal.SIGTERM)
    assert finish(first, timeout=60) == 128 + signal.SIGTERM, stderr_of(first_dir)
    state = torch.load(first_dir / "state.pt", weights_only=True)
    assert int(state["dynamics_state"]["step_count"]) >= 3
    assert not list(first_dir.glob(".state.pt.*")), list(first_dir.iterdir())  # lock removed too
