"""The full Coulomb energy a released AIMNet2 adds outside its network.

A released model subtracts a short-range Coulomb term inside the network (`SRCoulomb`)
and leaves the full term to the calculator. aimnet's calculator uses the all-pairs sum
for molecules and damped shifted force (DSF) for periodic cells; so do we:

* ``"simple"``: aimnet's own `LRCoulomb.coul_simple` on the Coulomb matrix, for open
  systems only (every pair must be in the list, which a periodic cell never allows);
* ``"ewald"``: periodic cells only, aimnet's Ewald option (`mlipdd_aimnet2.ewald`);
* ``"dsf"``: the same closed form as aimnet's differentiable `LRCoulomb._coul_dsf_torch`
  (pairs within ``dsf_rc``, plus the DSF self term), written here because aimnet's
  version masks "the last row" for its padding atom, which this layout does not have.

Both are sums over the receiver-major matrix ``nbmat_lr`` and per-system sums
(``nbops.mol_sum``), so they run under domain decomposition unchanged.
"""

from __future__ import annotations

import math

import torch
from mlipdd.data import InputError

COULOMB_METHODS = ("dsf", "simple", "ewald", "none")
SYSTEM_KINDS = ("molecule", "periodic")  # index: whether a system has a periodic direction


def coulomb_per_kind(coulomb, needs_coulomb: bool) -> dict[str, str]:
    """``{"molecule": method, "periodic": method}`` from a wrapper's ``coulomb`` argument."""
    if coulomb is None:
        coulomb = "dsf" if needs_coulomb else "none"
    per_kind = dict.fromkeys(SYSTEM_KINDS, coulomb) if isinstance(coulomb, str) else dict(coulomb)
    if set(per_kind) != set(SYSTEM_KINDS):
        raise ValueError(
            f"coulomb={coulomb!r}: give one method for every system, or one per kind of system with "
            f"exactly the keys {SYSTEM_KINDS}, e.g. {{'molecule': 'simple', 'periodic': 'dsf'}}"
        )
    for kind, method in per_kind.items():
        if method not in COULOMB_METHODS:
            raise ValueError(f"coulomb={coulomb!r}: {kind} method {method!r} is not one of {COULOMB_METHODS}")
        if method != "none" and not needs_coulomb:
            raise ValueError(
                f"coulomb={coulomb!r} was asked for, but this model has no Coulomb term outside its network "
                "(metadata needs_coulomb is False); use coulomb='none'"
            )
    if per_kind["molecule"] == "ewald" and per_kind["periodic"] != "ewald":
        raise ValueError(
            f"coulomb={coulomb!r}: Ewald sums periodic images, so it cannot be the molecule method; use "
            "'simple' or 'dsf' for molecules"
        )
    if per_kind["periodic"] == "simple" and per_kind["molecule"] != "simple":
        raise ValueError(
            f"coulomb={coulomb!r}: the all-pairs sum cannot be the periodic method (the pairs with periodic "
            "images never end); use 'dsf' for periodic systems"
        )
    return per_kind


def coulomb_factor() -> float:
    """aimnet's pair convention: half of Hartree * Bohr per ordered pair (eV * A)."""
    from aimnet import constants

    return constants.half_Hartree * constants.Bohr


def simple_energy(data: dict) -> torch.Tensor:
    """All pairs of the Coulomb matrix, 1/r, through aimnet's own code (per system, float64)."""
    from aimnet.modules.lr import LRCoulomb

    module = LRCoulomb(key_in="charges", key_out="energy", method="simple", subtract_sr=False)
    return module.coul_simple(data)


def missing_pairs(data: dict, chosen: torch.Tensor | None) -> torch.Tensor:
    """Per system, how many (atom, other atom) pairs of an all-pairs system its Coulomb matrix
    misses (a molecule wider than the cutoff); `check_all_pairs` refuses any.

    Every atom of such a system must list all others: the row counts are summed per
    system (local rows + all_reduce under DD, so every rank sees the same sums and
    raises together), ``chosen`` (per system, 1.0 for the all-pairs systems; None: all) picks them.
    A tensor, not yet read on the host: the caller reads it after the backward is queued.
    """
    from aimnet import nbops

    atoms = nbops.mol_sum(torch.ones_like(data["charges"]), data)
    listed = (~data["mask_ij_lr"]).sum(-1).to(atoms.dtype)  # the slots that hold a neighbour
    missing = nbops.mol_sum(atoms.index_select(0, data["mol_idx"]) - 1.0 - listed, data)
    return missing if chosen is None else missing * chosen.to(missing.dtype)


def check_all_pairs(missing: torch.Tensor, cutoff: float) -> None:
    """Refuse an all-pairs system whose Coulomb matrix misses pairs (`missing_pairs`)."""
    if bool((missing > 0.5).any()):
        systems = torch.nonzero(missing > 0.5).flatten().tolist()
        raise InputError(
            f"system(s) {systems} take the all-pairs Coulomb sum, but some of their atoms are farther apart than "
            f"simple_cutoff={cutoff} A, so pairs would be missing; raise simple_cutoff above the largest "
            "molecule's extent, or use DSF for molecules (coulomb={'molecule': 'dsf', ...})"
        )


def dsf_energy(data: dict, alpha: float, cutoff: float) -> torch.Tensor:
    """Damped shifted force Coulomb (Fennell and Gezelter), per system, float64."""
    from aimnet import nbops, ops

    data = ops.lazy_calc_dij(data, "_lr")
    d = data["d_ij_lr"]
    q = data["charges"]
    q_i, q_j = nbops.get_ij(q, data, suffix="_lr")
    erfc_rc = math.erfc(alpha * cutoff)
    shift = erfc_rc / cutoff
    slope = erfc_rc / cutoff**2 + 2.0 * alpha / math.sqrt(math.pi) * math.exp(-((alpha * cutoff) ** 2)) / cutoff
    pair = torch.erfc(alpha * d) / d - shift + (d - cutoff) * slope
    pair = pair * (d < cutoff).to(pair.dtype)
    e_ij = (q_i * q_j * pair).masked_fill(data["mask_ij_lr"], 0.0)
    self_coeff = -(shift / 2.0 + alpha / math.sqrt(math.pi))
    e_i = e_ij.sum(-1, dtype=torch.float64) + 2.0 * self_coeff * q.pow(2).to(torch.float64)
    return coulomb_factor() * nbops.mol_sum(e_i, data)


def dsf_energy_and_forces(data: dict, alpha: float, cutoff: float, cell: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DSF through nvalchemiops' kernel, as aimnet's calculator runs it: the energy per system
    (float64, attached to the charges only) and the fixed-charge forces, which autograd of
    that energy does not give. One process only (the kernel reads every neighbour's row).
    ``cell``: (B, 3, 3), one per system (the kernel takes the slots' integer shifts,
    ``_unit_shifts_lr``; aimnet's ``shifts_lr`` are vectors when the batch has several cells).

    Autograd through the closed form (`dsf_energy`) walks every one of the ~1100 Coulomb
    slots per atom at 15 A twice; the kernel does the pair sum and its derivative in one pass.
    """
    from aimnet import constants
    from nvalchemiops.torch.interactions.electrostatics import dsf_coulomb

    coord = data["coord"]
    n = coord.shape[0]
    # the kernel skips slots holding ``fill_value``; this layout pads with the row itself
    matrix = torch.where(data["mask_ij_lr"], n, data["nbmat_lr"]).to(torch.int32)
    cell = cell.detach().to(coord.dtype)
    energy, forces = dsf_coulomb(
        positions=coord.detach(), charges=data["charges"].to(coord.dtype), cutoff=float(cutoff), alpha=float(alpha),
        cell=cell.unsqueeze(0) if cell.ndim == 2 else cell, batch_idx=data["mol_idx"].to(torch.int32),
        neighbor_matrix=matrix, neighbor_matrix_shifts=data["_unit_shifts_lr"].round().to(torch.int32),
        fill_value=n, compute_forces=True, num_systems=int(data["_num_mol"]), device=str(coord.device))
    scale = constants.Hartree * constants.Bohr
    return energy * scale, forces.detach() * scale
