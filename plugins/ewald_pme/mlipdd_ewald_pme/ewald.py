"""Ewald reciprocal space as per-atom energies, in plain torch.

    E_rec = k_e / (2V) sum_{k != 0} 4 pi / k^2 exp(-k^2 / 4 alpha^2) |S(k)|^2,
    S(k) = sum_j q_j exp(i k.r_j)

written per atom as ``e_i = q_i sum_k pref_k (C_k cos(k.r_i) + S_k sin(k.r_i))`` with
``C_k, S_k`` the per-system cosine and sine sums. Those two sums are `per_system_sum`s:
under domain decomposition the ShardTensor dispatch turns each into "owned atoms of
this rank + all_reduce", and the replicated result read per atom carries its gradient
back to every rank. No distributed code here.

Phases come from fractional coordinates, ``k.r = 2 pi m.s``, so a ghost row (an image
of its owner, shifted by whole cell vectors) has exactly its owner's phase, and the
strain derivative (stress) flows only through ``k^2`` and ``V``, as it must.
"""

from __future__ import annotations

import math

import torch
from mlipdd import Batch
from mlipdd.models import per_system_sum

from mlipdd_ewald_pme.coulomb import COULOMB_EV_ANGSTROM


def plane_spacings(cell: torch.Tensor) -> torch.Tensor:
    """(n_systems, 3) distances between lattice planes (the heights of the cell)."""
    inverse = torch.linalg.inv(cell.detach())
    return 1.0 / inverse.norm(dim=1)  # columns of inv(cell) are b_i / 2 pi


def miller_indices(cell: torch.Tensor, k_cutoff: float, spherical: bool = True) -> torch.Tensor:
    """Integer vectors ``m`` (half space, no origin) with ``|k| <= k_cutoff`` in some system;
    ``spherical=False``: the whole box ``|m_i| <= ceil(k_cutoff |a_i| / 2 pi)`` that holds that
    sphere (the set nvalchemiops' Ewald, and so aimnet's, sums; pass ``k_cutoff=inf`` to
    `reciprocal_energies` with it)."""
    cell = cell.detach()
    bounds = torch.ceil(k_cutoff * cell.norm(dim=2) / (2 * math.pi)).long().amax(0)
    axes = [torch.arange(-int(b), int(b) + 1, device=cell.device) for b in bounds]
    m = torch.stack(torch.meshgrid(*axes, indexing="ij"), -1).reshape(-1, 3)
    half = (m[:, 0] > 0) | ((m[:, 0] == 0) & (m[:, 1] > 0)) | ((m[:, 0] == 0) & (m[:, 1] == 0) & (m[:, 2] > 0))
    m = m[half].to(cell.dtype)
    if not spherical:
        return m
    k = 2 * math.pi * torch.einsum("kj,sij->ski", m, torch.linalg.inv(cell))
    needed = (k.square().sum(-1) <= k_cutoff**2).any(0)
    return m[needed]


def reciprocal_energies(batch: Batch, positions, cell, charges, alpha: float, k_cutoff: float,
                        miller: torch.Tensor, coulomb_constant: float = COULOMB_EV_ANGSTROM) -> torch.Tensor:
    inverse = torch.linalg.inv(cell)  # differentiable: the strained cell of the stress route
    k = 2 * math.pi * torch.einsum("kj,sij->ski", miller, inverse)  # (S, K, 3)
    k2 = k.square().sum(-1)
    volume = torch.linalg.det(cell).abs()
    inside = k2 <= k_cutoff**2
    safe_k2 = torch.where(inside, k2, torch.ones_like(k2))
    # factor 2: only half of k-space is summed, k and -k contribute alike
    green = torch.where(inside, 8 * math.pi / safe_k2 * torch.exp(-safe_k2 / (4 * alpha**2)), torch.zeros_like(k2))
    prefactor = 0.5 * coulomb_constant * green / volume.unsqueeze(1)  # (S, K)

    fractional = torch.einsum("ni,nij->nj", positions, inverse[batch.batch])
    phase = 2 * math.pi * fractional @ miller.T  # (N, K)
    cos, sin = torch.cos(phase), torch.sin(phase)
    q = charges.unsqueeze(1)
    cos_sum = per_system_sum(q * cos, batch)  # (S, K), replicated under DD
    sin_sum = per_system_sum(q * sin, batch)
    per_k = prefactor[batch.batch] * (cos_sum[batch.batch] * cos + sin_sum[batch.batch] * sin)
    return charges * per_k.sum(1)


def background_energies(batch: Batch, cell, charges, alpha: float,
                        coulomb_constant: float = COULOMB_EV_ANGSTROM) -> torch.Tensor:
    """Neutralising background of a charged cell, ``-pi Q^2 / (2 V alpha^2)``, shared as
    ``q_i Q`` per atom (sums to the system's term; zero for neutral cells)."""
    total = per_system_sum(charges, batch)  # replicated under DD
    volume = torch.linalg.det(cell).abs()
    # NOTE [read per atom first]: index both per-system values per atom BEFORE combining
    # them. ``total / volume`` would be a replicated value, and its gradient (summed over
    # ranks where it meets atom rows) would reach the cell once per rank: the stress
    # would be counted world_size times. Per atom, each rank differentiates its share.
    return -coulomb_constant * math.pi / (2 * alpha**2) * charges * total[batch.batch] / volume[batch.batch]


def slab_energies(batch: Batch, positions, cell, charges, axis: torch.Tensor) -> torch.Tensor:
    """The slab (dipole) correction of a cell periodic along two axes, vacuum along ``axis``
    (one per system), as per-atom energies:

        E = 2 pi k_e / V [M^2 - Q sum_i q_i z_i^2 - Q^2 L^2 / 12],   M = sum_i q_i z_i,

    ``z`` along the normal of the periodic plane, ``L`` the cell's height along it (Yeh and
    Berkowitz, J. Chem. Phys. 111, 3155 (1999); the charged-slab terms of Ballenegger,
    Arnold and Cerda, J. Chem. Phys. 131, 094107 (2009)). It removes the interaction of the
    slab's dipole with its periodic images along the normal, so the 3D sum over a cell with
    enough vacuum becomes the 2D-periodic energy. Shared per atom as
    ``q_i (z_i M - Q z_i^2 - Q L^2 / 12)`` (sums to E; origin-independent in the total).
    """
    inverse = torch.linalg.inv(cell)  # column c is normal to the other two cell vectors
    normal = inverse.gather(2, axis.view(-1, 1, 1).expand(-1, 3, 1)).squeeze(2)  # (S, 3), b_c
    height = 1.0 / normal.norm(dim=1)
    volume = torch.linalg.det(cell).abs()
    z = (positions * (normal * height.unsqueeze(1))[batch.batch]).sum(1)
    dipole = per_system_sum(charges * z, batch)  # replicated under DD
    total = per_system_sum(charges, batch)
    # NOTE [read per atom first] (background_energies): every per-system value indexed per atom
    m, q_total, l_z, v = dipole[batch.batch], total[batch.batch], height[batch.batch], volume[batch.batch]
    return 2 * math.pi * COULOMB_EV_ANGSTROM * charges * (z * m - q_total * z * z - q_total * l_z * l_z / 12) / v
