"""aimnet's matrices kept while a list with a skin holds (NOTE [matrices while the list holds]).

One process, float64: a list built at cutoff + 0.8 A, atoms then moved by up to 0.35 A (inside
skin / 2). The network's matrix compacted from the kept cut is the one the list gives at the new
positions, slot for slot; energy, forces, stress and charges equal a call that cuts the list
afresh (DSF on a batch of two charged crystals; Ewald on a triclinic crystal, whose Coulomb
matrix is compacted too), and a new list replaces the kept cut.
"""

from __future__ import annotations

import functools

import pytest
import torch
from aimnet2_systems import DSF_CUTOFF, triclinic_crystal
from mlipdd.neighbors import attach_neighbors
from mlipdd.testing.conformance import relative_difference
from mlipdd_aimnet2 import inputs
from mlipdd_aimnet2.testing import charged_pair, random_aimnet2_wrapper

SKIN = 0.8
CASES = {
    "dsf, two systems": (functools.partial(random_aimnet2_wrapper, coulomb="dsf", dsf_cutoff=DSF_CUTOFF), charged_pair),
    "ewald": (functools.partial(random_aimnet2_wrapper, coulomb="ewald", ewald_cutoff=7.0), triclinic_crystal),
}


def _moved(batch, seed: int):
    g = torch.Generator().manual_seed(seed)
    step = torch.rand(batch.positions.shape, generator=g, dtype=batch.dtype) * 2 - 1
    moved = batch.clone()
    moved.node["positions"] = batch.positions + 0.35 / 3**0.5 * step  # each atom < 0.35 A
    moved.neighbors = batch.neighbors  # the list holds (dynamics hands the same list on)
    return moved


@pytest.mark.parametrize("case", list(CASES))
def test_kept_matrices_equal_a_fresh_cut(case):
    factory, system = CASES[case]
    model = factory()
    batch = system()
    attach_neighbors(batch, model.cutoff + SKIN)
    model(batch)  # cuts the list and keeps the cut
    kept = model._list_matrices._matrices
    moved = _moved(batch, seed=1)  # the same list (its edge index) at new positions
    assert moved.neighbors.edge_index is batch.neighbors.edge_index
    out = model(moved, compute_stress=True)
    assert model._list_matrices._matrices is kept, "the list held: its cut must be reused"

    fresh = inputs._matrices_from_list(moved, moved.positions, model.short_cutoff, model._long_cutoff(moved))
    got = model._list_matrices.get(moved, moved.positions, model.short_cutoff, model._long_cutoff(moved),
                                   model.cutoff, exact_long=case == "ewald")
    for suffix in ("", "_lr") if case == "ewald" else ("",):
        for field in ("index", "unit_shifts", "pad"):
            assert torch.equal(getattr(got[suffix], field), getattr(fresh[suffix], field)), (suffix, field)

    reference_model = factory()
    reference_model._list_matrices.get = lambda *args, **kwargs: None  # cut the list every call
    reference = reference_model(moved, compute_stress=True)
    for key in ("energy", "forces", "stress", "charges"):
        assert relative_difference(out[key], reference[key]) < 1e-12, key

    rebuilt = moved.clone()
    attach_neighbors(rebuilt, model.cutoff + SKIN)
    model._list_matrices.get(rebuilt, rebuilt.positions, model.short_cutoff, model._long_cutoff(rebuilt),
                             model.cutoff, exact_long=False)
    assert model._list_matrices._matrices is not kept, "a new list must be cut again"
