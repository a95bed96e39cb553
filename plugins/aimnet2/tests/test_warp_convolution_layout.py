"""The GPU branch of aimnet's convolution, run on the CPU: `AIMNet2Wrapper` still equals aimnet's calculator.

On CUDA in float32 aimnet's `ConvSV` calls a Warp kernel whose defaults treat the last
atom row as a padding atom (NOTE [aimnet's Warp convolution] in `mlipdd_aimnet2.inputs`);
mlipdd's layout has no padding atom, and before `explicit_convolution_rows` the H200 gave
0.07 eV, 0.7 eV/A and 0.1 e off the calculator while every CPU test passed. Here the same
Warp kernel runs on the CPU (`warp_convolution_on_cpu`), float32 as the calculator runs.
Measured with the fix: differences 0 to 6e-8 (the kernel's sum order); without it (the
control): 2.5e-3 eV, 6e-2 eV/A, 5e-2 e on the 48-atom molecule.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from aimnet2_systems import DSF_CUTOFF
from mlipdd.data import AtomicData, Batch
from mlipdd_aimnet2.building import random_aimnet2
from mlipdd_aimnet2.testing import molecular_crystal
from mlipdd_aimnet2.wrapper import AIMNet2Wrapper
from warp_convolution_on_cpu import cuda_convolution_on_cpu

pytest.importorskip("warp")


@pytest.fixture(scope="module")
def model32():
    return random_aimnet2(seed=0, dtype=torch.float32)


def _molecule():
    cluster = molecular_crystal((2, 2, 2), seed=0, pbc=False, dtype=torch.float32)  # 48 atoms
    molecule = AtomicData(positions=cluster.positions, atomic_numbers=cluster.atomic_numbers, dtype=torch.float32,
                          charge=-1.0)
    data = {"coord": molecule.positions, "numbers": molecule.atomic_numbers, "charge": torch.tensor([-1.0])}
    return Batch.from_data_list([molecule]), data, "simple"


def _crystal():
    crystal = molecular_crystal((2, 2, 2), seed=1, dtype=torch.float32, charge=1.0)
    data = {"coord": crystal.positions, "numbers": crystal.atomic_numbers, "charge": torch.tensor([1.0]),
            "cell": crystal.cell[0], "pbc": torch.ones(3, dtype=torch.bool)}
    return Batch.from_data_list([crystal]), data, "dsf"


def _largest_differences(model, system):
    from aimnet.calculators import AIMNet2Calculator

    batch, data, coulomb = system
    calc = AIMNet2Calculator(model, needs_coulomb=True, needs_dispersion=False, device="cpu")
    if coulomb == "dsf":
        calc.set_lrcoulomb_method("dsf", cutoff=DSF_CUTOFF, dsf_alpha=0.2)
    wrapper = AIMNet2Wrapper(model, dispersion=False, coulomb=coulomb, dsf_cutoff=DSF_CUTOFF)
    with cuda_convolution_on_cpu():
        reference = calc(dict(data), forces=True)
        out = wrapper(batch)
    return {key: float((out[key].detach().double().reshape(-1) - reference[key].detach().double().reshape(-1))
                       .abs().max()) for key in ("energy", "forces", "charges")}


@pytest.mark.parametrize("system", [_molecule, _crystal], ids=["molecule_all_pairs", "crystal_dsf"])
def test_wrapper_equals_calculator_on_aimnets_warp_convolution(model32, system):
    model, _ = model32
    diff = _largest_differences(model, system())
    assert diff["energy"] < 1e-5 and diff["forces"] < 1e-4 and diff["charges"] < 1e-5, diff


def test_control_without_explicit_rows_the_warp_convolution_is_wrong(model32, monkeypatch):
    """The check above can fail: with the kernel's defaults the last atom is dropped."""
    import mlipdd_aimnet2.wrapper as wrapper_module

    model, _ = model32
    monkeypatch.setattr(wrapper_module, "explicit_convolution_rows", contextlib.nullcontext)
    diff = _largest_differences(model, _molecule())
    assert diff["charges"] > 1e-3 and diff["forces"] > 1e-3, diff


def _distributed_on_warp(rank, world_size):
    """DD with aimnet's Warp convolution branch taken (as on CUDA): ShardTensor rows take the einsum."""
    from aimnet2_systems import triclinic_crystal
    from mlipdd.distributed import DistributedModel, DomainConfig, StrategyKind
    from mlipdd_aimnet2.testing import random_aimnet2_wrapper

    model = random_aimnet2_wrapper(seed=0, dtype=torch.float32, dsf_cutoff=DSF_CUTOFF)
    results = {}
    with cuda_convolution_on_cpu():
        for strategy in (StrategyKind.SHARDED,):  # halo reads through the same convolution
            dm = DistributedModel(model, DomainConfig(cutoff=model.cutoff, skin=0.3, strategy=strategy))
            owned = dm.partition(triclinic_crystal().to(dtype=torch.float32) if rank == 0 else None)
            out = dm(owned)
            results[strategy.value] = {"atom_ids": owned.atom_ids, "energy": out["energy"],
                                       "forces": out["forces"], "charges": out["charges"]}
    return results


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_distributed_on_warp_convolution_equals_one_process(world_size):
    from aimnet2_systems import triclinic_crystal
    from mlipdd.testing import run_ranks
    from mlipdd.testing.conformance import gather_by_id, relative_difference
    from mlipdd_aimnet2.testing import random_aimnet2_wrapper

    batch = triclinic_crystal().to(dtype=torch.float32)
    with cuda_convolution_on_cpu():
        reference = random_aimnet2_wrapper(seed=0, dtype=torch.float32, dsf_cutoff=DSF_CUTOFF)(batch)
    parts = run_ranks(_distributed_on_warp, world_size, timeout=900)
    for strategy in ("sharded",):
        runs = [p[strategy] for p in parts]
        got = {"energy": runs[0]["energy"], "forces": gather_by_id(runs, "forces", batch.num_atoms),
               "charges": gather_by_id(runs, "charges", batch.num_atoms)}
        # float32: the one-process call sums in another order (and its DSF goes through the kernel)
        for key, limit in {"energy": 1e-6, "forces": 1e-4, "charges": 1e-4}.items():
            diff = relative_difference(got[key].double(), reference[key].detach().double())
            assert diff < limit, f"{strategy}, {key}: {diff:.3g}"
