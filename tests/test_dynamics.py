"""Single-process MD engine: ASE agreement, conservation, Langevin, hooks, input errors."""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
import torch
from ase import units
from ase.calculators.lj import LennardJones as AseLennardJones
from ase.md.verlet import VelocityVerlet
from mlipdd.data import Batch, InputError
from mlipdd.dynamics import (
    NVE,
    DynamicsStage,
    GlobalReducer,
    NeighborListHook,
    NVTLangevin,
    ProgressBar,
    ThermoLogger,
    TrajectoryWriter,
    initialize_velocities,
)
from mlipdd.dynamics.random import hash_normal
from mlipdd.dynamics.reduce import temperature
from mlipdd.lattices import fcc_argon, lj_liquid
from mlipdd.models.lj import LennardJones

EPS, SIGMA, CUTOFF = 0.0104, 3.4, 7.5


@pytest.fixture
def model():
    return LennardJones(epsilon=EPS, sigma=SIGMA, cutoff=CUTOFF, shift=True)


def rattled_argon(temperature_K=60.0, seed=3) -> Batch:
    """108 atoms, displaced off the lattice so forces are not zero, with velocities."""
    batch = fcc_argon(3, temperature=temperature_K, seed=seed)
    rng = np.random.default_rng(seed)
    batch.positions = batch.positions + torch.as_tensor(rng.normal(0, 0.05, (108, 3)))
    return batch


def test_nve_matches_ase_velocity_verlet(model):
    batch = rattled_argon()
    atoms = batch.to_ase()[0]
    atoms.calc = AseLennardJones(epsilon=EPS, sigma=SIGMA, rc=CUTOFF, smooth=False)
    ase_md = VelocityVerlet(atoms, timestep=2.0 * units.fs)

    dyn = NVE(model, dt=2.0)
    dyn.run(batch, 200)
    ase_md.run(200)

    np.testing.assert_allclose(batch.positions.numpy(), atoms.get_positions(), rtol=0, atol=1e-8)
    np.testing.assert_allclose(batch.velocities.numpy(), atoms.get_velocities(), rtol=0, atol=1e-9)
    assert float(batch.energy[0]) == pytest.approx(atoms.get_potential_energy(), abs=1e-8)
    assert dyn.step_count == 200


def test_nve_conserves_energy(model):
    batch = rattled_argon(temperature_K=90.0)
    logger = ThermoLogger(io.StringIO(), frequency=5)
    NVE(model, dt=2.0, hooks=[logger]).run(batch, 300)
    etot = np.array([r["etot"] for r in logger.records])
    assert len(etot) == 61  # the starting state plus every 5th step
    assert np.ptp(etot) / 108 < 5e-6  # eV per atom over 0.6 ps (measured ~1e-6)
    assert np.std([r["ekin"] for r in logger.records]) > 1e-3  # and things did move


def test_consecutive_runs_continue_exactly(model):
    one, two = rattled_argon(), rattled_argon()
    NVE(model, dt=2.0).run(one, 20)
    dyn = NVE(model, dt=2.0)
    dyn.run(two, 8)
    dyn.run(two, 12)
    torch.testing.assert_close(one.positions, two.positions, rtol=0, atol=1e-12)


def test_neighbor_list_hook_is_added_and_rebuilds_rarely(model):
    dyn = NVE(model, dt=2.0)
    (hook,) = [h for h in dyn.hooks if isinstance(h, NeighborListHook)]
    assert hook.policy.skin == 0.5 and hook.policy.cutoff == CUTOFF
    dyn.run(rattled_argon(), 50)
    assert 1 <= hook.num_builds < 25


def test_langevin_reaches_target_temperature(model):
    batch = lj_liquid(3, temperature=20.0, seed=1)  # start cold: the thermostat must heat it
    logger = ThermoLogger(io.StringIO(), frequency=1)
    NVTLangevin(model, dt=4.0, temperature=94.0, friction=0.05, seed=7, hooks=[logger]).run(
        batch, 600
    )
    temps = np.array([r["temperature"] for r in logger.records[200:]])
    assert temps.mean() == pytest.approx(94.0, rel=0.08)


def test_langevin_noise_follows_atom_ids_not_rows(model):
    batch = rattled_argon()
    perm = torch.randperm(batch.num_atoms, generator=torch.Generator().manual_seed(0))
    permuted = batch.select_atoms(perm)  # atom_ids travel with their atoms
    for b in (batch, permuted):
        NVTLangevin(model, dt=2.0, temperature=94.0, friction=0.02, seed=11).run(b, 25)
    order = torch.argsort(permuted.atom_ids)
    torch.testing.assert_close(permuted.positions[order], batch.positions, rtol=0, atol=1e-10)
    torch.testing.assert_close(permuted.velocities[order], batch.velocities, rtol=0, atol=1e-11)


def test_hashed_noise_is_exact_on_any_split():
    ids = torch.arange(1000)
    full = hash_normal(5, 1, 42, ids)
    parts = [hash_normal(5, 1, 42, ids[s]) for s in (slice(0, 300), slice(300, 1000))]
    assert torch.equal(torch.cat(parts), full)
    assert not torch.equal(hash_normal(5, 1, 43, ids), full)
    assert abs(float(full.mean())) < 0.1 and float(full.std()) == pytest.approx(1.0, abs=0.05)


def test_langevin_conserved_energy_stays_flat(model):
    batch = rattled_argon(temperature_K=94.0)
    logger = ThermoLogger(io.StringIO(), frequency=10)
    NVTLangevin(model, dt=2.0, temperature=94.0, friction=0.02, seed=1, hooks=[logger]).run(
        batch, 200
    )
    econs = np.array([r["econs"] for r in logger.records])
    etot = np.array([r["etot"] for r in logger.records])
    assert np.ptp(econs) < 0.01 * np.ptp(etot)  # the bath ledger accounts for the exchanged heat


def test_zero_friction_langevin_is_velocity_verlet(model):
    a, b = rattled_argon(), rattled_argon()
    NVE(model, dt=2.0).run(a, 30)
    NVTLangevin(model, dt=2.0, temperature=94.0, friction=0.0).run(b, 30)
    torch.testing.assert_close(a.positions, b.positions, rtol=0, atol=1e-10)


def test_initialize_velocities():
    batch = fcc_argon(4)
    initialize_velocities(batch, 300.0, seed=2)
    momentum = (batch.atomic_masses[:, None] * batch.velocities).sum(0)
    assert float(momentum.abs().max()) < 1e-12
    assert float(temperature(batch, GlobalReducer())[0]) == pytest.approx(300.0, rel=0.1)
    again = initialize_velocities(fcc_argon(4), 300.0, seed=2)
    assert torch.equal(again.velocities, batch.velocities)


def test_missing_velocities_name_the_fix(model):
    with pytest.raises(InputError, match=r'add_node_property\("velocities"') as err:
        NVE(model, dt=1.0).run(fcc_argon(2), 1)
    assert "initialize_velocities" in str(err.value)


def test_nan_positions_are_refused(model):
    batch = rattled_argon()
    batch.positions[5, 1] = math.nan
    with pytest.raises(InputError, match="NaN"):
        NVTLangevin(model, dt=1.0, temperature=10.0).run(batch, 1)


@pytest.mark.parametrize(
    "bad", [{"dt": 0.0}, {"dt": float("nan")}, {"friction": -1.0}, {"temperature": -5.0}]
)
def test_bad_parameters_are_refused(model, bad):
    kwargs = {"dt": 1.0, "temperature": 10.0, "friction": 0.01} | bad
    with pytest.raises(InputError):
        NVTLangevin(model, **kwargs)


@pytest.mark.parametrize("suffix", [".extxyz", ".traj"])
def test_trajectory_file_has_every_frame(model, tmp_path, suffix):
    import ase.io

    path = tmp_path / f"md{suffix}"
    batch = rattled_argon()
    NVE(model, dt=2.0, hooks=[TrajectoryWriter(path, frequency=5)]).run(batch, 20)
    frames = ase.io.read(path, ":")
    assert len(frames) == 5  # step 0, 5, 10, 15, 20
    last = frames[-1]
    np.testing.assert_allclose(last.get_positions(), batch.positions.numpy(), atol=1e-6)
    np.testing.assert_allclose(last.get_velocities(), batch.velocities.numpy(), atol=1e-6)
    np.testing.assert_allclose(last.get_forces(), batch.forces.numpy(), atol=1e-6)
    assert last.get_potential_energy() == pytest.approx(float(batch.energy[0]), abs=1e-6)


class CountingHook:
    def __init__(self, stage, frequency=1):
        self.stage, self.frequency, self.seen = stage, frequency, []

    def __call__(self, ctx, stage):
        self.seen.append((stage, ctx.step))


def test_hook_stages_and_frequency(model):
    every = CountingHook(tuple(DynamicsStage), frequency=1)
    third = CountingHook(DynamicsStage.AFTER_STEP, frequency=3)
    NVE(model, dt=1.0, hooks=[every, third]).run(rattled_argon(), 6)
    stages = [s for s, _ in every.seen]
    assert stages[0] is DynamicsStage.BEFORE_COMPUTE  # the initial force evaluation
    assert stages[3] is DynamicsStage.BEFORE_STEP and stages[-1] is DynamicsStage.AFTER_RUN
    assert stages.count(DynamicsStage.AFTER_STEP) == 6
    assert [step for _, step in third.seen] == [3, 6]


def test_not_a_hook_is_refused(model):
    with pytest.raises(InputError, match="not a dynamics hook"):
        NVE(model, dt=1.0, hooks=[lambda ctx, stage: None])


def test_every_global_sum_goes_through_the_reducer(model):
    class Recording(GlobalReducer):
        def __init__(self):
            self.calls = 0

        def sum(self, local):
            self.calls += 1
            return local

    reducer = Recording()
    dyn = NVTLangevin(model, dt=1.0, temperature=50.0, reduce=reducer)
    dyn.run(rattled_argon(), 3)
    before = reducer.calls
    dyn.temperature()
    assert reducer.calls > before >= 3  # bath ledger once per step


def test_no_neighbor_hook_for_models_that_build_their_own(model):
    model.manages_neighbor_list = True
    assert not any(isinstance(h, NeighborListHook) for h in NVE(model, dt=1.0).hooks)
    assert not any(
        isinstance(h, NeighborListHook) for h in NVE(LennardJones(), dt=1.0, skin=None).hooks
    )


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_plain_lines_off_a_terminal_tqdm_on_one(model):
    plain, quiet, terminal = io.StringIO(), io.StringIO(), _Terminal()
    hooks = [ProgressBar(plain, interval=0.0), ProgressBar(quiet, interval=1e6), ProgressBar(terminal)]
    NVE(model, dt=1.0, hooks=hooks).run(rattled_argon(), 4)
    lines = plain.getvalue().splitlines()
    assert "\r" not in plain.getvalue() and lines[-1].startswith("step 4/4 (100%)")
    assert quiet.getvalue() == ""  # a run shorter than the interval prints nothing
    assert "4/4" in terminal.getvalue() and "step/s" in terminal.getvalue()  # tqdm's bar


def test_several_systems_in_one_batch(model, tmp_path):
    import ase.io

    cold, hot = rattled_argon(seed=1), rattled_argon(seed=2)
    both = Batch.from_data_list([cold.clone(), hot.clone()])
    NVE(model, dt=2.0).run(cold, 10)
    logger = ThermoLogger(io.StringIO(), frequency=10)
    writer = TrajectoryWriter(tmp_path / "two.extxyz", frequency=10)
    NVE(model, dt=2.0, hooks=[logger, writer]).run(both, 10)
    torch.testing.assert_close(both.positions[:108], cold.positions, rtol=0, atol=1e-10)
    assert [r["system"] for r in logger.records] == [0, 1, 0, 1]
    assert len(ase.io.read(tmp_path / "two.extxyz", ":")) == 4  # 2 systems x (step 0, 10)


def test_langevin_per_system_temperatures(model):
    both = Batch.from_data_list([lj_liquid(2, temperature=50.0), lj_liquid(2, temperature=150.0)])
    logger = ThermoLogger(io.StringIO(), frequency=2)
    NVTLangevin(model, dt=4.0, temperature=[50.0, 150.0], friction=0.05, hooks=[logger]).run(
        both, 500
    )
    for system, target in ((0, 50.0), (1, 150.0)):
        temps = [
            r["temperature"] for r in logger.records if r["system"] == system and r["step"] > 100
        ]
        assert np.mean(temps) == pytest.approx(target, rel=0.15)


def test_energy_turning_nan_stops_the_run(model):
    class BlowsUp(torch.nn.Module):
        cutoff = None

        def forward(self, batch, compute_stress=False):
            out = model(batch)
            if float(batch.positions[0, 0]) > 0.05:  # after the first drift step
                out["energy"] = out["energy"] * math.nan
            return out

    batch = rattled_argon()
    batch.positions[0, 0] = 0.0
    batch.velocities[0] = torch.tensor([0.05, 0.0, 0.0]) / units.fs  # 0.05 A/fs along x
    with pytest.raises(InputError, match="blew up.*lower the time step"):
        NVE(BlowsUp(), dt=2.0).run(batch, 5)
