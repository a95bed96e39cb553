"""Ewald, PME, DSF, D3 and pipelines under the aten dispatch.

One spawned launch per rank count (2, 3, 4 gloo ranks, float64) runs its cases against one
process, 1e-10 relative on energy, forces and stress. Halo storage: Ewald and PME (Warp and
torch splines: the spec's OpAdapters act above autograd, NOTE [aten op adapters]) on a
tilted charged cell whose ranks see their own images and on two triclinic cells, DSF on a
slab with vacuum, D3 on rattled MgO (its C6 op in blocks of 7 edges) with and without its three-body (ATM) term (triples
built per receiver on plain local rows, NOTE [declared rows]), and the pipelines
[MACE, PME, D3] and [MACE, QEq -> PME]. Sharded storage: Ewald on the tilted charged cell,
PME on two systems with the batch's charges, DSF on the slab, D3 with ATM, both pipelines.
Cases in turn: case i runs at the i-th rank count (cycling 2, 3, 4), so every case and every
count runs once and the file costs one pass over the cases instead of three (all cases at
every count: MLIPDD_ATEN_EVERY_COUNT=1).
"""

from __future__ import annotations

import functools
import itertools
import os

import pytest
from mlipdd import Batch
from mlipdd.testing.spawn import run_ranks
from mlipdd.testing.systems import slab, two_systems
from mlipdd_ewald_pme.d3 import D3Wrapper
from mlipdd_ewald_pme.testing import (
    DSF,
    EWALD,
    PME,
    PME_TORCH,
    WORLD_SIZES,
    compare_distributed,
    d3_systems,
    mace_pme_d3_pipeline,
    qeq_pme_pipeline,
    random_charges,
    rock_salt,
)

D3_ATM = functools.partial(D3Wrapper, cutoff=6.0, params={"s9": 1.0}, three_body_cutoff=5.0, switch_on=4.5)
D3_CHUNKED = functools.partial(D3Wrapper, cutoff=6.0, chunk=7)  # the C6 op over several blocks (edge rows)


def _cases():
    small = rock_salt((2, 2, 2), vacancies=2, extra_charge=1.0, seed=1)
    pair = random_charges(two_systems(species=(11, 17), spacing=2.9), seed=2, neutral=False)
    vacuum = random_charges(slab(species=(11, 17), spacing=2.9, reps=(5, 5, 3)), seed=3)
    mgo = Batch.from_ase(d3_systems()["MgO(100) slab"].repeat((2, 2, 1)))
    mgo.system["pbc"][:] = True
    halo = [(EWALD, small), (PME, small), (PME_TORCH, small), (PME, pair), (DSF, vacuum), (D3_CHUNKED, mgo),
            (D3_ATM, mgo), (mace_pme_d3_pipeline, small), (qeq_pme_pipeline, small)]
    sharded = [(EWALD, small), (PME, pair), (DSF, vacuum), (D3_ATM, mgo), (mace_pme_d3_pipeline, small),
               (qeq_pme_pipeline, small)]
    # halo and sharded cases alternate, so that each rank count's turn holds both storages
    pairs = itertools.zip_longest([(f, b, True, "halo") for f, b in halo], [(f, b, True, "sharded") for f, b in sharded])
    return [case for pair_ in pairs for case in pair_ if case is not None]


def _aten_cases(rank, world_size, cases):
    from mlipdd.distributed import DistributedModel, DistributedPipelineModel, DomainConfig
    from mlipdd.models import PipelineModelWrapper

    def run(factory, batch, stress, strategy):
        model = factory()
        runner = DistributedPipelineModel if isinstance(model, PipelineModelWrapper) else DistributedModel
        dm = runner(model, DomainConfig(cutoff=model.cutoff, strategy=strategy))
        owned = dm.partition(batch if rank == 0 else None)
        out = dm(owned, compute_stress=stress)
        return {"atom_ids": owned.atom_ids, "energy": out["energy"], "forces": out["forces"],
                "stress": out["stress"] if stress else None, "edges": dm.last_padded.neighbors.num_edges}

    return [run(*case) for case in cases]


@pytest.fixture(scope="module")
def single_process():
    cases = _cases()
    references = [{k: v.detach() for k, v in factory()(batch, compute_stress=stress).items()}
                  for factory, batch, stress, _ in cases]
    return cases, references


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_aten_dispatch_equals_single_process(single_process, world_size):
    cases, references = single_process
    if not os.environ.get("MLIPDD_ATEN_EVERY_COUNT"):
        turn = WORLD_SIZES.index(world_size)
        mine = range(turn, len(cases), len(WORLD_SIZES))
        cases, references = [cases[i] for i in mine], [references[i] for i in mine]
    parts = run_ranks(_aten_cases, world_size, cases, timeout=900)
    report = compare_distributed([c[:3] for c in cases], parts, references)
    for (factory, batch, _, strategy), diffs in zip(cases, report):
        name = f"{strategy}, {getattr(factory, 'func', factory).__name__} on {batch.num_atoms} atoms"
        for key in ("energy", "forces", "stress"):
            assert diffs[key] <= 1e-10, f"{world_size} ranks, {name}: {key} differs by {diffs[key]:.2e}"
