"""A scheduler's stop: SIGTERM to the launcher and to every rank at once (catalogue L7).

``scancel`` (and a batch system's time limit) signals every process of the job, and the
launcher forwards its own SIGTERM to each rank too, so every rank gets two within
milliseconds. Before: a rank took the second as "give up the clean stop" and ended by the
default action (exit 143, no checkpoint, sometimes half a frame); 1 of 3 trials stopped
cleanly. Now signals within `STOP_BURST_S` of the first are one request (NOTE [clean
stop]), on the ranks and in the launcher. Real launched runs, three trials.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import ase.io
import pytest
import torch
from fault_helpers import LONG, SMALL_RUN, finish, rank_pids, start_run, stderr_of, wait_for_file

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc (Linux)")

GAP_S = 0.005  # seconds between the scheduler's signals to the ranks and to the launcher
WRITES = ["--trajectory", "md.extxyz", "--trajectory-every", "1", "--checkpoint", "state.pt",
          "--checkpoint-every", "1000000"]


@pytest.mark.parametrize("trial", range(3))
def test_sigterm_to_the_launcher_and_every_rank_at_once_stops_cleanly(tmp_path, trial):
    launcher = start_run(tmp_path, "--nproc", "2", *SMALL_RUN, *LONG, *WRITES)
    ranks = rank_pids(launcher, 2)
    wait_for_file(tmp_path / "md.extxyz", launcher)
    # as scancel does: every process of the job, one burst; the launcher's forwarded
    # SIGTERM then reaches each rank a moment after the scheduler's own
    for pid in ranks:
        os.kill(pid, signal.SIGTERM)
    time.sleep(GAP_S)
    os.kill(launcher.pid, signal.SIGTERM)
    os.kill(launcher.pid, signal.SIGTERM)  # under srun: the scheduler's and srun's forward
    assert finish(launcher, timeout=90) == 128 + signal.SIGTERM, stderr_of(tmp_path)
    err = stderr_of(tmp_path)
    assert (tmp_path / "state.pt").exists(), err  # the checkpoint of the stop was written
    step = int(torch.load(tmp_path / "state.pt", weights_only=True)["dynamics_state"]["step_count"])
    frames = ase.io.read(tmp_path / "md.extxyz", ":")  # whole frames only
    assert frames and all(len(f) == 108 for f in frames)
    assert frames[-1].info["step"] == step and f"stopped after step {step}" in err, err


# a process that watches for stop signals, signals itself, and reports what is pending
_SIGNALLED = """
import os, signal, sys, time
from mlipdd.dynamics import stop
with stop.stop_on_signals():
    os.kill(os.getpid(), signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGTERM)  # the same burst: one request, the process lives
    print(stop.stop_requested(), flush=True)
    time.sleep(stop.STOP_BURST_S + 0.2)
    os.kill(os.getpid(), signal.SIGTERM)  # later: "give up", the default action ends it
    print("still running", flush=True)
"""


def test_a_later_second_signal_still_gives_up_the_clean_stop():
    """L7: the burst rule does not take away the user's way out of a stop that hangs."""
    out = subprocess.run([sys.executable, "-c", _SIGNALLED], capture_output=True, text=True,
                         timeout=60, check=False)
    assert out.returncode == -signal.SIGTERM, out.stderr
    assert out.stdout.splitlines() == ["SIGTERM received"], out.stdout
