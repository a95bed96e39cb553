"""NoseHoover, NPT, NPH, FIRE and FIRE2 in one process: physics, ASE agreement, DD-readiness.

# NOTE [two ranks in one process]
`run_split` emulates domain decomposition without torch.distributed: two threads, each
running its own copy of the integrator on half of the atoms (interleaved by atom id).
Their reducer adds the two halves' partial sums (always in rank order, so both threads
get bit-identical answers) and their model gathers both halves, evaluates the whole
system and hands each thread its own rows plus the replicated energy and stress, as
the distributed model does. If an integrator summed anything over atoms without going
through ``reduce``, the split run would leave the single-process trajectory.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from ase import units
from ase.calculators.lj import LennardJones as AseLennardJones
from ase.md.nose_hoover_chain import IsotropicMTKNPT, NoseHooverChainNVT
from ase.optimize import FIRE as AseFIRE
from ase.optimize import FIRE2 as AseFIRE2
from mlipdd.data import Batch, InputError
from mlipdd.dynamics import FIRE, FIRE2, NPH, NPT, DynamicsStage, GlobalReducer, NoseHoover
from mlipdd.lattices import fcc_argon
from mlipdd.models.lj import LennardJones

EPS, SIGMA, CUTOFF = 0.0104, 3.4, 7.5
N_ATOMS = 108


@pytest.fixture(scope="module")
def model():
    return LennardJones(epsilon=EPS, sigma=SIGMA, cutoff=CUTOFF, shift=True)


def ase_lj():
    return AseLennardJones(epsilon=EPS, sigma=SIGMA, rc=CUTOFF, smooth=False)


def argon(temperature_K=40.0, seed=1, rattle=0.0) -> Batch:
    """108 atoms of FCC argon, optionally rattled off the lattice, with velocities."""
    batch = fcc_argon(3, temperature=temperature_K, seed=seed)
    if rattle:
        rng = np.random.default_rng(seed)
        batch.positions = batch.positions + torch.as_tensor(rng.normal(0, rattle, (N_ATOMS, 3)))
    return batch


class Recorder:
    """Per-step samples of any integrator observables (first system)."""

    stage = DynamicsStage.AFTER_STEP

    def __init__(self, frequency=1, **observables):
        self.frequency = frequency
        self.observables = observables
        self.samples = {name: [] for name in observables}

    def __call__(self, ctx, stage):
        for name, get in self.observables.items():
            self.samples[name].append(float(get(ctx.dynamics)[0]))

    def __getitem__(self, name):
        return np.array(self.samples[name])


def econs_and_temperature(frequency=5):
    return Recorder(
        frequency, econs=lambda d: d.conserved_energy(), temperature=lambda d: d.temperature()
    )


# ---- Nosé-Hoover -----------------------------------------------------------------------
def test_nose_hoover_matches_ase_chain(model):
    """Same MTK scheme as ASE's NoseHooverChainNVT (its fourth-order Suzuki-Yoshida weights)."""
    batch = argon(rattle=0.05)
    atoms = batch.to_ase()[0]
    atoms.calc = ase_lj()
    ase_md = NoseHooverChainNVT(
        atoms, timestep=5.0 * units.fs, temperature_K=80.0, tdamp=100.0 * units.fs, tchain=3
    )
    dyn = NoseHoover(model, dt=5.0, temperature=80.0, tdamp=100.0, suzuki_yoshida=3)
    dyn.run(batch, 100)
    ase_md.run(100)
    np.testing.assert_allclose(batch.positions.numpy(), atoms.get_positions(), atol=1e-8)
    np.testing.assert_allclose(batch.velocities.numpy(), atoms.get_velocities(), atol=1e-9)
    econs = float(dyn.conserved_energy()[0])
    assert econs == pytest.approx(ase_md.get_conserved_energy(), abs=1e-8)


def test_nose_hoover_heats_to_target_and_conserves_extended_energy(model):
    batch = argon(temperature_K=40.0)
    record = econs_and_temperature()
    record.observables["etot"] = lambda d: d.potential_energy() + d.kinetic_energy()
    record.samples["etot"] = []
    NoseHoover(model, dt=5.0, temperature=80.0, tdamp=100.0, hooks=[record]).run(batch, 1000)
    assert record["temperature"][-100:].mean() == pytest.approx(80.0, rel=0.1)
    # the bath put ~1 eV into the system; the extended energy moved by ~1e-3 of that,
    # the size of velocity Verlet's own error at 5 fs (NVE here: ~5e-4 eV)
    heat = np.ptp(record["etot"])
    assert heat > 0.5
    assert np.ptp(record["econs"]) < 2e-3 * heat
    assert np.ptp(record["econs"]) / N_ATOMS < 2e-5  # eV per atom (measured 1.2e-5)


# ---- NPT / NPH -------------------------------------------------------------------------
def test_npt_matches_ase_isotropic_mtk(model):
    """Same scheme as ASE's IsotropicMTKNPT once its barostat-chain mass (9 kT tau^2 on the
    first link, ours kT tau^2: a free choice) is copied over."""
    batch = argon(rattle=0.05)
    atoms = batch.to_ase()[0]
    atoms.calc = ase_lj()
    ase_md = IsotropicMTKNPT(
        atoms,
        timestep=5.0 * units.fs,
        temperature_K=60.0,
        pressure_au=500.0 * units.bar,
        tdamp=100.0 * units.fs,
        pdamp=500.0 * units.fs,
    )
    dyn = NPT(
        model,
        dt=5.0,
        temperature=60.0,
        pressure=500.0,
        tdamp=100.0,
        pdamp=500.0,
        suzuki_yoshida=3,
    )
    dyn.run(batch, 0)  # builds the state
    dyn.barostat_chain.masses[:, 0] *= 9.0
    dyn.run(batch, 60)
    ase_md.run(60)
    np.testing.assert_allclose(batch.cell[0].numpy(), atoms.cell.array, rtol=0, atol=1e-9)
    np.testing.assert_allclose(batch.positions.numpy(), atoms.get_positions(), rtol=0, atol=1e-8)
    np.testing.assert_allclose(batch.velocities.numpy(), atoms.get_velocities(), atol=1e-9)
    econs = float(dyn.conserved_energy()[0])
    assert econs == pytest.approx(ase_md.get_conserved_energy(), abs=1e-8)


def test_npt_reaches_target_pressure_and_conserves(model):
    batch = argon(temperature_K=40.0)
    start_volume = float(torch.linalg.det(batch.cell)[0])
    record = Recorder(
        5,
        pressure=lambda d: d.pressure(),
        volume=lambda d: d.volume(),
        econs=lambda d: d.conserved_energy(),
        temperature=lambda d: d.temperature(),
    )
    dyn = NPT(
        model, dt=5.0, temperature=40.0, pressure=500.0, tdamp=100.0, pdamp=500.0, hooks=[record]
    )
    dyn.run(batch, 600)
    # the lattice expands by ~5% to hold 500 bar at 40 K; single samples scatter by ~250 bar
    assert record["volume"][-60:].mean() > 1.03 * start_volume
    assert record["pressure"][-60:].mean() == pytest.approx(500.0, abs=100.0)
    assert record["temperature"][-60:].mean() == pytest.approx(40.0, rel=0.15)
    assert np.ptp(record["econs"]) / N_ATOMS < 1e-5  # eV per atom (measured ~4e-6)
    assert float(batch.cell[0, 0, 1]) == 0.0  # isotropic: the shape is kept


def test_nph_conserves_enthalpy(model):
    batch = argon(temperature_K=40.0)
    record = Recorder(5, econs=lambda d: d.conserved_energy(), volume=lambda d: d.volume())
    NPH(model, dt=5.0, pressure=500.0, pdamp=500.0, hooks=[record]).run(batch, 300)
    assert np.ptp(record["volume"]) > 50.0  # A^3: the box breathes
    assert np.ptp(record["econs"]) / N_ATOMS < 1e-5


def test_nph_from_rest_needs_a_temperature(model):
    batch = argon(temperature_K=0.0)
    with pytest.raises(InputError, match="temperature="):
        NPH(model, dt=5.0, pressure=0.0, pdamp=500.0).run(batch, 1)
    NPH(model, dt=5.0, pressure=0.0, pdamp=500.0, temperature=40.0).run(batch, 2)


def test_barostats_refuse_what_they_cannot_do(model):
    class NoStress(torch.nn.Module):
        cutoff = CUTOFF

        def forward(self, batch, compute_stress=False):
            out = model(batch)
            return {"energy": out["energy"], "forces": out["forces"]}

    with pytest.raises(InputError, match="needs the stress"):
        NPT(NoStress(), 5.0, 40.0, 0.0, 100.0, 500.0).run(argon(), 1)
    slab = argon()
    slab.pbc = torch.tensor([[True, True, False]])
    with pytest.raises(InputError, match="periodic cell along all three axes"):
        NPH(model, 5.0, pressure=0.0, pdamp=500.0).run(slab, 1)
    with pytest.raises(InputError, match="pdamp"):
        NPT(model, 5.0, 40.0, 0.0, 100.0, pdamp=-1.0)
    with pytest.raises(InputError, match="temperature"):
        NoseHoover(model, 5.0, temperature=0.0, tdamp=100.0)


# ---- FIRE ------------------------------------------------------------------------------
def test_fire_reproduces_ase_step_by_step_with_unit_masses(model):
    """ASE's FIRE uses unit masses, ASE time units and a limit on the whole step's norm."""
    batch = argon(rattle=0.15)
    batch.atomic_masses = torch.ones(N_ATOMS, dtype=torch.float64)
    atoms = batch.to_ase()[0]
    atoms.calc = ase_lj()
    AseFIRE(atoms, logfile=None).run(fmax=1e-4, steps=40)
    dyn = FIRE(model, dt=0.1 / units.fs, dt_max=1.0 / units.fs, fmax=1e-4, max_step_rule="norm")
    dyn.run(batch, 40)
    np.testing.assert_allclose(batch.positions.numpy(), atoms.get_positions(), rtol=0, atol=1e-10)


@pytest.mark.parametrize(("ours", "theirs"), [(FIRE, AseFIRE), (FIRE2, AseFIRE2)])
def test_fire_relaxes_to_the_same_energy_as_ase(model, ours, theirs):
    """Real masses, fs and a per-atom step limit here; unit masses in ASE: different paths,
    same minimum (the perfect lattice, -7.80234 eV) up to the residual at fmax."""
    batch = argon(rattle=0.15)
    atoms = batch.to_ase()[0]
    atoms.calc = ase_lj()
    theirs(atoms, logfile=None).run(fmax=1e-3, steps=1000)
    dyn = ours(model, dt=2.0, fmax=1e-3)
    dyn.run(batch, 1000)
    assert dyn.converged() and dyn.step_count < 300
    assert float(dyn.max_force[0]) < 1e-3
    forces = batch.forces.norm(dim=-1).max()
    assert float(forces) == pytest.approx(float(dyn.max_force[0]))
    assert float(batch.energy[0]) == pytest.approx(atoms.get_potential_energy(), abs=2e-4)


def test_fire_stops_converged_systems_and_runs_the_others(model):
    relaxed, rattled = fcc_argon(3), argon(rattle=0.1, temperature_K=None)
    batch = Batch.from_data_list([relaxed, rattled])
    dyn = FIRE2(model, dt=2.0, fmax=1e-3)
    dyn.run(batch, 500)
    assert dyn.converged()
    torch.testing.assert_close(batch.positions[:N_ATOMS], relaxed.positions, rtol=0, atol=0)
    assert int(dyn.state_dict()["iterations"][0]) == 0


def test_fire_parameters_are_checked(model):
    with pytest.raises(InputError, match="fmax"):
        FIRE(model, fmax=0.0)
    with pytest.raises(InputError, match="max_step_rule"):
        FIRE2(model, max_step_rule="box")
    with pytest.raises(InputError, match="dt_max"):
        FIRE(model, dt=2.0, dt_max=1.0)


# ---- exact under any atom order and any split ---------------------------------------
ENSEMBLES = {
    "nose_hoover": lambda m, **kw: NoseHoover(m, 5.0, 80.0, 100.0, **kw),
    "npt": lambda m, **kw: NPT(m, 5.0, 60.0, 500.0, 100.0, 500.0, **kw),
    "nph": lambda m, **kw: NPH(m, 5.0, 500.0, 500.0, **kw),
    "fire": lambda m, **kw: FIRE(m, 2.0, fmax=1e-3, **kw),
    "fire2": lambda m, **kw: FIRE2(m, 2.0, fmax=1e-3, **kw),
}
STEPS = 40


def by_id(batch: Batch, name: str) -> torch.Tensor:
    return getattr(batch, name)[torch.argsort(batch.atom_ids)]


@pytest.mark.parametrize("name", sorted(ENSEMBLES))
def test_same_run_twice_is_identical(model, name):
    one, two = argon(rattle=0.05), argon(rattle=0.05)
    ENSEMBLES[name](model).run(one, STEPS)
    ENSEMBLES[name](model).run(two, STEPS)
    assert torch.equal(one.positions, two.positions) and torch.equal(one.cell, two.cell)


@pytest.mark.parametrize("name", sorted(ENSEMBLES))
def test_permuted_atoms_follow_the_same_trajectory(model, name):
    reference = argon(rattle=0.05)
    perm = torch.randperm(N_ATOMS, generator=torch.Generator().manual_seed(5))
    shuffled = reference.select_atoms(perm)  # atom ids travel with their rows
    ENSEMBLES[name](model).run(reference, STEPS)
    ENSEMBLES[name](model).run(shuffled, STEPS)
    for field in ("positions", "velocities"):
        torch.testing.assert_close(
            by_id(shuffled, field), by_id(reference, field), rtol=0, atol=1e-9
        )
    torch.testing.assert_close(shuffled.cell, reference.cell, rtol=0, atol=1e-10)


class ThreadGroup:
    """All-gather between threads (see NOTE [two ranks in one process])."""

    def __init__(self, size: int):
        self.size = size
        self.slots = [None] * size
        self.barrier = threading.Barrier(size, timeout=30)

    def allgather(self, rank: int, value):
        self.slots[rank] = value
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()  # nobody overwrites a slot before everyone has read it
        return out


class ThreadReducer(GlobalReducer):
    is_distributed = True

    def __init__(self, group: ThreadGroup, rank: int):
        self.group, self.rank = group, rank
        self.calls = {"sum": 0, "max": 0, "any": 0}

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    def sum(self, local):
        self.calls["sum"] += 1
        parts = self.group.allgather(self.rank, local)
        total = parts[0]
        for part in parts[1:]:
            total = total + part
        return total

    def max(self, local):
        self.calls["max"] += 1
        return torch.stack(self.group.allgather(self.rank, local)).amax(0)

    def any(self, flag):
        self.calls["any"] += 1
        return any(self.group.allgather(self.rank, bool(flag)))


class GatheringModel(torch.nn.Module):
    """Evaluates the whole system from both halves; returns this half's forces."""

    manages_neighbor_list = True

    def __init__(self, model, whole: Batch, group: ThreadGroup, rank: int):
        super().__init__()
        self.model, self.whole, self.group, self.rank = model, whole, group, rank

    def forward(self, batch: Batch, compute_stress: bool = False):
        parts = self.group.allgather(self.rank, (batch.atom_ids, batch.positions, batch.cell))
        assert all(torch.equal(cell, batch.cell) for _, _, cell in parts), "cells diverged"
        ids = torch.cat([p[0] for p in parts])
        positions = torch.cat([p[1] for p in parts])
        whole = self.whole.clone()
        whole.positions = positions[torch.argsort(ids)]
        whole.cell = batch.cell
        out = self.model(whole, compute_stress=compute_stress)
        mine = {"energy": out["energy"], "forces": out["forces"][batch.atom_ids]}
        if "stress" in out:
            mine["stress"] = out["stress"]
        return mine


def run_split(make, model, whole: Batch, n_steps: int):
    """Run on two interleaved halves in two threads; returns the halves, the integrators
    and each one's conserved energy (a collective too, so it is taken in the threads)."""
    group = ThreadGroup(2)
    halves = [whole.select_atoms(whole.atom_ids % 2 == rank) for rank in range(2)]
    dyns = [
        make(
            GatheringModel(model, whole, group, rank), reduce=ThreadReducer(group, rank), skin=None
        )
        for rank in range(2)
    ]
    errors, econs = [], [None, None]

    def work(rank):
        try:
            dyns[rank].run(halves[rank], n_steps)
            econs[rank] = dyns[rank].conserved_energy()
        except Exception as error:  # noqa: BLE001  (handed to the main thread)
            errors.append(error)
            group.barrier.abort()

    threads = [threading.Thread(target=work, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return halves, dyns, econs


@pytest.mark.parametrize("name", sorted(ENSEMBLES))
def test_two_halves_with_a_summing_reducer_match_one_process(model, name):
    whole = argon(rattle=0.05)
    reference = whole.clone()
    single = ENSEMBLES[name](model, skin=None)
    single.run(reference, STEPS)
    halves, dyns, econs = run_split(ENSEMBLES[name], model, whole, STEPS)
    for field in ("positions", "velocities"):
        joined = torch.cat([getattr(h, field) for h in halves])
        ids = torch.cat([h.atom_ids for h in halves])
        torch.testing.assert_close(
            joined[torch.argsort(ids)], getattr(reference, field), rtol=0, atol=1e-10
        )
    for half, dyn, energy in zip(halves, dyns, econs, strict=True):
        torch.testing.assert_close(half.cell, reference.cell, rtol=0, atol=1e-12)
        torch.testing.assert_close(energy, single.conserved_energy(), rtol=0, atol=1e-10)
        assert dyn.step_count == single.step_count
        assert dyn.reduce.calls["sum"] > 0


def test_fire_converges_in_the_same_step_count_on_two_halves(model):
    whole = argon(rattle=0.1)
    reference = whole.clone()
    single = FIRE2(model, 2.0, fmax=1e-3, skin=None)
    single.run(reference, 500)
    assert single.converged()
    _, dyns, _ = run_split(lambda m, **kw: FIRE2(m, 2.0, fmax=1e-3, **kw), model, whole, 500)
    assert [d.step_count for d in dyns] == [single.step_count] * 2


def test_reductions_per_step(model):
    """One kinetic-energy sum per NHC half step; FIRE: one sum of stacked products per step,
    one max for the step limit and one for the convergence test."""
    counts = {}
    for name in ("nose_hoover", "npt", "fire"):
        reducer = CountingReducer()
        dyn = ENSEMBLES[name](model, reduce=reducer)
        dyn.run(argon(rattle=0.05), 0)
        before = dict(reducer.calls)
        dyn.run(dyn.batch, 10)
        counts[name] = {k: (reducer.calls[k] - before[k]) / 10 for k in before}
    assert counts["nose_hoover"]["sum"] == 2
    assert counts["npt"]["sum"] == 2
    assert counts["fire"] == {"sum": 1, "max": 2, "any": 2}  # + the neighbour-list vote


class CountingReducer(GlobalReducer):
    def __init__(self):
        self.calls = {"sum": 0, "max": 0, "any": 0}

    def sum(self, local):
        self.calls["sum"] += 1
        return local

    def max(self, local):
        self.calls["max"] += 1
        return local

    def any(self, flag):
        self.calls["any"] += 1
        return bool(flag)


# ---- checkpoints -----------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(ENSEMBLES))
def test_state_dict_restart_continues_exactly(model, name):
    straight, restarted = argon(rattle=0.05), argon(rattle=0.05)
    ENSEMBLES[name](model).run(straight, STEPS + 10)
    first = ENSEMBLES[name](model)
    first.run(restarted, STEPS // 2)
    state, saved = first.state_dict(), restarted.clone()
    second = ENSEMBLES[name](model)
    second.load_state_dict(state)  # before its first run: applied when the run starts
    second.run(saved, STEPS // 2 + 10)
    assert second.step_count == STEPS + 10
    torch.testing.assert_close(saved.positions, straight.positions, rtol=0, atol=1e-12)
    torch.testing.assert_close(saved.cell, straight.cell, rtol=0, atol=1e-12)


def test_nose_hoover_per_system_batch_equals_separate_runs(model):
    cold, warm = argon(temperature_K=20.0, seed=1), argon(temperature_K=60.0, seed=2)
    batch = Batch.from_data_list([cold.clone(), warm.clone()])
    NoseHoover(model, 5.0, temperature=[30.0, 90.0], tdamp=100.0).run(batch, 30)
    for index, (alone, target) in enumerate([(cold, 30.0), (warm, 90.0)]):
        NoseHoover(model, 5.0, temperature=target, tdamp=100.0).run(alone, 30)
        rows = slice(index * N_ATOMS, (index + 1) * N_ATOMS)
        torch.testing.assert_close(batch.positions[rows], alone.positions, rtol=0, atol=1e-10)
