"""The full Coulomb energy a released AIMNet2 adds outside its network.

A released model subtracts a short-range Coulomb term inside the network (`SRCoulomb`)
and leaves the full term to the calculator. aimnet's calculator uses the all-pairs sum
for molecules and damped shifted force (DSF) for periodic cells; so do we:

* ``"simple"``: aimnet's own `LRCoulomb.coul_simple` on the Coulomb matrix, for open
  systems only (every pair must be in the list, which a periodic cell never allows);
* ``"dsf"``: the same closed form as aimnet's differentiable `LRCoulomb._coul_dsf_torch`
  (pairs within ``dsf_rc``, plus the DSF self term), written here because aimnet's
  version masks "the last row" for its padding atom, which this layout does not have.

Both are sums over the receiver-major matrix ``nbmat_lr`` and per-system sums
(``nbops.mol_sum``), so they run under domain decomposition unchanged.
"""

from __future__ import annotations

import math

import torch

COULOMB_METHODS = ("dsf", "simple", "none")


def coulomb_factor() -> float:
    """aimnet's pair convention: half of Hartree * Bohr per ordered pair (eV * A)."""
    from aimnet import constants

    return constants.half_Hartree * constants.Bohr


def simple_energy(data: dict) -> torch.Tensor:
    """All pairs of the Coulomb matrix, 1/r, through aimnet's own code (per system, float64)."""
    from aimnet.modules.lr import LRCoulomb

    module = LRCoulomb(key_in="charges", key_out="energy", method="simple", subtract_sr=False)
    return module.coul_simple(data)


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
