"""Pair parts of point-charge electrostatics, per atom, in plain torch.

Everything here is a sum over the edges of the model's neighbour list, written as an
out-of-place ``index_add`` into receiver rows, so under domain decomposition it is
ordinary halo work: each rank evaluates only the edges of its owned receivers.

Units: eV, Angstrom, elementary charge. Each function returns one energy per atom whose
sum is the system's energy; a full list holds every pair twice, so each end gets half.
"""

from __future__ import annotations

import math

import torch
from mlipdd import Batch

COULOMB_EV_ANGSTROM = 14.399645478425667  # e^2 / (4 pi eps0), eV * Angstrom (CODATA 2018)


def edge_distances(batch: Batch, positions: torch.Tensor, cell: torch.Tensor):
    """(sender, receiver, distance) of every edge of ``batch.neighbors``."""
    nl = batch.neighbors
    sender, receiver = nl.edge_index
    vectors = positions[receiver] + nl.shifts(cell, batch.batch) - positions[sender]
    return sender, receiver, vectors.norm(dim=1)


def _pair_sum(charges, sender, receiver, pair_values):
    """Half of ``q_i q_j v(r_ij)`` to the receiver of each edge (full list: twice per pair)."""
    per_edge = 0.5 * COULOMB_EV_ANGSTROM * charges[sender] * charges[receiver] * pair_values
    out = torch.zeros_like(charges)
    return out.index_add(0, receiver, per_edge)


def _inside(distance: torch.Tensor, cutoff: float):
    """Mask of edges within the cutoff, and distances safe to divide by elsewhere.

    A Verlet list carries a skin; edges past the model's own cutoff add nothing.
    """
    inside = distance < cutoff
    return inside, torch.where(inside, distance, torch.ones_like(distance))


def ewald_real_space(batch: Batch, positions, cell, charges, alpha: float, cutoff: float):
    """Screened Coulomb ``erfc(alpha r) / r`` within ``cutoff``."""
    sender, receiver, d = edge_distances(batch, positions, cell)
    inside, safe = _inside(d, cutoff)
    pair = torch.where(inside, torch.erfc(alpha * safe) / safe, torch.zeros_like(d))
    return _pair_sum(charges, sender, receiver, pair)


def ewald_self_energy(charges, alpha: float):
    """The interaction of each Gaussian screening charge with its own point charge."""
    return -COULOMB_EV_ANGSTROM * alpha / math.sqrt(math.pi) * charges * charges


def dsf_pair_energy(batch: Batch, positions, cell, charges, alpha: float, cutoff: float):
    """Damped shifted force (Fennell and Gezelter, J. Chem. Phys. 124, 234104 (2006)).

    Pair term ``erfc(a r)/r - erfc(a R)/R + (r - R) [erfc(a R)/R^2 + 2a/sqrt(pi) exp(-a^2 R^2)/R]``:
    energy and force both reach zero at the cutoff ``R``, in periodic and open cells alike.
    """
    sender, receiver, d = edge_distances(batch, positions, cell)
    inside, safe = _inside(d, cutoff)
    erfc_rc = math.erfc(alpha * cutoff) / cutoff
    slope = erfc_rc / cutoff + 2 * alpha / math.sqrt(math.pi) * math.exp(-(alpha * cutoff) ** 2) / cutoff
    pair = torch.erfc(alpha * safe) / safe - erfc_rc + (safe - cutoff) * slope
    pair = torch.where(inside, pair, torch.zeros_like(d))
    return _pair_sum(charges, sender, receiver, pair)


def dsf_self_energy(charges, alpha: float, cutoff: float):
    """DSF's self term, ``-(erfc(a R) / 2R + a / sqrt(pi)) q_i^2``."""
    shift = math.erfc(alpha * cutoff) / (2 * cutoff) + alpha / math.sqrt(math.pi)
    return -COULOMB_EV_ANGSTROM * shift * charges * charges
