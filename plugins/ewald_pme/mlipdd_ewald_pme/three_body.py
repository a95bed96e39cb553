"""The Axilrod-Teller-Muto three-body term of DFT-D3, per atom, over pairs of edges.

    E_ATM = sum_{triples ijk} s9 sqrt(|C6_ij C6_ik C6_jk|) (3 cos a cos b cos c + 1)
                             / (r_ij r_ik r_jk)^3 * f(ijk),
    f     = 1 / (1 + 6 (rs9^3 R_ij R_ik R_jk / (r_ij r_ik r_jk))^(16/3))    (zero damping)

over every triple whose three distances lie within the three-body cutoff (images
included), ``R`` the pairwise van der Waals radii of D3's zero damping and ``rs9 = 4/3``
(tad-dftd3's and simple-dftd3's convention; 16/3 = (alp + 2) / 3 with alp = 14). The cosine
product is written through squared distances only:
``3 cos a cos b cos c = 3/8 (r_ij^2 + r_jk^2 - r_ik^2)(r_ij^2 - r_jk^2 + r_ik^2)(-r_ij^2 + r_jk^2 + r_ik^2) / (r_ij r_ik r_jk)^2``.

NOTE [triples under DD]. Atom ``i`` gets a third of every triple it belongs to, found as a
pair of ITS edges (j -> i, k -> i) whose far ends are within the cutoff of each other; the
three atoms' thirds add up to the triple, and the per-atom energy equals one process's.
Each edge lives on its receiver's rank, so every pair of edges of an owned receiver is on
that rank: the triples need nothing but the rank's own edge rows (no ghost shell beyond
the pair term's one cutoff; the far ends' C6 weights are read at the edges' senders, as
the pair term reads them). The pairs are built here from the rank's own edge rows, as plain
tensors, and their sum comes back as this rank's atom rows (ghost rows zero: not their
owners' values, so declared stale).
"""

from __future__ import annotations

import torch
from mlipdd.shard import as_atom_rows, local

RS9 = 4.0 / 3.0
ZERO_DAMPING_EXPONENT = 16.0 / 3.0  # (alp + 2) / 3, alp = 14


def pairs_sharing_receiver(receiver: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every unordered pair (a, b), a before b, of edges with the same receiver."""
    order = torch.argsort(receiver, stable=True)
    grouped = receiver[order]
    counts = torch.bincount(grouped) if receiver.numel() else receiver.new_zeros(0)
    start = torch.cumsum(counts, 0) - counts
    position = torch.arange(len(order), device=receiver.device) - start[grouped]  # place in its block
    partners = counts[grouped] - position - 1  # the later edges of the same block
    first = torch.repeat_interleave(torch.arange(len(order), device=receiver.device), partners)
    block_offset = torch.repeat_interleave(torch.cumsum(partners, 0) - partners, partners)
    second = first + 1 + torch.arange(len(first), device=receiver.device) - block_offset
    return order[first], order[second]


def atm_energies(like: torch.Tensor, receiver, vectors, c6, weights_sender, z_sender, z_receiver,
                 c6_reference: torch.Tensor, rvdw: torch.Tensor, cutoff: float, s9: float) -> torch.Tensor:
    """Per-atom ATM energies (Hartree) from this rank's edge rows (Bohr): edge vectors
    (sender minus receiver, image included), ``c6`` of each edge, the sender's reference
    weights, both ends' atomic numbers; ``c6_reference`` (Z, Z, 7, 7) and ``rvdw`` (Z, Z)
    tables. ``like``: the batch's positions (their rows are the output's rows)."""
    n_rows = like.shape[0]
    receiver, vectors, c6 = local(receiver), local(vectors), local(c6)
    weights_sender, z_sender, z_receiver = local(weights_sender), local(z_sender), local(z_receiver)
    distance2 = vectors.square().sum(1)
    near = torch.nonzero(distance2 < cutoff**2).flatten()
    a, b = pairs_sharing_receiver(receiver[near])
    a, b = near[a], near[b]
    r2_ij, r2_ik = distance2[a], distance2[b]
    r2_jk = (vectors[b] - vectors[a]).square().sum(1)
    keep = r2_jk < cutoff**2
    a, b, r2_ij, r2_ik, r2_jk = a[keep], b[keep], r2_ij[keep], r2_ik[keep], r2_jk[keep]

    z_i, z_j, z_k = z_receiver[a], z_sender[a], z_sender[b]
    # C6 of the far pair, w_j C6ref(z_j, z_k) w_k: the first product per edge and species
    # (E x S x 7) rather than per triple (T x 7 x 7; T ~ 50 E in a dense solid at 6 A)
    species, kind = torch.unique(z_sender, return_inverse=True)
    projected = torch.einsum("ea,esab->esb", weights_sender, c6_reference[z_sender[:, None], species[None, :]])
    c6_jk = (projected[a, kind[b]] * weights_sender[b]).sum(1)
    c9 = s9 * torch.sqrt((c6[a] * c6[b] * c6_jk).abs())
    r0 = RS9**3 * rvdw[z_i, z_j] * rvdw[z_i, z_k] * rvdw[z_j, z_k]
    r2 = r2_ij * r2_ik * r2_jk
    r1 = torch.sqrt(r2)
    damping = 1.0 / (1.0 + 6.0 * (r0 / r1) ** ZERO_DAMPING_EXPONENT)
    cosines = 0.375 * (r2_ij + r2_jk - r2_ik) * (r2_ij - r2_jk + r2_ik) * (-r2_ij + r2_jk + r2_ik) / (r2 * r2 * r1)
    triple = c9 * damping * (cosines + 1.0 / (r2 * r1))
    energies = torch.zeros(n_rows, dtype=vectors.dtype, device=vectors.device)
    energies = energies.index_add(0, receiver[a], triple / 3.0)
    return as_atom_rows(energies, like, ghosts_current=False)
