"""The halo planner: spatial ownership, migration, the halo plan and the local list.

One rebuild (when the Verlet skin is used up, or the cell changed):

1. owned atoms that left their subdomain move to their new owner (`migrate`); with
   ``DomainConfig(balance=...)`` the cut planes may move first (`mlipdd.strategy.balance`),
   and this same migration hands atoms to their owners under the new planes;
2. each rank lists, for each of its owned atoms, every (image shift, rank) whose
   extended subdomain (the subdomain grown by cutoff + skin perpendicular to its
   faces) contains that image: this covers a rank's own images and shells wider than
   a neighbouring subdomain;
3. counts and static ghost data (atomic number, id, system, shift) travel once over
   ``all_to_all_single``; the result is an `ExchangePlan` reused until the next rebuild;
4. the local neighbour list is built on ``[owned | ghost]`` positions with open
   boundaries, keeping only edges whose receiver is owned.

Between rebuilds only ghost positions are refreshed (`pad`), once per force call.
`HaloPlanner` has a public interface (``partition``, ``needs_rebuild``, ``prepare``,
``padded_positions``, ``grid``, ``rebuilds``) that any strategy built on spatial
ownership composes (the halo and sharded strategies; `tests/test_third_party_strategy.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from mlipdd.comm import OnGroup, check_together, compute_on_rank0, scatter_objects
from mlipdd.data import Batch, InputError, fractional
from mlipdd.neighbors import NeighborList, build_neighbor_list, strained_list_invalid
from mlipdd.shard.exchange import ExchangePlan, all_to_all_rows, pad
from mlipdd.strategy.balance import LoadBalance
from mlipdd.strategy.grid import RankGrid, check_grid, choose_grid, halo_targets, plane_spacings


@dataclass
class HaloState:
    """Everything fixed between two rebuilds."""

    plan: ExchangePlan
    ghost_numbers: torch.Tensor
    ghost_ids: torch.Tensor
    ghost_system: torch.Tensor
    ghost_unit_shift: torch.Tensor  # (n_ghost, 3) float, image shift in cell vectors
    neighbors: NeighborList  # over padded rows, owned receivers only
    reference_padded: torch.Tensor  # padded positions at build time
    reference_cell: torch.Tensor
    atom_ids: torch.Tensor  # owned ids at build time
    copies: NeighborList | None = None  # `neighbors` for ghost rows that copy their owners (aten halo)


class HaloPlanner(OnGroup):
    """Spatial ownership, migration and the halo plan (see the module docstring)."""

    def __init__(self, width: float, grid: tuple[int, int, int] | None, group=None,
                 cutoff: float | None = None, skin: float = 0.0, balance: LoadBalance | None = None):
        self.width = float(width)
        self.cutoff = float(cutoff if cutoff is not None else width - skin)
        self.skin = float(skin)
        self.requested_grid = grid
        self.group = group
        self.grid: RankGrid | None = None
        self.rebuilds = 0
        self.ghosts_on_uncut_axes = False  # NOTE [own graph] in mlipdd.spec.policies
        self.balance = balance if balance is not None else LoadBalance(group=group)  # planes that follow the atoms

    def grid_for(self, cell: torch.Tensor) -> RankGrid:
        if self.grid is None:
            if self.requested_grid is not None:
                self.grid = check_grid(RankGrid(tuple(self.requested_grid)), self.world_size)
            else:
                self.grid = choose_grid(cell, self.world_size, self.width)
        return self.grid

    @classmethod
    def from_config(cls, config, group=None) -> HaloPlanner:
        return cls(config.halo_width, config.grid, group, cutoff=config.cutoff, skin=config.skin,
                   balance=LoadBalance.from_config(config, group))

    def prepare(self, batch: Batch, rebuild: bool) -> HaloState | None:
        """Collective: at a rebuild (``rebuild``: agreed by all ranks from `needs_rebuild`),
        validate, migrate and build the halo; returns the new state, or None without one.

        The planner keeps no state itself, so a strategy that rewrites the plan (sharded
        storage) does not keep the halo's ghost data alive."""
        if not rebuild:
            return None
        check_together(check_domain_inputs, batch, group=self.group)
        self.grid = self.balance.at_rebuild(self.grid_for(batch.cell), wrapped_fractional(batch))
        self.migrate(batch)
        self.balance.record(self.grid, batch.num_atoms, self.rebuilds + 1)
        return self.build(batch, self.cutoff + self.skin)

    # ---- ownership ------------------------------------------------------------------
    def owners(self, batch: Batch) -> torch.Tensor:
        grid = self.grid_for(batch.cell)
        frac = wrapped_fractional(batch)
        return grid.owner(frac)

    def partition(self, full: Batch | None, device=None) -> Batch:
        """Rank 0's full batch -> this rank's owned batch (atoms sorted by system)."""
        parts = compute_on_rank0(self._split, full, group=self.group)
        owned = scatter_objects(parts, self.group)
        owned = owned.to(device) if device is not None else owned
        grid = self.grid_for(owned.cell)
        if self.balance.mode is not None:  # planes by atom count, then atoms to their owners
            self.grid = self.balance.at_partition(grid, wrapped_fractional(owned), device)
            self.migrate(owned)
        return owned

    def _split(self, full: Batch | None) -> list[Batch]:
        if full is None:
            raise InputError("partition() needs the full system on rank 0; got None there")
        full = full.clone()
        check_domain_inputs(full)
        wrap_positions(full)
        owner = self.owners(full)
        return [full.select_atoms(owner == r).to("cpu") for r in range(self.world_size)]

    def migrate(self, batch: Batch) -> None:
        """Send owned atoms that left the subdomain to their owner; updates ``batch`` in place."""
        wrap_positions(batch)
        owner = self.owners(batch)
        order = torch.argsort(owner, stable=True)
        counts = torch.bincount(owner, minlength=self.world_size)
        recv_counts = exchange_counts(counts, self.group)
        moved = {}
        for name, value in batch.node.items():
            rows = value.index_select(0, order)
            moved[name] = all_to_all_rows(rows, counts.tolist(), recv_counts, self.group)
        # keep owned atoms grouped by system, then by id: a deterministic layout
        key = moved["batch"] * (int(moved["atom_ids"].max()) + 1 if moved["atom_ids"].numel() else 1)
        order = torch.argsort(key + moved["atom_ids"], stable=True)
        batch.node.clear()
        batch.node.update({k: v.index_select(0, order) for k, v in moved.items()})

    # ---- the halo ---------------------------------------------------------------------
    def build(self, batch: Batch, nl_cutoff: float) -> HaloState:
        grid = self.grid_for(batch.cell)
        positions = batch.positions.detach()
        frac = fractional(batch)
        cell = batch.cell.detach()
        frac_width = self.width / plane_spacings(cell)  # (n_systems, 3)
        sys = batch.batch
        # NOTE [uncut axes]: along a periodic axis the grid does not cut (one rank across),
        # the local list wraps around periodically (`local_neighbors`), so no image of any
        # atom is a ghost there; ghosts come only from the cut axes. (Mirroring images
        # along uncut axes too cost 1.72x rows per owned atom at 27k atoms on a 2x1x1 grid,
        # against ~1.3x for one halo width across the two cut faces.)
        ghost_axes = batch.pbc[sys] & self._ghost_axes(grid, frac.device)
        atom, shift, rank = halo_targets(frac, frac_width[sys], ghost_axes, grid)
        keep = (rank != self.rank) | (shift != 0).any(dim=1)  # not the atom itself
        if self.world_size == 1:
            keep &= False  # see NOTE [one rank] in local_neighbors
        atom, shift, rank = atom[keep], shift[keep], rank[keep]
        order = torch.argsort(rank, stable=True)
        atom, shift, rank = atom[order], shift[order], rank[order]
        send_counts = torch.bincount(rank, minlength=self.world_size)
        recv_counts = exchange_counts(send_counts, self.group)
        static = torch.cat(
            [torch.stack([batch.atomic_numbers[atom], batch.atom_ids[atom], sys[atom]], 1), shift], 1
        )
        ghost = all_to_all_rows(static, send_counts.tolist(), recv_counts, self.group)
        plan = ExchangePlan(
            send_index=atom,
            send_counts=tuple(send_counts.tolist()),
            recv_counts=tuple(recv_counts),
            n_owned=batch.num_atoms,
            group=self.group,
        )
        state = HaloState(
            plan=plan,
            ghost_numbers=ghost[:, 0],
            ghost_ids=ghost[:, 1],
            ghost_system=ghost[:, 2],
            ghost_unit_shift=ghost[:, 3:].to(positions.dtype),
            neighbors=None,  # set below, needs padded positions
            reference_padded=None,
            reference_cell=cell.clone(),
            atom_ids=batch.atom_ids.clone(),
        )
        padded = self.padded_positions(positions, cell, state).detach()
        state.reference_padded = padded
        state.neighbors = local_neighbors(padded, batch, state, nl_cutoff, self._ghost_axes(grid, cell.device))
        self.rebuilds += 1
        return state

    def _ghost_axes(self, grid: RankGrid, device) -> torch.Tensor:
        """The axes along which periodic images become ghost rows (and the local list is
        open): the cut ones (NOTE [uncut axes]), or all of them (NOTE [own graph])."""
        return torch.tensor([g > 1 or self.ghosts_on_uncut_axes for g in grid.dims], device=device)

    def padded_positions(self, owned: torch.Tensor, cell: torch.Tensor, state: HaloState) -> torch.Tensor:
        shift = torch.einsum("gi,gij->gj", state.ghost_unit_shift, cell.detach()[state.ghost_system])
        return pad(owned, state.plan, shift)

    def needs_rebuild(self, batch: Batch, state) -> bool:
        """Rank-local answer (``state``: the caller's current one, a `HaloState` or any
        state with its rebuild fields; None: none yet); reduced across ranks by the core."""
        skin = self.skin
        if state is None or batch.num_atoms != state.plan.n_owned:
            return True
        # one device->host read for the three questions (each read stalls the device queue)
        cell = batch.cell.detach()
        flags = [(batch.atom_ids != state.atom_ids).any(), (cell != state.reference_cell).any()]
        owned_before = state.reference_padded[: batch.num_atoms]
        if batch.num_atoms:
            flags.append((batch.positions.detach() - owned_before).norm(dim=1).max() > 0.5 * skin)
        ids_changed, strained, *moved = torch.stack(flags).tolist()
        if ids_changed:
            return True
        if strained:  # a barostat strains the cell every step: NOTE [skin under strain]
            return strained_list_invalid(batch.positions.detach(), cell, owned_before, state.reference_cell,
                                         batch.batch, self.cutoff, skin)
        return bool(moved and moved[0])


def local_neighbors(padded: torch.Tensor, batch: Batch, state: HaloState, cutoff: float,
                    cut_axes: torch.Tensor) -> NeighborList:
    """List over [owned | ghost] (ghosts sit at their images); owned receivers only.

    Open along the axes the rank grid cuts (ghosts stand in for the neighbours there),
    periodic with the real cell along the periodic axes it does not cut (NOTE [uncut axes]).

    # NOTE [one rank]
    With a single rank there is nothing to exchange: no ghosts, and the ordinary
    periodic list (image shifts on the edges) replaces the ghost shell, so one rank
    costs what the bare model costs.
    """
    if state.plan.world_size == 1:
        return build_neighbor_list(batch, cutoff)
    system = torch.cat([batch.batch, state.ghost_system])
    wrap = batch.pbc & ~cut_axes
    view = Batch._from_dicts(
        {"positions": padded, "batch": system, "atom_ids": torch.arange(padded.shape[0])},
        {"cell": torch.where(wrap[..., None], batch.cell.detach(), torch.zeros_like(batch.cell)), "pbc": wrap},
    )
    neighbors = build_neighbor_list(view, cutoff)
    return neighbors.select(neighbors.receivers < batch.num_atoms)


def wrapped_fractional(batch: Batch) -> torch.Tensor:
    frac = fractional(batch).detach()
    periodic = batch.pbc[batch.batch]
    return torch.where(periodic, frac - frac.floor(), frac)


def wrap_positions(batch: Batch) -> None:
    """Move atoms into the cell along periodic axes, counting the crossings in ``image``."""
    frac = fractional(batch).detach()
    periodic = batch.pbc[batch.batch]
    jump = torch.where(periodic, frac.floor(), torch.zeros_like(frac))
    if bool((jump != 0).any()):
        cell = batch.cell.detach()[batch.batch]
        batch.node["positions"] = batch.positions - torch.einsum("ni,nij->nj", jump, cell)
    image = batch.node.get("image")
    batch.node["image"] = (jump.long() if image is None else image + jump.long())


def check_domain_inputs(batch: Batch) -> None:
    """What spatial decomposition needs beyond a valid batch: a box on every axis."""
    batch.validate()
    for s in range(batch.num_systems):
        lengths = batch.cell[s].norm(dim=1)
        if bool((lengths == 0).any()):
            raise InputError(
                f"system {s} has a zero cell vector; spatial decomposition splits the cell, so give "
                "a box on every axis (for a cluster or slab: a box with vacuum and pbc False there)"
            )
    from mlipdd.data import check_inside_box

    check_inside_box(batch)


def exchange_counts(send_counts: torch.Tensor, group) -> tuple[int, ...]:
    if send_counts.numel() == 1:
        return tuple(send_counts.tolist())
    recv = torch.empty_like(send_counts)
    dist.all_to_all_single(recv, send_counts.contiguous(), group=group)
    return tuple(recv.tolist())
