"""The list a wrapper builds for itself (nvalchemiops' cell list, as aimnet's calculator)
holds exactly mlipdd's pairs and shifts: triclinic crystal, slab with vacuum, a batch of
two cells, a cell thinner than the cutoff (own images) and a batch of a molecule, a
crystal and a slab, at the network's cutoff and beyond; energies then agree too."""

from __future__ import annotations

import pytest
import torch
from aimnet2_systems import SYSTEMS
from mlipdd.data import Batch
from mlipdd.neighbors import attach_neighbors, build_neighbor_list
from mlipdd_aimnet2.own_neighbors import aimnet_kernel_neighbors
from mlipdd_aimnet2.testing import random_aimnet2_wrapper
from test_mixed_batch import PER_KIND, SIMPLE_CUTOFF, mixed_systems

CASES = {**SYSTEMS, "mixed": lambda: Batch.from_data_list(mixed_systems())}


def _edges(neighbors):
    rows = torch.cat([neighbors.edge_index.T, neighbors.unit_shifts.round().long()], dim=1)
    return sorted(map(tuple, rows.tolist()))


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_list_equals_mlipdds(name):
    batch = CASES[name]()
    for cutoff in (5.0, 7.0, 12.0):
        ours = aimnet_kernel_neighbors(batch, cutoff, {})
        assert ours is not None
        receivers = ours.edge_index[1]
        assert bool((receivers[1:] >= receivers[:-1]).all())  # grouped by receiver
        assert _edges(ours) == _edges(build_neighbor_list(batch, cutoff)), (name, cutoff)


def test_energy_with_either_list():
    model = random_aimnet2_wrapper(seed=0, coulomb=PER_KIND["all_pairs"], dsf_cutoff=7.0,
                                   simple_cutoff=SIMPLE_CUTOFF)
    batch = CASES["mixed"]()
    own = model(batch, compute_stress=True)
    listed = batch.clone()
    attach_neighbors(listed, model.cutoff)
    theirs = model(listed, compute_stress=True)
    for key in ("energy", "forces", "stress", "charges"):
        assert torch.allclose(own[key], theirs[key], rtol=1e-11, atol=1e-11), key


@pytest.mark.parametrize("name", list(SYSTEMS))
def test_kernel_matrices_give_the_same_outputs(name):
    """Matrices straight from the kernel (no COO list) vs cut from mlipdd's list."""
    model = random_aimnet2_wrapper(seed=0, dsf_cutoff=7.0)
    batch = SYSTEMS[name]()
    assert model._kernel_matrices(batch) is not None
    own = model(batch, compute_stress=True)
    listed = batch.clone()
    attach_neighbors(listed, model.cutoff)
    theirs = model(listed, compute_stress=True)
    for key in ("energy", "forces", "stress", "charges"):
        assert torch.allclose(own[key], theirs[key], rtol=1e-11, atol=1e-11), (name, key)
