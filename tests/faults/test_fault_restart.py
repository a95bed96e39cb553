"""``mlipdd run --restart s.pt`` continues the checkpoint's run (catalogue entries R1-R6).

Before: a plain restart ran at the default dt, temperature and seed 0 (they were read from
the integrator's state instead of its settings), with the default model (LJ after a MACE
run), ignored ``--system`` / ``--size`` without a word, made atoms jump by a lattice vector
when a multi-rank run was continued on one process (image counts dropped from the frames),
and truncated the trajectory it was given. Real runs through the command line throughout.
"""

from __future__ import annotations

import itertools
import json

import ase.io
import numpy as np
import pytest
import torch
from fault_helpers import finish, run_here, start_run, stderr_of
from mlipdd.cli import main

QUIET = ["--log-every", "0", "--progress", "off", "--device", "cpu", "--json"]
# non-default settings everywhere, so a restart that falls back to a default shows
NVT = ["--system", "lj_liquid", "--size", "2", "--ensemble", "nvt", "--dt", "2",
       "--temperature", "150", "--seed", "7", "--friction", "0.05"]


def _run(capsys, *args) -> dict:
    assert main(["run", *QUIET, *args]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    return json.loads(out[out.index("{"):])  # mace-torch prints a note at import


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
    # a setting given on purpose wins, and is said in one line, not as a Python warning
    assert main(["run", *QUIET, "--steps", "1", "--restart", str(tmp_path / "half.pt"),
                 "--dt", "1"]) == 0
    notes = capsys.readouterr().err.strip().splitlines()
    assert len(notes) == 1 and notes[0].startswith("mlipdd run: note: ") and "dt_fs = 2" in notes[0]


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
    moves = [np.abs(b.positions - a.positions).max() for a, b in itertools.pairwise(frames)]
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


# ---- R5: the model of a restart is the checkpoint's ------------------------------------------
def _mace_file(path, seed):
    pytest.importorskip("mace", reason="mace-torch is not installed (see plugins/mace/README.md)")
    from mlipdd_mace.testing import random_mace

    torch.save(random_mace(elements=(18,), r_max=4.0, dtype=torch.float64, seed=seed), path)
    return str(path)


MACE_NVE = ["--system", "fcc_argon", "--size", "2", "--ensemble", "nve", "--dt", "1"]


def test_a_restart_continues_with_the_checkpoints_mace_model(tmp_path, capsys):
    """R5: after a MACE run, ``--restart s.pt`` alone continues with that MACE model (it
    used to continue with LJ: energy -619 -> +399 eV); 2 + 2 steps == 4 straight."""
    weights = _mace_file(tmp_path / "argon.model", seed=0)
    mace = ["--model", "mace", "--model-arg", f"path={weights}"]
    straight = _run(capsys, *mace, *MACE_NVE, "--steps", "4", "--checkpoint", str(tmp_path / "a.pt"))
    _run(capsys, *mace, *MACE_NVE, "--steps", "2", "--checkpoint", str(tmp_path / "half.pt"))
    again = _run(capsys, "--steps", "2", "--restart", str(tmp_path / "half.pt"),
                 "--checkpoint", str(tmp_path / "b.pt"))
    assert (again["model"], again["system"], again["ensemble"]) == ("mace", "fcc_argon", "nve")
    assert torch.equal(_positions(tmp_path / "b.pt"), _positions(tmp_path / "a.pt"))
    assert straight["final_step"] == again["final_step"] == 4


def test_another_model_or_changed_weights_are_refused_unless_allowed(tmp_path, capsys):
    """R5: a different --model, other --model-arg values, or a weights file whose bytes
    changed: one line naming both, exit 2; ``--restart-allow-model-change`` lets it run."""
    weights = _mace_file(tmp_path / "argon.model", seed=0)
    _run(capsys, "--model", "mace", "--model-arg", f"path={weights}", *MACE_NVE, "--steps", "1",
         "--checkpoint", str(tmp_path / "s.pt"))
    restart = ["run", *QUIET, "--steps", "1", "--restart", str(tmp_path / "s.pt")]

    def refused(*flags) -> str:
        assert main([*restart, *flags]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and str(tmp_path / "s.pt") in err[0], err
        return err[0]

    line = refused("--model", "lj")
    assert "mace(path=" in line and "lj()" in line and "--restart-allow-model-change" in line
    _mace_file(tmp_path / "argon.model", seed=1)  # the same path, other weights
    line = refused()
    assert "argon.model" in line and "changed" in line and "sha256" in line
    assert main([*restart, "--restart-allow-model-change"]) == 0
    assert "continuing anyway" in capsys.readouterr().err


def test_two_ranks_refuse_another_model_in_one_line(tmp_path, capfd):
    """R5 under the launcher: the refusal is agreed, said once, exit 2."""
    _run(capfd, *NVT, "--steps", "1", "--checkpoint", str(tmp_path / "s.pt"))
    code, err = run_here(capfd, tmp_path, "--nproc", "2", *QUIET, "--steps", "1", "--restart", "s.pt",
                         "--model-arg", "sigma=3.0")
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "lj(sigma=3.0)" in lines[0] and "s.pt" in lines[0], lines
