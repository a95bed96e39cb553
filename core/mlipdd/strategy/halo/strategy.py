"""`HaloStrategy`: the model sees ``[owned | ghost]`` rows of the halo planner's plan.

Per forward the ghost rows of positions (and of any extra per-atom float input) are
refreshed from their owners (one all-to-all) and handed to the model as
`mlipdd.shard.aten.ShardTensor`s with a placement each (positions and per-atom inputs
GHOSTED, ``batch`` GHOSTED with system values, the edge index edge rows whose values are
atom rows); consolidation goes by placement: atom rows -> the owners' rows (shares summed
first), replicated values as they are. One rank hands the plain owned rows (NOTE [aten at
one rank]). `SpatialStrategy` is the shared base of strategies built on spatial ownership
(halo and sharded storage: the same scope and consolidation).

# NOTE [ghosts as copies]
The dispatch takes a ghost row of ANY tensor for a copy of its owner's row (NOTE [aten
placements]), so the positions' ghost rows hold their owners' own positions, and each ghost's
image shift moves onto its edges: an edge read as ``pos[r] + u @ cell - pos[s]`` with a ghost
sender ``s`` at ``owner + n[s] @ cell`` keeps its vector with ``u' = u + n[r] - n[s]``
(`_copies_list`, once per rebuild). A per-atom value of the raw positions (``sin(pos)[sender]``,
``pos * q``) then is the owner's, as in one process. A model that builds its own graph from the
positions (NOTE [own graph]) has no edges to carry the shift: its ghosts stay images.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from mlipdd.data import NODE_FIELDS, Batch
from mlipdd.neighbors import NeighborList
from mlipdd.shard.aten import EDGES, GHOSTED, HaloContext, Rows, ShardTensor, from_local, owned_rows
from mlipdd.shard.aten.adapters import AdaptedOps
from mlipdd.shard.aten.counted import CountedReductions
from mlipdd.shard.aten.factories import factory_rows, refuse_local_output
from mlipdd.shard.aten.placement import Replicate
from mlipdd.shard.exchange import pad
from mlipdd.strategy.base import Strategy
from mlipdd.strategy.grid import RankGrid
from mlipdd.strategy.halo.planner import HaloPlanner
from mlipdd.strategy.skin import edges_in_cutoff


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

    # NOTE [aten at one rank]: one rank hands the model its plain owned rows (nothing crosses
    # ranks, every rule would be the identity); True: ShardTensor rows there too (what the
    # dispatch cost benchmark and a few tests measure)
    rows_at_one_rank = False

    def _plain(self) -> bool:
        return self.world_size == 1 and not self.rows_at_one_rank

    def use_spec(self, spec) -> None:
        self._adapted = bool(spec.distribution.custom_ops)  # NOTE [aten op adapters]

    @contextlib.contextmanager
    def model_scope(self, meta):
        """Factories make ShardTensors (NOTE [aten factories]), means over rows count every
        rank's (NOTE [aten means]), the spec's OpAdapters act on custom ops (NOTE [aten op
        adapters]); balance="time" times the call."""
        with contextlib.ExitStack() as scope:
            if meta is not None:
                scope.enter_context(factory_rows(meta))
                scope.enter_context(CountedReductions())
                if getattr(self, "_adapted", False):
                    scope.enter_context(AdaptedOps(meta))
            scope.enter_context(self.halo.balance.timing())
            yield

    def consolidate(self, outputs: dict, meta: HaloContext | None, spec, autograd_outputs) -> dict:
        """By placement: atom rows -> this rank's owned rows, replicated values as they are."""
        result = {}
        for name, value in outputs.items():
            refuse_local_output(name, value)  # NOTE [rank-local values]
            if not isinstance(value, ShardTensor):
                result[name] = value.detach() if torch.is_tensor(value) else value
                continue
            place = value._place
            if isinstance(place, Rows) and place.is_atoms() and place.dim == 0:
                result[name] = owned_rows(value).detach()
            elif isinstance(place, Replicate):
                result[name] = value._local.detach()
            else:
                raise RuntimeError(
                    f"the model's output {name!r} holds {place} (from `{value._origin}`); an output is per atom "
                    "(rows along dim 0) or one value per system: return atom rows or a sum over them"
                )
        return result

    def plain_rows(self, batch: Batch) -> tuple[Batch, None]:
        """NOTE [aten at one rank]: the owned rows themselves, no context."""
        node = {"positions": batch.positions.detach().requires_grad_(True), "atomic_numbers": batch.atomic_numbers,
                "batch": batch.batch, "atom_ids": batch.atom_ids, **model_inputs(batch)}
        plain = Batch._from_dicts(node, dict(batch.system))
        plain.neighbors, plain.n_owned = self.state.neighbors, batch.num_atoms
        return plain, None


def _copies_list(state) -> NeighborList:
    """NOTE [ghosts as copies]: the local list with each ghost's image shift on its edges."""
    if state.copies is None:
        neighbors = state.neighbors
        n_owned, shift = state.plan.n_owned, state.ghost_unit_shift.to(neighbors.unit_shifts.dtype)
        row_shift = torch.cat([shift.new_zeros((n_owned, 3)), shift])
        sender, receiver = neighbors.edge_index
        unit_shifts = neighbors.unit_shifts + row_shift[receiver] - row_shift[sender]
        state.copies = dataclasses.replace(neighbors, unit_shifts=unit_shifts)
    return state.copies


def rows_batch(node: dict, batch: Batch, neighbors, ctx: HaloContext) -> Batch:
    """The model's batch: ``node``'s row tensors, ``batch``'s system fields and ``neighbors``
    with its edge index and shifts as edge rows (halo and sharded storage hand the model this)."""
    rows = Batch._from_dicts(node, dict(batch.system))
    rows.neighbors = dataclasses.replace(
        neighbors,
        edge_index=ShardTensor(neighbors.edge_index, Rows(1, EDGES, values="atoms"), ctx, "edge_index"),
        unit_shifts=ShardTensor(neighbors.unit_shifts, Rows(0, EDGES), ctx, "unit_shifts"),
    )
    rows.n_owned = batch.num_atoms
    rows.neighbors.edge_index._meta = ctx  # NOTE [skin edges at one rank]: a list the strategy tracks
    return rows


class HaloStrategy(SpatialStrategy):
    """``"halo"``: the model sees ``[owned | ghost]`` rows (module docstring)."""

    name = "halo"
    preset = "SPEC_MPNN_HALO"

    @classmethod
    def accepts(cls, policy) -> bool:
        return policy.is_halo() or policy.is_local()

    def prepare(self, batch: Batch, rebuild: bool) -> None:
        self.state = self.halo.prepare(batch, rebuild) or self.state

    def use_spec(self, spec) -> None:
        super().use_spec(spec)
        policy = spec.distribution.policy
        self.halo.ghosts_on_uncut_axes = policy.is_halo() and policy.builds_own_graph

    def model_batch(self, batch: Batch, spec) -> tuple[Batch, HaloContext | None]:
        state = self.state
        if self._plain():
            return self.plain_rows(batch)
        positions = batch.positions.detach().requires_grad_(True)
        if self.halo.ghosts_on_uncut_axes:  # NOTE [ghosts as copies]: no edges to carry the shifts
            padded_positions, neighbors = self.halo.padded_positions(positions, batch.cell, state), state.neighbors
        else:
            padded_positions, neighbors = pad(positions, state.plan), _copies_list(state)
        if self.halo.skin > 0:  # NOTE [skin edges]
            neighbors = edges_in_cutoff(neighbors, padded_positions, batch.cell, batch.batch, self.halo.cutoff)
        ctx = HaloContext(plan=state.plan, n_edges=neighbors.num_edges, group=self.group,
                          atom_ids=batch.atom_ids)

        def atoms(t, name, values=None):
            return from_local(t, Rows(0, GHOSTED, values=values), ctx, name)

        node = {
            "positions": atoms(padded_positions, "positions"),
            "atomic_numbers": atoms(torch.cat([batch.atomic_numbers, state.ghost_numbers]), "atomic_numbers"),
            "batch": atoms(torch.cat([batch.batch, state.ghost_system]), "batch", values="systems"),
            "atom_ids": torch.cat([batch.atom_ids, state.ghost_ids]),
        }
        node.update({name: atoms(pad(value, state.plan), name) for name, value in model_inputs(batch).items()})
        return rows_batch(node, batch, neighbors, ctx), ctx


def model_inputs(batch: Batch) -> dict[str, torch.Tensor]:
    """Extra per-atom float inputs of the model (partial charges, spins, ...).

    A model reads them at the other end of an edge, so they get ghost rows like the
    positions. State that integrators own (velocities, forces, masses) and integer
    bookkeeping (periodic image counts) never enter the model.
    """
    return {name: value for name, value in batch.node.items()
            if name not in NODE_FIELDS and torch.is_tensor(value) and value.is_floating_point()}
