"""AIMNet2 under the aten dispatch, halo and sharded storage.

The wrapper builds aimnet's dense neighbour tables from this rank's edges on plain local
tensors (every edge of a receiver lives on its owner's rank) and declares them atom rows of
the forward (NOTE [declared rows] in `mlipdd.shard.aten.tensor`): the table's rows are
OWNED (a ghost row lists nothing), its values atom row numbers, so aimnet's
``index_select`` through it reads ghost (halo) or remote (sharded) rows by the rules, and
a convolution's ghost rows are refreshed by the placement, not by an adapter.

One launch per rank count (2, 3, 4 gloo ranks, float64) runs its turn of the cases (case i
at the i-th count, cycling; all at every count: MLIPDD_ATEN_EVERY_COUNT=1) against one
process: DSF on the triclinic crystal and on a charged slab, Ewald on a cell where every
rank sees its own images and on two charged crystals (the background term), and a batch
of a charged molecule (all-pairs Coulomb) next to a crystal (Ewald); energy 1e-12, forces,
stress and charges 1e-10 relative.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch
from aimnet2_systems import DSF_CUTOFF, own_images, slab, triclinic_crystal
from mlipdd.data import AtomicData, Batch
from mlipdd.testing import run_ranks
from mlipdd.testing.conformance import gather_by_id, relative_difference
from mlipdd_aimnet2.testing import charged_pair, molecular_crystal, random_aimnet2_wrapper

WORLD_SIZES = (2, 3, 4)
KEYS = ("energy", "forces", "stress", "charges")
LIMITS = {"energy": 1e-12, "forces": 1e-10, "stress": 1e-10, "charges": 1e-10}
DSF = functools.partial(random_aimnet2_wrapper, seed=0, dsf_cutoff=DSF_CUTOFF)
EWALD = functools.partial(random_aimnet2_wrapper, seed=0, coulomb="ewald", ewald_cutoff=8.0)
PER_KIND = functools.partial(random_aimnet2_wrapper, seed=0, coulomb={"molecule": "simple", "periodic": "ewald"},
                             ewald_cutoff=8.0, simple_cutoff=12.0)


def molecule_and_crystal() -> Batch:
    pair = molecular_crystal((1, 1, 2), seed=7)
    molecule = AtomicData(positions=pair.positions + 12.0, atomic_numbers=pair.atomic_numbers,
                          cell=torch.eye(3, dtype=torch.float64) * 30.0, pbc=False, charge=-1.0)
    return Batch.from_data_list([molecule, molecular_crystal((2, 2, 1), seed=1, charge=1.0)])


CASES = [(DSF, triclinic_crystal, "halo"), (DSF, slab, "sharded"), (EWALD, own_images, "halo"),
         (EWALD, charged_pair, "sharded"), (PER_KIND, molecule_and_crystal, "halo"),
         (DSF, triclinic_crystal, "sharded"), (PER_KIND, molecule_and_crystal, "sharded"),
         (EWALD, charged_pair, "halo"), (DSF, slab, "halo")]


def _distributed(rank, world_size, cases):
    from mlipdd.distributed import DistributedModel, DomainConfig

    results = []
    for factory, build, strategy in cases:
        model = factory()
        dm = DistributedModel(model, DomainConfig(cutoff=model.cutoff, skin=0.3, strategy=strategy))
        owned = dm.partition(build() if rank == 0 else None)
        out = dm(owned, compute_stress=True)
        results.append({"atom_ids": owned.atom_ids, **{k: out[k] for k in KEYS}})
    return results


@functools.cache
def _reference(factory, build):
    return {k: v.detach() for k, v in factory()(build(), compute_stress=True).items()}


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_aimnet2_aten_equals_one_process(world_size):
    cases = CASES
    if not os.environ.get("MLIPDD_ATEN_EVERY_COUNT"):
        cases = CASES[WORLD_SIZES.index(world_size)::len(WORLD_SIZES)]
    parts = run_ranks(_distributed, world_size, cases, timeout=900)
    for index, (factory, build, strategy) in enumerate(cases):
        runs = [p[index] for p in parts]
        n_atoms, reference = build().num_atoms, _reference(factory, build)
        got = {"energy": runs[0]["energy"], "stress": runs[0]["stress"],
               "forces": gather_by_id(runs, "forces", n_atoms), "charges": gather_by_id(runs, "charges", n_atoms)}
        for key in KEYS:
            diff = relative_difference(got[key], reference[key])
            assert diff <= LIMITS[key], f"{world_size} ranks, {strategy}, {build.__name__}: {key} {diff:.3g}"
