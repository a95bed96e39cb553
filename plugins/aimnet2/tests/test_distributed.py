"""AIMNet2 under domain decomposition equals one process: 2, 3 and 4 gloo ranks, float64.

aimnet's modules compute in float64 when the model is converted (only aimnet's own
input preparation casts to float32, and the wrapper hands aimnet prepared inputs), so
the comparison is float64 at the library's usual limits: energy 1e-12, forces,
stress and charges 1e-10 relative. Measured: 2e-16 (energy), 5e-15 (forces, charges),
1e-14 (stress).

Each world size is one spawned run that checks, for sharded (the default) and halo
storage, a triclinic molecular crystal, a slab with vacuum (charge -1), a batch of two
crystals with total charges +1 and -2, and a cell so small that every rank sees its own
images. DSF Coulomb (7 A) reaches further than the network (5 A), so the long-range
term has its own ghosts. Charges add up to each system's total charge on every rank
count (to within aimnet's NSE epsilon of 1e-6 in the weights' denominator, the same
sum as one process to 1e-12).
"""

from __future__ import annotations

import functools
import re

import pytest
import torch
from aimnet2_systems import DSF_CUTOFF, SYSTEMS, total_charges
from mlipdd.distributed import DistributedModel, DomainConfig, StrategyKind
from mlipdd.testing import run_ranks
from mlipdd.testing.conformance import gather_by_id, relative_difference
from mlipdd_aimnet2.testing import random_aimnet2_wrapper

FACTORY = functools.partial(random_aimnet2_wrapper, seed=0, dsf_cutoff=DSF_CUTOFF)
STRATEGIES = (StrategyKind.SHARDED, StrategyKind.HALO)
KEYS = ("energy", "forces", "stress", "charges")
LIMITS = {"energy": 1e-12, "forces": 1e-10, "stress": 1e-10, "charges": 1e-10}


def _distributed(rank, world_size):
    model = FACTORY()
    results = {}
    for strategy in STRATEGIES:
        for name, build in SYSTEMS.items():
            dm = DistributedModel(model, DomainConfig(cutoff=model.cutoff, skin=0.3, strategy=strategy))
            owned = dm.partition(build() if rank == 0 else None)
            out = dm(owned, compute_stress=True)
            results[strategy.value, name] = {"atom_ids": owned.atom_ids, **{k: out[k] for k in KEYS},
                                             "spec": dm.spec.name}
    return results


@functools.cache
def _reference(name):
    return {k: v.detach() for k, v in FACTORY()(SYSTEMS[name](), compute_stress=True).items()}


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_distributed_equals_one_process(world_size):
    parts = run_ranks(_distributed, world_size, timeout=900)
    for strategy in STRATEGIES:
        for name, build in SYSTEMS.items():
            batch, reference = build(), _reference(name)
            runs = [p[strategy.value, name] for p in parts]
            assert runs[0]["spec"] == f"aimnet2_{strategy.value}"
            got = {"energy": runs[0]["energy"], "stress": runs[0]["stress"],
                   "forces": gather_by_id(runs, "forces", batch.num_atoms),
                   "charges": gather_by_id(runs, "charges", batch.num_atoms)}
            for key in KEYS:
                diff = relative_difference(got[key], reference[key])
                assert diff <= LIMITS[key], f"{strategy.value}, {name}, {key}: {diff:.3g}"
            for run in runs[1:]:
                assert torch.equal(run["energy"], runs[0]["energy"])
            sums = torch.zeros(batch.num_systems, dtype=torch.float64).index_add(0, batch.batch, got["charges"])
            one = torch.zeros(batch.num_systems, dtype=torch.float64).index_add(0, batch.batch, reference["charges"])
            assert torch.allclose(sums, one, rtol=0, atol=1e-12), (name, sums, one)
            assert torch.allclose(sums, total_charges(batch), rtol=0, atol=1e-3), (name, sums)
            assert float(reference["stress"].abs().max()) > 1e-5  # a real stress, not zeros


def _bad_input(rank, world_size, case):
    """One distributed call on a bad batch; every rank must raise (collected by run_ranks)."""
    from aimnet2_systems import triclinic_crystal
    from mlipdd.data import AtomicData, Batch
    from mlipdd_aimnet2.testing import molecular_crystal

    model = FACTORY()
    if case == "element":
        batch = triclinic_crystal()
        batch.node["atomic_numbers"] = batch.atomic_numbers.clone()
        batch.atomic_numbers[0] = 79  # gold, on whichever rank owns atom 0 only
    elif case == "charge":
        batch = triclinic_crystal()
        batch.system["charge"] = torch.tensor([0.3], dtype=torch.float64)
    else:
        # a cluster in a vacuum box (spatial decomposition needs a box), periodic nowhere, wider
        # than the all-pairs cutoff: each rank finds pairs missing on its own atoms
        model = random_aimnet2_wrapper(seed=0, coulomb="simple", simple_cutoff=3.0)
        pair = molecular_crystal((2, 1, 1))
        batch = Batch.from_data_list([AtomicData(positions=pair.positions + 10.0, atomic_numbers=pair.atomic_numbers,
                                                 cell=torch.eye(3) * 30.0, pbc=False)])
    dm = DistributedModel(model, DomainConfig(cutoff=model.cutoff))
    owned = dm.partition(batch if rank == 0 else None)
    dm(owned)


@pytest.mark.parametrize(("case", "message"), [
    ("element", r"not trained on atomic number\(s\) \[79\]"),
    ("charge", "not an integer"),
    ("open_system", r"system\(s\) \[0\] take the all-pairs Coulomb sum.*raise simple_cutoff"),
])
def test_bad_input_fails_on_every_rank_with_the_fix(case, message):
    from mlipdd.testing.spawn import RankFailure

    with pytest.raises(RankFailure) as failure:
        run_ranks(_bad_input, 2, case, timeout=300)
    assert sorted(failure.value.failures) == [0, 1]
    for text in failure.value.failures.values():
        assert re.search(message, text), text[-800:]


def _halo_without_refresh(rank, world_size):
    """Halo storage with the mol_sum adapter only (no ghost refresh after the convolution)."""
    from aimnet2_systems import triclinic_crystal
    from mlipdd.spec import DistributionSpec, HaloStoragePolicy
    from mlipdd_aimnet2.adapters import aimnet2_helpers
    from mlipdd_aimnet2.spec import aimnet2_halo_spec

    model = FACTORY()
    spec = aimnet2_halo_spec().replace(
        distribution=DistributionSpec(HaloStoragePolicy(), third_party_helpers=aimnet2_helpers(halo=False)))
    dm = DistributedModel(model, DomainConfig(cutoff=model.cutoff, strategy=StrategyKind.HALO), spec=spec)
    owned = dm.partition(triclinic_crystal() if rank == 0 else None)
    out = dm(owned)
    return {"atom_ids": owned.atom_ids, "forces": out["forces"], "charges": out["charges"]}
