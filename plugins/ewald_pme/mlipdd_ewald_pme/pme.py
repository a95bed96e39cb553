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

import functools
import math
from collections import OrderedDict

import torch
from mlipdd import Batch
from mlipdd.data import InputError
from nvalchemiops.torch import spline as _nv_spline  # registers nvalchemiops::spline_* ops

from mlipdd_ewald_pme.coulomb import COULOMB_EV_ANGSTROM
from mlipdd_ewald_pme.ewald import plane_spacings

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
    grad_mesh = _convolve(grad, green) if ctx.needs_input_grad[0] else None
    # only a strained cell (stress) asks for the Green function's gradient: two FFTs saved otherwise
    grad_green = (torch.fft.fftn(mesh) * torch.fft.fftn(grad).conj()).real if ctx.needs_input_grad[1] else None
    return grad_mesh, grad_green


mesh_potential.register_autograd(_backward, setup_context=_save)


# ---- B-spline spread and gather in plain torch: no weight threshold ----------------------
#
# NOTE [spline floor]. nvalchemiops 0.5.0's spread and gather kernels skip every stencil
# weight below 1e-8 (``if weight > 1e-8``, in float64 as in float32): an order-6 atom
# loses ~5e-8 of its charge to its stencil's corners, and PME stops improving near
# 1e-7 eV/A RMS force (NaCl; it scales with the charges) at any mesh. These two ops
# (``spline="torch"``) spread and gather every weight in the input's dtype, so float64
# PME converges to Ewald as the mesh is refined. Cardinal B-spline weights by the
# Cox-de Boor recursion; the grid convention (point floor(u) - j gets M_p(frac(u) + j))
# differs from the Warp kernels' by a constant shift, which no energy sees. Backward:
# the op re-runs its own torch code under autograd (first derivatives: forces, stress,
# charge gradients; not a second derivative).

TORCH_SPREAD_OP = "mlipdd_ewald_pme::spline_spread"
TORCH_GATHER_OP = "mlipdd_ewald_pme::spline_gather"


def _stencil(positions: torch.Tensor, cell_inv_t: torch.Tensor, dims, order: int):
    """Flat mesh indices (N, p^3) and weights (N, p^3) of each atom's stencil."""
    n = torch.tensor(list(dims), device=positions.device)
    u = (positions @ cell_inv_t[0].T) * n.to(positions.dtype)  # mesh coordinates
    base = torch.floor(u.detach())
    frac = u - base  # carries the position (and cell) gradient
    # M_p(frac + j), j = 0..p-1, by the recursion M_k(x) = (x M_{k-1}(x) + (k - x) M_{k-1}(x - 1)) / (k - 1)
    j = torch.arange(order, device=positions.device, dtype=positions.dtype)
    x = frac.unsqueeze(-1) + j  # (N, 3, p)
    weights = torch.where((x >= 1) & (x < 2), 2 - x, torch.zeros_like(x))
    weights = torch.where((x >= 0) & (x < 1), x, weights)  # M_2
    for k in range(3, order + 1):
        shifted = torch.cat([torch.zeros_like(weights[..., :1]), weights[..., :-1]], -1)  # M_{k-1}(x - 1)
        weights = (x * weights + (k - x) * shifted) / (k - 1)
    points = (base.long().unsqueeze(-1) - j.long()) % n.unsqueeze(-1)  # (N, 3, p)
    flat = (points[:, 0, :, None, None] * n[1] + points[:, 1, None, :, None]) * n[2] + points[:, 2, None, None, :]
    w = weights[:, 0, :, None, None] * weights[:, 1, None, :, None] * weights[:, 2, None, None, :]
    return flat.reshape(len(positions), -1), w.reshape(len(positions), -1)


def _spread_torch(positions, values, cell_inv_t, dims, order):
    flat, w = _stencil(positions, cell_inv_t, dims, order)
    mesh = torch.zeros(math.prod(dims), device=positions.device, dtype=positions.dtype)
    return mesh.index_add(0, flat.reshape(-1), (values.unsqueeze(1) * w).reshape(-1)).reshape(*dims)


def _gather_torch(positions, mesh, cell_inv_t, order):
    flat, w = _stencil(positions, cell_inv_t, tuple(mesh.shape), order)
    return (mesh.reshape(-1)[flat] * w).sum(1)


@torch.library.custom_op(TORCH_SPREAD_OP, mutates_args=())
def spline_spread(positions: torch.Tensor, values: torch.Tensor, cell_inv_t: torch.Tensor,
                  dims: list[int], order: int) -> torch.Tensor:
    """B-spline spread of ``values`` at ``positions`` onto a ``dims`` mesh (no threshold)."""
    return _spread_torch(positions, values, cell_inv_t, dims, order)


@spline_spread.register_fake
def _(positions, values, cell_inv_t, dims, order):
    return positions.new_empty(tuple(dims))


@torch.library.custom_op(TORCH_GATHER_OP, mutates_args=())
def spline_gather(positions: torch.Tensor, mesh: torch.Tensor, cell_inv_t: torch.Tensor,
                  order: int) -> torch.Tensor:
    """B-spline interpolation of ``mesh`` at ``positions`` (no threshold)."""
    return _gather_torch(positions, mesh, cell_inv_t, order)


@spline_gather.register_fake
def _(positions, mesh, cell_inv_t, order):
    return positions.new_empty(positions.shape[0])


def _save_tensors_and_ints(ctx, inputs, output):
    ctx.save_for_backward(*[x for x in inputs if isinstance(x, torch.Tensor)])
    ctx.ints = [x for x in inputs if not isinstance(x, torch.Tensor)]


def _rerun_backward(function, n_tensors: int):
    def backward(ctx, grad):
        tensors = [t.detach().requires_grad_(True) for t in ctx.saved_tensors]
        with torch.enable_grad():
            out = function(*tensors, *ctx.ints)
            grads = torch.autograd.grad(out, tensors, grad, allow_unused=True)
        return (*grads, *([None] * len(ctx.ints)))
    return backward


spline_spread.register_autograd(_rerun_backward(_spread_torch, 3), setup_context=_save_tensors_and_ints)
spline_gather.register_autograd(_rerun_backward(_gather_torch, 3), setup_context=_save_tensors_and_ints)


# ---- mesh size from the accuracy: an error estimate for this PME --------------------------
#
# NOTE [PME error estimate]. The RMS force error of a mesh method over random particle
# positions is ``dF = k_e sum_i q_i^2 sqrt(Q / (N V))`` with ``Q`` the pair-force error
# functional of Deserno and Holm (J. Chem. Phys. 109, 7678 (1998)): the squared error of
# the force between two unit charges, averaged over both positions. For this PME (B-spline
# assignment of order p, transform U(k) = prod_a sinc^p; the SPME Green function
# G = phi(k) / U(k)^2 with phi(k) = 4 pi / k^2 exp(-k^2 / 4 alpha^2); forces by
# differentiating the interpolation, "ad"; not P3M's optimal influence function), doing the
# average over the two positions through Poisson's sum gives, per mesh frequency m with
# aliases k_n = k_m + 2 pi sum_a n_a K_a b_a,
#
#     Q = (1/V) sum_m phi(k_m)^2 [ S1(m) S2(m) / U(k_m)^4 - |k_m|^2 ],
#     S1 = sum_n U(k_n)^2,  S2 = sum_n |k_n|^2 U(k_n)^2,
#
# plus |k|^2 phi(k)^2 for every k the mesh cannot hold. With t_a = m_a / K_a the alias
# ratios are exact, U(k_n)^2 / U(k_m)^2 = prod_a (t_a / (t_a + n_a))^(2p), so the sum needs
# only the m where phi is not negligible: the Ewald-like set |k| <= k_lim, a few
# k-vectors per A^3 (``mesh_error_functional``; cached per cell and mesh). The first
# aliases' |k_n|^2 ~ (2 pi / h)^2 dominate: the force error falls as h^(p-1), one order
# slower than the potential's (the derivative of an interpolant). Leading order in the
# spacing, the sum integrates in closed form, axis by axis (``estimated_error_functional``,
# the first guess of the mesh search):
#
#     Q_a = 32 pi^2 zeta(2p-2) Gamma(p-1/2) (2 alpha^2)^(p-1/2) / ((2p+1) delta_a^2) (h_a / 2 pi)^(2p)
#
# with h_a = |a_a| / K_a (along the cell vector) and delta_a = d_a / K_a (between mesh
# planes). Ewald's k-space truncation at k_c has, in the same normalisation,
# Q_E = 8 (alpha^2 / k_c) exp(-k_c^2 / 2 alpha^2) = 8 (alpha^2 / k_c) accuracy^2: the
# Kolafa-Perram estimate, equal to the real-space one at this code's splitting. The default
# mesh is the coarsest (fast FFT lengths) with Q <= (MESH_ERROR_FRACTION)^2 Q_E: its error
# is half of Ewald's k-space error at the same accuracy, whatever the charges (both scale
# with k_e sum q^2 / sqrt(N V)). Measured: benchmarks/results/ewald_pme_accuracy.md.

MESH_ERROR_FRACTION = 0.5  # default mesh: RMS mesh force error <= this x Ewald's k-space error
_ALIASES = 6  # aliases per side and axis in the exact sum (the 7th adds < 1e-6 of the total)


def _fft_size(n: int) -> int:
    """Smallest even n' >= n with no prime factor above 5 (fast FFT lengths)."""
    n = max(int(n), 2)
    while True:
        m = n
        for f in (2, 3, 5):
            while m % f == 0:
                m //= f
        if m == 1 and n % 2 == 0:
            return n
        n += 1


def _zeta(s: float) -> float:
    return sum(k ** -s for k in range(1, 200)) + 199.5 ** (1 - s) / (s - 1)


def alias_coefficient(alpha: float, spline_order: int) -> float:
    """``Q_a delta_a^2 / h_a^(2p)`` of NOTE [PME error estimate] (Angstrom^-(2p+1))."""
    p = spline_order
    return (32 * math.pi**2 * _zeta(2 * p - 2) * math.gamma(p - 0.5) * (2 * alpha**2) ** (p - 0.5)
            / ((2 * p + 1) * (2 * math.pi) ** (2 * p)))


def ewald_error_functional(alpha: float, k_cutoff: float) -> float:
    """``Q_E`` of Ewald's k-space truncation at ``k_cutoff`` (continuum, Kolafa-Perram)."""
    return 8 * alpha**2 / k_cutoff * math.exp(-(k_cutoff**2) / (2 * alpha**2))


def estimated_error_functional(cell: torch.Tensor, dims, alpha: float, spline_order: int) -> float:
    """Closed-form ``Q`` (leading order in the spacing) of a (3, 3) cell's mesh ``dims``."""
    lengths = cell.detach().norm(dim=1)
    heights = plane_spacings(cell.unsqueeze(0))[0]
    c = alias_coefficient(alpha, spline_order)
    return sum(c * (float(lengths[a]) / n) ** (2 * spline_order) / (float(heights[a]) / n) ** 2
               for a, n in enumerate(dims))


def _k_limit(alpha: float) -> float:
    # phi^2 carries exp(-k^2 / 2 alpha^2): past 9 alpha it is below 1e-17 of its value at
    # k ~ alpha, far under any accuracy this code is asked for
    return 9.0 * alpha


def mesh_error_functional(cell: torch.Tensor, dims, alpha: float, spline_order: int,
                          k_limit: float | None = None) -> float:
    """``Q`` of NOTE [PME error estimate] for a (3, 3) cell and mesh ``dims``: the sum over
    the frequencies with ``|k| <= k_limit`` (default ``9 alpha``) and their aliases
    (``|n| <= 6`` per axis), in float64. A frequency outside the mesh counts as missing."""
    key = (tuple(round(float(x), 10) for x in cell.detach().reshape(-1)), tuple(int(n) for n in dims),
           float(alpha), int(spline_order), float(k_limit or _k_limit(alpha)))
    return _mesh_error_functional(key)


# NOTE [strided frequency sum]
# A large cell holds many frequencies under 9 alpha (~10^7 at 1M ions), and the mesh search
# evaluates Q for a dozen meshes: summed exactly that took 43 s at 100k ions and 186 s at 1M
# on the first call (2 cores). The summand is smooth on the scale of alpha (phi^2's Gaussian,
# the alias ratios in m / K) and decays to ~1e-17 at the sphere's edge, so past
# _FREQUENCY_BUDGET frequencies the sum takes every s-th frequency per axis (the frequencies of
# the cell shrunk s times) weighted s^3: a trapezoid rule on a smooth, decaying integrand,
# whose error falls off exponentially in the points per alpha. Measured against the exact sum
# (accuracy 1e-6, 10 A cutoff, order 6): 10k ions s = 2, 2.6e-7 relative in Q; 100k s = 3,
# 5.7e-9. The set depends on the cell, alpha and the limit only: built once, it serves every
# mesh the search tries. First call now 2.4 s at 10k and 100k, 0.7 s at 1M.
_FREQUENCY_BUDGET = 1 << 16


@functools.lru_cache(maxsize=8)
def _frequencies(flat, k_limit: float, budget: int = _FREQUENCY_BUDGET):
    """(m (k, 3), |k|^2 (k,), weight) of the frequencies with 0 < |k| <= k_limit, every
    ``stride``-th per axis past ``budget`` of them (NOTE [strided frequency sum])."""
    cell = torch.tensor(flat, dtype=torch.float64).reshape(3, 3)
    inverse = torch.linalg.inv(cell)  # columns b_a (no 2 pi)
    metric = inverse.T @ inverse  # b_a . b_b
    bounds = [math.ceil(k_limit * float(length) / (2 * math.pi)) for length in cell.norm(dim=1)]
    # the sphere holds ~pi/6 of its bounding box
    stride = max(1, math.ceil((math.pi / 6 * math.prod(2 * b + 1 for b in bounds) / budget) ** (1 / 3)))
    axes = [stride * torch.arange(-(b // stride), b // stride + 1, dtype=torch.float64) for b in bounds]
    kept_m, kept_k2 = [], []
    # in blocks of first-axis frequencies: the box can hold ~10^8 of them
    for block in axes[0].split(max(1, (1 << 20) // (len(axes[1]) * len(axes[2])))):
        m = torch.stack(torch.meshgrid(block, axes[1], axes[2], indexing="ij"), -1).reshape(-1, 3)
        k2 = 4 * math.pi**2 * torch.einsum("ka,ab,kb->k", m, metric, m)
        inside = (k2 <= k_limit**2) & (k2 > 0)
        kept_m.append(m[inside])
        kept_k2.append(k2[inside])
    return torch.cat(kept_m), torch.cat(kept_k2), float(stride**3), metric


@functools.lru_cache(maxsize=256)
def _mesh_error_functional(key) -> float:
    flat, dims, alpha, p, k_limit = key
    m, k2, weight, metric = _frequencies(flat, k_limit)
    total = 0.0
    for m_part, k2_part in zip(m.split(1 << 18), k2.split(1 << 18)):  # the alias sums: ~300 bytes each
        total += _functional_terms(m_part, k2_part, metric, dims, alpha, p)
    volume = abs(float(torch.linalg.det(torch.tensor(flat, dtype=torch.float64).reshape(3, 3))))
    return weight * total / volume


def _functional_terms(m, k2, metric, dims, alpha: float, p: int) -> float:
    """The sum of NOTE [PME error estimate]'s terms over the frequencies ``m`` (k, 3)."""
    phi2 = (4 * math.pi / k2 * torch.exp(-k2 / (4 * alpha**2))) ** 2
    n_dims = torch.tensor(dims, dtype=torch.float64)
    held = (m.abs() <= n_dims / 2).all(1) & ~((2 * m.abs() == n_dims) & (m < 0)).any(1)  # fftfreq's range
    # alias sums relative to the principal term, per axis: e0 = sum (t/(t+n))^2p, e1, e2 with mu = m + n K
    aliases = torch.tensor([n for n in range(-_ALIASES, _ALIASES + 1) if n != 0], dtype=torch.float64)
    t = m / n_dims
    ratio = (t[:, :, None] / (t[:, :, None] + aliases)) ** (2 * p)  # (k, 3, aliases)
    mu = m[:, :, None] + n_dims[None, :, None] * aliases
    e0, e1, e2 = ratio.sum(2), (mu * ratio).sum(2), (mu * mu * ratio).sum(2)
    log1p = torch.log1p(e0)
    total = log1p.sum(1)
    a1 = torch.expm1(total)  # S1 / U0^2 - 1
    # D = S2 / U0^2 - |k|^2 from the alias shares only (nothing large cancels)
    D = torch.zeros_like(k2)
    for a in range(3):
        P = torch.expm1(total - log1p[:, a])
        D = D + metric[a, a] * (m[:, a] ** 2 * P + e2[:, a] * (1 + P))
        for b in range(3):
            if b != a:
                P = torch.expm1(total - log1p[:, a] - log1p[:, b])
                D = D + metric[a, b] * (m[:, a] * m[:, b] * P
                                        + (m[:, a] * e1[:, b] + e1[:, a] * m[:, b] + e1[:, a] * e1[:, b]) * (1 + P))
    bracket = a1 * k2 + (1 + a1) * 4 * math.pi**2 * D  # S1 S2 / U0^4 - |k|^2
    terms = torch.where(held, phi2 * bracket, phi2 * k2)
    return float(terms.sum())


def rms_force_error(functional: float, charges: torch.Tensor, volume: float) -> float:
    """``k_e sum q^2 sqrt(Q / (N V))`` in eV/A (NOTE [PME error estimate])."""
    q2 = float(charges.detach().double().square().sum())
    return COULOMB_EV_ANGSTROM * q2 * math.sqrt(max(functional, 0.0) / (len(charges) * volume))


def accurate_mesh(cell: torch.Tensor, alpha: float, k_cutoff: float, spline_order: int,
                  fraction: float = MESH_ERROR_FRACTION) -> tuple[int, int, int]:
    """The default mesh: the closed form's guess, refined until ``mesh_error_functional``
    is at most ``fraction^2`` of Ewald's k-space functional at ``k_cutoff``."""
    p = spline_order
    lengths = cell.detach().norm(dim=1)
    heights = plane_spacings(cell.unsqueeze(0))[0]
    target = fraction**2 * ewald_error_functional(alpha, k_cutoff)
    c = alias_coefficient(alpha, p)
    # Q_a = c |a_a|^2p / d_a^2 * K_a^-(2p-2) <= target / 3 per axis
    guess = [(3 * c * float(length) ** (2 * p) / float(h) ** 2 / target) ** (1 / (2 * p - 2))
             for length, h in zip(lengths, heights)]
    nyquist = [k_cutoff * float(h) / math.pi for h in heights]
    scale = 1.0
    for _ in range(40):
        dims = tuple(_fft_size(max(math.ceil(scale * g), math.ceil(n), p)) for g, n in zip(guess, nyquist))
        if mesh_error_functional(cell, dims, alpha, p) <= target:
            return dims
        scale *= 1.06
    return dims


def mesh_dimensions(cell: torch.Tensor, k_cutoff: float, spline_order: int,
                    mesh_spacing: float | None, alpha: float | None = None) -> tuple[int, int, int]:
    """Mesh points per axis for one system's (3, 3) cell.

    The mesh resolves wave vectors up to ``pi n_i / d_i`` along axis ``i`` (``d_i`` the
    plane spacing); it must reach the Ewald cutoff ``k_cutoff`` set by the accuracy. With
    ``mesh_spacing=None`` and ``alpha`` given it is the `accurate_mesh` (NOTE [PME error
    estimate]); without ``alpha``, only that Nyquist bound (the old default).
    """
    heights = plane_spacings(cell.unsqueeze(0))[0]
    needed = [max(math.ceil(k_cutoff * float(h) / math.pi), spline_order) for h in heights]
    if mesh_spacing is None:
        if alpha is not None:
            return accurate_mesh(cell, alpha, k_cutoff, spline_order)
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


# NOTE [Green function cache]. The Green function (the k-space kernel times the B-spline
# deconvolution, one value per mesh point) depends on the cell, the mesh, alpha and the spline
# order only, and building it costs several passes over the mesh (frequencies, a 3x3 product
# per point, exp, sinc^p): about as much as the mesh's FFTs. Between the calls of an MD run or
# an optimisation at fixed cell none of these change, so it is kept, keyed by the cell's exact
# bytes (a reuse returns the very bits a fresh evaluation gives), the mesh, alpha, order, dtype,
# device and, for the distributed mesh, this rank's spectrum slab. Not kept: when the cell
# carries a gradient (stress: its graph must be built), for a cell that is not a plain tensor,
# and under torch.compile or a CUDA-graph capture (reading the cell's bytes is a host copy).
# Any change of the cell (NPT) is a new key; the oldest entries go first.


class GreenCache:
    """A few Green functions, reused while their key and the cell's bytes are unchanged."""

    def __init__(self, size: int = 8):
        self.enabled = True
        self.size = size
        self.entries: OrderedDict = OrderedDict()
        self.hits = self.misses = 0

    def clear(self) -> None:
        self.entries.clear()
        self.hits = self.misses = 0

    def get(self, key: tuple, cell: torch.Tensor, compute) -> torch.Tensor:
        if (not self.enabled or type(cell) is not torch.Tensor or (cell.requires_grad and torch.is_grad_enabled())
                or torch.compiler.is_compiling()
                or (cell.is_cuda and torch.cuda.is_current_stream_capturing())):
            return compute()
        full = (key, cell.dtype, str(cell.device), cell.detach().cpu().contiguous().numpy().tobytes())
        found = self.entries.get(full)
        if found is not None:
            self.entries.move_to_end(full)
            self.hits += 1
            return found
        self.misses += 1
        found = self.entries[full] = compute()
        while len(self.entries) > self.size:
            self.entries.popitem(last=False)
        return found


GREEN_CACHE = GreenCache()


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
    # the spline's structure factor, sinc(m / n)^order per axis (as nvalchemiops' own PME; written
    # here: importing its PME module compiles ~13 s of Warp kernels per process, per spawned rank)
    moduli = [torch.special.sinc(f / n) ** spline_order for f, n in zip(freqs, dims)]
    modulus = moduli[0][:, None, None] * moduli[1][None, :, None] * moduli[2][None, None, :]
    deconvolution = 1.0 / modulus.square()
    return torch.where(origin, torch.zeros_like(k2), green * deconvolution)


def reciprocal_energies(batch: Batch, positions, cell, charges, alpha: float, spline_order: int,
                        dims: list[tuple[int, int, int]], spline: str = "warp") -> torch.Tensor:
    """Per-atom PME reciprocal energies; one mesh per system of the batch. ``spline``:
    "warp" (nvalchemiops' kernels) or "torch" (this module's, NOTE [spline floor])."""
    spread = torch.ops.nvalchemiops.spline_spread if spline == "warp" else spline_spread
    gather = torch.ops.nvalchemiops.spline_gather if spline == "warp" else spline_gather
    energies = torch.zeros_like(charges)
    for system, system_dims in enumerate(dims):
        # other systems' atoms spread zero charge: rows stay [owned | ghost] for the dispatch
        q = charges * (batch.batch == system).to(charges.dtype) if batch.num_systems > 1 else charges
        cell_inv_t = torch.linalg.inv(cell[system]).T.unsqueeze(0).contiguous()
        mesh = spread(positions, q, cell_inv_t, list(system_dims), spline_order)
        key = ("replicated", tuple(system_dims), float(alpha), int(spline_order))
        green = GREEN_CACHE.get(key, cell[system],
                                functools.partial(green_function, cell[system], system_dims, alpha, spline_order))
        potential = mesh_potential(mesh, green)
        at_atoms = gather(positions, potential, cell_inv_t, spline_order)
        energies = energies + 0.5 * q * at_atoms
    return energies
