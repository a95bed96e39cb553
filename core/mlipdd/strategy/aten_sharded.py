"""Sharded storage under the aten-level dispatch (``DomainConfig(strategy="sharded", dispatch="aten")``).

The same ownership, rewrite and request table as `ShardedStrategy` (owned rows only;
the edge index addresses ``[owned | request table]``); only what the model sees differs:
its rows are `mlipdd.shard.aten.ShardTensor`s whose context carries the request table
(``HaloContext.reads``), so a read by the edge index fetches remote rows from their
owners and a scatter by it delivers remote sums to them (NOTE [aten sharded storage] in
`mlipdd.shard.aten.index_rules`). Atom rows are complete on every rank at every op, so
consolidation takes the owned rows as they are (shared with `AtenHaloStrategy`).
"""

from __future__ import annotations

import dataclasses

from mlipdd.data import Batch
from mlipdd.shard.aten import EDGES, GHOSTED, HaloContext, Rows, ShardTensor, from_local
from mlipdd.shard.aten.comm import OwnedRowsOnly
from mlipdd.strategy.aten_halo import AtenHaloStrategy
from mlipdd.strategy.halo import model_inputs
from mlipdd.strategy.sharded import ShardedStrategy


class AtenShardedStrategy(ShardedStrategy):
    """`ShardedStrategy` with the aten dispatch's rows (module docstring)."""

    # shared with halo storage: one rank hands the plain rows (NOTE [aten at one rank]),
    # factories make ShardTensors (NOTE [aten factories]), outputs consolidated by placement
    rows_at_one_rank = False
    _plain = AtenHaloStrategy._plain
    model_scope = AtenHaloStrategy.model_scope
    consolidate = AtenHaloStrategy.consolidate

    def model_batch(self, batch: Batch, spec) -> tuple[Batch, HaloContext | None]:
        state = self.state
        if self._plain():
            return AtenHaloStrategy.model_batch(self, batch, spec)  # its one-rank branch reads only the list
        if getattr(self, "_storage", (None,))[0] is not state:  # one per rebuild: HaloContext keys on it
            self._storage = (state, OwnedRowsOnly(batch.num_atoms))
        ctx = HaloContext(plan=self._storage[1], n_edges=state.neighbors.num_edges, group=self.group,
                          reads=state.plan)
        positions = batch.positions.detach().requires_grad_(True)

        def atoms(t, name, values=None):
            return from_local(t, Rows(0, GHOSTED, values=values), ctx, name)

        node = {
            "positions": atoms(positions, "positions"),
            "atomic_numbers": atoms(batch.atomic_numbers, "atomic_numbers"),
            "batch": atoms(batch.batch, "batch", values="systems"),
            "atom_ids": batch.atom_ids,
        }
        node.update({name: atoms(value, name) for name, value in model_inputs(batch).items()})
        owned = Batch._from_dicts(node, dict(batch.system))
        nl = state.neighbors
        owned.neighbors = dataclasses.replace(
            nl,
            edge_index=ShardTensor(nl.edge_index, Rows(1, EDGES, values="atoms"), ctx, "edge_index"),
            unit_shifts=ShardTensor(nl.unit_shifts, Rows(0, EDGES), ctx, "unit_shifts"),
        )
        owned.n_owned = batch.num_atoms
        owned.neighbors.edge_index._meta = ctx  # NOTE [skin edges at one rank]: a list the strategy tracks
        return owned, ctx
