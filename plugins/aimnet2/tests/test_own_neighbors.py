"""The list a wrapper builds for itself (nvalchemiops' cell list, as aimnet's calculator)
holds exactly mlipdd's pairs and shifts: triclinic crystal, slab with vacuum, a batch of
two cells, a cell thinner than the cutoff (own images), a batch of a molecule, a
crystal and a slab, and a batch of open molecules (one all-pairs search over the batch),
at the network's cutoff and beyond; energies then agree too."""

from __future__ import annotations

import pytest
import torch
from aimnet2_systems import SYSTEMS
from mlipdd.data import AtomicData, Batch
from mlipdd.neighbors import attach_neighbors, build_neighbor_list
from mlipdd_aimnet2.own_neighbors import aimnet_kernel_neighbors
from mlipdd_aimnet2.testing import molecular_crystal, random_aimnet2_wrapper
from test_mixed_batch import PER_KIND, SIMPLE_CUTOFF, mixed_systems


def open_molecules() -> Batch:
    """Three open clusters of different sizes, total charges 0, -1, +1, no cell at all."""
    clusters = [molecular_crystal(reps, seed=i, pbc=False) for i, reps in enumerate([(2, 1, 1), (2, 2, 1), (1, 1, 1)])]
    return Batch.from_data_list([AtomicData(positions=c.positions, atomic_numbers=c.atomic_numbers, charge=q)
                                 for c, q in zip(clusters, (0.0, -1.0, 1.0))])


CASES = {**SYSTEMS, "mixed": lambda: Batch.from_data_list(mixed_systems()), "open_molecules": open_molecules}


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


@pytest.mark.parametrize("name", [*SYSTEMS, "open_molecules", "open_molecules_dsf"])
def test_kernel_matrices_give_the_same_outputs(name):
    """Matrices straight from the kernel (no COO list) vs cut from mlipdd's list."""
    coulomb = {"open_molecules": "simple"}.get(name, "dsf")
    model = random_aimnet2_wrapper(seed=0, dsf_cutoff=7.0, coulomb=coulomb, simple_cutoff=SIMPLE_CUTOFF)
    batch = CASES[name.removesuffix("_dsf")]()
    assert model._kernel_matrices(batch) is not None
    stress = bool(batch.pbc.any())  # an open system has no cell to strain
    own = model(batch, compute_stress=stress)
    listed = batch.clone()
    attach_neighbors(listed, model.cutoff)
    theirs = model(listed, compute_stress=stress)
    for key in ("energy", "forces", "charges") + (("stress",) if stress else ()):
        assert torch.allclose(own[key], theirs[key], rtol=1e-11, atol=1e-11), (name, key)
