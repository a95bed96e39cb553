"""MACE (random weights) under the aten dispatch equals one process at spawned ranks.

The unchanged MACEWrapper forward on aten ShardTensors: e3nn products over features
row-local, MACE's in-place ``scatter_sum`` into a ``torch.zeros`` accumulator made atom
rows in place (NOTE [aten factories]), the per-row pick ``x[arange(n), head]`` and its
adjoint; halo storage, float64, a triclinic cell and a cell where a rank sees
its own images; energy, forces and stress to 1e-10.
"""

from __future__ import annotations

import pytest
import torch
from mlipdd.testing.conformance import check_conformance_cases
from mlipdd.testing.systems import small_cell, triclinic


def small_mace():
    from mlipdd_mace import MACEWrapper
    from mlipdd_mace.testing import random_mace

    return MACEWrapper(random_mace(elements=(14,), r_max=4.0, channels=8, max_ell=1, correlation=2,
                                   num_interactions=2, dtype=torch.float64, seed=0)).eval()


def systems():
    """Rattled silicon (a perfect crystal has zero forces: nothing to compare)."""
    return [triclinic(species=(14,), spacing=2.4, reps=4), small_cell(species=(14,), spacing=2.4, reps=3)]


@pytest.mark.mlipdd_conformance(world_sizes=(2, 3, 4))
def test_mace_exact_under_aten_dispatch(world_size):
    cases = [(small_mace, batch, {"strategy": "halo", "skin": 0.0}) for batch in systems()]
    for result, _ in check_conformance_cases(cases, world_size):
        result.assert_close(energy=1e-10, forces=1e-10, stress=1e-10)
