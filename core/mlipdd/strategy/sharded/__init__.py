"""The sharded strategy, in one package (``DomainConfig(strategy="sharded")``): the halo
strategy's ownership, without storing the ghost shell.

Ownership, partition and migration are the spatial ones of the halo strategy: this
strategy composes a `HaloPlanner` (its public interface only). At each rebuild the
halo's neighbour list (built over ``[owned | ghost]`` positions, as for
halo storage) is rewritten so that it no longer needs ghost rows:

* a ghost sender is an image of some atom: (owner rank, atom id, unit shift ``u``),
  its position ``x_owner + u @ cell``. The edge keeps the atom and carries the shift
  instead: ``x_j + (-u) @ cell - x_owner`` is the same vector, so a model that reads
  ``positions[receiver] + shifts - positions[sender]`` (the library's convention) sees
  one process's geometry;
* the atom becomes an owned row (an image of an atom this rank owns) or a row of the
  request table, one per remote atom read, grouped by owner (`ExchangePlan`);
* the owners learn which of their rows to send (one ``all_to_all`` of ids).

The model then gets a batch of owned rows (aten ShardTensors whose context carries the
request table), whose reads of remote rows are routed to the owners by the dispatch
(NOTE [aten sharded storage] in `mlipdd.shard.aten.index_rules`). Per-atom outputs are
already owned rows.

Storage policy `mlipdd.spec.ShardedStoragePolicy` (a halo policy runs here too); the
strategy, its rows, consolidation and reporting (``stored_rows`` in `Strategy.report`) in `strategy.py`;
the rewrite of the halo plan in `rewrite.py`.
"""

from mlipdd.strategy.sharded.rewrite import ShardedState, rows_of_ids, shard_halo
from mlipdd.strategy.sharded.strategy import ShardedStrategy

__all__ = ["ShardedState", "ShardedStrategy", "rows_of_ids", "shard_halo"]
