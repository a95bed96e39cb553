"""`ShardedStrategy`: owned rows only; reads of remote rows routed to their owners."""

from __future__ import annotations

import contextlib

from mlipdd.data import Batch
from mlipdd.shard import ShardMeta, ShardTensor
from mlipdd.shard.layouts import Sharded
from mlipdd.shard.owned_rows import owned_rows_scope
from mlipdd.shard.placement import ATOMS, SYSTEM_INDEX
from mlipdd.shard.scripted import script_functions_dispatched
from mlipdd.shard.tensor import neighbors_as_edge_rows
from mlipdd.strategy.halo import SpatialStrategy, model_inputs
from mlipdd.strategy.outputs import consolidate_outputs
from mlipdd.strategy.sharded.rewrite import shard_halo


class ShardedStrategy(SpatialStrategy):
    """``"sharded"``: owned rows only; remote reads routed to their owners."""

    name = "sharded"
    preset = "SPEC_MPNN_SHARDED"
    dispatches = ("aten", "torch_function")  # NOTE [choosing the dispatch]: aten is the default
    aten_class = "mlipdd.strategy.aten_sharded:AtenShardedStrategy"
    keep_halo_state = False  # set by compile=True; otherwise only owned rows are kept
    halo_state = None

    @classmethod
    def accepts(cls, policy) -> bool:
        # "halo | sharded -> sharded": a halo model's reads are served over the wire; one
        # that builds its own graph over the ghost shell (NOTE [own graph]) needs the rows
        return policy.is_sharded() or (policy.is_halo() and not policy.builds_own_graph)

    def layout(self, policy) -> Sharded:
        """A sharded policy says which of reads and scatters are routed; a halo policy
        ("halo | sharded -> sharded") has both routed."""
        if policy.is_sharded():
            return Sharded(route_gathers=policy.gather == "distributed",
                           route_scatters=policy.scatter == "distributed",
                           reduce_systems=policy.system_reductions)
        return Sharded(reduce_systems=policy.system_reductions)

    def prepare(self, batch: Batch, rebuild: bool) -> None:
        """Collective: when the halo plan is rebuilt, rewrite it over owned rows."""
        halo = self.halo.prepare(batch, rebuild)
        if halo is not None:
            self.state = shard_halo(halo, batch, self.rank, self.group)
            if self.keep_halo_state:  # compile=True reads the halo rows of the same plan
                self.halo_state = halo  # (NOTE [sharded, compiled] in mlipdd.distributed.compiled_halo)

    def model_batch(self, batch: Batch, spec) -> tuple[Batch, ShardMeta]:
        """Owned rows only; positions and atomic numbers as sharded ShardTensors."""
        state = self.state
        meta = ShardMeta(
            plan=state.plan,
            n_systems=batch.num_systems,
            n_edges=state.neighbors.num_edges,
            layout=self.layout(spec.distribution.policy),
            group=self.group,
        )
        # the ShardTensor itself is the leaf: wrapping a leaf under no_grad (dynamics) would
        # give an alias outside the graph, which autograd.grad could not differentiate by
        positions = ShardTensor.wrap(batch.positions.detach(), meta, ATOMS).requires_grad_(True)
        node = {
            "positions": positions,
            "atomic_numbers": ShardTensor.wrap(batch.atomic_numbers, meta, ATOMS),
            "batch": ShardTensor.wrap(batch.batch, meta, SYSTEM_INDEX),
            "atom_ids": batch.atom_ids,
        }
        # extra per-atom inputs (partial charges, spins) as halo storage hands them over,
        # owned rows here: a read at an edge's remote end is routed like the positions'
        node.update({name: ShardTensor.wrap(value, meta, ATOMS) for name, value in model_inputs(batch).items()})
        owned = Batch._from_dicts(node, dict(batch.system))
        owned.neighbors = neighbors_as_edge_rows(state.neighbors, meta)
        owned.n_owned = batch.num_atoms
        return owned, meta

    @contextlib.contextmanager
    def model_scope(self, meta: ShardMeta):
        """Per-atom tensors the model creates from the atom count are owned rows too
        (NOTE [row counts] in mlipdd.shard.owned_rows), script functions called on rows run
        under the dispatch (NOTE [scripted functions] in mlipdd.shard.scripted);
        balance="time" times the call."""
        with owned_rows_scope(meta), script_functions_dispatched(), self.halo.balance.timing():
            yield

    def consolidate(self, outputs: dict, meta: ShardMeta, spec, autograd_outputs) -> dict:
        """Per-atom outputs are owned rows already (gradients reached their owners in the
        routed gathers' backward); rank partials named by the spec are summed."""
        return consolidate_outputs(outputs, spec, self.group)

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
