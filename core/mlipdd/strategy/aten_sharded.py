"""Sharded storage under the aten-level dispatch (``DomainConfig(strategy="sharded", dispatch="aten")``).

The same ownership, rewrite and request table as `ShardedStrategy` (owned rows only;
the edge index addresses ``[owned | request table]``); only what the model sees differs:
its rows are `mlipdd.shard.aten.ShardTensor`s whose context carries the request table
(``HaloContext.reads``), so a read by the edge index fetches remote rows from their
owners and a scatter by it delivers remote sums to them (NOTE [aten sharded storage] in
`mlipdd.shard.aten.index_rules`). Atom rows are complete on every rank at every op, so
consolidation takes the owned rows as they are (shared with `AtenHaloStrategy`).

# NOTE [a single row]
The ShardTensor has this rank's LOCAL shape, and torch decomposes some ops by shape: a
size-1 dim is a broadcast dim to einsum, which then permutes and views it where a
larger dim would not go ((3, 1, 3) viewed as (1, 3, 3)). A rank owning one atom thus
runs other views than its peers, and no view rule can tell where its one row went
(merged with the 3, or moved). Halo storage always has ghost rows besides; sharded
storage has only the owned rows, so a rank owning exactly one atom is refused at the
rebuild, on every rank (one owning none is fine: a view of zero rows is placed by
probing, `mlipdd.shard.aten.rules._probe_shapes`).
"""

from __future__ import annotations

from mlipdd.comm import any_rank
from mlipdd.data import Batch, InputError
from mlipdd.shard.aten import GHOSTED, HaloContext, Rows, from_local
from mlipdd.shard.aten.comm import OwnedRowsOnly
from mlipdd.strategy.aten_halo import AtenHaloStrategy, rows_batch
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

    def prepare(self, batch: Batch, rebuild: bool) -> None:
        """Collective: the sharded rewrite; at a rebuild, every rank learns whether some rank
        owns a single atom (NOTE [a single row]), one all_reduce."""
        before = self.state
        super().prepare(batch, rebuild)
        if self.state is not before and self.world_size > 1 and any_rank(batch.num_atoms == 1, self.group):
            error = InputError(
                "the aten dispatch under sharded storage cannot run a rank that owns a single atom: its rows "
                "are a dimension of size 1, which torch's shape-dependent decompositions (einsum, matmul) "
                "move and merge differently than on the other ranks, so no view can tell where the atom went "
                "(NOTE [a single row] in mlipdd.strategy.aten_sharded). Fix: fewer ranks for this system, "
                "another rank grid, or strategy='halo'")
            error.raised_on_every_rank = True  # agreed by the all_reduce: no rank's failure to relay
            raise error

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
        return rows_batch(node, batch, state.neighbors, ctx), ctx
