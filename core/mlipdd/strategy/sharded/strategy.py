"""`ShardedStrategy`: owned rows only; reads of remote rows routed to their owners.

The same ownership as halo storage; the edge index addresses ``[owned | request table]``
(`rewrite.py`). The model's rows are `mlipdd.shard.aten.ShardTensor`s whose context carries
the request table (``HaloContext.reads``), so a read by the edge index fetches remote rows
from their owners and a scatter by it delivers remote sums to them (NOTE [aten sharded
storage] in `mlipdd.shard.aten.index_rules`). Atom rows are complete on every rank at every
op, so consolidation takes the owned rows as they are (`SpatialStrategy.consolidate`).

A rank owning one atom holds rows of size 1, which torch's einsum takes for a broadcast
dim; the strategies' torch-function mode spells such an einsum shape-stably (NOTE [a
single row] in `mlipdd.shard.aten.one_row_einsum`). A rank owning none runs the model on
zero rows (a view of them is placed by probing, `mlipdd.shard.aten.rules._probe_shapes`).
"""

from __future__ import annotations

from mlipdd.data import Batch
from mlipdd.shard.aten import GHOSTED, HaloContext, Rows, comm, from_local
from mlipdd.shard.aten.comm import OwnedRowsOnly
from mlipdd.strategy.halo import SpatialStrategy, model_inputs
from mlipdd.strategy.halo.strategy import rows_batch
from mlipdd.strategy.sharded.rewrite import shard_halo
from mlipdd.strategy.skin import edges_in_cutoff


class ShardedStrategy(SpatialStrategy):
    """``"sharded"``: owned rows only; remote reads routed to their owners."""

    name = "sharded"
    preset = "SPEC_MPNN_SHARDED"
    keep_halo_state = False  # set by compile=True; otherwise only owned rows are kept
    halo_state = None

    @classmethod
    def accepts(cls, policy) -> bool:
        # "halo | sharded -> sharded": a halo model's reads are served over the wire; one
        # that builds its own graph over the ghost shell (NOTE [own graph]) needs the rows
        return policy.is_sharded() or (policy.is_halo() and not policy.builds_own_graph)

    def prepare(self, batch: Batch, rebuild: bool) -> None:
        """Collective: when the halo plan is rebuilt, rewrite it over owned rows."""
        halo = self.halo.prepare(batch, rebuild)
        if halo is not None:
            self.state = shard_halo(halo, batch, self.rank, self.group)
            if self.keep_halo_state:  # compile=True reads the halo rows of the same plan
                self.halo_state = halo  # (NOTE [sharded, compiled] in mlipdd.distributed.compiled_halo)

    def model_batch(self, batch: Batch, spec) -> tuple[Batch, HaloContext | None]:
        state = self.state
        if self._plain():
            return self.plain_rows(batch)
        if getattr(self, "_storage", (None,))[0] is not state:  # one per rebuild: HaloContext keys on it
            self._storage = (state, OwnedRowsOnly(batch.num_atoms))
        positions = batch.positions.detach().requires_grad_(True)
        neighbors = state.neighbors
        if self.halo.skin > 0:  # NOTE [skin edges]: the request table's rows fetched (one all_to_all)
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

    def stored_rows(self) -> dict[str, int]:
        """Rows of one per-atom tensor on this rank, sharded vs halo storage."""
        state = self.state
        return {
            "owned": state.plan.n_owned,
            "request_table": state.plan.n_ghost,  # transient: only inside a routed gather
            "halo_ghosts": state.halo_ghosts,
        }

    def report(self) -> dict:
        return {**super().report(), **({} if self.state is None else {"stored_rows": self.stored_rows()})}
