"""How much of the system each rank sees, and a default sample in which none sees all of it.

# NOTE [conclusive sample]
A model that reads rows it should not (ghost rows in a whole-system reduction), or that
needs what a rank does not hold (the edges of ghost atoms, an atom's whole neighbourhood),
still gets the right answer when a rank's owned atoms plus its ghosts are the whole
system: on such a sample validation proves nothing about those models. So the default
sample is sized from the model's cutoff, the skin and the world size: a triclinic cell,
long along the axis the rank grid cuts, so that every rank's extended subdomain (its slab
plus ``cutoff + skin`` on each side) leaves at least one cutoff of the cell unseen. A
model whose answer hangs on one atom (a maximum over the system) is still right whenever
every rank happens to see that atom, and on two ranks the atoms near both cut planes are
seen by both; so the cell also runs in other positions along the cut axis, as few as make
every atom invisible to some rank in one of them (a longer cell needs fewer). And
every validation run counts, on every rank, the distinct atoms the model could read
(owned rows, ghost rows, the request table of sharded storage) against the total, so a
sample that is too small (the user's own, or a strategy's unusual split) is reported as
inconclusive rather than passed as exact. Graph partition gives every rank the whole
geometry by design; there the owned block must be a strict part of the system.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mlipdd.data import Batch

# spacing of the default sample's grid: argon's, denser for short cutoffs so every atom
# has neighbours and no check passes on an all-zero answer
MAX_SPACING = 3.7
SPACING_PER_CUTOFF = 0.6
RATTLE_PER_SPACING = 0.05  # displacement scale of the rattled grid, as a fraction of the spacing
CROSS_SECTION = 4  # grid points along the two axes the rank grid leaves whole
MAX_REPEATS = 400
MAX_POSITIONS = 3  # positions of the cell along the cut axis, at most


@dataclass(frozen=True)
class RankView:
    """What one rank's model could read: ``seen`` distinct atoms of ``total`` (its ``owned``
    ones included); ``holds_all``: the strategy gives every rank the whole system by
    design (graph partition), so only the owned block is checked."""

    rank: int
    owned: int
    seen: int
    total: int
    holds_all: bool = False

    @property
    def inconclusive(self) -> bool:
        if self.total <= 1:
            return False
        if self.holds_all:
            return self.owned >= self.total
        return self.seen >= self.total

    def line(self) -> str:
        if self.holds_all:
            return f"rank {self.rank} owns {self.owned} of {self.total} atoms (sees all by design)"
        return f"rank {self.rank} sees {self.seen} of {self.total} atoms ({self.owned} owned)"


def coverage_warning(views: list[RankView]) -> str | None:
    """The report's warning when some rank's view makes the check inconclusive, else None."""
    if len(views) < 2:
        return None
    bad = [v for v in views if v.inconclusive]
    if not bad:
        return None
    ranks = ", ".join(str(v.rank) for v in bad)
    verb = "own" if bad[0].holds_all else "see"
    who = f"rank {ranks} {verb}s" if len(bad) == 1 else f"ranks {ranks} {verb}"
    return (f"sample too small: {who} every atom; a wrong model can pass (leave "
            "sample_batch out for a default sized to the model's cutoff, or give a larger cell)")


def coverage_line(views: list[RankView]) -> str:
    return "; ".join(v.line() for v in views)


def record_view(batch: Batch) -> dict[str, int]:
    """On a rank, from the batch its model is called with: rows and distinct atoms readable.

    Under halo storage the rows are ``[owned | ghost]`` (ghosts may repeat an atom as
    several images, so ids are counted once); under sharded storage the neighbour list's
    senders past the owned rows index the request table, one row per remote atom."""
    from mlipdd.shard import local

    positions = batch.node["positions"]
    rows = int(positions.shape[0])
    ids = local(batch.node["atom_ids"])
    seen = int(torch.unique(ids).numel())
    edges = -1
    neighbors = batch.neighbors
    if neighbors is not None:
        senders = local(neighbors.edge_index[0])
        edges = int(senders.shape[0])
        seen += int(torch.unique(senders[senders >= rows]).numel())
    return {"rows": rows, "seen": seen, "edges": edges}


# ---- the default sample ----------------------------------------------------------------------
def unseen_width(cell: torch.Tensor, grid_dims, width: float) -> tuple[float, int]:
    """``(length, axis)``: the length of cell that every rank's extended subdomain misses
    along the best cut axis (plane spacing minus one subdomain minus the halo on both
    sides; <= 0: some rank may see everything), and that axis."""
    from mlipdd.strategy.grid import plane_spacings

    spacing = plane_spacings(cell.detach().double().reshape(-1, 3, 3)).min(dim=0).values
    gaps = [(float(spacing[a]) * (1.0 - 1.0 / g) - 2.0 * width, a) for a, g in enumerate(grid_dims) if g > 1]
    return max(gaps, default=(-math.inf, 0))


def sighted(batch: Batch, grid, width: float) -> torch.Tensor:
    """(ranks, atoms) bool: which atoms lie in which rank's extended subdomain (its own
    region grown by ``width`` across the cut faces, periodic images included), for
    uniform cut planes: the atoms a rank's model can read under halo storage (sharded
    storage reads a subset of them)."""
    from mlipdd.data import fractional
    from mlipdd.strategy.grid import halo_targets, plane_spacings

    frac = fractional(batch).detach()
    frac = frac - frac.floor()
    frac_width = (width / plane_spacings(batch.cell.detach()))[batch.batch]
    cut = torch.tensor([g > 1 for g in grid.dims]).expand(batch.num_atoms, 3)
    atom, _, rank = halo_targets(frac, frac_width, cut, grid)
    seen = torch.zeros(grid.size, batch.num_atoms, dtype=torch.bool)
    seen[rank, atom] = True
    return seen


def shifted(batch: Batch, axis: int, fraction: float) -> Batch:
    """``batch`` translated by ``fraction`` of its cell vector ``axis``, wrapped into the cell."""
    from mlipdd.data import fractional

    moved = batch.clone()
    frac = fractional(batch).detach()
    frac[:, axis] = frac[:, axis] + fraction
    frac = frac - frac.floor()
    moved.node["positions"] = torch.einsum("ni,nij->nj", frac, batch.cell.detach()[batch.batch])
    return moved


def default_samples(model, world_size: int = 2, species=None, seed: int = 6) -> list[Batch]:
    """The default validation sample (NOTE [conclusive sample]) and the same cell in
    other positions along the cut axis: the fewest atom-forwards for which no rank sees
    every atom, each rank misses at least one cutoff of the cell, and every atom is out
    of some rank's sight in one of the positions (so a model whose answer hangs on one
    atom's value, a maximum over the system, cannot pass by luck). A long rattled
    triclinic cell with up to two of the model's species (``species``, else
    ``model_config.extra["atomic_numbers"]``, else argon).

    A model without those elements fails with its own unknown-element error, which the
    translator explains.
    """
    from mlipdd.distributed.config import DomainConfig
    from mlipdd.strategy.grid import choose_grid
    from mlipdd.testing.systems import long_triclinic
    from mlipdd.validate.rank_checks import model_species

    cutoff = float(model.cutoff)
    width = DomainConfig(cutoff=cutoff).halo_width
    spacing = min(MAX_SPACING, SPACING_PER_CUTOFF * cutoff)
    chosen = (tuple(species) if species else (model_species(model) or (18,)))[:2]

    def sample(length: int) -> Batch:
        return long_triclinic(species=chosen, spacing=spacing, reps=(length, CROSS_SECTION, CROSS_SECTION),
                              rattle=RATTLE_PER_SPACING * spacing, seed=seed)

    if world_size < 2:
        return [sample(CROSS_SECTION)]
    best = None
    for length in range(CROSS_SECTION, MAX_REPEATS):
        batch = sample(length)
        if best is not None and batch.num_atoms >= best[0]:
            break
        grid = choose_grid(batch.cell, world_size, width)
        gap, axis = unseen_width(batch.cell, grid.dims, width)
        if gap < cutoff:
            continue
        hidden = {}  # shift -> atoms some rank cannot see with the cell shifted so
        for copies in range(1, MAX_POSITIONS + 1):
            if best is not None and batch.num_atoms * copies >= best[0]:
                break
            # a shift by 1 / g maps the cut planes onto themselves: spread the positions below it
            shifts = [j / (copies * grid.dims[axis]) for j in range(copies)]
            for shift in shifts:
                if shift not in hidden:
                    moved = shifted(batch, axis, shift) if shift else batch
                    hidden[shift] = (moved, ~sighted(moved, grid, width).all(dim=0))
            if bool(torch.stack([hidden[shift][1] for shift in shifts]).any(dim=0).all()):
                best = (batch.num_atoms * copies, [hidden[shift][0] for shift in shifts])
                break
    if best is None:
        raise RuntimeError(f"no default validation sample for cutoff {cutoff} on {world_size} ranks")
    return best[1]


def default_sample(model, world_size: int = 2, species=None, seed: int = 6) -> Batch:
    """The first of `default_samples`: the cell in which no rank of ``world_size`` sees
    every atom."""
    return default_samples(model, world_size, species, seed)[0]
