"""MACEWrapper reproduces mace's own ASE calculator, and its forces are energy gradients."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from mace_structures import STRUCTURES, mace_reference

from mlipdd.data import Batch
from mlipdd.neighbors import build_neighbor_list
from mlipdd_mace.testing import random_mace
from mlipdd_mace.wrapper import MACEWrapper

TOL = 1e-10


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy()


def assert_matches_mace(out: dict, ref: dict, cell, system: int = 0, atoms=slice(None), tol=TOL):
    scale = max(1.0, abs(ref["energy"]))
    assert abs(float(out["energy"][system].detach()) - ref["energy"]) < tol * scale
    np.testing.assert_allclose(_np(out["forces"])[atoms], ref["forces"], rtol=0, atol=tol)
    np.testing.assert_allclose(_np(out["energies"])[atoms], ref["energies"], rtol=0, atol=tol)
    if "virial" in ref:
        volume = abs(np.linalg.det(_np(cell)[system]))
        virial = _np(out["stress"])[system] * volume
        np.testing.assert_allclose(
            virial, ref["virial"], rtol=0, atol=tol * max(1.0, np.abs(ref["virial"]).max())
        )


def test_energy_forces_stress_equal_mace_calculator(mace_model, structure):
    wrapper = MACEWrapper(mace_model)
    batch = Batch.from_ase(structure)
    out = wrapper(batch, compute_stress=True)
    assert out["energy"].shape == (1,)
    assert out["stress"].shape == (1, 3, 3)
    assert out["forces"].shape == (len(structure), 3)
    assert_matches_mace(out, mace_reference(mace_model, structure), batch.cell)


def test_batch_of_two_systems_equals_each_alone(mace_model):
    first, second = STRUCTURES["triclinic"](), STRUCTURES["slab"]()
    batch = Batch.from_ase([first, second])
    out = MACEWrapper(mace_model)(batch, compute_stress=True)
    n = len(first)
    assert out["energy"].shape == (2,)
    assert_matches_mace(
        out, mace_reference(mace_model, first), batch.cell, system=0, atoms=slice(0, n)
    )
    assert_matches_mace(
        out, mace_reference(mace_model, second), batch.cell, system=1, atoms=slice(n, None)
    )


def test_neighbor_list_with_skin_gives_same_answer(mace_model):
    """Edges beyond r_max (a skin) are dropped, so a longer list changes nothing."""
    atoms = STRUCTURES["triclinic"]()
    wrapper = MACEWrapper(mace_model)
    plain = wrapper(Batch.from_ase(atoms), compute_stress=True)
    batch = Batch.from_ase(atoms)
    batch.neighbors = build_neighbor_list(batch, wrapper.cutoff + 1.5)
    skinned = wrapper(batch, compute_stress=True)
    for key in ("energy", "forces", "stress", "energies"):
        torch.testing.assert_close(skinned[key], plain[key], rtol=0, atol=TOL)


def test_forces_equal_finite_differences_of_energy(mace_model):
    atoms = STRUCTURES["tiny_cell"]()
    wrapper = MACEWrapper(mace_model)
    batch = Batch.from_ase(atoms)
    forces = _np(wrapper(batch)["forces"])
    h = 1e-5
    for atom in range(len(atoms)):
        for axis in range(3):
            energies = []
            for sign in (1, -1):
                moved = atoms.copy()
                moved.positions[atom, axis] += sign * h
                energies.append(float(wrapper(Batch.from_ase(moved))["energy"][0].detach()))
            numeric = -(energies[0] - energies[1]) / (2 * h)
            assert abs(numeric - forces[atom, axis]) < 1e-6


def test_stress_equals_finite_differences_of_strain(mace_model):
    """Stress = (1/V) dE/d(strain), the sign and convention of ASE and mlipdd."""
    atoms = STRUCTURES["triclinic"]()
    wrapper = MACEWrapper(mace_model)
    stress = _np(wrapper(Batch.from_ase(atoms), compute_stress=True)["stress"])[0]
    h = 1e-5
    for i, j in ((0, 0), (1, 2), (2, 0)):
        energies = []
        for sign in (1, -1):
            strain = np.eye(3)
            strain[i, j] += sign * h / 2
            strain[j, i] += sign * h / 2
            moved = atoms.copy()
            moved.set_cell(atoms.cell.array @ strain, scale_atoms=True)
            energies.append(float(wrapper(Batch.from_ase(moved))["energy"][0].detach()))
        numeric = (energies[0] - energies[1]) / (2 * h) / atoms.cell.volume
        assert abs(numeric - stress[i, j]) < 1e-7


def test_float32_model_runs_and_matches_mace():
    model = random_mace(dtype=torch.float32, seed=1)
    wrapper = MACEWrapper(model)
    assert wrapper.model_config.supported_dtypes == (torch.float32,)
    atoms = STRUCTURES["triclinic"]()
    batch = Batch.from_ase(atoms)
    out = wrapper(batch, compute_stress=True)  # float64 batch is converted
    assert out["forces"].dtype == torch.float32
    assert out["energies"].dtype == torch.float32
    assert_matches_mace(out, mace_reference(model, atoms), batch.cell, tol=1e-4)


def test_plain_mace_class_matches_mace():
    """The `MACE` base class (no scale/shift block) works the same way."""
    model = random_mace(scale_shift=False, seed=3)
    assert type(model).__name__ == "MACE"
    atoms = STRUCTURES["triclinic"]()
    batch = Batch.from_ase(atoms)
    out = MACEWrapper(model)(batch, compute_stress=True)
    assert_matches_mace(out, mace_reference(model, atoms), batch.cell)


def test_positions_passed_through_untouched(mace_model):
    """The wrapper hands mace the batch's own tensor and leaves its grad flag as it was."""
    wrapper = MACEWrapper(mace_model)
    batch = Batch.from_ase(STRUCTURES["slab"]())
    assert wrapper.adapt_input(batch)["positions"] is batch.positions
    with torch.no_grad():  # forces are still computed
        out = wrapper(batch)
    assert out["forces"].abs().sum() > 0
    assert not batch.positions.requires_grad
    batch.positions.add_(0.0)  # an integrator's in-place update still works


def test_model_config(mace_model):
    cfg = MACEWrapper(mace_model).model_config
    assert cfg.cutoff == pytest.approx(4.0)
    assert cfg.extra["atomic_numbers"] == (1, 6, 8)
    assert {"energy", "forces", "stress"} <= cfg.outputs
    assert cfg.extra["cuequivariance"] is False
