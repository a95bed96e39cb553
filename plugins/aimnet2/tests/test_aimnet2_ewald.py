"""``AIMNet2Wrapper(coulomb="ewald")``: aimnet's Ewald option, at one process and under DD.

* one process, float32 (the calculator casts to float32) vs aimnet's `AIMNet2Calculator` with
  ``set_lrcoulomb_method("ewald", ewald_accuracy=1e-6)`` on a charged triclinic crystal, with the
  real-space cutoff aimnet picks for that cell (`aimnet_ewald_cutoff`). Measured: energy 2e-8,
  forces 4e-6, stress 2e-6, charges 3e-6 relative; limits 10x;
* one process, float64: the Ewald term alone (the energy with Ewald minus the energy without any
  Coulomb term: the network and the charges are the same) equals nvalchemiops'
  ``ewald_summation`` (aimnet's backend, float64, its own neighbour matrix) on the predicted
  charges, in aimnet's k_e; limit 1e-12 relative;
* DD, float64, 2/3/4 gloo ranks, sharded and halo storage: a triclinic crystal, two crystals with
  charges +1 / -2 (the background term), a cell smaller than the cutoff (own images) and a batch
  of a charged molecule and a crystal (``{"molecule": "simple", "periodic": "ewald"}``) equal one
  process (energy 1e-12, forces, stress, charges 1e-10 relative);
* refusals: a slab, a molecule under ``coulomb="ewald"``, Ewald as the molecule method.
"""

from __future__ import annotations

import functools

import pytest
import torch
from aimnet2_systems import own_images, triclinic_crystal
from mlipdd.data import AtomicData, Batch, InputError
from mlipdd.distributed import DistributedModel, DomainConfig, StrategyKind
from mlipdd.testing import run_ranks
from mlipdd.testing.conformance import gather_by_id, relative_difference
from mlipdd_aimnet2.building import random_aimnet2
from mlipdd_aimnet2.ewald import aimnet_ewald_cutoff
from mlipdd_aimnet2.testing import charged_pair, molecular_crystal, random_aimnet2_wrapper
from mlipdd_aimnet2.wrapper import AIMNet2Wrapper

ACCURACY = 1e-6
DD_CUTOFF = 8.0  # real space under DD: deeper than the network's 5 A, so the Coulomb ghosts are their own
STRATEGIES = (StrategyKind.SHARDED, StrategyKind.HALO)
KEYS = ("energy", "forces", "stress", "charges")
LIMITS = {"energy": 1e-12, "forces": 1e-10, "stress": 1e-10, "charges": 1e-10}
PER_KIND = {"molecule": "simple", "periodic": "ewald"}
SIMPLE_CUTOFF = 12.0  # wider than the two-molecule cluster (7 A): all its pairs listed


def _aimnet_cutoff(system) -> float:
    volume = float(torch.linalg.det(system.cell[0].double()).abs())
    return aimnet_ewald_cutoff(system.positions.shape[0], volume, ACCURACY)


def test_one_process_equals_aimnets_calculator_with_its_ewald_option():
    from aimnet.calculators import AIMNet2Calculator

    model, _ = random_aimnet2(seed=0, dtype=torch.float32)
    crystal = molecular_crystal((2, 2, 2), dtype=torch.float32, charge=1.0)
    calc = AIMNet2Calculator(model, needs_coulomb=True, needs_dispersion=False, device="cpu")
    calc.set_lrcoulomb_method("ewald", ewald_accuracy=ACCURACY)
    reference = calc({"coord": crystal.positions, "numbers": crystal.atomic_numbers, "charge": torch.tensor([1.0]),
                      "cell": crystal.cell[0], "pbc": torch.ones(3, dtype=torch.bool)}, forces=True, stress=True)
    wrapper = AIMNet2Wrapper(model, dispersion=False, coulomb="ewald", ewald_cutoff=_aimnet_cutoff(crystal),
                             ewald_accuracy=ACCURACY)
    out = wrapper(Batch.from_data_list([crystal]), compute_stress=True)
    limits = {"energy": 2e-7, "forces": 4e-5, "stress": 2e-5, "charges": 3e-5}
    for key, limit in limits.items():
        diff = relative_difference(out[key].detach().double().reshape(reference[key].shape),
                                   reference[key].detach().double())
        assert diff < limit, f"{key}: {diff:.3g} relative (limit {limit})"
    dsf = AIMNet2Wrapper(model, dispersion=False, coulomb="dsf")(Batch.from_data_list([crystal]))
    assert abs(float(dsf["energy"]) - float(out["energy"])) > 1e-2  # a different sum, visibly


def test_ewald_term_equals_nvalchemiops_ewald_summation_in_float64():
    from aimnet import constants
    from aimnet.calculators.neighbors import AdaptiveNeighborList
    from mlipdd_aimnet2.ewald import splitting
    from nvalchemiops.torch.interactions.electrostatics import ewald_summation

    model, _ = random_aimnet2(seed=0, dtype=torch.float64)
    batch = charged_pair()  # two systems, charges +1 and -2: background terms, a shared box of k
    cutoff = 9.0
    with_ewald = AIMNet2Wrapper(model, dispersion=False, coulomb="ewald", ewald_cutoff=cutoff)(batch.clone())
    without = AIMNet2Wrapper(model, dispersion=False, coulomb="none")(batch.clone())
    assert torch.equal(with_ewald["charges"], without["charges"])
    alpha, k_cutoff = splitting(cutoff, ACCURACY)
    matrix, _, shifts = AdaptiveNeighborList(cutoff=cutoff)(batch.positions, batch.cell, batch.pbc.bool(),
                                                           batch.batch.to(torch.int32), fill_value=batch.num_atoms)
    per_atom = ewald_summation(batch.positions, with_ewald["charges"], batch.cell, alpha=alpha, k_cutoff=k_cutoff,
                               batch_idx=batch.batch.to(torch.int32), neighbor_matrix=matrix,
                               neighbor_matrix_shifts=shifts.to(torch.int32), mask_value=batch.num_atoms)
    expected = torch.zeros(2, dtype=torch.float64).index_add(0, batch.batch, per_atom.double())
    expected = expected * constants.Hartree * constants.Bohr
    term = with_ewald["energy"] - without["energy"]
    assert relative_difference(term, expected) < 1e-12, (term, expected)


@pytest.mark.parametrize("name", ["two_charged_systems", "molecule_and_crystal"])
def test_one_process_kernels_equal_the_distributable_sums(name, monkeypatch):
    """At one process the Ewald term runs on nvalchemiops' kernels (no (N, K) phase matrices);
    under DD on per-atom torch sums. Same terms, same pairs, same Miller set: energies, forces,
    stress (through the kernels' own backward) and charges agree to 1e-12 in float64."""
    from mlipdd_aimnet2 import ewald

    factory, coulomb = SYSTEMS[name]
    model = _factory(coulomb)
    used = []
    original = ewald._kernels_apply
    monkeypatch.setattr(ewald, "_kernels_apply", lambda *a: used.append(original(*a)) or used[-1])
    kernels = model(factory(), compute_stress=True)
    assert used == [True]
    monkeypatch.setattr(ewald, "_kernels_apply", lambda *a: False)
    sums = model(factory(), compute_stress=True)
    for key in KEYS:
        assert relative_difference(kernels[key], sums[key]) < 1e-12, key


def _mixed() -> Batch:
    pair = molecular_crystal((1, 1, 2), seed=7)
    molecule = AtomicData(positions=pair.positions + 12.0, atomic_numbers=pair.atomic_numbers,
                          cell=torch.eye(3, dtype=torch.float64) * 30.0, pbc=False, charge=-1.0)
    return Batch.from_data_list([molecule, molecular_crystal((2, 2, 1), seed=1, charge=1.0)])


SYSTEMS = {"triclinic_crystal": (triclinic_crystal, "ewald"), "two_charged_systems": (charged_pair, "ewald"),
           "own_images": (own_images, "ewald"), "molecule_and_crystal": (_mixed, "per_kind")}


def _factory(coulomb: str):
    methods = PER_KIND if coulomb == "per_kind" else coulomb
    return random_aimnet2_wrapper(seed=0, coulomb=methods, ewald_cutoff=DD_CUTOFF, simple_cutoff=SIMPLE_CUTOFF)


def _distributed(rank, world_size):
    results = {}
    for strategy in STRATEGIES:
        for name, (build, coulomb) in SYSTEMS.items():
            model = _factory(coulomb)
            dm = DistributedModel(model, DomainConfig(cutoff=model.cutoff, skin=0.3, strategy=strategy))
            owned = dm.partition(build() if rank == 0 else None)
            out = dm(owned, compute_stress=True)
            results[strategy.value, name] = {"atom_ids": owned.atom_ids, **{k: out[k] for k in KEYS}}
    return results


@functools.cache
def _reference(name):
    build, coulomb = SYSTEMS[name]
    return {k: v.detach() for k, v in _factory(coulomb)(build(), compute_stress=True).items()}


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ewald_distributed_equals_one_process(world_size):
    parts = run_ranks(_distributed, world_size, timeout=900)
    for strategy in STRATEGIES:
        for name, (build, _) in SYSTEMS.items():
            n_atoms, reference = build().num_atoms, _reference(name)
            runs = [p[strategy.value, name] for p in parts]
            got = {"energy": runs[0]["energy"], "stress": runs[0]["stress"],
                   "forces": gather_by_id(runs, "forces", n_atoms), "charges": gather_by_id(runs, "charges", n_atoms)}
            for key in KEYS:
                diff = relative_difference(got[key], reference[key])
                assert diff <= LIMITS[key], f"{strategy.value}, {name}, {key}: {diff:.3g}"
            for run in runs[1:]:
                assert torch.equal(run["energy"], runs[0]["energy"])


def test_ewald_refusals_name_the_fix():
    model, _ = random_aimnet2(seed=0, dtype=torch.float64)
    slab = Batch.from_data_list([molecular_crystal((2, 2, 1), seed=3, vacuum_axis=2)])
    with pytest.raises(InputError, match=r"not periodic along every axis.*'dsf'.*slab_correction=True"):
        AIMNet2Wrapper(model, dispersion=False, coulomb="ewald")(slab)
    with pytest.raises(InputError, match=r"batch has a molecule.*'periodic': 'ewald'"):
        AIMNet2Wrapper(model, dispersion=False, coulomb="ewald")(_mixed())
    with pytest.raises(ValueError, match="cannot be the molecule method"):
        AIMNet2Wrapper(model, dispersion=False, coulomb={"molecule": "ewald", "periodic": "dsf"})
    with pytest.raises(ValueError, match="ewald_accuracy must lie in"):
        AIMNet2Wrapper(model, dispersion=False, coulomb="ewald", ewald_accuracy=2.0)
