"""Random-weight AIMNet2 wrappers and small organic systems, for tests, examples and benchmarks."""

from __future__ import annotations

import torch
from mlipdd.data import AtomicData, Batch


def random_aimnet2_wrapper(seed: int = 0, dtype: torch.dtype = torch.float64, **options):
    """`AIMNet2Wrapper` around `building.random_aimnet2` (released architecture, no D3).

    Module-level so it can be sent to spawned ranks (use functools.partial for options).
    """
    from mlipdd_aimnet2.building import random_aimnet2
    from mlipdd_aimnet2.wrapper import AIMNet2Wrapper

    model, metadata = random_aimnet2(seed=seed, dtype=dtype)
    return AIMNet2Wrapper(model, metadata=metadata, dispersion=False, **options)


# One methanol-like molecule (C, O, 4 H) in A; crystals are made of copies of it.
_MOLECULE_Z = (6, 8, 1, 1, 1, 1)
_MOLECULE_XYZ = (
    (0.000, 0.000, 0.000),
    (1.410, 0.000, 0.000),
    (-0.360, 1.020, 0.000),
    (-0.360, -0.510, 0.890),
    (-0.360, -0.510, -0.890),
    (1.730, 0.900, 0.000),
)


def _rotation(g: torch.Generator, dtype) -> torch.Tensor:
    q, r = torch.linalg.qr(torch.randn(3, 3, generator=g, dtype=dtype))
    return q * torch.sign(torch.diagonal(r))


def molecular_crystal(reps=(2, 2, 2), cell=None, seed: int = 0, pbc=True, vacuum_axis: int | None = None,
                      vacuum: float = 10.0, dtype=torch.float64, charge: float | None = None) -> AtomicData:
    """Randomly oriented methanol-like molecules on a (triclinic) lattice, ~4.2 A apart.

    ``vacuum_axis`` makes a slab: no periodicity along it and ``vacuum`` A of empty space.
    """
    g = torch.Generator().manual_seed(seed)
    if cell is None:
        cell = torch.tensor([[4.3, 0.0, 0.0], [1.1, 4.2, 0.0], [0.7, 0.9, 4.4]], dtype=dtype)
    cell = torch.as_tensor(cell, dtype=dtype)
    molecule = torch.tensor(_MOLECULE_XYZ, dtype=dtype)
    molecule = molecule - molecule.mean(0)
    positions, numbers = [], []
    for i in range(reps[0]):
        for j in range(reps[1]):
            for k in range(reps[2]):
                origin = torch.tensor([i + 0.5, j + 0.5, k + 0.5], dtype=dtype) @ cell
                shake = 0.05 * torch.randn(len(_MOLECULE_Z), 3, generator=g, dtype=dtype)
                positions.append(origin + molecule @ _rotation(g, dtype).T + shake)
                numbers.extend(_MOLECULE_Z)
    supercell = cell * torch.tensor(reps, dtype=dtype).unsqueeze(1)
    periodic = [bool(pbc)] * 3
    if vacuum_axis is not None:
        periodic[vacuum_axis] = False
        normal = torch.zeros(3, dtype=dtype)
        normal[vacuum_axis] = 1.0
        supercell = supercell.clone()
        supercell[vacuum_axis] = supercell[vacuum_axis] + vacuum * normal
    return AtomicData(positions=torch.cat(positions), atomic_numbers=numbers, cell=supercell, pbc=periodic,
                      dtype=dtype, charge=charge)


def charged_pair(dtype=torch.float64) -> Batch:
    """Two crystals of different shape and size with total charges +1 and -2."""
    first = molecular_crystal((2, 2, 1), seed=1, dtype=dtype, charge=1.0)
    second = molecular_crystal((1, 2, 2), seed=2, dtype=dtype, charge=-2.0,
                               cell=torch.tensor([[4.5, 0.0, 0.0], [0.0, 4.4, 0.0], [0.0, 0.0, 4.6]]))
    return Batch.from_data_list([first, second])
