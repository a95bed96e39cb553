"""Sharded storage (issue 26 item 3): batch charges reach the model as owned rows, and PME's
spline ops (OpAdapters of SliceOwned / AllReduceSum only) run on them. Ewald, PME (Warp and
torch splines), DSF, QEq charges -> PME, AIMNet2 charges -> PME (a random AIMNet2 of the
released architecture) and D3 with its three-body term and a switched cutoff at 2, 3 and 4
gloo ranks equal one process (float64): a small tilted charged cell, a slab-corrected charged slab, a batch of two
triclinic cells with random non-neutral charges, a molecular crystal, 32 copper atoms. One spawned launch per rank count.
"""

from __future__ import annotations

import functools

import pytest
from mlipdd import Batch
from mlipdd.testing.spawn import run_ranks
from mlipdd.testing.systems import two_systems
from mlipdd_ewald_pme.d3 import D3Wrapper
from mlipdd_ewald_pme.testing import (
    DSF,
    EWALD,
    PME,
    PME_TORCH,
    WORLD_SIZES,
    compare_distributed,
    d3_systems,
    dipolar_slab,
    distributed_cases,
    qeq_pme_pipeline,
    random_charges,
    rock_salt,
)
from mlipdd_ewald_pme.wrappers import PMEWrapper

D3_ATM = functools.partial(D3Wrapper, cutoff=6.0, params={"s9": 1.0}, switch_on=4.5, chunk=7)
PME_SLAB = functools.partial(PMEWrapper, cutoff=6.0, accuracy=1e-6, slab_correction=True)


def aimnet_pme():
    """AIMNet2's predicted charges feeding PME (the network's own Coulomb off)."""
    from mlipdd_aimnet2.testing import random_aimnet2_wrapper
    from mlipdd_ewald_pme.coupled import ChargeCoupled

    return ChargeCoupled(random_aimnet2_wrapper(seed=0, coulomb="none"), PME())


def _cases():
    from mlipdd_aimnet2.testing import molecular_crystal

    small = rock_salt((2, 2, 2), vacancies=2, extra_charge=1.0, seed=1)
    pair = random_charges(two_systems(species=(11, 17), spacing=2.9), seed=2, neutral=False)
    crystal = Batch.from_data_list([molecular_crystal((3, 2, 2), seed=0)])
    copper = Batch.from_ase(d3_systems()["Cu fcc (cubic)"].repeat((2, 2, 2)))
    return [(D3_ATM, copper, True), (PME_SLAB, dipolar_slab(12.0, neutral=False), True), (EWALD, small, True), (PME, small, True), (PME_TORCH, pair, True), (DSF, pair, True),
            (qeq_pme_pipeline, small, True), (aimnet_pme, crystal, True)]


@pytest.fixture(scope="module")
def single_process():
    cases = _cases()
    return cases, [{k: v.detach() for k, v in factory()(batch, compute_stress=stress).items()}
                   for factory, batch, stress in cases]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_sharded_equals_single_process(single_process, world_size):
    cases, references = single_process
    parts = run_ranks(distributed_cases, world_size, cases, "sharded", timeout=600)
    for (factory, batch, _), diffs in zip(cases, compare_distributed(cases, parts, references)):
        name = f"{getattr(factory, 'func', factory).__name__} on {batch.num_atoms} atoms"
        for key in ("energy", "forces", "stress"):
            assert diffs[key] <= 1e-10, f"{world_size} ranks, sharded, {name}: {key} differs by {diffs[key]:.2e}"
