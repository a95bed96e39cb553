"""The 3-D rank grid of the spatial halo strategy and who owns which point.

Space is split in fractional coordinates, so a triclinic cell is cut along its own
lattice planes: rank ``(cx, cy, cz)`` owns ``cuts_a[cx] <= f_a < cuts_a[cx+1]`` along a,
and so on. The cuts are uniform (``c / g``) unless a balancer moved them
(`mlipdd.strategy.balance`); moved cuts are still lattice planes, so triclinic cells
stay exact. A length measured perpendicular to the faces (the halo width) becomes the
fractional width ``w * |column a of inv(cell)|`` (the reciprocal vector's length is
one over the spacing of the a-planes).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

from mlipdd.data import InputError


@dataclass(frozen=True)
class RankGrid:
    """``dims`` ranks per axis; ``cuts`` per axis the ``g + 1`` plane positions in
    fractional coordinates (0 first, 1 last, non-decreasing), None for uniform cuts."""

    dims: tuple[int, int, int]
    cuts: tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...]] | None = None

    def __post_init__(self) -> None:
        if self.cuts is None:
            return
        for g, c in zip(self.dims, self.cuts, strict=True):
            if len(c) != g + 1 or c[0] != 0.0 or c[-1] != 1.0 or any(b < a for a, b in itertools.pairwise(c)):
                raise InputError(
                    f"rank grid cuts {self.cuts} do not fit dims {self.dims}: each axis needs g + 1 "
                    "non-decreasing fractional positions from 0 to 1"
                )

    def bounds(self, axis: int, dtype=torch.float64, device=None) -> torch.Tensor:
        """The ``g + 1`` cut positions along ``axis`` (fractional)."""
        g = self.dims[axis]
        if self.cuts is None:
            return torch.arange(g + 1, dtype=dtype, device=device) / g
        return torch.tensor(self.cuts[axis], dtype=dtype, device=device)

    def with_cuts(self, cuts) -> RankGrid:
        return RankGrid(self.dims, tuple(tuple(float(x) for x in c) for c in cuts))

    @property
    def size(self) -> int:
        return self.dims[0] * self.dims[1] * self.dims[2]

    def rank_of(self, cells: torch.Tensor) -> torch.Tensor:
        """Rank of grid cells given as integer coordinates (..., 3)."""
        _, gy, gz = self.dims
        return (cells[..., 0] * gy + cells[..., 1]) * gz + cells[..., 2]

    def owner(self, frac: torch.Tensor) -> torch.Tensor:
        """Owner rank of points with fractional coordinates in [0, 1)."""
        if self.cuts is None:
            dims = torch.tensor(self.dims, device=frac.device)
            cells = torch.minimum((frac * dims).floor().long(), dims - 1).clamp_min(0)
            return self.rank_of(cells)
        cells = [
            torch.bucketize(frac[:, a].contiguous(), self.bounds(a, frac.dtype, frac.device)[1:-1], right=True)
            for a in range(3)
        ]
        return self.rank_of(torch.stack(cells, dim=-1))


def plane_spacings(cell: torch.Tensor) -> torch.Tensor:
    """Distance between successive lattice planes along each axis, (n_systems, 3)."""
    return 1.0 / torch.linalg.inv(cell).norm(dim=-2)


def choose_grid(cells: torch.Tensor, world_size: int, width: float) -> RankGrid:
    """The factorisation of ``world_size`` with the least ghost volume per rank.

    Ghost volume ~ prod(h_a / g_a + 2 w) - prod(h_a / g_a) with h_a the plane spacing,
    summed over systems; ties go to the grid that cuts the longest axes.
    """
    spacing = plane_spacings(cells.detach().double().cpu())
    best = None
    for dims in _factorisations(world_size):
        g = torch.tensor(dims, dtype=torch.float64)
        sub = spacing / g
        ghost = (torch.prod(sub + 2 * width, dim=-1) - torch.prod(sub, dim=-1)).sum().item()
        key = (round(ghost, 6), -float((g * spacing.sum(0)).max()))
        if best is None or key < best[0]:
            best = (key, dims)
    return RankGrid(best[1])


def _factorisations(n: int):
    for gx in range(1, n + 1):
        if n % gx:
            continue
        for gy in range(1, n // gx + 1):
            if (n // gx) % gy:
                continue
            yield gx, gy, n // (gx * gy)


def check_grid(grid: RankGrid, world_size: int) -> RankGrid:
    if grid.size != world_size:
        raise InputError(
            f"rank grid {grid.dims} has {grid.size} cells but there are {world_size} ranks; "
            "give a grid whose product equals the number of ranks, or leave it out (auto)"
        )
    return grid


def image_range(frac_width: torch.Tensor) -> int:
    """How many cell images each way a halo of this fractional width can reach."""
    return max(1, math.ceil(float(frac_width.max()))) if frac_width.numel() else 1


def halo_targets(frac: torch.Tensor, frac_width: torch.Tensor, periodic: torch.Tensor,
                 grid: RankGrid) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every (atom, image shift, rank) whose image lies in the rank's extended domain.

    ``frac`` (n, 3) wrapped fractional coordinates, ``frac_width`` (n, 3) the halo
    width of each atom's system in fractional units, ``periodic`` (n, 3). Returns
    ``atom`` (m,), ``shift`` (m, 3) integer image shifts and ``rank`` (m,); the atom's
    own place (shift 0 in its own cell) is included and filtered by the caller.
    """
    n = frac.shape[0]
    device = frac.device
    per_axis = []
    for a in range(3):
        g = grid.dims[a]
        bounds = grid.bounds(a, frac.dtype, device)
        k = image_range(frac_width[:, a]) if bool(periodic[:, a].any()) else 0
        shifts = torch.arange(-k, k + 1, device=device)
        cells = torch.arange(g, device=device)
        s, c = torch.meshgrid(shifts, cells, indexing="ij")
        s, c = s.reshape(-1), c.reshape(-1)
        u = frac[:, a : a + 1] + s  # (n, options)
        w = frac_width[:, a : a + 1]
        inside = (u >= bounds[c] - w) & (u < bounds[c + 1] + w)
        inside &= periodic[:, a : a + 1] | (s == 0)
        per_axis.append((inside, s, c))
    # Combine the axes one at a time to keep the candidate set small.
    atom = torch.arange(n, device=device)
    shift = torch.zeros((n, 0), dtype=torch.long, device=device)
    cell = torch.zeros((n, 0), dtype=torch.long, device=device)
    for inside, s, c in per_axis:
        rows, opt = torch.nonzero(inside[atom], as_tuple=True)
        atom = atom[rows]
        shift = torch.cat([shift[rows], s[opt, None]], dim=1)
        cell = torch.cat([cell[rows], c[opt, None]], dim=1)
    return atom, shift, grid.rank_of(cell)

