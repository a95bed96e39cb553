"""Halo decomposition equals one process: LJ and a 3-layer MPNN, 1-4 real gloo ranks, float64."""

import pytest
import torch
from mlipdd.data import Batch
from mlipdd.models.lj import LennardJones
from mlipdd.testing.conformance import check_conformance
from mlipdd.testing.systems import AWKWARD_CELLS, _grid_system
from mlipdd.testing.toy_models import ToyMPNN


def lj():
    return LennardJones(epsilon=0.0104, sigma=3.4, cutoff=7.0)


def mpnn():
    return ToyMPNN(cutoff=4.5, layers=3, species=(8, 18))


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("cell", sorted(AWKWARD_CELLS))
@pytest.mark.parametrize("factory", [lj, mpnn], ids=["lj", "mpnn"])
def test_distributed_equals_single_process(factory, cell, world_size):
    batch = AWKWARD_CELLS[cell]()
    result = check_conformance(factory, batch, world_size)
    result.assert_close(energy=1e-12, forces=1e-10, stress=1e-10)


def _random_case(seed):
    g = torch.Generator().manual_seed(seed)
    reps = tuple(int(x) for x in torch.randint(2, 5, (3,), generator=g))
    lengths = torch.tensor(reps, dtype=torch.float64) * 3.7
    tilt = (torch.rand(3, generator=g, dtype=torch.float64) - 0.5) * 0.8
    cell = torch.diag(lengths)
    cell[1, 0], cell[2, 0], cell[2, 1] = tilt[0] * lengths[0], tilt[1] * lengths[0], tilt[2] * lengths[1]
    pbc = tuple(bool(x) for x in torch.rand(3, generator=g) < 0.8)
    if not all(pbc):
        for a in range(3):
            if not pbc[a]:
                cell[a] = cell[a] * (1 + 8.0 / float(cell[a].norm()))
    margin = tuple(0.0 if p else 0.25 for p in pbc)
    data = _grid_system(cell, pbc, reps, (18, 8), seed, margin=margin)
    return Batch.from_data_list([data])


@pytest.mark.parametrize("seed", range(4))
def test_random_cells_positions_and_grids(seed):
    """Seeded property check: random triclinic cells, pbc, species and explicit rank grids."""
    batch = _random_case(seed)
    grids = [(2, 1, 1), (1, 3, 1), (1, 2, 2), (2, 2, 1)]
    grid = grids[seed]
    world_size = grid[0] * grid[1] * grid[2]
    result = check_conformance(mpnn, batch, world_size, config_kwargs={"grid": grid, "skin": 0.3})
    result.assert_close()
