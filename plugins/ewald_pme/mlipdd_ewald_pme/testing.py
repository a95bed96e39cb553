"""Charged test systems and the torch-pme reference used by the tests and benchmarks."""

from __future__ import annotations

import math

import torch
from mlipdd import AtomicData, Batch

SKEW = torch.tensor([[1.0, 0.0, 0.0], [0.12, 1.0, 0.0], [-0.08, 0.15, 1.0]], dtype=torch.float64)


def rock_salt(reps=(2, 2, 2), lattice=5.64, rattle=0.1, vacancies=0, skew=True, seed=0,
              extra_charge=0.0) -> Batch:
    """Na+/Cl- rock salt, ``reps`` conventional cells, rattled, some vacancies, a tilted cell.

    Vacancies are removed in cation/anion pairs (the cell stays neutral); ``extra_charge``
    is added evenly to every atom (a charged cell, for the background term).
    """
    g = torch.Generator().manual_seed(seed)
    base = torch.tensor([[0, 0, 0], [0.5, 0.5, 0], [0.5, 0, 0.5], [0, 0.5, 0.5]], dtype=torch.float64)
    grid = torch.stack(torch.meshgrid(*[torch.arange(n) for n in reps], indexing="ij"), -1).reshape(-1, 1, 3)
    cations = (grid + base).reshape(-1, 3)
    anions = cations + torch.tensor([0.5, 0.0, 0.0], dtype=torch.float64)
    frac = torch.cat([cations, anions]) / torch.tensor(reps, dtype=torch.float64)
    z = torch.cat([torch.full((len(cations),), 11), torch.full((len(anions),), 17)])
    q = torch.cat([torch.ones(len(cations)), -torch.ones(len(anions))]).double()
    if vacancies:
        drop = torch.cat([torch.randperm(len(cations), generator=g)[:vacancies],
                          len(cations) + torch.randperm(len(anions), generator=g)[:vacancies]])
        keep = torch.ones(len(z), dtype=torch.bool)
        keep[drop] = False
        frac, z, q = frac[keep], z[keep], q[keep]
    cell = torch.diag(torch.tensor(reps, dtype=torch.float64) * lattice)
    if skew:
        cell = SKEW @ cell
    positions = frac @ cell + rattle * torch.randn(frac.shape, generator=g, dtype=torch.float64)
    data = AtomicData(positions=positions, atomic_numbers=z, cell=cell, pbc=True, dtype=torch.float64)
    batch = Batch.from_data_list([data])
    batch.add_node_property("charges", q + extra_charge / len(q))
    return batch


def random_charges(batch: Batch, seed=0, neutral=True) -> Batch:
    """Give ``batch`` random charges in [-1, 1] (neutral per system if asked)."""
    g = torch.Generator().manual_seed(seed)
    q = 2 * torch.rand(batch.num_atoms, generator=g, dtype=batch.dtype) - 1
    if neutral:
        for s in range(batch.num_systems):
            mask = batch.batch == s
            q[mask] -= q[mask].mean()
    batch.add_node_property("charges", q)
    return batch


def torchpme_reference(batch: Batch, alpha: float, cutoff: float, method="ewald", k_cutoff=None,
                       mesh_spacing=None, interpolation_nodes=4):
    """Energy, forces, stress of one system from torch-pme (the outside oracle)."""
    import torchpme
    from torchpme.prefactors import eV_A
    from vesin_torch import NeighborList

    positions = batch.positions.detach().clone().requires_grad_(True)
    cell = batch.cell[0].detach().clone()
    strain = torch.zeros(3, 3, dtype=cell.dtype, requires_grad=True)
    deform = torch.eye(3, dtype=cell.dtype) + 0.5 * (strain + strain.T)
    pos, box = positions @ deform, cell @ deform
    pairs, shifts = NeighborList(cutoff=cutoff, full_list=False).compute(
        points=pos.detach(), box=box.detach(), periodic=True, quantities="PS")
    distances = (pos[pairs[:, 1]] + shifts.to(pos.dtype) @ box - pos[pairs[:, 0]]).norm(dim=1)
    smearing = 1.0 / (math.sqrt(2.0) * alpha)
    potential = torchpme.CoulombPotential(smearing=smearing).to(cell.dtype)
    if method == "ewald":
        calc = torchpme.EwaldCalculator(potential, lr_wavelength=2 * math.pi / k_cutoff)
    else:
        calc = torchpme.PMECalculator(potential, mesh_spacing=mesh_spacing, interpolation_nodes=interpolation_nodes)
    q = batch.charges.detach().unsqueeze(1)
    energy = eV_A * (q * calc(q, box, pos, pairs, distances)).sum()
    grad_pos, grad_strain = torch.autograd.grad(energy, [positions, strain])
    return {"energy": energy.detach(), "forces": -grad_pos, "stress": grad_strain / cell.det().abs()}


# ---- domain decomposition: many cases per spawned launch -------------------------------


def distributed_cases(rank, world_size, cases):
    """Spawned-rank worker: each ``(factory, batch, compute_stress)`` through `DistributedModel`.

    One launch per rank count covers every case (spawning ranks is the slow part).
    Returns per case the owned atom ids, energy, forces, stress and this rank's edge count.
    """
    from mlipdd.distributed import DistributedModel, DistributedPipelineModel, DomainConfig
    from mlipdd.models import PipelineModelWrapper

    results = []
    for factory, batch, compute_stress in cases:
        model = factory()
        runner = DistributedPipelineModel if isinstance(model, PipelineModelWrapper) else DistributedModel
        dm = runner(model, DomainConfig(cutoff=model.cutoff))
        owned = dm.partition(batch if rank == 0 else None)
        out = dm(owned, compute_stress=compute_stress)
        results.append({
            "atom_ids": owned.atom_ids, "energy": out["energy"].detach(), "forces": out["forces"].detach(),
            "stress": out["stress"].detach() if compute_stress else None,
            "edges": dm.last_padded.neighbors.num_edges,
        })
    return results


def compare_distributed(cases, parts_by_rank, references):
    """Max relative differences per case and output: ranks (gathered by atom id) vs one process."""
    report = []
    for index, ((_, batch, compute_stress), reference) in enumerate(zip(cases, references)):
        parts = [rank_results[index] for rank_results in parts_by_rank]
        forces = torch.full_like(reference["forces"], float("nan"))
        for part in parts:
            forces[part["atom_ids"]] = part["forces"]
        diffs = {
            "energy": _relative(parts[0]["energy"], reference["energy"]),
            "forces": _relative(forces, reference["forces"]),
            "edges": max(p["edges"] for p in parts),
        }
        if compute_stress:
            diffs["stress"] = _relative(parts[0]["stress"], reference["stress"])
        report.append(diffs)
    return report


def _relative(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


# ---- pipelines (module level: spawned ranks rebuild them by name) ----------------------


def mace_block(seed=0):
    from mlipdd_mace.testing import random_mace_wrapper

    return random_mace_wrapper(elements=(11, 17), r_max=4.0, dtype=torch.float64, seed=seed)


def mace_pme_pipeline():
    from mlipdd.models import PipelineModelWrapper

    from mlipdd_ewald_pme.wrappers import PMEWrapper

    return PipelineModelWrapper([mace_block(), PMEWrapper(cutoff=6.0, accuracy=1e-6)])


def qeq_pme_pipeline():
    """A charge-equilibration model whose charges feed PME, next to MACE."""
    from mlipdd.models import PipelineModelWrapper
    from mlipdd.testing.qeq_model import QEqModel

    from mlipdd_ewald_pme.coupled import ChargeCoupled
    from mlipdd_ewald_pme.wrappers import PMEWrapper

    qeq = QEqModel(cutoff=4.0, species=(11, 17), seed=1)
    return PipelineModelWrapper([mace_block(), ChargeCoupled(qeq, PMEWrapper(cutoff=6.0, accuracy=1e-6))])


def distributed_error(rank, world_size, factory, batch):
    """Spawned-rank worker: the error message this rank raises for ``batch`` (None if none)."""
    from mlipdd.distributed import DistributedModel, DomainConfig

    model = factory()
    try:
        dm = DistributedModel(model, DomainConfig(cutoff=model.cutoff))
        owned = dm.partition(batch if rank == 0 else None)
        dm(owned)
    except Exception as error:  # noqa: BLE001 - the test inspects whatever reached this rank
        return f"{type(error).__name__}: {error}"
    return None


def mace_d3_pipeline():
    from mlipdd.models import PipelineModelWrapper

    from mlipdd_ewald_pme.d3 import D3Wrapper

    return PipelineModelWrapper([mace_block(), D3Wrapper(cutoff=6.0)])


def mace_pme_d3_pipeline():
    from mlipdd.models import PipelineModelWrapper

    from mlipdd_ewald_pme.d3 import D3Wrapper
    from mlipdd_ewald_pme.wrappers import PMEWrapper

    return PipelineModelWrapper([mace_block(), PMEWrapper(cutoff=6.0, accuracy=1e-6), D3Wrapper(cutoff=5.0)])
