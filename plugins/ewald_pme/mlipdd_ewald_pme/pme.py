"""Smooth particle-mesh Ewald reciprocal space: three ops, each declared in the spec.

1. ``nvalchemiops::spline_spread`` (Warp kernel): B-spline charges onto the mesh.
   Under domain decomposition each rank spreads its OWNED atoms only and the meshes
   are summed over ranks (``SliceOwned`` in, ``AllReduceSum`` out).
2. ``mlipdd_ewald_pme::mesh_potential`` (this module, torch FFTs): the mesh potential
   ``phi = IFFT(G . FFT(Q))``. It takes the replicated mesh and gives this rank's copy
   of the potential, so the gradient with respect to the Green function ``G`` (hence
   the stress) is each rank's share, and the mesh's gradient is summed over ranks.
3. ``nvalchemiops::spline_gather`` (Warp kernel): the potential at each atom row.

Per atom ``e_i = q_i phi(r_i) / 2``; forces and stress by autograd through the three
ops (the Warp ops carry their own backward, the FFT op's is below).
"""

from __future__ import annotations

import math

import torch
from mlipdd import Batch
from mlipdd.data import InputError
from nvalchemiops.torch import spline as _nv_spline  # registers nvalchemiops::spline_* ops
from nvalchemiops.torch.interactions.electrostatics.pme import compute_bspline_moduli_1d

from mlipdd_ewald_pme.coulomb import COULOMB_EV_ANGSTROM
from mlipdd_ewald_pme.ewald import plane_spacings

SPREAD_OP = "nvalchemiops::spline_spread"
GATHER_OP = "nvalchemiops::spline_gather"
POTENTIAL_OP = "mlipdd_ewald_pme::mesh_potential"
assert _nv_spline is not None


# ---- the FFT convolution as an op ---------------------------------------------------------


def _convolve(mesh: torch.Tensor, green: torch.Tensor) -> torch.Tensor:
    # forward FFT unscaled, inverse unscaled: sum_m Q(m) phi(m) = sum_k G_k |FFT(Q)_k|^2
    return torch.fft.ifftn(green * torch.fft.fftn(mesh), norm="forward").real


@torch.library.custom_op(POTENTIAL_OP, mutates_args=())
def mesh_potential(mesh: torch.Tensor, green: torch.Tensor) -> torch.Tensor:
    """``IFFT(green * FFT(mesh))`` (both (nx, ny, nz), ``green`` real and even in k)."""
    return _convolve(mesh, green)


@mesh_potential.register_fake
def _(mesh, green):
    return torch.empty_like(mesh)


def _save(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad):
    mesh, green = ctx.saved_tensors
    # the kernel is real and even, so the convolution is its own adjoint
    grad_mesh = _convolve(grad, green)
    grad_green = (torch.fft.fftn(mesh) * torch.fft.fftn(grad).conj()).real
    return grad_mesh, grad_green


mesh_potential.register_autograd(_backward, setup_context=_save)


# ---- mesh size and Green function ---------------------------------------------------------


def mesh_dimensions(cell: torch.Tensor, k_cutoff: float, spline_order: int,
                    mesh_spacing: float | None) -> tuple[int, int, int]:
    """Mesh points per axis for one system's (3, 3) cell.

    The mesh resolves wave vectors up to ``pi n_i / d_i`` along axis ``i`` (``d_i`` the
    plane spacing); it must reach the Ewald cutoff ``k_cutoff`` set by the accuracy.
    """
    heights = plane_spacings(cell.unsqueeze(0))[0]
    needed = [max(math.ceil(k_cutoff * float(h) / math.pi), spline_order) for h in heights]
    if mesh_spacing is None:
        return tuple(n + n % 2 for n in needed)
    lengths = cell.detach().norm(dim=1)
    dims = tuple(max(math.ceil(float(length) / mesh_spacing), 1) for length in lengths)
    coarse = [i for i in range(3) if dims[i] < needed[i]]
    if coarse:
        finest = min(float(lengths[i]) / needed[i] for i in coarse)
        raise InputError(
            f"PME mesh spacing {mesh_spacing} A gives {dims} points, too coarse for the requested "
            f"accuracy (axes {coarse} need at least {[needed[i] for i in coarse]}); use "
            f"mesh_spacing <= {finest:.3f} A, or leave mesh_spacing=None to size the mesh from the accuracy"
        )
    return dims


def green_function(cell: torch.Tensor, dims: tuple[int, int, int], alpha: float,
                   spline_order: int) -> torch.Tensor:
    """``k_e 4 pi / (V k^2) exp(-k^2 / 4 alpha^2)`` times the B-spline deconvolution, k = 0 removed.

    Differentiable in ``cell`` (the strained cell of the stress route)."""
    device, dtype = cell.device, cell.dtype
    freqs = [torch.fft.fftfreq(n, d=1.0 / n, device=device, dtype=dtype) for n in dims]
    m = torch.stack(torch.meshgrid(*freqs, indexing="ij"), -1)  # integer frequencies
    k = 2 * math.pi * torch.einsum("xyzj,ij->xyzi", m, torch.linalg.inv(cell))
    k2 = k.square().sum(-1)
    origin = k2 == 0
    safe = torch.where(origin, torch.ones_like(k2), k2)
    volume = torch.linalg.det(cell).abs()
    green = COULOMB_EV_ANGSTROM * 4 * math.pi / (volume * safe) * torch.exp(-safe / (4 * alpha**2))
    # the spline's structure factor, sinc(m / n)^order per axis (nvalchemiops' own PME uses it)
    moduli = [compute_bspline_moduli_1d(f, n, spline_order) for f, n in zip(freqs, dims)]
    modulus = moduli[0][:, None, None] * moduli[1][None, :, None] * moduli[2][None, None, :]
    deconvolution = 1.0 / modulus.square()
    return torch.where(origin, torch.zeros_like(k2), green * deconvolution)


def reciprocal_energies(batch: Batch, positions, cell, charges, alpha: float, spline_order: int,
                        dims: list[tuple[int, int, int]]) -> torch.Tensor:
    """Per-atom PME reciprocal energies; one mesh per system of the batch."""
    energies = torch.zeros_like(charges)
    for system, system_dims in enumerate(dims):
        # other systems' atoms spread zero charge: rows stay [owned | ghost] for the dispatch
        q = charges * (batch.batch == system).to(charges.dtype) if batch.num_systems > 1 else charges
        cell_inv_t = torch.linalg.inv(cell[system]).T.unsqueeze(0).contiguous()
        mesh = torch.ops.nvalchemiops.spline_spread(positions, q, cell_inv_t, list(system_dims), spline_order)
        green = green_function(cell[system], system_dims, alpha, spline_order)
        potential = mesh_potential(mesh, green)
        at_atoms = torch.ops.nvalchemiops.spline_gather(positions, potential, cell_inv_t, spline_order)
        energies = energies + 0.5 * q * at_atoms
    return energies
