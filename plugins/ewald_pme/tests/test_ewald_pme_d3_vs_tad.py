"""D3Wrapper against tad-dftd3 (the reference implementation's torch port) on an open
cluster of H, C, N, O, Si and Cu with the same cutoffs, and a periodic-cell sanity check."""

from __future__ import annotations

import pytest
import torch
from mlipdd import AtomicData, Batch
from mlipdd_ewald_pme.d3 import BOHR, HARTREE, PBE_BJ, D3Wrapper

d3 = pytest.importorskip("tad_dftd3", reason="tad-dftd3 is the D3 oracle (requirements/ewald-pme.txt)")
CUTOFF = 8.0


def _cluster(seed=0):
    g = torch.Generator().manual_seed(seed)
    grid = torch.stack(torch.meshgrid(*[torch.arange(4.0)] * 3, indexing="ij"), -1).reshape(-1, 3) * 1.9
    positions = grid.double() + 0.2 * torch.randn(grid.shape, generator=g, dtype=torch.float64)
    z = torch.tensor([1, 6, 7, 8, 14, 29])[torch.randint(6, (len(positions),), generator=g)]
    data = AtomicData(positions=positions, atomic_numbers=z, cell=torch.eye(3) * 30.0, pbc=False, dtype=torch.float64)
    return Batch.from_data_list([data])


def test_d3_equals_tad_dftd3_on_h_c_n_o_si_cu():
    from tad_dftd3.cutoff import Cutoff

    batch = _cluster()
    assert set(batch.atomic_numbers.tolist()) == {1, 6, 7, 8, 14, 29}
    out = D3Wrapper(cutoff=CUTOFF)(batch)
    positions = batch.positions.clone().requires_grad_(True)
    param = {k: torch.tensor(v, dtype=torch.float64) for k, v in {**PBE_BJ, "s9": 0.0}.items()}
    cutoff = Cutoff(cn=CUTOFF / BOHR, disp2=CUTOFF / BOHR, disp3=CUTOFF / BOHR, dtype=torch.float64)
    energy = HARTREE * d3.dftd3(batch.atomic_numbers, positions / BOHR, param, cutoff=cutoff).sum()
    forces = -torch.autograd.grad(energy, positions)[0]
    assert abs(float(out["energy"][0] - energy)) < 1e-12 * abs(float(energy))
    assert float((out["forces"] - forces).abs().max()) < 1e-12 * float(forces.abs().max())


def test_d3_periodic_stress_matches_finite_differences():
    batch = _cluster(seed=1)
    batch.system["pbc"] = torch.tensor([[True, True, True]])
    batch.system["cell"] = torch.tensor([[[7.6, 0.0, 0.0], [0.9, 7.6, 0.0], [-0.5, 0.7, 7.6]]], dtype=torch.float64)
    model = D3Wrapper(cutoff=CUTOFF)
    stress = model(batch, compute_stress=True)["stress"][0]
    h, volume = 1e-5, float(batch.cell[0].det())
    for i, j in ((0, 0), (1, 2)):
        energies = []
        for sign in (1, -1):
            strain = torch.zeros(3, 3, dtype=torch.float64)
            strain[i, j] = strain[j, i] = sign * h
            deformed = batch.clone()
            deformed.system["cell"] = batch.cell @ (torch.eye(3, dtype=torch.float64) + strain)
            deformed.node["positions"] = batch.positions @ (torch.eye(3, dtype=torch.float64) + strain)
            energies.append(float(model(deformed)["energy"][0]))
        fd = (energies[0] - energies[1]) / (2 * h) / volume / (1 if i == j else 2)
        assert abs(fd - float(stress[i, j])) < 1e-6 * max(abs(fd), 1e-3)
