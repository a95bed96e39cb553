"""A PME mesh split over ranks in slabs, and the distributed 3-D FFT over it.

# NOTE [mesh slabs]
Rank ``r`` holds the mesh planes ``x0_r <= x < x0_r + n_r`` along the first mesh axis
(``n_r`` = ``nx // world`` or one more: any mesh size, any rank count; a rank may hold
none). An atom is spread by the rank holding its stencil's top plane ``floor(u_x)``; its
stencil reaches ``order - 1`` planes below, so each rank spreads into a *virtual* buffer
``[order - 1 planes below its slab | its slab]`` and sends those lower planes' partial
sums to the ranks holding them (`SlabMesh.accumulate`); to interpolate, it fetches them
back (`SlabMesh.fill`). Both are the core's halo exchanges (`ExchangePlan`,
`halo_accumulate` / `pad`) with mesh planes as rows, each the other's adjoint, so
autograd carries forces and the stress through them. A small mesh wraps (the planes
below may be the rank's own, or several ranks'): the exchange plan lists each plane by
its owner, itself included.

The 3-D FFT of the slabs (`SlabMesh.forward_fft` / `inverse_fft`): a real FFT along z and
a complex one along y in each slab, an all_to_all that turns x-slabs into y-slabs
(`transpose`), the FFT along x. The spectrum lives as y-slabs ``(nx, n_y,r, nz // 2 + 1)``;
the Green function is evaluated on this rank's part only. Memory per rank: the slab, its
``order - 1`` halo planes, and a spectrum slab, all ~1/world of the mesh.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch
from mlipdd.comm import group_rank, group_size
from mlipdd.shard import ExchangePlan, all_to_all_rows, halo_accumulate, pad


def split(n: int, world: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Sizes and starts of ``n`` items split over ``world`` ranks (the first ``n % world`` get one more)."""
    sizes = tuple(n // world + (r < n % world) for r in range(world))
    starts = tuple(sum(sizes[:r]) for r in range(world))
    return sizes, starts


class AllToAll(torch.autograd.Function):
    """``all_to_all_rows`` with its adjoint (the same exchange, counts swapped) as backward.

    # NOTE [collective order]: every rank builds the same graph (the PME code is the same
    # everywhere and loops over the same systems), so the backward exchanges match too."""

    @staticmethod
    def forward(ctx, rows, send_counts, recv_counts, group):
        ctx.counts, ctx.group = (send_counts, recv_counts), group
        return all_to_all_rows(rows, send_counts, recv_counts, group)

    @staticmethod
    def backward(ctx, grad):
        send_counts, recv_counts = ctx.counts
        return all_to_all_rows(grad.contiguous(), recv_counts, send_counts, ctx.group), None, None, None


def exchange_counts(send_counts: list[int], group, device) -> tuple[int, ...]:
    """How many rows each rank will send here (one int per rank, through all_to_all)."""
    world = len(send_counts)
    mine = torch.tensor(send_counts, dtype=torch.int64, device=device).view(world, 1)
    return tuple(int(c) for c in all_to_all_rows(mine, [1] * world, [1] * world, group).flatten())


def _fft(transform, x: torch.Tensor, dim: int, **kwargs) -> torch.Tensor:
    """``transform`` along ``dim``, also on a rank that holds no plane (MKL refuses empty
    transforms): there an empty tensor of the transform's shape, still in the autograd
    graph (its backward must reach the same exchanges as the other ranks')."""
    if x.numel():
        return transform(x, dim=dim, **kwargs)
    shape = list(x.shape)
    if transform is torch.fft.rfft:
        shape[dim] = shape[dim] // 2 + 1
    elif transform is torch.fft.irfft:
        shape[dim] = kwargs["n"]
    real = x.real.dtype if x.is_complex() else x.dtype
    dtype = real if transform is torch.fft.irfft else {torch.float32: torch.complex64}.get(real, torch.complex128)
    zero = x.sum() * 0
    zero = zero.real if zero.is_complex() and not dtype.is_complex else zero
    return torch.zeros(shape, dtype=dtype, device=x.device) + zero


@dataclass(frozen=True)
class SlabMesh:
    """One system's mesh ``dims`` split over the ranks of ``group`` (NOTE [mesh slabs])."""

    dims: tuple[int, int, int]
    order: int
    group: object = None
    world: int = 1
    rank: int = 0
    stats: dict = field(default_factory=dict, compare=False)

    @classmethod
    def of(cls, dims, order: int, group=None, distributed: bool = True) -> SlabMesh:
        world, rank = (group_size(group), group_rank(group)) if distributed else (1, 0)
        return cls(tuple(int(n) for n in dims), int(order), group if distributed else None, world, rank)

    # ---- who holds what ----------------------------------------------------------------
    @cached_property
    def x_split(self):
        return split(self.dims[0], self.world)

    @cached_property
    def y_split(self):
        return split(self.dims[1], self.world)

    @property
    def x0(self) -> int:
        return self.x_split[1][self.rank]

    @property
    def n_planes(self) -> int:
        return self.x_split[0][self.rank]

    def plane_owner(self, planes: torch.Tensor) -> torch.Tensor:
        """The rank holding each x plane (0 <= plane < nx)."""
        starts = torch.tensor(self.x_split[1][1:], dtype=planes.dtype, device=planes.device)
        return torch.bucketize(planes, starts, right=True)

    def _below(self, rank: int) -> list[int]:
        """The planes under ``rank``'s slab its stencils reach (none for an empty slab)."""
        nx, start = self.dims[0], self.x_split[1][rank]
        if self.x_split[0][rank] == 0:
            return []
        return [(start - (self.order - 1) + v) % nx for v in range(self.order - 1)]

    def _owner(self, plane: int) -> int:
        return int(self.plane_owner(torch.tensor([plane]))[0])

    def _ghost_order(self, rank: int) -> list[int]:
        """Virtual indices of ``rank``'s lower planes, grouped by owner (the plan's row order)."""
        below = self._below(rank)
        return sorted(range(len(below)), key=lambda v: (self._owner(below[v]), v))

    @cached_property
    def plan(self) -> ExchangePlan:
        """Lower planes as ghost rows of the slab's planes (the core's halo exchange)."""
        send_index, send_counts, recv_counts = [], [], [0] * self.world
        for dest in range(self.world):
            below = self._below(dest)
            mine = [below[v] - self.x0 for v in self._ghost_order(dest) if self._owner(below[v]) == self.rank]
            send_index += mine
            send_counts.append(len(mine))
        for v in self._ghost_order(self.rank):
            recv_counts[self._owner(self._below(self.rank)[v])] += 1
        index = torch.tensor(send_index, dtype=torch.int64)
        return ExchangePlan(index, tuple(send_counts), tuple(recv_counts), self.n_planes, self.group)

    @cached_property
    def _permutations(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``virtual -> [slab | ghosts]`` and back (row indices for index_select)."""
        lower = self.order - 1 if self.n_planes else 0
        ghosts = self._ghost_order(self.rank)
        to_plan = list(range(lower, lower + self.n_planes)) + ghosts
        to_virtual = [0] * len(to_plan)
        for position, v in enumerate(to_plan):
            to_virtual[v] = position
        return torch.tensor(to_plan, dtype=torch.int64), torch.tensor(to_virtual, dtype=torch.int64)

    @property
    def virtual_planes(self) -> int:
        return self.n_planes + (self.order - 1 if self.n_planes else 0)

    # ---- the halo planes ------------------------------------------------------------------
    def _on(self, plan: ExchangePlan, device) -> ExchangePlan:
        return ExchangePlan(plan.send_index.to(device), plan.send_counts, plan.recv_counts, plan.n_owned, plan.group)

    def accumulate(self, virtual: torch.Tensor) -> torch.Tensor:
        """The spread buffer ``(virtual_planes, ny, nz)`` -> this rank's slab, lower planes'
        partial sums added into their owners."""
        to_plan, _ = self._permutations
        rows = virtual.index_select(0, to_plan.to(virtual.device))
        return halo_accumulate(rows, self._on(self.plan, virtual.device))[: self.n_planes]

    def fill(self, slab: torch.Tensor) -> torch.Tensor:
        """This rank's slab -> the virtual buffer (its lower planes fetched from their owners)."""
        _, to_virtual = self._permutations
        rows = pad(slab, self._on(self.plan, slab.device))
        return rows.index_select(0, to_virtual.to(slab.device))

    # ---- the distributed FFT --------------------------------------------------------------
    def transpose(self, spectrum: torch.Tensor, to_y: bool) -> torch.Tensor:
        """x-slabs ``(n_x,r, ny, nzc)`` <-> y-slabs ``(nx, n_y,r, nzc)`` (complex), one all_to_all."""
        (xs, x0), (ys, y0) = self.x_split, self.y_split
        real = torch.view_as_real(spectrum)  # gloo moves real tensors
        tail = real.shape[2:]
        if to_y:  # send my x-planes' y-range of each rank
            blocks = [real[:, y0[d]: y0[d] + ys[d]].reshape(-1, *tail) for d in range(self.world)]
            send = [xs[self.rank] * ys[d] for d in range(self.world)]
            recv = [xs[s] * ys[self.rank] for s in range(self.world)]
        else:  # send my y-planes' x-range of each rank
            blocks = [real[x0[d]: x0[d] + xs[d]].reshape(-1, *tail) for d in range(self.world)]
            send = [xs[d] * ys[self.rank] for d in range(self.world)]
            recv = [xs[self.rank] * ys[s] for s in range(self.world)]
        got = AllToAll.apply(torch.cat(blocks), send, recv, self.group)
        parts = got.split(recv)
        if to_y:
            out = torch.cat([p.reshape(xs[s], ys[self.rank], *tail) for s, p in enumerate(parts)], 0)
        else:
            out = torch.cat([p.reshape(xs[self.rank], ys[s], *tail) for s, p in enumerate(parts)], 1)
        return torch.view_as_complex(out.contiguous())

    def forward_fft(self, slab: torch.Tensor) -> torch.Tensor:
        """Real x-slab -> its part of the unscaled 3-D DFT, as a y-slab (half spectrum in z)."""
        spectrum = _fft(torch.fft.fft, _fft(torch.fft.rfft, slab, dim=2), dim=1)
        return _fft(torch.fft.fft, self.transpose(spectrum, to_y=True), dim=0)

    def inverse_fft(self, spectrum: torch.Tensor) -> torch.Tensor:
        """y-slab of a Hermitian spectrum -> real x-slab (unscaled inverse, as `pme._convolve`)."""
        planes = self.transpose(_fft(torch.fft.ifft, spectrum, dim=0, norm="forward"), to_y=False)
        planes = _fft(torch.fft.ifft, planes, dim=1, norm="forward")
        return _fft(torch.fft.irfft, planes, n=self.dims[2], dim=2, norm="forward")

    def spectrum_frequencies(self, device, dtype) -> list[torch.Tensor]:
        """Integer frequencies (fftfreq's convention) of this rank's spectrum slab, per axis."""
        nx, ny, nz = self.dims
        ys, y0 = self.y_split
        fx = torch.fft.fftfreq(nx, d=1.0 / nx, device=device, dtype=dtype)
        fy = torch.fft.fftfreq(ny, d=1.0 / ny, device=device, dtype=dtype)[y0[self.rank]: y0[self.rank] + ys[self.rank]]
        fz = torch.fft.fftfreq(nz, d=1.0 / nz, device=device, dtype=dtype)[: nz // 2 + 1]
        return [fx, fy, fz]
