"""AIMNet2 with the ewald_pme plugin: its charges feeding Ewald, and D3(BJ) outside the network.

* ``ChargeCoupled(AIMNet2Wrapper(coulomb="none"), EwaldWrapper)``: the network's energy plus
  the Ewald energy of its predicted charges, differentiated once (forces include
  ``dE/dq . dq/dr``). Single process: the energy is the sum of the two parts computed
  apart; forces and stress match central finite differences.
* ``PipelineModelWrapper([AIMNet2Wrapper(dispersion=False), D3Wrapper(params=metadata["d3_params"])])``:
  the D3(BJ) term a released AIMNet2 (wB97M-D3) expects from its calculator; the D3 part
  equals tad-dftd3 with the same parameters (1e-12) and aimnet's own `DFTD3` module to its
  float32 tables (2.5e-7 energy, 3e-6 forces, relative).
* Under DD (2, 3 and 4 gloo ranks, float64, one launch per rank count): both compositions
  on a triclinic molecular crystal equal one process; the Ewald one under sharded storage
  (the merge of AIMNet2's sharded spec with Ewald's halo spec) and under halo storage, and
  the PME one under halo storage (PME's spline ops are halo-only OpAdapters), plus the Ewald
  one on a 12-atom cell thinner than the cutoff (every rank sees its own images). Measured:
  energy <= 5e-16, forces <= 1e-14, stress <= 8e-15, charges <= 6e-15 relative.
"""

from __future__ import annotations

# Needs the ewald_pme plugin next to this one (as `make install` sets up): a missing
# plugin is a failure here, not a skip.
import functools

import pytest
import torch
from aimnet2_systems import own_images, triclinic_crystal
from mlipdd.testing import run_ranks
from mlipdd.testing.conformance import gather_by_id, relative_difference
from mlipdd_aimnet2.testing import molecular_crystal, random_aimnet2_wrapper

EWALD_CUTOFF = 6.0
D3_CUTOFF = 8.0
LIMIT = 1e-10


def aimnet_ewald():
    """AIMNet2 charges -> Ewald (the network's own Coulomb off)."""
    from mlipdd_ewald_pme import ChargeCoupled, EwaldWrapper

    return ChargeCoupled(random_aimnet2_wrapper(seed=0, coulomb="none"),
                         EwaldWrapper(cutoff=EWALD_CUTOFF, accuracy=1e-6))


def aimnet_pme():
    """AIMNet2 charges -> smooth PME (halo storage only: its spline ops are OpAdapters)."""
    from mlipdd_ewald_pme import ChargeCoupled, PMEWrapper

    return ChargeCoupled(random_aimnet2_wrapper(seed=0, coulomb="none"),
                         PMEWrapper(cutoff=EWALD_CUTOFF, accuracy=1e-6, mesh_spacing=0.5))


def aimnet_d3(coulomb="dsf"):
    """[AIMNet2 (dispersion=False), D3(BJ) with the wB97M parameters from the model's metadata]."""
    from mlipdd.models import PipelineModelWrapper
    from mlipdd_ewald_pme import D3Wrapper

    aimnet = random_aimnet2_wrapper(seed=0, coulomb=coulomb, dsf_cutoff=7.0)
    return PipelineModelWrapper([aimnet, D3Wrapper(cutoff=D3_CUTOFF, params=aimnet.metadata["d3_params"])])


def test_energy_is_aimnet_plus_ewald_of_its_charges():
    batch = triclinic_crystal()
    coupled = aimnet_ewald()
    out = coupled(batch, compute_stress=True)
    alone = coupled.charge_model(batch, compute_stress=True)
    with_charges = triclinic_crystal()
    with_charges.add_node_property("charges", alone["charges"])
    ewald = coupled.electrostatics(with_charges, compute_stress=True)
    assert torch.allclose(out["charges"], alone["charges"], rtol=0, atol=1e-14)
    assert abs(float((out["energy"] - alone["energy"] - ewald["energy"]).detach())) < 1e-12 * abs(float(out["energy"].detach()))
    assert float(ewald["energy"].detach().abs()) > 1e-3  # the charges are not zero: a real Coulomb term
    # forces differ from the sum of independently differentiated parts by dE_ewald/dq . dq/dr
    assert float((out["forces"] - alone["forces"] - ewald["forces"]).abs().max()) > 1e-6
    from mlipdd.data import InputError
    from mlipdd_ewald_pme import ChargeCoupled, EwaldWrapper

    with pytest.raises(InputError, match="count it twice"):
        ChargeCoupled(random_aimnet2_wrapper(seed=0), EwaldWrapper(cutoff=EWALD_CUTOFF))(batch)


def test_pme_agrees_with_ewald_on_the_predicted_charges():
    batch = triclinic_crystal()
    ewald, pme = aimnet_ewald()(batch, compute_stress=True), aimnet_pme()(batch, compute_stress=True)
    # measured: 3.8e-7 eV, 1.3e-6 eV/A, 4e-9 eV/A^3 (the mesh's interpolation error)
    assert abs(float((ewald["energy"] - pme["energy"]).detach())) < 1e-5
    assert float((ewald["forces"] - pme["forces"]).abs().max()) < 1e-4
    assert float((ewald["stress"] - pme["stress"]).abs().max()) < 1e-7


def test_forces_and_stress_match_finite_differences():
    batch = triclinic_crystal()
    model = aimnet_ewald()
    out = model(batch, compute_stress=True)

    def energy(positions=None, cell=None):
        b = triclinic_crystal()
        if positions is not None:
            b.node["positions"] = positions
        if cell is not None:
            b.system["cell"] = cell
        return float(model(b)["energy"].detach())

    h = 1e-4
    for atom in (0, 17, 41):
        for axis in range(3):
            plus, minus = batch.positions.clone(), batch.positions.clone()
            plus[atom, axis] += h
            minus[atom, axis] -= h
            fd = -(energy(positions=plus) - energy(positions=minus)) / (2 * h)
            assert abs(fd - float(out["forces"][atom, axis])) < 1e-6, (atom, axis, fd)
    # stress: strain the cell and the positions together, one symmetric component
    volume = float(torch.linalg.det(batch.cell[0]).abs())
    for i, j in ((0, 0), (0, 1)):
        values = []
        for sign in (1, -1):
            strain = torch.zeros(3, 3, dtype=torch.float64)
            strain[i, j] = strain[j, i] = sign * h / (2 if i != j else 1)
            deform = torch.eye(3, dtype=torch.float64) + strain
            values.append(energy(positions=batch.positions @ deform, cell=batch.cell @ deform))
        fd = (values[0] - values[1]) / (2 * h) / volume  # d E / d(symmetric strain) / V
        assert abs(fd - float(out["stress"][0, i, j])) < 1e-7, (i, j, fd, float(out["stress"][0, i, j]))


def test_d3_part_equals_tad_dftd3_with_the_wb97m_parameters():
    import tad_dftd3 as tad  # the ewald_pme plugin's dependency
    from mlipdd.data import Batch
    from mlipdd_ewald_pme.d3 import BOHR, HARTREE
    from tad_dftd3.cutoff import Cutoff

    # an open cluster of 4 molecules (tad-dftd3 sums no periodic images): all-pairs Coulomb
    batch = Batch.from_data_list([molecular_crystal((2, 2, 1), seed=5, pbc=False)])
    pipeline = aimnet_d3(coulomb="simple")
    out = pipeline(batch)
    alone = pipeline.models[0](batch)
    params = pipeline.models[0].metadata["d3_params"]
    assert params == {"s6": 1.0, "s8": 0.3908, "a1": 0.566, "a2": 3.128}  # aimnet's wB97M-D3(BJ)
    positions = batch.positions.clone().requires_grad_(True)
    param = {k: torch.tensor(v, dtype=torch.float64) for k, v in {**params, "s9": 0.0}.items()}
    cutoff = Cutoff(cn=D3_CUTOFF / BOHR, disp2=D3_CUTOFF / BOHR, disp3=D3_CUTOFF / BOHR, dtype=torch.float64)
    e_d3 = HARTREE * tad.dftd3(batch.atomic_numbers, positions / BOHR, param, cutoff=cutoff).sum()
    f_d3 = -torch.autograd.grad(e_d3, positions)[0]
    assert abs(float((out["energy"] - alone["energy"] - e_d3).detach())) < 1e-12 * abs(float(e_d3))
    assert float((out["forces"] - alone["forces"] - f_d3).abs().max()) < 1e-12 * float(f_d3.abs().max())
    assert float(e_d3) < -1e-2  # a real dispersion energy


def test_d3_equals_aimnets_own_dftd3_module():
    """aimnet's calculator adds its `DFTD3` module (nvalchemiops kernels, float32 reference
    tables; runs on CPU): the same numbers to float32 accuracy. No cutoff inside the cluster:
    40 A for both, aimnet's smoothing window pushed to the last 1 % of it."""
    from aimnet.modules.lr import DFTD3
    from mlipdd.data import Batch
    from mlipdd_aimnet2.building import released_layout
    from mlipdd_ewald_pme import D3Wrapper

    params = released_layout()[1]["d3_params"]
    batch = Batch.from_data_list([molecular_crystal((2, 2, 1), seed=5, pbc=False)])
    ours = D3Wrapper(cutoff=40.0, params=params)(batch)
    positions = batch.positions.clone().requires_grad_(True)
    module = DFTD3(s8=params["s8"], a1=params["a1"], a2=params["a2"], s6=params["s6"], cutoff=40.0,
                   smoothing_fraction=0.01)
    energy = module({"coord": positions[None], "numbers": batch.atomic_numbers[None],
                     "_nb_mode": torch.tensor(0)})["energy"]
    forces = -torch.autograd.grad(energy.sum(), positions)[0]
    # measured: 2.5e-7 (energy), 3e-6 (forces), relative
    assert abs(float((energy - ours["energy"]).detach())) < 1e-6 * abs(float(energy.detach()))
    assert float((forces - ours["forces"]).abs().max()) < 2e-5 * float(forces.abs().max())


CASES = {  # name: (model, strategy, system)
    "ewald_sharded": (aimnet_ewald, "sharded", triclinic_crystal),
    "ewald_halo": (aimnet_ewald, "halo", triclinic_crystal),
    "pme_halo": (aimnet_pme, "halo", triclinic_crystal),
    "d3_sharded": (aimnet_d3, "sharded", triclinic_crystal),
    "ewald_own_images": (aimnet_ewald, "sharded", own_images),  # cell thinner than the cutoff
}


def _distributed(rank, world_size):
    from mlipdd.distributed import (
        DistributedModel,
        DistributedPipelineModel,
        DomainConfig,
        StrategyKind,
    )
    from mlipdd.models import PipelineModelWrapper

    results = {}
    for name, (factory, strategy, system) in CASES.items():
        model = factory()
        runner = DistributedPipelineModel if isinstance(model, PipelineModelWrapper) else DistributedModel
        config = DomainConfig(cutoff=model.cutoff, skin=0.3, strategy=StrategyKind(strategy))
        dm = runner(model, config)
        owned = dm.partition(system() if rank == 0 else None)
        out = dm(owned, compute_stress=True)
        results[name] = {"atom_ids": owned.atom_ids, "spec": dm.spec.name,
                         **{k: out[k].detach() for k in ("energy", "forces", "stress") if k in out},
                         "charges": out["charges"].detach() if "charges" in out else None}
    return results


@functools.cache
def _reference(name):
    factory, _, system = CASES[name]
    return {k: v.detach() for k, v in factory()(system(), compute_stress=True).items()}


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_distributed_equals_one_process(world_size):
    parts = run_ranks(_distributed, world_size, timeout=900)
    for name, (_, _, system) in CASES.items():
        n = system().num_atoms
        runs, reference = [p[name] for p in parts], _reference(name)
        got = {"energy": runs[0]["energy"], "stress": runs[0]["stress"], "forces": gather_by_id(runs, "forces", n)}
        if runs[0]["charges"] is not None:  # the coupled models report the charges they fed in
            got["charges"] = gather_by_id(runs, "charges", n)
            assert abs(float(got["charges"].sum())) < 1e-3  # the neutral crystal stays neutral
        for key, value in got.items():
            diff = relative_difference(value, reference[key])
            assert diff <= LIMIT, f"{world_size} ranks, {name}, {key}: {diff:.3g}"
            print(f"{world_size} ranks {name} {key}: {diff:.2g} ({runs[0]['spec']})")
    assert parts[0]["ewald_sharded"]["spec"].startswith("aimnet2_sharded")
    assert parts[0]["ewald_halo"]["spec"].startswith("aimnet2_halo")
    assert parts[0]["pme_halo"]["spec"].startswith("aimnet2_halo")
