"""PME reciprocal space on a mesh split over ranks (``PMEWrapper(mesh="distributed")``).

Per system: every rank computes the mesh coordinates ``u`` of its owned atoms and sends
``(u, q)`` to the rank holding the atom's top stencil plane (an all_to_all of 4 numbers
per atom); that rank spreads them into its slab and the ``order - 1`` planes below it,
whose partial sums go to their owners (NOTE [mesh slabs] in `slab_fft`); the slabs go
through the distributed 3-D FFT, the Green function of this rank's part of the spectrum,
and back; each rank fetches its lower planes again, interpolates the potential at the
atoms it spread, and returns it to their owners (the reverse all_to_all). Per atom
``e_i = q_i phi(r_i) / 2``, as in the replicated PME (`pme.reciprocal_energies`).

# NOTE [distributed mesh under DD]
This is the one part of the plugin with collectives of its own: a distributed FFT is an
algorithm over ranks, which no per-op rule or OpAdapter of the dispatch can express. It
takes the plain tensors behind the ShardTensors (``local``: same autograd history), runs
autograd-aware exchanges of the core (`halo_accumulate`, `pad`, `all_to_all_rows` in an
autograd Function) on them, and hands per-atom energies back in the caller's layout
(``[owned | ghost]`` rows under halo storage: ghost rows get their owner's value by `pad`;
owned rows under sharded storage). Every rank reaches the same exchanges in the same
order (the loop over systems and the mesh are the same everywhere), so the backward's
adjoint exchanges match too. Gradients: by positions and charges through the exchanges
back to the owners; by the cell (stress) through ``u`` and this rank's part of the
Green function, this rank's share, which the strategy sums over ranks as it does for
every plain strain.

The spread and gather are autograd Functions with analytic backwards (cardinal B-spline
weights and their derivatives), chunked over atoms so that the stencils never take more
than ``CHUNK x order^3`` entries; the same weights and grid convention as the plain-torch
spline ops of `pme` (NOTE [spline floor]: no weight threshold), so this equals
``PMEWrapper(spline="torch")`` with a replicated mesh to rounding. First derivatives only.
"""

from __future__ import annotations

import math

import torch
from mlipdd.shard import call_adapted, is_distributed, process_group
from mlipdd.spec import OpAdapter, SliceOwned

from mlipdd_ewald_pme.coulomb import COULOMB_EV_ANGSTROM
from mlipdd_ewald_pme.pme import GREEN_CACHE
from mlipdd_ewald_pme.slab_fft import AllToAll, SlabMesh, exchange_counts

CHUNK = 1 << 15  # atoms per stencil block: 32k x 216 entries (order 6) ~ 110 MB in float64 with indices

# Bytes of mesh-shaped tensors the last call held per rank (largest system), for benchmarks.
MESH_BYTES = {"last": 0}


# ---- B-spline weights and their derivatives --------------------------------------------


def bspline(frac: torch.Tensor, order: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``M_p(frac + j)`` and ``M_p'(frac + j)``, j = 0..p-1, for ``frac`` (n, 3) in [0, 1)."""
    j = torch.arange(order, device=frac.device, dtype=frac.dtype)
    x = frac.unsqueeze(-1) + j
    w = torch.where((x >= 1) & (x < 2), 2 - x, torch.zeros_like(x))
    w = torch.where((x >= 0) & (x < 1), x, w)  # M_2
    for k in range(3, order):
        shifted = torch.cat([torch.zeros_like(w[..., :1]), w[..., :-1]], -1)
        w = (x * w + (k - x) * shifted) / (k - 1)
    shifted = torch.cat([torch.zeros_like(w[..., :1]), w[..., :-1]], -1)  # M_{p-1}(x - 1)
    return (x * w + (order - x) * shifted) / (order - 1), w - shifted  # M_p' = M_{p-1}(x) - M_{p-1}(x-1)


def _stencil(u: torch.Tensor, mesh: SlabMesh, top_offset: torch.Tensor):
    """Flat indices into the virtual buffer (n, p^3) and per-axis weights, derivatives (n, 3, p)."""
    p, (_, ny, nz) = mesh.order, mesh.dims
    base = torch.floor(u)
    w, dw = bspline(u - base, p)
    j = torch.arange(p, device=u.device)
    vx = top_offset.unsqueeze(1) + (p - 1) - j  # virtual plane of stencil row j
    vy = (base[:, 1].long().unsqueeze(1) - j) % ny
    vz = (base[:, 2].long().unsqueeze(1) - j) % nz
    flat = (vx[:, :, None, None] * ny + vy[:, None, :, None]) * nz + vz[:, None, None, :]
    return flat.reshape(len(u), -1), w, dw


def _outer(wx, wy, wz):
    return (wx[:, :, None, None] * wy[:, None, :, None] * wz[:, None, None, :]).reshape(len(wx), -1)


def _chunks(n: int):
    return [(s, min(s + CHUNK, n)) for s in range(0, n, CHUNK)]


def _spread(u, top, values, mesh, buffer_shape):
    out = torch.zeros(math.prod(buffer_shape), dtype=values.dtype, device=values.device)
    for a, b in _chunks(len(u)):
        flat, w, _ = _stencil(u[a:b], mesh, top[a:b])
        out.index_add_(0, flat.reshape(-1), (values[a:b, None] * _outer(w[:, 0], w[:, 1], w[:, 2])).reshape(-1))
    return out.view(buffer_shape)


def _gather(u, top, buffer, mesh, with_gradient: bool):
    """Interpolated values (n,) and, if asked, their gradient by ``u`` (n, 3)."""
    flat_buffer = buffer.reshape(-1)
    values = buffer.new_empty(len(u))
    grads = buffer.new_empty(len(u), 3) if with_gradient else None
    for a, b in _chunks(len(u)):
        flat, w, dw = _stencil(u[a:b], mesh, top[a:b])
        at = flat_buffer[flat]  # (n, p^3)
        values[a:b] = (at * _outer(w[:, 0], w[:, 1], w[:, 2])).sum(1)
        if with_gradient:
            for axis in range(3):
                parts = [dw[:, i] if i == axis else w[:, i] for i in range(3)]
                grads[a:b, axis] = (at * _outer(*parts)).sum(1)
    return values, grads


class _Spread(torch.autograd.Function):
    """``(u, q)`` of the atoms this rank spreads -> the virtual buffer (NOTE [mesh slabs])."""

    @staticmethod
    def forward(ctx, u, values, top, mesh):
        ctx.save_for_backward(u, values, top)
        ctx.mesh = mesh
        return _spread(u, top, values, mesh, (mesh.virtual_planes, *mesh.dims[1:]))

    @staticmethod
    def backward(ctx, grad):
        u, values, top = ctx.saved_tensors
        at, by_u = _gather(u, top, grad, ctx.mesh, ctx.needs_input_grad[0])
        grad_u = values.unsqueeze(1) * by_u if by_u is not None else None
        return grad_u, at, None, None


class _Gather(torch.autograd.Function):
    """The virtual buffer -> its interpolated value at each atom this rank spread."""

    @staticmethod
    def forward(ctx, u, buffer, top, mesh):
        values, by_u = _gather(u, top, buffer, mesh, ctx.needs_input_grad[0])
        ctx.save_for_backward(u, top, by_u if by_u is not None else u.new_empty(0))
        ctx.mesh, ctx.shape = mesh, buffer.shape
        return values

    @staticmethod
    def backward(ctx, grad):
        u, top, by_u = ctx.saved_tensors
        grad_u = grad.unsqueeze(1) * by_u if ctx.needs_input_grad[0] else None
        grad_buffer = _spread(u, top, grad, ctx.mesh, ctx.shape) if ctx.needs_input_grad[1] else None
        return grad_u, grad_buffer, None, None


# ---- the Green function of this rank's part of the spectrum ------------------------------


def local_green_function(cell: torch.Tensor, mesh: SlabMesh, alpha: float) -> torch.Tensor:
    """``pme.green_function`` on this rank's spectrum slab, made even in ``m``.

    The replicated PME takes the real part of ``IFFT(G FFT(Q))``, which equals the IFFT of
    ``(G(m) + G(-m)) / 2`` with ``-m`` taken modulo the mesh; ``G`` is even in ``k`` except
    on a Nyquist plane of a triclinic cell, where ``-m`` wraps onto the plane itself. The
    half spectrum this FFT keeps needs a kernel that is even in ``m``: the same average."""
    device, dtype = cell.device, cell.dtype
    freqs = mesh.spectrum_frequencies(device, dtype)
    m = torch.stack(torch.meshgrid(*freqs, indexing="ij"), -1)
    nyquist = torch.tensor([-(n // 2) if n % 2 == 0 else 0.5 for n in mesh.dims], device=device, dtype=dtype)
    mirrored = torch.where(m == nyquist, m, -m)  # fftfreq's representative of -m mod n
    inverse = torch.linalg.inv(cell)
    volume = torch.linalg.det(cell).abs()
    moduli = [torch.special.sinc(f / n) ** mesh.order for f, n in zip(freqs, mesh.dims)]
    deconvolution = 1.0 / (moduli[0][:, None, None] * moduli[1][None, :, None] * moduli[2][None, None, :]).square()

    def green(frequencies):
        k = 2 * math.pi * torch.einsum("xyzj,ij->xyzi", frequencies, inverse)
        k2 = k.square().sum(-1)
        origin = k2 == 0
        safe = torch.where(origin, torch.ones_like(k2), k2)
        value = COULOMB_EV_ANGSTROM * 4 * math.pi / (volume * safe) * torch.exp(-safe / (4 * alpha**2))
        return torch.where(origin, torch.zeros_like(k2), value)

    # sinc^p is even in m, Nyquist planes included: one deconvolution serves both
    return 0.5 * (green(m) + green(mirrored)) * deconvolution


# ---- one system ---------------------------------------------------------------------------


def _system_potential(u, charges, mesh: SlabMesh, cell, alpha: float) -> torch.Tensor:
    """The reciprocal potential at each owned atom of one system (mesh coordinates ``u``)."""
    nx = mesh.dims[0]
    top = torch.floor(u[:, 0].detach()).long() % nx
    dest = mesh.plane_owner(top)
    order = torch.argsort(dest, stable=True)
    send = torch.bincount(dest, minlength=mesh.world).tolist()
    recv = exchange_counts(send, mesh.group, u.device)
    rows = torch.cat([u, charges.unsqueeze(1)], 1).index_select(0, order)
    here = AllToAll.apply(rows, send, recv, mesh.group)  # the atoms whose top plane this rank holds
    u_here, q_here = here[:, :3], here[:, 3]
    top_here = torch.floor(u_here[:, 0].detach()).long() % nx - mesh.x0
    virtual = _Spread.apply(u_here, q_here, top_here, mesh)
    slab = mesh.accumulate(virtual)
    spectrum = mesh.forward_fft(slab)
    # NOTE [Green function cache] in pme: this rank's spectrum slab of it, kept while the cell is
    key = ("slab", mesh.dims, mesh.order, mesh.world, mesh.rank, float(alpha))
    green = GREEN_CACHE.get(key, cell, lambda: local_green_function(cell, mesh, alpha))
    potential = mesh.inverse_fft(green * spectrum)
    phi_here = _Gather.apply(u_here, mesh.fill(potential), top_here, mesh)
    phi = AllToAll.apply(phi_here.unsqueeze(1), recv, send, mesh.group).squeeze(1)
    mesh_bytes = sum(t.numel() * t.element_size() for t in (virtual, slab, spectrum, green, potential))
    MESH_BYTES["last"] = max(MESH_BYTES["last"], mesh_bytes)
    return torch.empty_like(phi).index_copy(0, order, phi)  # back in owned-row order


# NOTE [distributed mesh under the aten dispatch]
# The aten dispatch sees ops, not algorithms: the distributed FFT runs as one adapted call
# (`mlipdd.shard.call_adapted`), whose adapter says what it reads and returns: the owned rows
# of positions, charges and system numbers (``SliceOwned``), the cell as it is (replicated),
# per-atom energies of the owned rows (the core pads them with ghost rows of no meaning:
# OWNED rows). It runs on plain tensors with the dispatch's modes off, forward and backward,
# so its own collectives and factories see plain tensors; the core sums this rank's part of
# the cell's gradient over ranks (the stress) and hands the charges' and positions'
# gradients back as shares of their owners.
RECIPROCAL_ADAPTER = OpAdapter(
    "mlipdd_ewald_pme::distributed_reciprocal",
    arg_transforms={0: SliceOwned(), 1: SliceOwned(), 2: SliceOwned()},
)


def owned_energies(pos, q, system, cells, *, alpha: float, spline_order: int, dims, group, distributed: bool):
    """Per-atom reciprocal energies of this rank's owned atoms (plain tensors)."""
    MESH_BYTES["last"] = 0
    energies = torch.zeros_like(q)
    for s, system_dims in enumerate(dims):
        mesh = SlabMesh.of(system_dims, spline_order, group, distributed=distributed)
        rows = torch.nonzero(system == s).flatten() if len(dims) > 1 else None
        pos_s = pos if rows is None else pos.index_select(0, rows)
        q_s = q if rows is None else q.index_select(0, rows)
        cell_inv_t = torch.linalg.inv(cells[s]).T  # as `pme._stencil`: the same rounding of u
        n = torch.tensor(list(system_dims), device=pos.device, dtype=pos.dtype)
        u = (pos_s @ cell_inv_t.T) * n
        e = 0.5 * q_s * _system_potential(u, q_s, mesh, cells[s], alpha)
        energies = e if rows is None else energies.index_add(0, rows, e)
    return energies


def reciprocal_energies(batch, positions, cell, charges, alpha: float, spline_order: int,
                        dims: list[tuple[int, int, int]]) -> torch.Tensor:
    """Per-atom PME reciprocal energies with each system's mesh split over the ranks
    (NOTE [distributed mesh under DD]); plain tensors (one process) run the same code."""
    options = {"alpha": alpha, "spline_order": spline_order, "dims": dims}
    # one process or the aten dispatch (the only one): NOTE [distributed mesh under the aten dispatch]
    return call_adapted(RECIPROCAL_ADAPTER, owned_energies, positions, charges, batch.batch, cell,
                        group=process_group(positions), distributed=is_distributed(positions), **options)
