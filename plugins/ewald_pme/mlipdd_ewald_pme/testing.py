"""Charged test systems and the torch-pme reference used by the tests and benchmarks."""

from __future__ import annotations

import functools
import itertools
import math
import os

import torch
from mlipdd import AtomicData, Batch

from mlipdd_ewald_pme.d3 import D3Wrapper
from mlipdd_ewald_pme.wrappers import DSFWrapper, EwaldWrapper, PMEWrapper

# The settings the plugin's distributed tests share: rank counts (MLIPDD_CONFORMANCE_RANKS narrows
# them) and the wrappers at a 6 A real-space cutoff, accuracy 1e-6.
WORLD_SIZES = tuple(int(n) for n in os.environ.get("MLIPDD_CONFORMANCE_RANKS", "2,3,4").split(","))
EWALD = functools.partial(EwaldWrapper, cutoff=6.0, accuracy=1e-6)
PME = functools.partial(PMEWrapper, cutoff=6.0, accuracy=1e-6)
PME_TORCH = functools.partial(PMEWrapper, cutoff=6.0, accuracy=1e-6, spline="torch")
DSF = functools.partial(DSFWrapper, cutoff=7.0, alpha=0.25)
D3 = functools.partial(D3Wrapper, cutoff=6.0)

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


def distributed_cases(rank, world_size, cases, strategy=None):
    """Spawned-rank worker: each ``(factory, batch, compute_stress)`` through `DistributedModel`
    (``strategy``: DomainConfig's, None = the model's own choice).

    One launch per rank count covers every case (spawning ranks is the slow part).
    Returns per case the owned atom ids, energy, forces, stress and this rank's edge count.
    """
    from mlipdd.distributed import DistributedModel, DistributedPipelineModel, DomainConfig
    from mlipdd.models import PipelineModelWrapper

    results = []
    for factory, batch, compute_stress in cases:
        model = factory()
        runner = DistributedPipelineModel if isinstance(model, PipelineModelWrapper) else DistributedModel
        dm = runner(model, DomainConfig(cutoff=model.cutoff, strategy=strategy))
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


# ---- D3 oracles: tad-dftd3 (molecular; periodic through an image cluster), simple-dftd3 ----


def _image_cluster(positions, cell, pbc, reach: float):
    """Every periodic image within ``reach`` of some atom of the cell: (atom index, shift)."""
    if not bool(pbc.any()):
        return torch.arange(len(positions)), torch.zeros(len(positions), 3, dtype=positions.dtype)
    heights = 1.0 / torch.linalg.inv(cell).norm(dim=0)
    bounds = [math.ceil(reach / float(h)) + 1 if bool(p) else 0 for h, p in zip(heights, pbc)]
    axes = [torch.arange(-b, b + 1, dtype=positions.dtype) for b in bounds]
    shifts = torch.stack(torch.meshgrid(*axes, indexing="ij"), -1).reshape(-1, 3)
    images = positions.unsqueeze(0) + (shifts @ cell).unsqueeze(1)  # (S, N, 3)
    near = torch.cdist(images.reshape(-1, 3), positions).amin(1) <= reach
    index = torch.arange(len(positions)).repeat(len(shifts))[near]
    return index, shifts.repeat_interleave(len(positions), 0)[near]


def tad_dftd3_reference(batch: Batch, cutoff: float, params: dict, s9: float = 0.0):
    """Energy, forces and stress of one system from tad-dftd3 (eV, eV/A, eV/A^3).

    tad-dftd3 is molecular, so a periodic cell becomes a cluster of its images: every image
    within twice the cutoff of a cell atom (a pair energy needs both atoms' CN, a CN needs
    the neighbours within the cutoff). The cell's energy is the sum of tad-dftd3's
    atom-resolved energies of the cell's own atoms; as a function of the cell atoms'
    positions (each image follows its atom) and of a strain of the whole cluster, it is the
    periodic energy exactly, so autograd gives the periodic forces and stress. ``s9 > 0``
    adds tad-dftd3's three-body (ATM) term with the same cutoff.
    """
    import tad_dftd3
    from tad_dftd3.cutoff import Cutoff

    from mlipdd_ewald_pme.d3 import BOHR, HARTREE

    cell = batch.cell[0].detach().clone()
    pbc = batch.pbc[0] if batch.pbc is not None else torch.zeros(3, dtype=torch.bool)
    index, shifts = _image_cluster(batch.positions.detach(), cell, pbc, 2 * cutoff)
    own = (shifts == 0).all(1)
    param = {k: torch.tensor(float(v), dtype=cell.dtype) for k, v in {**params, "s9": s9}.items()}
    cut = Cutoff(cn=cutoff / BOHR, disp2=cutoff / BOHR, disp3=cutoff / BOHR, dtype=cell.dtype)

    def cell_energy(positions, strain):
        deform = torch.eye(3, dtype=cell.dtype) + 0.5 * (strain + strain.T)
        cluster = (positions[index] + shifts @ cell) @ deform
        per_atom = tad_dftd3.dftd3(batch.atomic_numbers[index], cluster / BOHR, param, cutoff=cut)
        return HARTREE * per_atom[own].sum()

    positions = batch.positions.detach().clone().requires_grad_(True)
    strain = torch.zeros(3, 3, dtype=cell.dtype, requires_grad=True)
    energy = cell_energy(positions, strain)
    grad_pos, grad_strain = torch.autograd.grad(energy, [positions, strain])
    differences = False
    if not bool(torch.isfinite(grad_pos).all() and torch.isfinite(grad_strain).all()):
        # tad-dftd3's own fallback (all weights on the highest-CN reference when every
        # Gaussian underflows) has a NaN backward: its energy is fine, so differentiate
        # that by central differences (h = 1e-4 A / 1e-4 strain: ~1e-9 relative)
        differences, h = True, 1e-4
        with torch.no_grad():
            grad_pos = torch.zeros_like(positions)
            for i, j in itertools.product(range(len(positions)), range(3)):
                step = torch.zeros_like(positions)
                step[i, j] = h
                grad_pos[i, j] = (cell_energy(positions + step, strain) - cell_energy(positions - step, strain)) / (2 * h)
            grad_strain = torch.zeros_like(strain)
            for i, j in itertools.product(range(3), range(3)):
                if not bool(pbc.all()) or j < i:
                    continue
                step = torch.zeros_like(strain)
                step[i, j] = h  # the symmetrised strain moves (i, j) and (j, i) by h / 2 each
                value = (cell_energy(positions, strain + step) - cell_energy(positions, strain - step)) / (2 * h)
                grad_strain[i, j] = grad_strain[j, i] = value
    volume = float(cell.det().abs()) if bool(pbc.all()) else float("nan")
    return {"energy": energy.detach(), "forces": -grad_pos, "stress": grad_strain / volume,
            "cluster_atoms": len(index), "finite_differences": differences}


def simple_dftd3_reference(batch: Batch, cutoff: float, params: dict, s9: float = 0.0,
                           three_body_cutoff: float | None = None, switch_width: float = 0.0):
    """Energy, forces and stress of one system from simple-dftd3 (the ``dftd3`` package's
    Python API over its compiled library; periodic natively), same cutoffs and units as
    `tad_dftd3_reference`; ``three_body_cutoff`` (default ``cutoff``): its ATM triples';
    ``switch_width`` (A): simple-dftd3's smoothing of the pair term over the last A of the cutoff."""
    from dftd3.interface import DispersionModel, RationalDampingParam

    from mlipdd_ewald_pme.d3 import BOHR, HARTREE

    pbc = batch.pbc[0] if batch.pbc is not None else torch.zeros(3, dtype=torch.bool)
    cell = batch.cell[0].detach().double()
    model = DispersionModel(batch.atomic_numbers.numpy(), batch.positions.detach().double().numpy() / BOHR,
                            cell.numpy() / BOHR, pbc.numpy())
    three = cutoff if three_body_cutoff is None else three_body_cutoff
    model.set_realspace_cutoff(cutoff / BOHR, three / BOHR, cutoff / BOHR, switch_width / BOHR)  # pairs, triples, CN
    damping = RationalDampingParam(s6=params["s6"], s8=params["s8"], a1=params["a1"], a2=params["a2"], s9=s9)
    result = model.get_dispersion(damping, grad=True)
    volume = float(cell.det().abs()) if bool(pbc.all()) else float("nan")
    return {"energy": torch.tensor(HARTREE * float(result["energy"]), dtype=torch.float64),
            "forces": torch.from_numpy(-HARTREE / BOHR * result["gradient"]),
            "stress": torch.from_numpy(HARTREE * result["virial"] / volume)}


def d3_systems(seed: int = 0) -> dict:
    """Crystals (ionic, covalent, metals), an oxide slab, an open MgO cluster and molecules,
    as ``{name: ase.Atoms}``, rattled by 0.05 A (forces and off-diagonal stress nonzero).

    The dense ionic solids (MgO, CsCl, CaF2, LiF, Al2O3, the MgO slab and cluster) put
    cations at coordination numbers far above their largest D3 reference, where every
    Gaussian weight underflows (NaN before the fix)."""
    import numpy as np
    from ase import Atoms
    from ase.build import bulk, molecule, surface
    from ase.spacegroup import crystal

    systems = {
        "MgO rock salt": bulk("MgO", "rocksalt", a=4.21),
        "CsCl": bulk("CsCl", "cesiumchloride", a=4.12),
        "CaF2 fluorite": bulk("CaF2", "fluorite", a=5.46),
        "LiF rock salt": bulk("LiF", "rocksalt", a=4.03),
        "NaCl rock salt (cubic)": bulk("NaCl", "rocksalt", a=5.64, cubic=True),
        "Al2O3 corundum": crystal(["Al", "O"], basis=[(0, 0, 0.3523), (0.3064, 0, 0.25)], spacegroup=167,
                                  cellpar=[4.759, 4.759, 12.99, 90, 90, 120]),
        "TiO2 rutile": crystal(["Ti", "O"], basis=[(0, 0, 0), (0.3048, 0.3048, 0)], spacegroup=136,
                               cellpar=[4.594, 4.594, 2.959, 90, 90, 90]),
        "SrTiO3 perovskite": crystal(["Sr", "Ti", "O"], basis=[(0, 0, 0), (0.5, 0.5, 0.5), (0.5, 0.5, 0)],
                                     spacegroup=221, cellpar=[3.905, 3.905, 3.905, 90, 90, 90]),
        "ZnS zinc blende": bulk("ZnS", "zincblende", a=5.41),
        "Si diamond": bulk("Si", "diamond", a=5.43),
        "Cu fcc (cubic)": bulk("Cu", "fcc", a=3.61, cubic=True),
        "Al fcc (cubic)": bulk("Al", "fcc", a=4.05, cubic=True),
        "Fe bcc (cubic)": bulk("Fe", "bcc", a=2.87, cubic=True),
        "Ni fcc (cubic)": bulk("Ni", "fcc", a=3.52, cubic=True),
        "Li bcc (cubic)": bulk("Li", "bcc", a=3.51, cubic=True),
        "MgO(100) slab": surface(bulk("MgO", "rocksalt", a=4.21, cubic=True), (1, 0, 0), 3, vacuum=6.0),
        "MgO cluster (open)": bulk("MgO", "rocksalt", a=4.21, cubic=True).repeat((2, 2, 2)),
        "H2O": molecule("H2O"),
        "CH4": molecule("CH4"),
        "benzene": molecule("C6H6"),
        "ethanol": molecule("CH3CH2OH"),
        "SiH4": molecule("SiH4"),
    }
    systems["MgO(100) slab"].pbc = (True, True, False)
    cluster = systems["MgO cluster (open)"]
    systems["MgO cluster (open)"] = Atoms(cluster.numbers, cluster.positions, cell=np.eye(3) * 30.0, pbc=False)
    rng = np.random.default_rng(seed)
    for atoms in systems.values():
        if not atoms.pbc.any():
            atoms.cell = np.eye(3) * 30.0
            atoms.center()
        atoms.positions += rng.normal(scale=0.05, size=atoms.positions.shape)
    return systems


# ---- PME accuracy: the committed set of charged systems ----------------------------------

SPCE_CHARGES = {"O": -0.8476, "H": 0.4238}


def water_box(n_side: int = 4, shear: float = 0.15, seed: int = 0) -> Batch:
    """``n_side^3`` rigid SPC/E-geometry waters (O-H 1 A, H-O-H 109.47 deg) at 1 g/cm^3,
    randomly oriented on a jittered grid in a sheared (triclinic) cell; SPC/E charges."""
    g = torch.Generator().manual_seed(seed)
    spacing = (18.015 / 0.6022 / 1.0) ** (1 / 3)  # A per molecule at 1 g/cm^3
    half = math.radians(109.47) / 2
    local = torch.tensor([[0.0, 0.0, 0.0], [math.sin(half), 0.0, math.cos(half)],
                          [-math.sin(half), 0.0, math.cos(half)]], dtype=torch.float64)
    grid = torch.stack(torch.meshgrid(*[torch.arange(n_side)] * 3, indexing="ij"), -1).reshape(-1, 3).double()
    rotations, _ = torch.linalg.qr(torch.randn(len(grid), 3, 3, generator=g, dtype=torch.float64))
    centres = (grid + 0.5 + 0.15 * torch.randn(grid.shape, generator=g, dtype=torch.float64)) * spacing
    positions = (centres[:, None, :] + local @ rotations.transpose(1, 2)).reshape(-1, 3)
    cell = torch.eye(3, dtype=torch.float64) * n_side * spacing
    cell[1, 0] = shear * n_side * spacing  # b tilted along a
    frac = positions @ torch.linalg.inv(torch.eye(3, dtype=torch.float64) * n_side * spacing)
    positions = frac @ cell
    z = torch.tensor([8, 1, 1]).repeat(len(grid))
    q = torch.tensor([SPCE_CHARGES["O"], SPCE_CHARGES["H"], SPCE_CHARGES["H"]], dtype=torch.float64).repeat(len(grid))
    batch = Batch.from_data_list([AtomicData(positions=positions, atomic_numbers=z, cell=cell, pbc=True,
                                             dtype=torch.float64)])
    batch.add_node_property("charges", q)
    return batch


def with_vacuum(batch: Batch, vacuum: float) -> Batch:
    """The same atoms in a cell lengthened along its third vector by ``vacuum`` A (a slab,
    still periodic: PME and Ewald sum its images, as in a slab calculation without dipole
    correction)."""
    out = batch.clone()
    cell = out.system["cell"].clone()
    length = cell[0, 2].norm()
    cell[0, 2] = cell[0, 2] * (length + vacuum) / length
    out.system["cell"] = cell
    return out


def dipolar_slab(vacuum: float, neutral: bool = True, periodic: bool = False) -> Batch:
    """A tilted, rattled 2x2x1 NaCl slab (32 ions) with random charges (a dipole across it;
    neutral or not) and ``vacuum`` A along its third, non-periodic axis (``periodic``: pbc
    True there too, for the uncorrected 3D sum)."""
    batch = with_vacuum(random_charges(rock_salt((2, 2, 1), seed=1, rattle=0.2), seed=5 if neutral else 6,
                                       neutral=neutral), vacuum)
    c = batch.cell[0, 2]
    batch.node["positions"] = batch.positions + 0.5 * vacuum * c / c.norm()  # centred: inside the box along z
    batch.system["pbc"] = torch.tensor([[True, True, periodic]])
    return batch


def accuracy_systems() -> dict:
    """The committed PME/Ewald accuracy set: an ionic crystal, SPC/E water, a slab with
    vacuum, a charged cell (background); all tilted, rattled."""
    return {
        "NaCl crystal (212 ions)": rock_salt((3, 3, 3), vacancies=2, seed=0),
        "SPC/E water (64 molecules, sheared cell)": water_box(4, seed=0),
        "NaCl slab (144 ions, 12 A vacuum)": with_vacuum(rock_salt((3, 3, 2), seed=1), 12.0),
        "charged NaCl cell (214 ions, +3 e)": rock_salt((3, 3, 3), vacancies=1, extra_charge=3.0, seed=2),
    }


def rock_salt_mgo(reps=(3, 3, 3), seed=0) -> Batch:
    """Mg2+/O2- rock salt (a = 4.21 A), rattled, tilted: formal charges +-2 at 0.107 atoms/A^3."""
    batch = rock_salt(reps, lattice=4.21, rattle=0.05, seed=seed)
    batch.node["atomic_numbers"] = torch.where(batch.atomic_numbers == 11, 12, 8)
    batch.add_node_property("charges", 2.0 * batch.charges)
    return batch


# ---- the distributed mesh (PMEWrapper(mesh="distributed")) ---------------------------------


def configured_cases(rank, world_size, cases):
    """Spawned-rank worker like `distributed_cases`, each case ``(factory, batch,
    compute_stress, options)`` with its own DomainConfig ``options`` (strategy, grid; a
    grid of ``"z"`` puts every rank along the third cell vector). Also returns the mesh
    bytes the rank held (`distributed_pme.MESH_BYTES`)."""
    from mlipdd.distributed import DistributedModel, DomainConfig

    from mlipdd_ewald_pme import distributed_pme

    results = []
    for factory, batch, compute_stress, options in cases:
        model = factory()
        options = dict(options)
        if options.get("grid") == "z":
            options["grid"] = (1, 1, world_size)
        dm = DistributedModel(model, DomainConfig(cutoff=model.cutoff, **options))
        owned = dm.partition(batch if rank == 0 else None)
        out = dm(owned, compute_stress=compute_stress)
        results.append({
            "atom_ids": owned.atom_ids, "energy": out["energy"].detach(), "forces": out["forces"].detach(),
            "stress": out["stress"].detach() if compute_stress else None, "edges": 0,
            "owned": int(owned.num_atoms), "mesh_bytes": distributed_pme.MESH_BYTES["last"],
        })
    return results


def offset_slab(vacuum: float = 30.0) -> Batch:
    """`dipolar_slab` moved to the bottom of its periodic cell: ranks cut along the third
    cell vector leave the upper ones without a charge (pbc True along every axis)."""
    batch = dipolar_slab(vacuum, neutral=False, periodic=True)
    c = batch.cell[0, 2]
    batch.node["positions"] = batch.positions - (0.5 * vacuum - 1.0) * c / c.norm()
    return batch


def reciprocal_only(mesh: str = "distributed", cutoff: float = 8.0, accuracy: float = 1e-4,
                    mesh_spacing: float | None = None):
    """PME's reciprocal part alone (benchmarks): the splitting of ``cutoff`` and
    ``accuracy``, but a 1 A neighbour list and halo, so that the mesh is what is timed."""
    from mlipdd_ewald_pme.wrappers import PMEWrapper, _splitting

    class ReciprocalOnly(PMEWrapper):
        def atomic_energies(self, batch, positions, cell, charges=None):
            q = self.charges(batch) if charges is None else charges
            return self.reciprocal(batch, positions, cell, q)

    alpha, _ = _splitting(cutoff, accuracy, None)
    spline = {"distributed": None, "replicated": "torch", "warp": "warp"}[mesh]  # "warp": replicated, Warp kernels
    return ReciprocalOnly(cutoff=1.0, accuracy=accuracy, alpha=alpha, mesh="distributed" if mesh == "distributed"
                          else "replicated", spline=spline, mesh_spacing=mesh_spacing)


def qeq_pme(mesh: str = "distributed"):
    """Charge equilibration feeding PME (``ChargeCoupled``): the charges' gradients cross the
    mesh exchanges; ``mesh="replicated"`` with the torch splines is its reference."""
    from mlipdd.testing.qeq_model import QEqModel

    from mlipdd_ewald_pme.coupled import ChargeCoupled
    from mlipdd_ewald_pme.wrappers import PMEWrapper

    spline = "torch" if mesh == "replicated" else None
    return ChargeCoupled(QEqModel(cutoff=4.0, species=(11, 17), seed=1),
                         PMEWrapper(cutoff=6.0, accuracy=1e-6, mesh=mesh, spline=spline))
