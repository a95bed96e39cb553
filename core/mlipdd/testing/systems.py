"""The awkward cells every distributed feature is checked on.

Atoms sit on a rattled grid (never closer than ~0.7 of the grid spacing) so that any
potential, a pair potential included, is well behaved. ``spacing`` sets the density.
"""

from __future__ import annotations

import torch

from mlipdd.data import AtomicData, Batch


def _grid_system(cell, pbc, reps, species, seed, rattle=0.1, margin=(0.0, 0.0, 0.0), dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    cell = torch.as_tensor(cell, dtype=dtype)
    axes = [torch.arange(n, dtype=dtype) / n for n in reps]
    frac = torch.stack(torch.meshgrid(*axes, indexing="ij"), -1).reshape(-1, 3)
    margin_t = torch.as_tensor(margin, dtype=dtype)
    frac = margin_t + frac * (1 - 2 * margin_t) + 0.25 / torch.as_tensor(reps, dtype=dtype)
    positions = frac @ cell
    positions = positions + rattle * torch.randn(positions.shape, generator=g, dtype=dtype)
    z = torch.as_tensor(species)[torch.randint(len(species), (positions.shape[0],), generator=g)]
    return AtomicData(positions=positions, atomic_numbers=z, cell=cell, pbc=pbc, dtype=dtype)


def cubic(species=(18,), spacing=3.7, reps=6, seed=0) -> Batch:
    a = spacing * reps
    return Batch.from_data_list([_grid_system(torch.eye(3) * a, True, (reps,) * 3, species, seed)])


def triclinic(species=(18,), spacing=3.7, reps=6, seed=1) -> Batch:
    """Angles far from 90 degrees (about 60, 65 and 70)."""
    a = spacing * reps
    cell = torch.tensor([[a, 0.0, 0.0], [0.5 * a, 0.87 * a, 0.0], [0.35 * a, 0.25 * a, 0.85 * a]])
    return Batch.from_data_list([_grid_system(cell, True, (reps,) * 3, species, seed)])


def long_triclinic(species=(18,), spacing=3.7, reps=(12, 4, 4), rattle=0.1, seed=6) -> Batch:
    """A triclinic cell long along its first vector (angles about 63, 72 and 75 degrees):
    rank grids cut it across that vector only, into slabs narrower than the cell."""
    la, lb, lc = (spacing * n for n in reps)
    cell = torch.tensor([[la, 0.0, 0.0], [0.3 * lb, 0.95 * lb, 0.0], [0.25 * lc, 0.2 * lc, 0.95 * lc]])
    return Batch.from_data_list([_grid_system(cell, True, reps, species, seed, rattle=rattle)])


def small_cell(species=(18,), spacing=3.7, reps=2, seed=2) -> Batch:
    """A cell so small that every rank sees its own periodic images."""
    a = spacing * reps
    cell = torch.tensor([[a, 0.0, 0.0], [0.2 * a, a, 0.0], [0.1 * a, 0.15 * a, a]])
    return Batch.from_data_list([_grid_system(cell, True, (reps,) * 3, species, seed)])


def slab(species=(18,), spacing=3.7, reps=(6, 6, 3), vacuum=12.0, seed=3) -> Batch:
    """Periodic in x and y, vacuum along a non-periodic z."""
    lx, ly = spacing * reps[0], spacing * reps[1]
    lz = spacing * reps[2] + vacuum
    cell = torch.tensor([[lx, 0.0, 0.0], [0.3 * lx, ly, 0.0], [0.0, 0.0, lz]])
    margin = (0.0, 0.0, 0.5 * vacuum / lz)
    return Batch.from_data_list([_grid_system(cell, (True, True, False), reps, species, seed, margin=margin)])


def two_systems(species=(18,), spacing=3.7, seed=4) -> Batch:
    """A batch of two different systems (different cells, sizes and shapes)."""
    first = triclinic(species, spacing, 5, seed).to_data_list()[0]
    second = cubic(species, spacing, 4, seed + 1).to_data_list()[0]
    return Batch.from_data_list([first, second])


def half_filled(species=(18,), spacing=3.7, reps=(4, 6, 5), seed=5) -> Batch:
    """Periodic triclinic cell whose atoms fill only the lower half along a (a block of
    matter and a vacuum gap): uniform cut planes leave ranks nearly empty."""
    la, lb, lc = 2 * spacing * reps[0], spacing * reps[1], spacing * reps[2]
    cell = torch.tensor([[la, 0.0, 0.0], [0.25 * lb, lb, 0.0], [0.15 * lc, 0.2 * lc, lc]], dtype=torch.float64)
    data = _grid_system(cell, True, reps, species, seed, margin=(0.0, 0.0, 0.0))
    frac = data.positions @ torch.linalg.inv(cell)
    frac[:, 0] = 0.5 * frac[:, 0]  # squeeze the block into the lower half along a
    return Batch.from_data_list([AtomicData(positions=frac @ cell, atomic_numbers=data.atomic_numbers,
                                            cell=cell, pbc=True, dtype=cell.dtype)])


# Inhomogeneous systems on which load balancing must move the planes and stay exact.
UNEVEN_CELLS = {"slab": slab, "half_filled": half_filled}

AWKWARD_CELLS = {
    "cubic": cubic,
    "triclinic": triclinic,
    "small_cell": small_cell,
    "slab": slab,
    "two_systems": two_systems,
}
