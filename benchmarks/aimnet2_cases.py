"""The systems and the two codes that the AIMNet2 speed runners compare (CPU and GPU).

Both sides read the same exported weights: a random AIMNet2 of the released architecture
(wB97M-D3 YAML shipped in aimnet, 2.2 M parameters) with atomic shifts of a released model's
size (H -13.6, C -1030, O -2042 eV: shifts near 1 eV would hide a float32 rounding of them),
written as an aimnet v2 file, read by `AIMNet2Wrapper.from_file` and by `AIMNet2Calculator(path)`.

Kinds of system (``size`` = about how many atoms):

* ``molecule``: one open cluster of methanol-like molecules, DSF Coulomb (alpha 0.2, 15 A;
  aimnet's all-pairs sum would need N^2 slots at 10k atoms);
* ``molecules``: a batch of 48-atom open clusters, all-pairs Coulomb (aimnet's default for
  molecules), total charges 0, -1, +1 in turn;
* ``crystal``: a triclinic molecular crystal, DSF (aimnet's periodic default, alpha 0.2, 15 A);
* ``crystal_ewald``: the same crystal with Ewald at accuracy 1e-6 against the calculator's
  ``set_lrcoulomb_method("ewald")``, at the real-space cutoff aimnet picks for the cell.
"""

from __future__ import annotations

import pathlib

import torch

RELEASED_SCALE_SHIFTS = {1: -13.6, 6: -1030.2, 8: -2041.7}
DSF_CUTOFF, DSF_ALPHA = 15.0, 0.2
EWALD_ACCURACY = 1e-6  # aimnet's default
CLUSTER_ATOMS = 48
KINDS = ("molecule", "molecules", "crystal", "crystal_ewald")
COULOMB = {"molecule": "dsf", "molecules": "simple", "crystal": "dsf", "crystal_ewald": "ewald"}
# molecules per axis of the crystal closest to each size (6 atoms per molecule)
CRYSTAL_REPS = {300: (5, 5, 2), 1000: (7, 6, 4), 3000: (10, 10, 5), 10000: (14, 12, 10)}


def exported_model(directory: pathlib.Path, dtype=torch.float64) -> pathlib.Path:
    from mlipdd_aimnet2.building import random_aimnet2, save_checkpoint

    model, metadata = random_aimnet2(seed=0, dtype=dtype)
    for z, value in RELEASED_SCALE_SHIFTS.items():
        model.outputs.atomic_shift.shifts.weight[z] = value
    path = directory / "aimnet2_random_released_scale.pt"
    save_checkpoint(model, metadata, path)
    return path


def crystal_reps(size: int):
    if size in CRYSTAL_REPS:
        return CRYSTAL_REPS[size]
    n = max(1, round((size / 6) ** (1 / 3)))
    return (n, n, n)


def systems(kind: str, size: int, dtype=torch.float32):
    """(mlipdd Batch, aimnet input dict), on the CPU."""
    from mlipdd.data import AtomicData, Batch
    from mlipdd_aimnet2.testing import molecular_crystal

    if kind.startswith("crystal") or kind == "molecule":
        periodic = kind != "molecule"
        crystal = molecular_crystal(crystal_reps(size), seed=0, pbc=periodic, dtype=dtype)
        data = {"coord": crystal.positions, "numbers": crystal.atomic_numbers, "charge": torch.tensor([0.0])}
        if periodic:
            data.update(cell=crystal.cell[0], pbc=torch.ones(3, dtype=torch.bool))
        else:  # an open system: no cell at all in either code
            crystal = AtomicData(positions=crystal.positions, atomic_numbers=crystal.atomic_numbers, dtype=dtype)
        return Batch.from_data_list([crystal]), data
    clusters = []
    for i in range(max(1, round(size / CLUSTER_ATOMS))):
        c = molecular_crystal((2, 2, 2), seed=i, pbc=False, dtype=dtype)
        clusters.append(AtomicData(positions=c.positions, atomic_numbers=c.atomic_numbers, dtype=dtype,
                                   charge=float((0, -1, 1)[i % 3])))
    batch = Batch.from_data_list(clusters)
    data = {"coord": batch.positions, "numbers": batch.atomic_numbers,
            "charge": torch.tensor([float(c.charge) for c in clusters]), "mol_idx": batch.batch}
    return batch, data


def both_codes(kind: str, batch, path, device: str, inference_kernels: bool = False):
    """(mlipdd wrapper, {name: aimnet calculator}) for one kind of system, same weights, float32."""
    from aimnet.calculators import AIMNet2Calculator
    from mlipdd_aimnet2.ewald import aimnet_ewald_cutoff
    from mlipdd_aimnet2.wrapper import AIMNet2Wrapper

    coulomb = COULOMB[kind]
    ewald_cutoff = 12.0
    if coulomb == "ewald":
        volume = float(torch.linalg.det(batch.cell[0].double()).abs())
        ewald_cutoff = aimnet_ewald_cutoff(batch.num_atoms, volume, EWALD_ACCURACY)
    wrapper = AIMNet2Wrapper.from_file(path, device=device, dtype=torch.float32, dispersion=False, coulomb=coulomb,
                                       dsf_cutoff=DSF_CUTOFF, dsf_alpha=DSF_ALPHA, ewald_cutoff=ewald_cutoff,
                                       ewald_accuracy=EWALD_ACCURACY).to(device)
    calcs = {"aimnet s": AIMNet2Calculator(str(path), needs_coulomb=True, needs_dispersion=False, device=device)}
    if inference_kernels:
        calcs["aimnet kernels s"] = AIMNet2Calculator(str(path), needs_coulomb=True, needs_dispersion=False,
                                                      device=device, inference_kernels=True)
    for calc in calcs.values():
        if coulomb == "dsf":
            calc.set_lrcoulomb_method("dsf", cutoff=DSF_CUTOFF, dsf_alpha=DSF_ALPHA)
        elif coulomb == "ewald":
            calc.set_lrcoulomb_method("ewald", ewald_accuracy=EWALD_ACCURACY)
    return wrapper, calcs


def agreement(ours: dict, theirs: dict) -> dict:
    """Energy (largest over systems), forces (largest component, and relative to the largest
    force) and charges: mlipdd minus aimnet."""
    f_ours, f_theirs = ours["forces"].detach().double(), theirs["forces"].detach().double().reshape(-1, 3)
    q_ours, q_theirs = ours["charges"].detach().double(), theirs["charges"].detach().double().reshape(-1)
    de = (ours["energy"].detach().double().reshape(-1) - theirs["energy"].detach().double().reshape(-1).to(
        ours["energy"].device)).abs()
    df = float((f_ours - f_theirs.to(f_ours.device)).abs().max())
    return {"energy diff eV": float(de.max()), "force diff max": df,
            "force diff rel": df / max(float(f_theirs.abs().max()), 1e-30),
            "charge diff max": float((q_ours - q_theirs.to(q_ours.device)).abs().max())}
