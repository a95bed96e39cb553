"""The structures every MACE plugin test uses, and mace's own reference results.

(A uniquely named module rather than conftest.py: test folders of several plugins are
collected in one pytest run, and two modules named ``conftest`` would shadow each other.)

Models are tiny (8 channels, 2 layers) and systems have tens of atoms: the suite runs
on a shared 2-core machine.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from ase import Atoms
from ase.build import bulk

pytest.importorskip("mace", reason="mace-torch is not installed (see plugins/mace/README.md)")


ELEMENTS = (1, 6, 8)
R_MAX = 4.0


def triclinic_three_elements() -> Atoms:
    """Periodic, skewed cell, H/C/O, rattled: no symmetry hides a wrong shift."""
    atoms = bulk("C", "diamond", a=3.7, cubic=True).repeat((2, 1, 1))
    rng = np.random.default_rng(3)
    atoms.numbers[rng.choice(len(atoms), 6, replace=False)] = [1, 1, 1, 8, 8, 8]
    skew = np.array([[0.0, 0.4, 0.3], [0.5, 0.0, 0.2], [0.3, 0.6, 0.0]])
    atoms.set_cell(atoms.cell + skew, scale_atoms=True)
    atoms.rattle(0.08, seed=4)
    return atoms


def tiny_cell_self_images() -> Atoms:
    """A cell much thinner than 2 r_max: every atom sees several images of itself."""
    atoms = Atoms(
        "CO",
        positions=[[0.1, 0.2, 0.0], [1.2, 1.0, 1.1]],
        cell=[[2.6, 0.0, 0.0], [0.4, 2.5, 0.0], [0.3, 0.2, 2.7]],
        pbc=True,
    )
    return atoms


def slab_with_vacuum() -> Atoms:
    """Periodic in x, y; 10 A of vacuum along a non-periodic z."""
    atoms = bulk("C", "diamond", a=3.7, cubic=True)
    atoms.numbers[[1, 5]] = [8, 1]
    atoms.center(vacuum=5.0, axis=2)
    atoms.pbc = (True, True, False)
    atoms.rattle(0.05, seed=7)
    return atoms


def molecule_open() -> Atoms:
    """No periodicity at all, zero cell."""
    atoms = Atoms(
        "CH3OH",
        positions=[
            [0, 0, 0],
            [1.0, 0.1, 0],
            [-0.4, 0.9, 0.1],
            [-0.3, -0.5, 0.8],
            [0.0, -0.4, -1.3],
            [0.8, -0.5, -1.7],
        ],
    )
    atoms.rattle(0.02, seed=2)
    return atoms


STRUCTURES = {
    "triclinic": triclinic_three_elements,
    "tiny_cell": tiny_cell_self_images,
    "slab": slab_with_vacuum,
    "molecule": molecule_open,
}


def mace_reference(model, atoms: Atoms) -> dict:
    """Energy, forces, virial and per-atom energies from mace's own ASE calculator.

    mace divides by a made-up volume when a system is not periodic along some axis (it
    replaces that cell vector by a long one, see mace.data.neighborhood), so its stress
    is only comparable through the virial ``stress * volume``; mlipdd uses the real
    cell's volume, as ASE does for slabs. Zero-volume systems have no stress.
    """
    from mace.calculators import MACECalculator
    from mace.data.neighborhood import get_neighborhood

    dtype = "float64" if next(model.parameters()).dtype == torch.float64 else "float32"
    # deepcopy: the calculator switches off requires_grad on the parameters it is given.
    calc = MACECalculator(models=copy.deepcopy(model), device="cpu", default_dtype=dtype)
    atoms = atoms.copy()
    atoms.calc = calc
    out = {
        "energy": atoms.get_potential_energy(),
        "forces": atoms.get_forces(),
        "energies": calc.results["energies"],
    }
    if abs(atoms.cell.volume) > 1e-8:
        *_, mace_cell = get_neighborhood(
            atoms.positions,
            float(model.r_max),
            tuple(bool(p) for p in atoms.pbc),
            atoms.cell.array.copy(),
        )
        out["virial"] = atoms.get_stress(voigt=False) * abs(np.linalg.det(mace_cell))
    return out
