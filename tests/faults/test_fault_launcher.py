"""``mlipdd run --nproc 2``: signals to the launcher, dead and suspended ranks (real processes).

Catalogue entries L1-L5 (see README.md in this folder).
"""

from __future__ import annotations

import inspect
import io
import os
import signal
import sys

import ase.io
import pytest
import torch
from fault_helpers import (
    LONG,
    SMALL_RUN,
    finish,
    rank_pids,
    start_run,
    stderr_of,
    wait_for_file,
    wait_gone,
)

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc (Linux)")


# a trajectory frame every 2 steps, a checkpoint only when the run ends or is stopped
WRITES_FILES = ("--trajectory", "md.extxyz", "--trajectory-every", "2",
                "--checkpoint", "state.pt", "--checkpoint-every", "1000000")


def _running(tmp_path, *extra, **launcher_waits):
    """A 2-rank run that writes a trajectory and a checkpoint, once it has taken steps."""
    launcher = start_run(
        tmp_path,
        "--nproc",
        "2",
        *SMALL_RUN,
        *LONG,
        *WRITES_FILES,
        *extra,
        **launcher_waits,
    )
    ranks = rank_pids(launcher, 2)
    wait_for_file(tmp_path / "md.extxyz", launcher)  # the first frame: the ranks are stepping
    return launcher, ranks


def _check_clean_stop(tmp_path):
    """The files of a run stopped between steps: a last checkpoint and whole frames."""
    state = torch.load(tmp_path / "state.pt", weights_only=True)
    step = int(state["dynamics_state"]["step_count"])
    assert step >= 1
    frames = ase.io.read(tmp_path / "md.extxyz", ":")
    assert frames and all(len(f) == 108 for f in frames)
    assert frames[-1].info["step"] <= step
    assert f"stopped after step {step}" in stderr_of(tmp_path)
    assert not list(tmp_path.glob(".state.pt.*.tmp"))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_stop_signal_to_the_launcher_stops_every_rank_cleanly(tmp_path, sig):
    """L1: the launcher forwards the stop; every rank stops after the same step, writes
    the checkpoint and closes the trajectory; exit code 128 + signal."""
    launcher, ranks = _running(tmp_path)
    os.kill(launcher.pid, sig)
    assert finish(launcher, timeout=60) == 128 + sig
    wait_gone(ranks, timeout=5)
    _check_clean_stop(tmp_path)
    assert f"{signal.Signals(sig).name} received" in stderr_of(tmp_path)


def test_stop_signal_during_start_up_is_a_stop_not_a_failure(tmp_path):
    """L1: SIGTERM before the ranks can stop cleanly (still importing, joining): they end
    by the forwarded SIGTERM, which the launcher asked for; exit 143, no rank blamed."""
    launcher = start_run(tmp_path, "--nproc", "2", *SMALL_RUN, *LONG)
    ranks = rank_pids(launcher, 2)
    os.kill(launcher.pid, signal.SIGTERM)
    assert finish(launcher, timeout=60) == 128 + signal.SIGTERM
    wait_gone(ranks, timeout=5)
    assert "was killed" not in stderr_of(tmp_path) and "exited with" not in stderr_of(tmp_path)


def test_ranks_die_with_a_killed_launcher_and_still_write_their_files(tmp_path):
    """L2: SIGKILL cannot be caught by the launcher; the ranks get the parent-death signal."""
    launcher, ranks = _running(tmp_path)
    os.kill(launcher.pid, signal.SIGKILL)
    launcher.wait(timeout=10)
    wait_gone(ranks, timeout=60)
    _check_clean_stop(tmp_path)


def test_a_rank_killed_mid_run_is_named_and_the_exit_code_is_small(tmp_path):
    """L3: rank 1 SIGKILLed while stepping: named with its signal, rank 0 says it lost
    contact, the launcher exits 1 (not 247 or a gloo traceback alone)."""
    launcher, ranks = _running(tmp_path)
    os.kill(ranks[1], signal.SIGKILL)
    assert finish(launcher, timeout=60) == 1
    err = stderr_of(tmp_path)
    assert f"rank 1 (pid {ranks[1]}) was killed by SIGKILL (signal 9) (the root cause)" in err
    assert "rank 0 stopped: lost contact with another rank" in err


def test_a_rank_killed_during_start_up_is_named(tmp_path):
    """L4: rank 1 dies before joining the group; rank 0, waiting for it at the rendezvous,
    is ended by the launcher after the grace period (5 s here, not 15: rank 0 cannot
    end by itself, so the full wait adds nothing); exit 1, rank 1 named."""
    launcher = start_run(tmp_path, "--nproc", "2", *SMALL_RUN, *LONG, failure_grace_s=5)
    ranks = rank_pids(launcher, 2)
    os.kill(ranks[1], signal.SIGKILL)
    assert finish(launcher, timeout=90) == 1
    err = stderr_of(tmp_path)
    assert f"rank 1 (pid {ranks[1]}) was killed by SIGKILL" in err
    assert "(the root cause)" in err and "ended by the launcher" in err


def test_a_suspended_rank_fails_the_run_at_the_collective_timeout(tmp_path):
    """L5: a SIGSTOPped rank blocks the others only for --collective-timeout seconds; the
    message names the timeout setting and the suspended rank. A suspended rank can neither
    fail by itself nor act on SIGTERM, so the launcher's 15 + 5 s of patience are 1 + 1 s
    here: it is SIGKILLed and named just the same."""
    launcher, ranks = _running(tmp_path, "--collective-timeout", "4", failure_grace_s=1,
                               kill_after_s=1)
    os.kill(ranks[1], signal.SIGSTOP)
    assert finish(launcher, timeout=90) == 1
    err = stderr_of(tmp_path)
    assert "collective_timeout = 4 s" in err and "--collective-timeout" in err
    assert f"rank 1 (pid {ranks[1]}) was killed by SIGKILL (signal 9) (it was suspended" in err


def test_one_default_collective_timeout():
    """L5: the CLI setting and the library's manager share the documented default."""
    from mlipdd.app.simulation import RunConfig
    from mlipdd.distributed.manager import DEFAULT_COLLECTIVE_TIMEOUT_S, DistributedManager

    assert RunConfig().collective_timeout == DEFAULT_COLLECTIVE_TIMEOUT_S == 300.0
    default = inspect.signature(DistributedManager).parameters["timeout_s"].default
    assert default == DEFAULT_COLLECTIVE_TIMEOUT_S


def test_sigterm_stops_a_one_process_run_cleanly(tmp_path):
    """L1 without --nproc: the same clean stop, checkpoint and exit code."""
    run = start_run(tmp_path, *SMALL_RUN, *LONG, *WRITES_FILES)
    wait_for_file(tmp_path / "md.extxyz", run)
    os.kill(run.pid, signal.SIGTERM)
    assert finish(run, timeout=60) == 128 + signal.SIGTERM
    _check_clean_stop(tmp_path)


def test_a_stop_signal_between_two_rank_starts_stops_the_run():
    """L1, the start-up window made certain: the launcher catches stop signals from before
    its first rank starts, so a SIGTERM between two starts stops the started rank and
    starts no more (it used to end the launcher by the default action: exit -15)."""
    from mlipdd.distributed.supervise import Supervisor

    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    supervisor = Supervisor(stream=io.StringIO())
    with supervisor.catching_signals():
        supervisor.start(sleeper, dict(os.environ))
        os.kill(os.getpid(), signal.SIGTERM)  # handled here, between the two starts
        supervisor.start(sleeper, dict(os.environ))
        code = supervisor.wait()
    assert code == 128 + signal.SIGTERM
    assert len(supervisor.ranks) == 1 and supervisor.ranks[0].code == -signal.SIGTERM
    assert "SIGTERM received" in supervisor.stream.getvalue()
