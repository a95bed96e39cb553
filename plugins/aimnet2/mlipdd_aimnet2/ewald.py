"""``coulomb="ewald"`` (periodic cells): aimnet's Ewald option, exact under domain decomposition.

aimnet's calculator (``set_lrcoulomb_method("ewald", ewald_accuracy=...)``) hands the predicted
charges to nvalchemiops' ``ewald_summation``: Kolafa-Perram splitting (``alpha rc =
sqrt(-ln accuracy)``, ``k_c = 2 alpha sqrt(-ln accuracy)``), an erfc real-space sum over a list
as deep as ``rc``, a reciprocal sum over the whole box of Miller indices ``|m_i| <= ceil(k_c
|a_i| / 2 pi)`` (no spherical cut), the self term and the neutralising background of a charged
cell, in ``k_e = Hartree * Bohr``. Its kernels are Python functions around Warp launches that
read every atom, which no per-op rule can split over ranks; this module writes the same terms
in pieces that distribute:

* real space: ``erfc(alpha d) / d`` over the Coulomb matrix, a sum over the receiver-major
  slots, as the DSF term (`coulomb.dsf_energy`) does;
* reciprocal space and background: mlipdd-ewald-pme's per-atom sums (per-system structure
  factors that the dispatch sums over ranks; NOTE [read per atom first] there), with the box
  of Miller indices and aimnet's ``k_e``.

The splitting: aimnet estimates ``alpha`` per call from the system's density, ``alpha =
sqrt(pi) (N / V^2)^(1/6)``, and ``rc`` from it. mlipdd's neighbour list (and the ghost shell
under DD) is as deep as a cutoff fixed when the wrapper is built, so here ``rc`` is given
(``ewald_cutoff``) and ``alpha`` follows from it; `aimnet_ewald_cutoff` is the ``rc`` aimnet
would pick for a cell, with which the two agree term by term (measured: 1e-13 relative in
float64 against nvalchemiops' ``ewald_summation``). The Ewald term is evaluated in float64
whatever the model's dtype (forces come back in the model's dtype).
"""

from __future__ import annotations

import math

import torch
from mlipdd.data import InputError


def aimnet_ewald_cutoff(n_atoms: int, volume: float, accuracy: float = 1e-6) -> float:
    """The real-space cutoff aimnet's Ewald (nvalchemiops' ``estimate_ewald_parameters``)
    uses for ``n_atoms`` in ``volume`` A^3: ``sqrt(-2 ln accuracy) (V^2 / N)^(1/6) / sqrt(2 pi)``."""
    return math.sqrt(-2.0 * math.log(accuracy)) * (volume**2 / n_atoms) ** (1.0 / 6.0) / math.sqrt(2.0 * math.pi)


def splitting(cutoff: float, accuracy: float) -> tuple[float, float]:
    """(alpha, k_cutoff) for a real-space ``cutoff`` at ``accuracy`` (Kolafa-Perram)."""
    if not 0.0 < accuracy < 1.0:
        raise ValueError(f"ewald_accuracy must lie in (0, 1), got {accuracy}; 1e-6 is aimnet's default")
    log = math.sqrt(-math.log(accuracy))
    alpha = log / cutoff
    return alpha, 2.0 * alpha * log


def _ewald_pme():
    try:
        from mlipdd_ewald_pme import ewald
    except ImportError as error:
        raise InputError(
            "AIMNet2Wrapper(coulomb='ewald') sums reciprocal space with mlipdd-ewald-pme, which is not "
            "installed: pip install 'mlipdd-aimnet2[ewald]' (or pip install -e plugins/ewald_pme)"
        ) from error
    return ewald


def check_fully_periodic(batch, chosen: list[bool], periodic: list[list[bool]]) -> None:
    """Refuse an Ewald system that is not periodic along all three axes (a slab would get the
    3-D lattice sum of its vacuum-padded cell, silently). ``periodic``: ``batch.pbc`` on the host."""
    partial = [s for s, (on, row) in enumerate(zip(chosen, periodic)) if on and not all(row)]
    if partial:
        raise InputError(
            f"system(s) {partial} take coulomb='ewald', which sums periodic images along all three axes, "
            f"but are not periodic along every axis (pbc={[periodic[i] for i in partial]}); use 'dsf' for them "
            "(coulomb={'molecule': ..., 'periodic': 'dsf'}), or a slab-corrected Ewald from mlipdd-ewald-pme: "
            "ChargeCoupled(AIMNet2Wrapper(..., coulomb='none'), EwaldWrapper(slab_correction=True))"
        )


def ewald_energy(data: dict, batch, positions, cell, chosen: torch.Tensor, alpha: float, k_cutoff: float,
                 cutoff: float) -> torch.Tensor:
    """Ewald energy per system (float64; zero where ``chosen`` is 0): real space over the Coulomb
    matrix, the box reciprocal sum, self and background terms, aimnet's ``k_e``.

    Plain tensors (one process) take nvalchemiops' kernels (`_kernel_energies`); rows of a
    ShardTensor (DD) take the per-atom torch sums (`_torch_energies`), which the dispatch splits.
    The two are the same terms over the same pairs and Miller set (measured: 1e-15 relative).
    """
    from aimnet import nbops

    from mlipdd_aimnet2.coulomb import coulomb_factor

    k_e = 2.0 * coulomb_factor()  # coulomb_factor is per ordered pair (half of k_e)
    atom_on = chosen.index_select(0, batch.batch)
    q = data["charges"].to(torch.float64) * atom_on  # other systems carry no charge: exactly zero here
    # a system without Ewald may have no cell at all: an identity stands in (its charges are 0)
    eye = torch.eye(3, dtype=torch.float64, device=chosen.device)
    cell64 = torch.where(chosen.view(-1, 1, 1) > 0, cell.to(torch.float64), eye)
    miller = _ewald_pme().miller_indices(cell64, k_cutoff, spherical=False)
    if _kernels_apply(data, positions, q):
        per_atom = _kernel_energies(data, batch, q, cell64, alpha, miller, k_e)
    else:
        per_atom = _torch_energies(data, batch, positions, q, cell64, alpha, cutoff, miller, k_e)
    return nbops.mol_sum(per_atom, data)


def _kernels_apply(data: dict, positions, q) -> bool:
    """One process: plain tensors (a ShardTensor's rows need the per-atom sums)."""
    plain = all(type(t) is torch.Tensor for t in (positions, q, data["nbmat_lr"]))
    return plain and "_unit_shifts_lr" in data


def _torch_energies(data, batch, positions, q, cell64, alpha, cutoff, miller, k_e) -> torch.Tensor:
    """Per-atom Ewald energies as sums a ShardTensor's dispatch splits over ranks. The
    reciprocal part holds (N, K) phase matrices (K Miller vectors): gigabytes at 10k atoms."""
    from aimnet import nbops, ops

    ewald = _ewald_pme()
    data = ops.lazy_calc_dij(data, "_lr")
    d = data["d_ij_lr"].to(torch.float64)
    q_i, q_j = nbops.get_ij(q, data, suffix="_lr")
    pair = torch.erfc(alpha * d) / d * (d < cutoff).to(d.dtype)
    real = (q_i * q_j * pair).masked_fill(data["mask_ij_lr"], 0.0).sum(-1)
    reciprocal = ewald.reciprocal_energies(batch, positions.to(torch.float64), cell64, q, alpha, math.inf, miller,
                                           coulomb_constant=k_e)
    background = ewald.background_energies(batch, cell64, q, alpha, coulomb_constant=k_e)
    self_term = -k_e * alpha / math.sqrt(math.pi) * q * q
    return 0.5 * k_e * real + reciprocal + background + self_term


# NOTE [Ewald through nvalchemiops at one process]: the torch reciprocal sum keeps (N, K)
# phase, cosine and sine matrices for autograd (8.4 GiB at 10k atoms and K ~ 4600 on an
# H200, 0.56x aimnet's call there); nvalchemiops' kernels (aimnet's backend) loop over k
# without them and carry the gradient to positions, charges and cell through their own
# backward (the energy-graph contract aimnet relies on). Its reciprocal term includes the
# self and background terms; from the same half-space Miller set it equals the torch
# terms per atom to 1e-15 in float64, gradients included (checked, and pinned by the DD
# tests: the distributed runs take the torch path, the one-process reference this one).
def _kernel_energies(data, batch, q, cell64, alpha, miller, k_e) -> torch.Tensor:
    from nvalchemiops.torch.interactions.electrostatics import (
        ewald_real_space,
        ewald_reciprocal_space_from_miller_indices,
    )

    coord = data["coord"].to(torch.float64)
    n = coord.shape[0]
    alpha_t = torch.full((cell64.shape[0],), float(alpha), dtype=torch.float64, device=coord.device)
    batch_idx = batch.batch.to(torch.int32)
    # the kernel skips slots holding ``mask_value``; this layout pads with the row itself
    matrix = torch.where(data["mask_ij_lr"], n, data["nbmat_lr"]).to(torch.int32)
    shifts = data["_unit_shifts_lr"].round().to(torch.int32)
    real = ewald_real_space(coord, q, cell64, alpha_t, neighbor_matrix=matrix, neighbor_matrix_shifts=shifts,
                            mask_value=n, batch_idx=batch_idx)
    reciprocal = ewald_reciprocal_space_from_miller_indices(coord, q, cell64, miller.to(torch.long), alpha_t,
                                                            batch_idx=batch_idx)
    return k_e * (real + reciprocal)
