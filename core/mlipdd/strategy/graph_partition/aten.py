"""Graph partition under the aten dispatch (``DomainConfig(strategy="graph_partition", dispatch="aten")``).

The same partition, replicated static data and checks as `GraphPartitionStrategy`;
what differs is the forward: the model gets the full geometry as plain (replicated)
tensors and the partition's helpers hand it aten ShardTensors (NOTE [aten graph
partition] in `mlipdd.shard.aten.graph_partition`), so every op on the owned block and
on the kept edges goes through the aten rules: exact or refused by name. Consolidation
goes by placement: atom rows are the owned block; a replicated value is complete (its
gradient rules summed over ranks), and a per-atom one of the full node set is cut to
the owned block. One rank hands the plain full batch, its partition one block (NOTE
[aten at one rank] in `mlipdd.strategy.aten_halo`): the helpers are the identity there.
"""

from __future__ import annotations

import contextlib

import torch

from mlipdd.comm import agree_on_errors
from mlipdd.data import Batch
from mlipdd.shard.aten import Rows, ShardTensor
from mlipdd.shard.aten.adapters import AdaptedOps
from mlipdd.shard.aten.comm import OwnedRowsOnly
from mlipdd.shard.aten.counted import CountedReductions
from mlipdd.shard.aten.graph_partition import PartitionContext
from mlipdd.shard.graph_partition import PartitionScope, partition_scope
from mlipdd.spec import OutputKind
from mlipdd.strategy.graph_partition.strategy import GraphPartitionStrategy, _unaware_model_error


class AtenGraphPartitionStrategy(GraphPartitionStrategy):
    """`GraphPartitionStrategy` with the aten dispatch's rows (module docstring)."""

    rows_at_one_rank = False  # NOTE [aten at one rank]

    def _plain(self) -> bool:
        return self.world_size == 1 and not self.rows_at_one_rank

    def use_spec(self, spec) -> None:
        super().use_spec(spec)
        self._adapted = bool(spec.distribution.custom_ops)

    def model_batch(self, batch: Batch, spec) -> tuple[Batch, PartitionScope]:
        """The full geometry (gathered positions, current cell), plain; the partition scope."""
        p = self.state.partition
        full = self.full_geometry(batch)
        if self._plain():  # one block of every row: the helpers' plain forms are the identity
            return full, PartitionScope(p)
        ctx = PartitionContext(plan=OwnedRowsOnly(p.n_owned), n_edges=0, group=self.group)
        return full, PartitionScope(p, ctx)

    @contextlib.contextmanager
    def model_scope(self, scope: PartitionScope):
        """The partition for the helpers; means over rows (NOTE [aten means]); the spec's
        OpAdapters (NOTE [aten op adapters])."""
        with partition_scope(scope), scope.after_graph, contextlib.ExitStack() as adapters:
            if scope.ctx is not None:
                adapters.enter_context(CountedReductions())
            if self._adapted and scope.ctx is not None:
                adapters.enter_context(AdaptedOps(scope.ctx))
            yield

    def consolidate(self, outputs: dict, scope: PartitionScope, spec, autograd_outputs) -> dict:
        agree_on_errors(None if scope.used else _unaware_model_error(), self.group)
        p = scope.partition
        result = {}
        for name, value in outputs.items():
            if not torch.is_tensor(value):
                result[name] = value
                continue
            place = value._place if isinstance(value, ShardTensor) else None
            local = (value._local if place is not None else value).detach()
            if isinstance(place, Rows) and place.is_atoms() and place.dim == 0:
                result[name] = local  # the owned block itself (no ghost rows)
            elif place is None or place.is_replicate():
                kind = spec.output_kinds.get(name, OutputKind.UNKNOWN)
                per_system = kind.is_per_graph() or kind.is_global()
                whole = not per_system and local.dim() > 0 and local.shape[0] == p.n_nodes
                result[name] = local[p.owned_slice] if whole else local
            else:
                raise RuntimeError(
                    f"the model's output {name!r} holds {place} (from `{value._origin}`); an output is per atom "
                    "(rows of the owned block, or of the full node set) or one value per system: return atom "
                    "rows or a sum over them")
        return result
