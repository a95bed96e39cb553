"""UMAWrapper equals calling the fairchem model the way fairchem's own inference does.

Reference: ``AtomicData.from_ase`` for each structure, ``atomicdata_list_to_batch``,
then the Hydra model's forward (what fairchem's predict unit runs for a model without
tasks). Tolerance: fairchem converts and wraps positions in float64 before casting to
float32, the wrapper wraps in float32, so the two differ at float32 rounding, far
below the permutation noise measured in `test_conformance` (~1e-6 on forces).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ase import Atoms
from ase.build import bulk
from mlipdd.data import AtomicData as MAtomicData
from mlipdd.data import Batch
from mlipdd_uma.testing import random_uma
from mlipdd_uma.wrapper import UMAWrapper

TOLERANCE = {"energy": 1e-6, "forces": 1e-5, "stress": 1e-5}


def triclinic_atoms() -> Atoms:
    atoms = bulk("C", "diamond", a=3.7, cubic=True).repeat((2, 1, 1))
    rng = np.random.default_rng(3)
    atoms.numbers[rng.choice(len(atoms), 6, replace=False)] = [1, 1, 1, 8, 8, 8]
    atoms.set_cell(atoms.cell + np.array([[0, 0.4, 0.3], [0.5, 0, 0.2], [0.3, 0.6, 0]]), scale_atoms=True)
    atoms.rattle(0.08, seed=4)
    return atoms


def molecule_atoms() -> Atoms:
    atoms = Atoms("CH3OH", positions=[[0, 0, 0], [1.0, 0.1, 0], [-0.4, 0.9, 0.1], [-0.3, -0.5, 0.8],
                                      [0.0, -0.4, -1.3], [0.8, -0.5, -1.7]])
    atoms.rattle(0.02, seed=2)
    return atoms


@pytest.fixture(scope="module")
def model():
    return random_uma(seed=1)


def fairchem_reference(model, atoms_list, task):
    from fairchem.core.datasets.atomic_data import AtomicData, atomicdata_list_to_batch

    data = atomicdata_list_to_batch([AtomicData.from_ase(a, task_name=task, r_data_keys=["charge", "spin"]) for a in atoms_list])
    out = model(data)["energyandforcehead"]
    return {
        "energy": out["energy"]["energy"].detach().float(),
        "forces": out["forces"]["forces"].detach(),
        "stress": out["stress"]["stress"].detach().float().reshape(-1, 3, 3),
    }


def rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


@pytest.mark.parametrize("structures", [("triclinic",), ("triclinic", "triclinic_shifted")])
def test_periodic_energy_forces_stress_match_fairchem(model, structures):
    atoms_list = []
    for name in structures:
        atoms = triclinic_atoms()
        if name.endswith("shifted"):  # a second, different system; some atoms outside the cell
            atoms.positions += [0.9, -0.7, 0.4]
            atoms.rattle(0.05, seed=9)
        atoms_list.append(atoms)
    wrapper = UMAWrapper(model, task="omat")
    batch = Batch.from_data_list([MAtomicData.from_ase(a, dtype=torch.float32) for a in atoms_list])
    out = wrapper(batch, compute_stress=True)
    ref = fairchem_reference(model, atoms_list, "omat")
    for key, limit in TOLERANCE.items():
        assert rel(out[key].detach(), ref[key]) < limit, (key, rel(out[key].detach(), ref[key]))


def test_molecule_with_charge_and_spin_matches_fairchem(model):
    atoms = molecule_atoms()
    atoms.info.update(charge=1, spin=2)
    wrapper = UMAWrapper(model, task="omol")
    batch = Batch.from_data_list([MAtomicData.from_ase(atoms, dtype=torch.float32)])
    batch.add_system_property("charge", torch.tensor([1]))
    batch.add_system_property("spin", torch.tensor([2]))
    out = wrapper(batch)
    ref = fairchem_reference(model, [atoms], "omol")
    assert rel(out["energy"].detach(), ref["energy"]) < TOLERANCE["energy"]
    assert rel(out["forces"], ref["forces"]) < TOLERANCE["forces"]
    # charge and spin do reach the model: the wrapper's defaults (no charge on the
    # batch) give another energy
    neutral = Batch.from_data_list([MAtomicData.from_ase(molecule_atoms(), dtype=torch.float32)])
    assert neutral.charge is None or int(neutral.charge[0]) == 0
    assert not torch.allclose(UMAWrapper(model, task="omol")(neutral)["energy"], out["energy"])


def test_callers_positions_are_left_alone(model):
    batch = Batch.from_data_list([MAtomicData.from_ase(triclinic_atoms(), dtype=torch.float32)])
    before = batch.positions.clone()
    UMAWrapper(model, task="omat")(batch, compute_stress=True)
    assert not batch.positions.requires_grad
    assert torch.equal(batch.positions, before)
