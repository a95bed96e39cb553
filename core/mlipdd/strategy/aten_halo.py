"""Halo storage under the aten-level dispatch (``DomainConfig(dispatch="aten")``).

The same planner, plan and local neighbour list as `HaloStrategy`; only what the model
sees differs: its rows are `mlipdd.shard.aten.ShardTensor`s with a placement each
(positions and per-atom inputs GHOSTED, ``batch`` GHOSTED with system values, the edge
index edge rows whose values are atom rows), also at ONE rank (no ghosts, nothing is
sent; the dispatch runs, which is what its cost benchmark measures).
Consolidation goes by placement: atom rows -> the owners' rows (shares summed first),
replicated values as they are.

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

from mlipdd.data import Batch
from mlipdd.neighbors import NeighborList
from mlipdd.shard.aten import EDGES, GHOSTED, HaloContext, Rows, ShardTensor, from_local, owned_rows
from mlipdd.shard.aten.adapters import AdaptedOps
from mlipdd.shard.aten.counted import CountedReductions
from mlipdd.shard.aten.factories import factory_rows
from mlipdd.shard.aten.placement import Replicate
from mlipdd.shard.exchange import pad
from mlipdd.strategy.aten_skin import edges_in_cutoff
from mlipdd.strategy.halo import HaloStrategy, model_inputs


def rows_batch(node: dict, batch: Batch, neighbors, ctx: HaloContext) -> Batch:
    """The model's batch: ``node``'s row tensors, ``batch``'s system fields and ``neighbors``
    with its edge index and shifts as edge rows (both aten strategies hand the model this)."""
    rows = Batch._from_dicts(node, dict(batch.system))
    rows.neighbors = dataclasses.replace(
        neighbors,
        edge_index=ShardTensor(neighbors.edge_index, Rows(1, EDGES, values="atoms"), ctx, "edge_index"),
        unit_shifts=ShardTensor(neighbors.unit_shifts, Rows(0, EDGES), ctx, "unit_shifts"),
    )
    rows.n_owned = batch.num_atoms
    rows.neighbors.edge_index._meta = ctx  # NOTE [skin edges at one rank]: a list the strategy tracks
    return rows


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


class AtenHaloStrategy(HaloStrategy):
    """`HaloStrategy` with the aten dispatch's rows (module docstring)."""

    rows_at_one_rank = False  # NOTE [aten at one rank]

    def _plain(self) -> bool:
        return self.state.plan.world_size == 1 and not self.rows_at_one_rank

    def use_spec(self, spec) -> None:
        super().use_spec(spec)
        self._adapted = bool(spec.distribution.custom_ops)

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

    def model_batch(self, batch: Batch, spec) -> tuple[Batch, HaloContext | None]:
        state = self.state
        if self._plain():  # NOTE [aten at one rank]: the owned rows themselves, no context
            node = {"positions": batch.positions.detach().requires_grad_(True), "atomic_numbers": batch.atomic_numbers,
                    "batch": batch.batch, "atom_ids": batch.atom_ids, **model_inputs(batch)}
            plain = Batch._from_dicts(node, dict(batch.system))
            plain.neighbors, plain.n_owned = state.neighbors, batch.num_atoms
            return plain, None
        positions = batch.positions.detach().requires_grad_(True)
        if self.halo.ghosts_on_uncut_axes:  # NOTE [ghosts as copies]: no edges to carry the shifts
            padded_positions, neighbors = self.halo.padded_positions(positions, batch.cell, state), state.neighbors
        else:
            padded_positions, neighbors = pad(positions, state.plan), _copies_list(state)
        if self.halo.skin > 0:  # NOTE [skin edges under aten]
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

    def consolidate(self, outputs: dict, meta: HaloContext | None, spec, autograd_outputs) -> dict:
        result = {}
        for name, value in outputs.items():
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
