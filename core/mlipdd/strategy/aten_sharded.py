"""Sharded storage under the aten-level dispatch (``DomainConfig(strategy="sharded", dispatch="aten")``).

The same ownership, rewrite and request table as `ShardedStrategy` (owned rows only;
the edge index addresses ``[owned | request table]``); only what the model sees differs:
its rows are `mlipdd.shard.aten.ShardTensor`s whose context carries the request table
(``HaloContext.reads``), so a read by the edge index fetches remote rows from their
owners and a scatter by it delivers remote sums to them (NOTE [aten sharded storage] in
`mlipdd.shard.aten.index_rules`). Atom rows are complete on every rank at every op, so
consolidation takes the owned rows as they are (shared with `AtenHaloStrategy`).

A rank owning one atom holds rows of size 1, which torch's einsum takes for a broadcast
dim; the aten strategies' torch-function mode spells such an einsum shape-stably (NOTE [a
single row] in `mlipdd.shard.aten.one_row_einsum`). A rank owning none runs the model on
zero rows (a view of them is placed by probing, `mlipdd.shard.aten.rules._probe_shapes`).
"""

from __future__ import annotations

from mlipdd.data import Batch
from mlipdd.shard.aten import GHOSTED, HaloContext, Rows, comm, from_local
from mlipdd.shard.aten.comm import OwnedRowsOnly
from mlipdd.strategy.aten_halo import AtenHaloStrategy, rows_batch
from mlipdd.strategy.aten_skin import edges_in_cutoff
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

    def use_spec(self, spec) -> None:
        super().use_spec(spec)
        self._adapted = bool(spec.distribution.custom_ops)  # PME's spline ops: NOTE [aten op adapters]

    def model_batch(self, batch: Batch, spec) -> tuple[Batch, HaloContext | None]:
        state = self.state
        if self._plain():
            return AtenHaloStrategy.model_batch(self, batch, spec)  # its one-rank branch reads only the list
        if getattr(self, "_storage", (None,))[0] is not state:  # one per rebuild: HaloContext keys on it
            self._storage = (state, OwnedRowsOnly(batch.num_atoms))
        positions = batch.positions.detach().requires_grad_(True)
        neighbors = state.neighbors
        if self.halo.skin > 0:  # NOTE [skin edges under aten]: the request table's rows fetched (one all_to_all)
            rows = comm.fetch(positions.detach(), 0, state.plan)
            neighbors = edges_in_cutoff(neighbors, rows, batch.cell, batch.batch, self.halo.cutoff)
        ctx = HaloContext(plan=self._storage[1], n_edges=neighbors.num_edges, group=self.group,
                          reads=state.plan, atom_ids=batch.atom_ids)

        def atoms(t, name, values=None):
            return from_local(t, Rows(0, GHOSTED, values=values), ctx, name)

        node = {
            "positions": atoms(positions, "positions"),
            "atomic_numbers": atoms(batch.atomic_numbers, "atomic_numbers"),
            "batch": atoms(batch.batch, "batch", values="systems"),
            "atom_ids": batch.atom_ids,
        }
        node.update({name: atoms(value, name) for name, value in model_inputs(batch).items()})
        return rows_batch(node, batch, neighbors, ctx), ctx
