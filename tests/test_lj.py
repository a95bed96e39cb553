"""Lennard-Jones against ASE, finite differences and a brute-force mixed-species sum."""

import itertools

import numpy as np
import pytest
import torch
from ase import Atoms
from ase.build import bulk
from ase.calculators.lj import LennardJones as AseLennardJones
from mlipdd.data import AtomicData, Batch, InputError
from mlipdd.models.lj import LennardJones
from mlipdd.neighbors import NeighborListPolicy, attach_neighbors

EPS, SIGMA, RC = 0.0104, 3.40, 8.0  # argon, eV and Angstrom


def argon_crystal(seed=0):
    """FCC argon (108 atoms), triclinically deformed and rattled."""
    atoms = bulk("Ar", "fcc", a=5.26, cubic=True).repeat((3, 3, 3))
    rng = np.random.default_rng(seed)
    deform = np.eye(3) + rng.uniform(-0.06, 0.06, (3, 3))
    atoms.set_cell(atoms.cell[:] @ deform, scale_atoms=True)
    atoms.rattle(0.1, seed=seed)
    return atoms


def argon_cluster(seed=1):
    rng = np.random.default_rng(seed)
    grid = np.array(list(itertools.product(range(3), repeat=3)), dtype=float) * 3.7
    return Atoms("Ar27", positions=grid + rng.normal(0, 0.15, grid.shape))


def ase_results(atoms):
    atoms = atoms.copy()
    atoms.calc = AseLennardJones(epsilon=EPS, sigma=SIGMA, rc=RC, smooth=False)
    out = {"energy": atoms.get_potential_energy(), "forces": atoms.get_forces()}
    out["energies"] = atoms.get_potential_energies()
    if atoms.cell.rank == 3:
        out["stress"] = atoms.get_stress(voigt=False)
    return out


def assert_close(actual, expected, rtol=1e-10):
    actual = np.asarray(actual.detach() if torch.is_tensor(actual) else actual, dtype=np.float64)
    expected = np.asarray(expected.detach() if torch.is_tensor(expected) else expected, np.float64)
    scale = np.abs(expected).max()
    assert np.abs(actual - expected).max() <= rtol * scale, np.abs(actual - expected).max() / scale


@pytest.fixture
def model():
    return LennardJones(epsilon=EPS, sigma=SIGMA, cutoff=RC)


@pytest.mark.parametrize("seed", [0, 1])
def test_periodic_triclinic_argon_equals_ase(model, seed):
    atoms = argon_crystal(seed)
    out = model(AtomicData.from_ase(atoms), compute_stress=True)
    ref = ase_results(atoms)
    assert_close(out["energy"][0], ref["energy"])
    assert_close(out["energies"], ref["energies"])
    assert_close(out["forces"], ref["forces"])
    assert_close(out["stress"][0], ref["stress"])


def test_cluster_equals_ase(model):
    atoms = argon_cluster()
    out = model(AtomicData.from_ase(atoms))
    ref = ase_results(atoms)
    assert_close(out["energy"][0], ref["energy"])
    assert_close(out["forces"], ref["forces"])


def test_shift_makes_energy_vanish_at_cutoff():
    shifted = LennardJones(epsilon=EPS, sigma=SIGMA, cutoff=RC)
    raw = LennardJones(epsilon=EPS, sigma=SIGMA, cutoff=RC, shift=False)

    def energy(model, r):
        dimer = AtomicData([[0.0, 0.0, 0.0], [r, 0.0, 0.0]], [18, 18], dtype=torch.float64)
        return float(model(dimer)["energy"].detach())

    assert abs(energy(shifted, RC - 1e-9)) < 1e-15  # |dphi/dr(rc)| * 1e-9 ~ 1e-12 * 1e-3
    assert energy(shifted, RC + 1e-9) == 0.0
    r = 4.0
    phi = lambda x: 4 * EPS * ((SIGMA / x) ** 12 - (SIGMA / x) ** 6)
    assert energy(raw, r) == pytest.approx(phi(r), rel=1e-14)
    assert energy(shifted, r) == pytest.approx(phi(r) - phi(RC), rel=1e-14)


def energy_of(model, positions, cell, pbc, numbers):
    data = AtomicData(positions, numbers, cell=cell, pbc=pbc, dtype=torch.float64)
    with torch.no_grad():
        return float(model(data)["energy"][0])


def test_forces_and_stress_equal_finite_differences(model):
    atoms = argon_crystal(2)
    data = AtomicData.from_ase(atoms)
    out = model(data, compute_stress=True)
    pos, cell = atoms.get_positions(), atoms.cell[:]
    z = atoms.numbers
    h = 1e-5
    for atom, axis in [(0, 0), (17, 1), (63, 2), (101, 0)]:
        plus, minus = pos.copy(), pos.copy()
        plus[atom, axis] += h
        minus[atom, axis] -= h
        fd = -(energy_of(model, plus, cell, True, z) - energy_of(model, minus, cell, True, z)) / (
            2 * h
        )
        assert float(out["forces"][atom, axis].detach()) == pytest.approx(fd, rel=1e-6, abs=1e-9)
    volume = abs(np.linalg.det(cell))
    for a, b in [(0, 0), (1, 1), (2, 2), (0, 1), (0, 2), (1, 2)]:
        sym = np.zeros((3, 3))
        sym[a, b] = sym[b, a] = 0.5 if a != b else 1.0
        energies = []
        for sign in (1, -1):
            deform = np.eye(3) + sign * h * sym
            energies.append(energy_of(model, pos @ deform, cell @ deform, True, z))
        fd = (energies[0] - energies[1]) / (2 * h) / volume
        assert float(out["stress"][0, a, b].detach()) == pytest.approx(fd, rel=1e-6, abs=1e-10)


def brute_force_two_species(positions, numbers, cell, eps, sigma, mixing, rc):
    """Energy and forces summed over every pair and every image (numpy, no neighbour list)."""
    n = len(positions)
    energy, forces = 0.0, np.zeros((n, 3))
    images = list(itertools.product(range(-3, 4), repeat=3))
    for i in range(n):
        for j in range(n):
            zi, zj = int(numbers[i]), int(numbers[j])
            e = np.sqrt(eps[zi] * eps[zj])
            if mixing == "lorentz_berthelot":
                s = 0.5 * (sigma[zi] + sigma[zj])
            else:
                s = np.sqrt(sigma[zi] * sigma[zj])
            for image in images:
                if i == j and image == (0, 0, 0):
                    continue
                d = positions[j] + np.asarray(image) @ cell - positions[i]
                r = np.linalg.norm(d)
                if r >= rc:
                    continue
                energy += 0.5 * (
                    4 * e * ((s / r) ** 12 - (s / r) ** 6 - (s / rc) ** 12 + (s / rc) ** 6)
                )
                dphi_dr = 4 * e * (-12 * s**12 / r**13 + 6 * s**6 / r**7)
                forces[i] += dphi_dr * d / r  # -dphi/dpos_i = +dphi/dr * d / r
    return energy, forces


@pytest.mark.parametrize("mixing", ["lorentz_berthelot", "geometric"])
def test_two_species_mixing_equals_brute_force(mixing):
    eps, sigma = {18: 0.0104, 36: 0.0140}, {18: 3.40, 36: 3.65}
    rng = np.random.default_rng(3)
    cell = np.array([[7.5, 0.0, 0.0], [0.9, 7.2, 0.0], [0.3, -0.4, 7.8]])
    grid = np.array(list(itertools.product(range(2), repeat=3)), dtype=float) * 0.5
    positions = (grid + rng.normal(0, 0.02, grid.shape)) @ cell
    numbers = np.array([18, 36, 18, 36, 36, 18, 18, 36])
    rc = 7.0  # larger than half the cell: atoms see their own images
    model = LennardJones(epsilon=eps, sigma=sigma, cutoff=rc, mixing=mixing)
    out = model(AtomicData(positions, numbers, cell=cell, pbc=True))
    energy, forces = brute_force_two_species(positions, numbers, cell, eps, sigma, mixing, rc)
    assert_close(out["energy"][0], energy)
    assert_close(out["forces"], forces)


def test_batch_of_two_systems_equals_separate_runs(model):
    crystal, cluster = AtomicData.from_ase(argon_crystal(4)), AtomicData.from_ase(argon_cluster(5))
    batch = Batch.from_data_list([crystal, cluster])
    out = model(batch, compute_stress=True)
    one, two = model(crystal, compute_stress=True), model(cluster)
    assert_close(out["energy"], torch.cat([one["energy"], two["energy"]]), rtol=1e-13)
    assert_close(out["forces"], torch.cat([one["forces"], two["forces"]]), rtol=1e-13)
    assert_close(out["stress"][0], one["stress"][0], rtol=1e-13)


def test_skin_list_gives_the_same_answer(model):
    atoms = argon_crystal(6)
    plain = model(AtomicData.from_ase(atoms), compute_stress=True)
    data = AtomicData.from_ase(atoms)
    NeighborListPolicy(cutoff=RC, skin=1.0).build(data)
    assert data.neighbors.cutoff == RC + 1.0
    skinned = model(data, compute_stress=True)
    for key in ("energy", "forces", "stress"):
        assert_close(skinned[key], plain[key], rtol=1e-13)


def test_half_list_gives_the_same_answer(model):
    atoms = argon_crystal(7)
    full = model(AtomicData.from_ase(atoms), compute_stress=True)
    data = AtomicData.from_ase(atoms)
    attach_neighbors(data, RC, full_list=False)
    half = model(data, compute_stress=True)
    for key in ("energy", "energies", "forces", "stress"):
        assert_close(half[key], full[key], rtol=1e-12)


def test_float32_runs_close_to_float64(model):
    data = AtomicData.from_ase(argon_crystal(8))
    double = model(data)
    single = model(data.to(dtype=torch.float32))
    assert single["forces"].dtype == torch.float32
    assert_close(single["forces"].double(), double["forces"], rtol=1e-4)


def test_bad_input_errors_name_the_fix():
    with pytest.raises(InputError, match="mixing rule"):
        LennardJones(mixing="arithmetic")
    with pytest.raises(InputError, match="sigma must be positive"):
        LennardJones(sigma=-1.0)
    model = LennardJones(epsilon={18: 0.01}, sigma={18: 3.4}, cutoff=6.0)
    with pytest.raises(InputError, match=r"atomic number\(s\) \[36\]"):
        model(AtomicData([[0.0, 0, 0], [3.5, 0, 0]], [18, 36]))
    data = AtomicData([[0.0, 0, 0], [3.5, 0, 0]], [18, 18])
    attach_neighbors(data, 4.0)
    with pytest.raises(InputError, match="rebuild it with at least the model cutoff"):
        model(data)


def test_config_and_spec(model):
    assert model.cutoff == RC
    assert model.model_config.neighbor_config.cutoff == RC
    assert model.distribution_spec() is None
    assert LennardJones(sigma=2.0).cutoff == 6.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_equals_ase(model):
    atoms = argon_crystal(9)
    out = model.to("cuda")(AtomicData.from_ase(atoms, device="cuda"), compute_stress=True)
    ref = ase_results(atoms)
    assert out["forces"].device.type == "cuda"
    assert_close(out["energy"][0].cpu(), ref["energy"])
    assert_close(out["forces"].cpu(), ref["forces"])
    assert_close(out["stress"][0].cpu(), ref["stress"])
