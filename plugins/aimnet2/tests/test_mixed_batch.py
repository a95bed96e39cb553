"""One wrapper, one batch of molecules and periodic cells, a Coulomb method per kind of system.

``coulomb={"molecule": "simple" | "dsf", "periodic": "dsf"}``: every system gets the
Coulomb term aimnet's calculator gives it alone (all pairs or DSF for the molecule, DSF
for the triclinic crystal and the slab). One process, float32 (the calculator's
precision) against aimnet's `AIMNet2Calculator` system by system; under DD (2, 3 and 4
gloo ranks, float64, sharded and halo storage) the mixed batch equals one process.
"""

from __future__ import annotations

import functools

import pytest
import torch
from aimnet2_systems import DSF_CUTOFF
from mlipdd.data import AtomicData, Batch
from mlipdd.testing import run_ranks
from mlipdd.testing.conformance import gather_by_id, relative_difference
from mlipdd_aimnet2.building import random_aimnet2
from mlipdd_aimnet2.testing import molecular_crystal, random_aimnet2_wrapper
from mlipdd_aimnet2.wrapper import AIMNet2Wrapper

SIMPLE_CUTOFF = 12.0  # wider than the two-molecule cluster (7 A), so all pairs are listed
MOLECULE_CHARGES = {"molecule": -1.0, "crystal": 1.0, "slab": 0.0}
PER_KIND = {"all_pairs": {"molecule": "simple", "periodic": "dsf"}, "dsf": {"molecule": "dsf", "periodic": "dsf"}}


def mixed_systems(dtype=torch.float64) -> list[AtomicData]:
    """A charged two-molecule cluster (in a 30 A box, periodic nowhere), a charged triclinic
    crystal and a neutral slab (periodic in x and y, vacuum along z)."""
    pair = molecular_crystal((1, 1, 2), seed=7, dtype=dtype)
    molecule = AtomicData(positions=pair.positions + 12.0, atomic_numbers=pair.atomic_numbers,
                          cell=torch.eye(3, dtype=dtype) * 30.0, pbc=False, dtype=dtype, charge=-1.0)
    crystal = molecular_crystal((2, 2, 1), seed=1, dtype=dtype, charge=1.0)
    slab = molecular_crystal((2, 2, 1), seed=3, vacuum_axis=2, dtype=dtype, charge=0.0)
    return [molecule, crystal, slab]


def _calculator_outputs(model, system: AtomicData, method: str) -> dict:
    from aimnet.calculators import AIMNet2Calculator

    calc = AIMNet2Calculator(model, needs_coulomb=True, needs_dispersion=False, device="cpu")
    data = {"coord": system.positions, "numbers": system.atomic_numbers, "charge": system.charge.reshape(1)}
    if bool(system.pbc.any()):
        data.update(cell=system.cell[0], pbc=system.pbc.reshape(3))
    if method == "dsf":
        calc.set_lrcoulomb_method("dsf", cutoff=DSF_CUTOFF, dsf_alpha=0.2)
    return calc(data, forces=True)


@pytest.mark.parametrize("per_kind", list(PER_KIND))
def test_each_system_equals_aimnets_calculator_on_it_alone(per_kind):
    model, _ = random_aimnet2(seed=0, dtype=torch.float32)
    methods = PER_KIND[per_kind]
    wrapper = AIMNet2Wrapper(model, dispersion=False, coulomb=methods, dsf_cutoff=DSF_CUTOFF,
                             simple_cutoff=SIMPLE_CUTOFF)
    systems = mixed_systems(torch.float32)
    batch = Batch.from_data_list(systems)
    assert wrapper.system_methods(batch) == [methods["molecule"], "dsf", "dsf"]
    out = wrapper(batch)
    start = 0
    for index, system in enumerate(systems):
        rows = slice(start, start + system.num_atoms)
        start += system.num_atoms
        method = methods["periodic" if bool(system.pbc.any()) else "molecule"]
        reference = {k: v.detach() for k, v in _calculator_outputs(model, system, method).items()}
        assert relative_difference(out["energy"][index].reshape(1), reference["energy"].reshape(1)) < 1e-6
        assert relative_difference(out["forces"][rows], reference["forces"]) < 4e-5, (index, method)
        assert relative_difference(out["charges"][rows], reference["charges"]) < 3e-5, (index, method)
    # the molecule's Coulomb term is the chosen one: the two choices differ
    other = AIMNet2Wrapper(model, dispersion=False, coulomb=PER_KIND["dsf" if per_kind == "all_pairs" else "all_pairs"],
                           dsf_cutoff=DSF_CUTOFF, simple_cutoff=SIMPLE_CUTOFF)(batch)
    assert abs(float(other["energy"][0] - out["energy"][0])) > 1e-3
    assert torch.equal(other["energy"][1:], out["energy"][1:])


FACTORY = functools.partial(random_aimnet2_wrapper, seed=0, coulomb=PER_KIND["all_pairs"], dsf_cutoff=DSF_CUTOFF,
                            simple_cutoff=SIMPLE_CUTOFF)
STRATEGIES = ("sharded", "halo")


def _distributed(rank, world_size):
    from mlipdd.distributed import DistributedModel, DomainConfig, StrategyKind

    model = FACTORY()
    results = {}
    for strategy in STRATEGIES:
        dm = DistributedModel(model, DomainConfig(cutoff=model.cutoff, skin=0.3, strategy=StrategyKind(strategy)))
        owned = dm.partition(Batch.from_data_list(mixed_systems()) if rank == 0 else None)
        out = dm(owned, compute_stress=True)
        results[strategy] = {"atom_ids": owned.atom_ids, **{k: v.detach() for k, v in out.items()}}
    return results


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_distributed_mixed_batch_equals_one_process(world_size):
    batch = Batch.from_data_list(mixed_systems())
    reference = FACTORY()(batch, compute_stress=True)
    parts = run_ranks(_distributed, world_size, timeout=900)
    for strategy in STRATEGIES:
        runs = [p[strategy] for p in parts]
        got = {"energy": runs[0]["energy"], "stress": runs[0]["stress"],
               "forces": gather_by_id(runs, "forces", batch.num_atoms),
               "charges": gather_by_id(runs, "charges", batch.num_atoms)}
        for key, value in got.items():
            diff = relative_difference(value, reference[key].detach())
            assert diff <= 1e-10, f"{world_size} ranks, {strategy}, {key}: {diff:.3g}"
