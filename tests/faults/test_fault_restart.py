"""``mlipdd run --restart s.pt`` continues the checkpoint's run (catalogue entries R1-R6).

Before: a plain restart ran at the default dt, temperature and seed 0 (they were read from
the integrator's state instead of its settings), with the default model (LJ after a MACE
run), ignored ``--system`` / ``--size`` without a word, made atoms jump by a lattice vector
when a multi-rank run was continued on one process (image counts dropped from the frames),
and truncated the trajectory it was given. Real runs through the command line throughout.
"""

from __future__ import annotations

import json

import ase.io
import numpy as np
import pytest
import torch
from fault_helpers import finish, start_run, stderr_of
from mlipdd.cli import main

QUIET = ["--log-every", "0", "--progress", "off", "--device", "cpu", "--json"]
# non-default settings everywhere, so a restart that falls back to a default shows
NVT = ["--system", "lj_liquid", "--size", "2", "--ensemble", "nvt", "--dt", "2",
       "--temperature", "150", "--seed", "7", "--friction", "0.05"]


def _run(capsys, *args) -> dict:
    assert main(["run", *QUIET, *args]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


def _positions(path) -> torch.Tensor:
    return torch.load(path, weights_only=True)["node"]["positions"]


def test_a_plain_restart_continues_at_the_checkpoints_dt_temperature_and_seed(tmp_path, capsys):
    """R1: 4 steps + ``--restart`` 4 steps (no other flag) == 8 steps straight, to the bit
    (the Langevin noise is keyed by seed, step and atom id)."""
    straight = _run(capsys, *NVT, "--steps", "8", "--checkpoint", str(tmp_path / "straight.pt"))
    _run(capsys, *NVT, "--steps", "4", "--checkpoint", str(tmp_path / "half.pt"))
    again = _run(capsys, "--steps", "4", "--restart", str(tmp_path / "half.pt"),
                 "--checkpoint", str(tmp_path / "again.pt"))
    assert (again["dt_fs"], again["temperature_K"], again["ensemble"]) == (2.0, 150.0, "nvt")
    assert again["system"] == straight["system"] == "lj_liquid" and again["final_step"] == 8
    assert torch.equal(_positions(tmp_path / "again.pt"), _positions(tmp_path / "straight.pt"))


@pytest.mark.parametrize("flags", [["--size", "3"], ["--system", "fcc_argon"]])
def test_system_or_size_other_than_the_checkpoints_is_refused(tmp_path, capsys, flags):
    """R2: the system of a restart is the checkpoint's; another one is one line, exit 2
    (the same values as the checkpoint's are accepted)."""
    _run(capsys, *NVT, "--steps", "1", "--checkpoint", str(tmp_path / "s.pt"))
    assert main(["run", *QUIET, "--steps", "1", "--restart", str(tmp_path / "s.pt"), *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and flags[0] in err[0] and "checkpoint's system" in err[0], err
    _run(capsys, "--steps", "1", "--restart", str(tmp_path / "s.pt"), "--size", "2",
         "--system", "lj_liquid")


def test_a_three_rank_nose_hoover_run_continued_on_one_process_has_no_jumps(tmp_path):
    """R3: image counts travel with the checkpoint and the one-process frames use them;
    the restart appends to the same trajectory (R4), one file for the whole run."""
    first = start_run(tmp_path, "--nproc", "3", "--system", "lj_liquid", "--size", "3",
                      "--ensemble", "nh", "--temperature", "300", "--steps", "40", *QUIET,
                      "--trajectory", "md.traj", "--trajectory-every", "5", "--checkpoint", "s.pt")
    assert finish(first, timeout=240) == 0, stderr_of(tmp_path)
    crossed = int((torch.load(tmp_path / "s.pt", weights_only=True)["node"]["image"] != 0)
                  .any(1).sum())
    assert crossed > 0  # atoms were wrapped by migration: otherwise this proves nothing
    assert main(["run", *QUIET, "--restart", str(tmp_path / "s.pt"), "--steps", "20",
                 "--ensemble", "nh", "--temperature", "300",  # as given to the first run
                 "--trajectory", str(tmp_path / "md.traj"), "--trajectory-every", "5"]) == 0
    frames = ase.io.read(tmp_path / "md.traj", ":")
    assert [f.info["step"] for f in frames] == list(range(0, 65, 5))
    moves = [np.abs(b.positions - a.positions).max() for a, b in zip(frames, frames[1:])]
    assert max(moves) < 1.0, moves  # a jump is a lattice vector (~16 A)


@pytest.mark.parametrize("suffix", ["extxyz", "traj"])
def test_a_restart_appends_to_its_trajectory_and_refuses_one_that_ran_past(tmp_path, capsys, suffix):
    """R4: the earlier frames stay; a file holding steps past the checkpoint's is refused."""
    path = str(tmp_path / f"md.{suffix}")
    every = ["--trajectory", path, "--trajectory-every", "2"]
    _run(capsys, *NVT, "--steps", "4", *every, "--checkpoint", str(tmp_path / "s.pt"))
    _run(capsys, "--steps", "4", *every, "--restart", str(tmp_path / "s.pt"))
    assert [f.info["step"] for f in ase.io.read(path, ":")] == [0, 2, 4, 6, 8]
    assert main(["run", *QUIET, "--steps", "2", *every, "--restart", str(tmp_path / "s.pt")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "up to step 8" in err[0] and path in err[0], err
    assert len(ase.io.read(path, ":")) == 5  # untouched
