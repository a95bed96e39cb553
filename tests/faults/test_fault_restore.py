"""Restoring a checkpoint restores declared state only (catalogue entries C1-C3).

A checkpoint loads with ``weights_only=True`` (no code runs), but its integrator state is
a plain dict: one that carries ``hooks=[]`` or ``nan_check_every=0`` must not switch the
restarted run's output or checks off. Settings (dt, temperature) are the script's, and a
difference from the checkpoint's is reported.
"""

from __future__ import annotations

import warnings

import ase.io
import pytest
import torch
from mlipdd.data import InputError
from mlipdd.distributed import DomainConfig, DomainParallel, load_checkpoint, restore_dynamics
from mlipdd.distributed.checkpoint import (
    CheckpointSettingsWarning,
    checkpoint_payload,
    write_atomically,
)
from mlipdd.dynamics import NVE, NVTLangevin, TrajectoryWriter
from mlipdd.lattices import lj_liquid
from mlipdd.models.lj import LennardJones
from mlipdd.testing import run_ranks

CUTOFF = 5.5


def _lj():
    return LennardJones(epsilon=0.0104, sigma=3.4, cutoff=CUTOFF)


def _hostile_checkpoint(path):
    """A real NVE checkpoint after 5 steps whose state also 'sets' wiring and checks."""
    dyn = NVE(_lj(), 2.0)
    batch = lj_liquid(3, temperature=300.0, seed=2)
    dyn.run(batch, 5)
    payload = checkpoint_payload(batch, dyn)
    payload["dynamics_state"].update(hooks=[], nan_check_every=0, max_step_displacement=1e30)
    write_atomically(payload, path)
    return path


def _restart_on_ranks(rank, world_size, checkpoint, trajectory):
    hooks = [TrajectoryWriter(trajectory, frequency=1)]
    dyn = NVE(_lj(), 2.0)
    with DomainParallel(dyn, DomainConfig(cutoff=CUTOFF), 3, hooks) as dp:
        dp.restore(checkpoint)
        kept = (len(dyn.hooks), dyn.nan_check_every, dyn.max_step_displacement)
        dp.run()
    return kept


def test_a_restored_state_cannot_switch_off_hooks_or_checks(tmp_path):
    checkpoint = _hostile_checkpoint(tmp_path / "state.pt")
    trajectory = tmp_path / "md.extxyz"
    kept = run_ranks(_restart_on_ranks, 2, str(checkpoint), str(trajectory))
    assert kept[0] == kept[1] and kept[0][1:] == (1, 1.0)
    assert kept[0][0] >= 1  # the trajectory writer's adapter is still there
    assert [f.info["step"] for f in ase.io.read(trajectory, ":")] == [5, 6, 7, 8]


def test_the_scripts_dt_and_temperature_win_and_the_difference_is_reported(tmp_path):
    batch = lj_liquid(3, temperature=300.0, seed=2)
    first = NVTLangevin(_lj(), 2.0, temperature=300.0, seed=1)
    first.run(batch, 4)
    write_atomically(checkpoint_payload(batch, first), tmp_path / "state.pt")
    checkpoint = load_checkpoint(tmp_path / "state.pt")

    same = NVTLangevin(_lj(), 2.0, temperature=300.0, seed=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CheckpointSettingsWarning)  # no difference, no warning
        restore_dynamics(same, checkpoint)
    assert same.step_count == 4 and torch.equal(same.bath_energy, first.bath_energy)

    changed = NVTLangevin(_lj(), 1.0, temperature=250.0, seed=1)
    with pytest.warns(CheckpointSettingsWarning) as caught:
        restore_dynamics(changed, checkpoint)
    text = " ".join(str(w.message) for w in caught)
    assert "dt_fs = 2 but this integrator has 1" in text
    assert "temperature_K" in text and "the integrator's value is used" in text
    assert changed.dt_fs == 1.0 and float(changed.temperature_K) == 250.0
    assert changed.step_count == 4


def test_a_damaged_step_count_is_refused(tmp_path):
    dyn = NVE(_lj(), 2.0)
    batch = lj_liquid(3, temperature=300.0, seed=2)
    dyn.run(batch, 2)
    payload = checkpoint_payload(batch, dyn)
    payload["dynamics_state"]["step_count"] = "7; rm -rf"
    write_atomically(payload, tmp_path / "state.pt")
    with pytest.raises(InputError, match="step_count .* not a non-negative integer"):
        restore_dynamics(NVE(_lj(), 2.0), load_checkpoint(tmp_path / "state.pt"))
