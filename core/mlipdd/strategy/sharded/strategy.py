"""`ShardedStrategy`: owned rows only; reads of remote rows routed to their owners.

The same ownership as halo storage; the edge index addresses ``[owned | request table]``
(`rewrite.py`). The model's rows are `mlipdd.shard.aten.ShardTensor`s whose context carries
the request table (``HaloContext.reads``), so a read by the edge index fetches remote rows
from their owners and a scatter by it delivers remote sums to them (NOTE [aten sharded
storage] in `mlipdd.shard.aten.index_rules`). Atom rows are complete on every rank at every
op, so consolidation takes the owned rows as they are (`SpatialStrategy.consolidate`).

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
from mlipdd.shard.aten import GHOSTED, HaloContext, Rows, comm, from_local
from mlipdd.shard.aten.comm import OwnedRowsOnly
from mlipdd.strategy.aten_skin import edges_in_cutoff
from mlipdd.strategy.halo import SpatialStrategy, model_inputs
from mlipdd.strategy.halo.strategy import rows_batch
from mlipdd.strategy.sharded.rewrite import shard_halo


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
        """Collective: when the halo plan is rebuilt, rewrite it over owned rows; then every
        rank learns whether some rank owns a single atom (NOTE [a single row]), one all_reduce."""
        before = self.state
        halo = self.halo.prepare(batch, rebuild)
        if halo is not None:
            self.state = shard_halo(halo, batch, self.rank, self.group)
            if self.keep_halo_state:  # compile=True reads the halo rows of the same plan
                self.halo_state = halo  # (NOTE [sharded, compiled] in mlipdd.distributed.compiled_halo)
        if self.state is not before and self.world_size > 1 and any_rank(batch.num_atoms == 1, self.group):
            error = InputError(
                "sharded storage cannot run a rank that owns a single atom: its rows are a dimension of "
                "size 1, which torch's shape-dependent decompositions (einsum, matmul) move and merge "
                "differently than on the other ranks, so no view can tell where the atom went "
                "(NOTE [a single row] in mlipdd.strategy.sharded.strategy). Fix: fewer ranks for this "
                "system, another rank grid, or strategy='halo'")
            error.raised_on_every_rank = True  # agreed by the all_reduce: no rank's failure to relay
            raise error

    def model_batch(self, batch: Batch, spec) -> tuple[Batch, HaloContext | None]:
        state = self.state
        if self._plain():
            return self.plain_rows(batch)
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
