"""Load balancing keeps distributed MACE exact: planes moved by atom count, 2/3/4 ranks.

One spawned launch per rank count covers both uneven systems of the core kit (a slab
with vacuum, a half-filled triclinic cell), float64, compared with one process.
"""

from __future__ import annotations

import functools

import pytest
import torch

from mlipdd.strategy.grid import RankGrid
from mlipdd.testing import UNEVEN_CELLS, check_conformance_cases
from mlipdd_mace.testing import random_mace_wrapper

SPECIES = (1, 6, 8)
FACTORY = functools.partial(random_mace_wrapper, elements=SPECIES, r_max=4.0, dtype=torch.float64, seed=0)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_balanced_planes_keep_mace_exact(world_size):
    cases = [(FACTORY, make(species=SPECIES, spacing=2.5), {"balance": "count"}) for make in UNEVEN_CELLS.values()]
    for name, (result, parts) in zip(UNEVEN_CELLS, check_conformance_cases(cases, world_size), strict=True):
        result.assert_close(energy=1e-12, forces=1e-10, stress=1e-10)
        grid = parts[0]["grid"]
        uniform = RankGrid(grid.dims)
        moved = any(grid.bounds(a).tolist() != uniform.bounds(a).tolist() for a in range(3))
        assert moved, f"{name}: the planes stayed uniform ({grid})"
        owned = torch.tensor([len(p["atom_ids"]) for p in parts], dtype=torch.float64)
        assert owned.max() / owned.mean() < 1.35, f"{name}: owned {owned.tolist()}"
