"""Spatial halo strategy: ownership, migration, the halo plan and the padded batch.

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

`HaloPlanner` is that machinery, with a public interface (``partition``, ``prepare``,
``padded_positions``, ``grid``, ``state``, ``rebuilds``) that any strategy built on
spatial ownership composes: `HaloStrategy` hands the model ``[owned | ghost]`` rows,
`mlipdd.strategy.sharded.ShardedStrategy` rewrites the same plan into owned rows.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mlipdd.comm import OnGroup, check_together, compute_on_rank0, scatter_objects
from mlipdd.data import NODE_FIELDS, Batch, InputError, fractional
from mlipdd.neighbors import NeighborList, build_neighbor_list, strained_list_invalid
from mlipdd.shard import ShardMeta, ShardTensor, halo_accumulate
from mlipdd.shard.exchange import ExchangePlan, all_to_all_rows, pad
from mlipdd.shard.layouts import Halo
from mlipdd.shard.placement import ATOMS, SYSTEM_INDEX, placement_of
from mlipdd.shard.scripted import script_functions_dispatched
from mlipdd.shard.tensor import neighbors_as_edge_rows
from mlipdd.strategy.balance import LoadBalance
from mlipdd.strategy.base import Strategy
from mlipdd.strategy.grid import RankGrid, check_grid, choose_grid, halo_targets, plane_spacings
from mlipdd.strategy.outputs import consolidate_outputs


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


class SpatialStrategy(Strategy):
    """A strategy built on spatial ownership: it holds a `HaloPlanner` (subdomains,
    migration, the halo plan) and decides what the model sees of it."""

    spatial = True

    def __init__(self, planner: HaloPlanner):
        self.halo = planner
        self.group = planner.group
        self.state = None  # the subclass's per-rebuild state; None until the first prepare

    @classmethod
    def from_config(cls, config, group=None) -> SpatialStrategy:
        return cls(HaloPlanner.from_config(config, group))

    @property
    def grid(self) -> RankGrid | None:
        return self.halo.grid

    @property
    def rebuilds(self) -> int:
        return self.halo.rebuilds

    @property
    def balance(self):
        return self.halo.balance

    def ghost_rows(self) -> int:
        return 0 if self.state is None else self.state.plan.n_ghost

    def partition(self, full: Batch | None, device=None) -> Batch:
        self.state = None
        return self.halo.partition(full, device)

    def rebuild_due(self, batch: Batch) -> bool:
        return self.halo.needs_rebuild(batch, self.state)


class HaloStrategy(SpatialStrategy):
    """``"halo"``: the model sees ``[owned | ghost]`` rows (module docstring)."""

    name = "halo"
    preset = "SPEC_MPNN_HALO"

    @classmethod
    def accepts(cls, policy) -> bool:
        return policy.is_halo() or policy.is_local()

    def layout(self, policy) -> Halo:
        """Ghost partials of scatters go home unless the policy keeps scatters local (a
        `LocalPolicy` keeps everything on the rank)."""
        return Halo(correct_scatters=not policy.is_local() and policy.scatter == "halo_correction",
                    reduce_systems=policy.system_reductions)

    def prepare(self, batch: Batch, rebuild: bool) -> None:
        self.state = self.halo.prepare(batch, rebuild) or self.state

    def use_spec(self, spec) -> None:
        policy = spec.distribution.policy
        self.halo.ghosts_on_uncut_axes = policy.is_halo() and policy.builds_own_graph

    @contextlib.contextmanager
    def model_scope(self, meta: ShardMeta):
        """Script functions called on rows run under the dispatch (NOTE [scripted functions]
        in mlipdd.shard.scripted); balance="time" times the call."""
        with script_functions_dispatched(), self.halo.balance.timing():
            yield

    def model_batch(self, batch: Batch, spec) -> tuple[Batch, ShardMeta]:
        """The batch the model sees: ``[owned | ghost]`` rows, positions as a ShardTensor."""
        state = self.state
        policy = spec.distribution.policy
        meta = ShardMeta(
            plan=state.plan,
            n_systems=batch.num_systems,
            n_edges=state.neighbors.num_edges,
            layout=self.layout(policy),
            group=self.group,
        )
        positions = batch.positions.detach().requires_grad_(True)
        if state.plan.world_size == 1:
            # NOTE [one rank]: nothing crosses ranks, every handler would be the identity, so
            # the model gets the owned rows themselves, plain tensors, the same objects on
            # every call (a wrapper may cache what it derives from them), and pays no
            # dispatch cost at all.
            node = {"positions": positions, "atomic_numbers": batch.atomic_numbers, "batch": batch.batch,
                    "atom_ids": batch.atom_ids}
            node.update(model_inputs(batch))
            padded = Batch._from_dicts(node, dict(batch.system))
            padded.neighbors = state.neighbors
            padded.n_owned = batch.num_atoms
            return padded, meta
        padded_positions = self.halo.padded_positions(positions, batch.cell, state)
        def wrap(t):
            return ShardTensor.wrap(t, meta, ATOMS)

        node = {
            "positions": wrap(padded_positions),
            "atomic_numbers": wrap(torch.cat([batch.atomic_numbers, state.ghost_numbers])),
            "batch": ShardTensor.wrap(torch.cat([batch.batch, state.ghost_system]), meta, SYSTEM_INDEX),
            "atom_ids": torch.cat([batch.atom_ids, state.ghost_ids]),
        }
        node.update({name: wrap(pad(value, state.plan)) for name, value in model_inputs(batch).items()})
        padded = Batch._from_dicts(node, dict(batch.system))
        padded.neighbors = neighbors_as_edge_rows(state.neighbors, meta)
        padded.n_owned = batch.num_atoms  # for diagnostics; models must not need it
        return padded, meta

    def consolidate(self, outputs: dict, meta: ShardMeta, spec, autograd_outputs) -> dict:
        """Per output: partial sums all-reduced, per-atom rows back to owned rows."""

        checked = meta.layout.is_checked()  # placements are kept (NOTE [refuse by default])
        places = {name: placement_of(value) if checked and getattr(value, "_meta", None) is not None else None
                  for name, value in outputs.items()}

        def per_atom(name, value):
            if value.dim() == 0 or value.shape[0] != meta.n_padded:
                return value  # per system: replicated already
            if name not in spec.owned_only_outputs and _ghosts_hold_partials(name, places[name], autograd_outputs):
                value = halo_accumulate(value, meta.plan)
            return value[: meta.n_owned]

        return consolidate_outputs(outputs, spec, self.group, per_atom)


def _ghosts_hold_partials(name: str, place, autograd_outputs) -> bool:
    """A gradient by atom rows holds each copy's share on its ghost rows, to be summed into
    the owners; a value (or forces the model summed itself with a scatter) holds the
    owners' values there (NOTE [partial rows]). The placement says which; an output
    without one (an unchecked layout) goes by the model's list of autograd outputs."""
    if place is not None and place.kind == "atoms" and place.leads():
        return place.partial
    return name in autograd_outputs


def model_inputs(batch: Batch) -> dict[str, torch.Tensor]:
    """Extra per-atom float inputs of the model (partial charges, spins, ...).

    A model reads them at the other end of an edge, so they get ghost rows like the
    positions. State that integrators own (velocities, forces, masses) and integer
    bookkeeping (periodic image counts) never enter the model.
    """
    return {name: value for name, value in batch.node.items()
            if name not in NODE_FIELDS and torch.is_tensor(value) and value.is_floating_point()}


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
