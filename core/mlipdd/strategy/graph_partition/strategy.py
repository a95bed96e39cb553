"""Graph-partition strategy: replicated geometry, a balanced node partition.

For models that build their own graph inside forward (UMA / eSCN, or
`mlipdd.testing.graph_building_model`), so there is no neighbour list to hand them
and no halo to pad. Instead:

* ``partition`` validates the full batch on rank 0 and broadcasts it; every rank keeps
  the static per-atom data (numbers, system index, ids) and returns its owned block,
  rows ``arange(n).tensor_split(W)[rank]`` of the whole batch (all systems together);
* each forward all-gathers the owned positions, so the model sees the FULL geometry
  (and the current cell, from the owned batch) and builds its graph on it; the
  partition is published for the forward (`mlipdd.shard.graph_partition`), and the
  model keeps the edges of owned receivers, runs its layers on owned rows and calls
  ``gather_nodes`` before reading sender features (reduce-scatter adjoint);
* the helpers hand the model `mlipdd.shard.aten.ShardTensor`s (NOTE [aten graph partition]
  in `mlipdd.shard.aten.graph_partition`), so every op on the owned block and on the kept
  edges goes through the aten rules: exact or refused by name. Consolidation goes by
  placement: atom rows are the owned block; a replicated value is complete (its gradient
  rules summed over ranks), and a per-atom one of the full node set is cut to the owned
  block. One rank hands the plain full batch (NOTE [aten at one rank]): the helpers are
  the identity there. Compiled (`mlipdd.distributed.compiled_partition`) the helpers run
  on plain tensors: `consolidate_plain` sums the stress partials and reduce-scatters the
  full-row gradients.

Atoms never change owner and the cell is an ordinary model input, so there is no
migration, no rebuild and no cell tracking.

Memory. Per rank, the layer activations span the owned rows and the edges of owned
receivers, about 1/W of the single-process activations, which dominate the peak of a
message-passing model. It stops saving at what is replicated: the full positions and
static atom data, the graph build on the full geometry (the library's full list
before filtering, O(N) edges for a moment), and the gathered node features of each
layer (N x F per layer, kept for backward). So the ratio to one process approaches
1/W only when features per edge outweigh features per node; at small N, or with few
edge channels, the replicated part dominates.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from mlipdd.comm import agree_on_errors, broadcast_object, compute_on_rank0
from mlipdd.data import Batch, InputError
from mlipdd.shard.aten import Rows, ShardTensor
from mlipdd.shard.aten.adapters import AdaptedOps
from mlipdd.shard.aten.comm import OwnedRowsOnly
from mlipdd.shard.aten.counted import CountedReductions
from mlipdd.shard.aten.graph_partition import PartitionContext
from mlipdd.shard.exchange import ExchangePlan
from mlipdd.shard.graph_partition import (
    NodePartition,
    PartitionScope,
    gather_rows,
    partition_scope,
    reduce_scatter_rows,
)
from mlipdd.spec import OutputKind
from mlipdd.strategy.base import Strategy
from mlipdd.strategy.grid import RankGrid
from mlipdd.strategy.outputs import consolidate_outputs

# Per-atom fields that change during a run and are no model input: not replicated.
_DYNAMIC_FIELDS = ("positions", "velocities", "forces", "image")


@dataclass
class GraphPartitionState:
    """Fixed for the run: the partition and the replicated static atom data."""

    partition: NodePartition
    static_node: dict  # full-batch per-atom fields except positions (and dynamics)
    owned_ids: torch.Tensor  # atom ids of this rank's block, to check the batch given
    n_systems: int
    plan: ExchangePlan  # no ghost rows: the meta's rows are the owned block


class GraphPartitionStrategy(Strategy):
    """See the module docstring; one per DistributedModel."""

    name = "graph_partition"
    preset = "SPEC_MPNN_GP"
    whole_system = True
    rows_at_one_rank = False  # NOTE [aten at one rank] in mlipdd.strategy.halo.strategy

    def __init__(self, group=None):
        self.group = group
        self.state: GraphPartitionState | None = None
        # W blocks along the atom index, reported the way a (W, 1, 1) rank grid is
        self.grid = RankGrid((self.world_size, 1, 1))

    @classmethod
    def from_config(cls, config, group=None) -> GraphPartitionStrategy:
        # cutoff and skin are the model's business: it builds its own graph every call
        return cls(group)

    @classmethod
    def accepts(cls, policy) -> bool:
        return policy.is_graph_partition()

    def use_spec(self, spec) -> None:
        self._adapted = bool(spec.distribution.custom_ops)

    # ---- the strategy protocol ----------------------------------------------------------
    def partition(self, full: Batch | None, device=None) -> Batch:
        """Rank 0's full batch -> every rank keeps it replicated, returns its owned block."""
        full = broadcast_object(compute_on_rank0(_checked_copy, full, group=self.group), self.group)
        if device is not None:
            full = full.to(device)
        p = NodePartition.balanced(full.num_atoms, self.world_size, self.rank, self.group)
        rows = torch.arange(p.start, p.stop, device=full.device)
        owned = full.select_atoms(rows)
        empty = torch.zeros(0, dtype=torch.long, device=full.device)
        zeros = (0,) * self.world_size
        self.state = GraphPartitionState(
            partition=p,
            static_node={k: v for k, v in full.node.items() if k not in _DYNAMIC_FIELDS},
            owned_ids=owned.atom_ids.clone(),
            n_systems=full.num_systems,
            plan=ExchangePlan(empty, zeros, zeros, p.n_owned, self.group),
        )
        return owned

    def check(self, batch: Batch) -> None:
        """Atoms never change owner: the batch must be the one partition() gave."""
        self._check_owned(batch)

    def prepare(self, batch: Batch, rebuild: bool) -> None:
        """Nothing to rebuild (never due)."""

    def full_geometry(self, batch: Batch) -> Batch:
        """The FULL geometry, plain: every rank's owned positions gathered (collective), the
        replicated static atom data, the current cell."""
        node = dict(self.state.static_node)
        node["positions"] = gather_rows(batch.positions.detach(), self.state.partition)
        return Batch._from_dicts(node, dict(batch.system))

    def model_batch(self, batch: Batch, spec) -> tuple[Batch, PartitionScope]:
        """The full geometry (gathered positions, current cell), plain; the partition scope."""
        p = self.state.partition
        full = self.full_geometry(batch)
        if self.world_size == 1 and not self.rows_at_one_rank:  # one block: the helpers are the identity
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
            if getattr(self, "_adapted", False) and scope.ctx is not None:
                adapters.enter_context(AdaptedOps(scope.ctx))
            yield

    def consolidate(self, outputs: dict, scope: PartitionScope, spec, autograd_outputs) -> dict:
        """By placement (module docstring)."""
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

    def consolidate_plain(self, outputs: dict, scope: PartitionScope, spec, autograd_outputs) -> dict:
        """Of plain outputs (the helpers' plain forms ran: no aten rows): stress partials
        all-reduced; full-row gradients summed over ranks, owned block kept."""
        agree_on_errors(None if scope.used else _unaware_model_error(), self.group)
        p = scope.partition

        def per_atom(name, value):
            if value.dim() == 0 or value.shape[0] != p.n_nodes:
                return value  # per system: summed by the model, replicated
            if name in autograd_outputs and name not in spec.owned_only_outputs:
                return reduce_scatter_rows(value, p)  # this rank's partial of every row
            return value[p.owned_slice] if p.n_owned != p.n_nodes else value

        return consolidate_outputs(outputs, spec, self.group, per_atom)

    # ---- checks -------------------------------------------------------------------------
    def _check_owned(self, batch: Batch) -> None:
        state = self.state
        if state is None:
            raise InputError(
                "graph partition has no partition yet: call dm.partition(full_batch_on_rank_0) "
                "and pass the batch it returns"
            )
        p = state.partition
        if batch.num_atoms != p.n_owned or not torch.equal(batch.atom_ids, state.owned_ids):
            raise InputError(
                f"rank {p.rank} owns atoms {p.start}..{p.stop - 1} ({p.n_owned}) under graph partition "
                f"but was given a batch of {batch.num_atoms} atoms with other ids; pass the batch "
                "partition() returned (atoms never change owner under graph partition)"
            )
        if batch.num_systems != state.n_systems:
            raise InputError(
                f"the batch has {batch.num_systems} systems, the partitioned one {state.n_systems}; "
                "call partition() again for a new set of systems"
            )


def _checked_copy(full: Batch | None) -> Batch:
    """Rank 0: a validated CPU copy of the full batch, to broadcast."""
    if full is None:
        raise InputError("partition() needs the full system on rank 0; got None there")
    full = full.clone().to("cpu")
    full.validate()
    return full


def _unaware_model_error() -> InputError:
    return InputError(
        "the model ran under graph partition without asking for its node partition, so every "
        "rank did the whole computation and the forces would be counted once per rank. Make "
        "the model graph-partition aware with mlipdd.shard.graph_partition (keep_owned_receivers, "
        "gather_nodes, sum_over_ranks; identity in one process) or use the halo strategy"
    )
