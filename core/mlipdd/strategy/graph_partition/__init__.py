"""The graph-partition strategy, in one package (``DomainConfig(strategy="graph_partition")``).

Storage policy `mlipdd.spec.GraphPartitionPolicy`; the strategy (replicated geometry, a
balanced node partition), its `GraphPartition` layout, consolidation and reporting in
`strategy.py`; the model-side helpers a graph-partition model calls are
`mlipdd.shard.graph_partition`.
"""

from mlipdd.strategy.graph_partition.strategy import GraphPartitionState, GraphPartitionStrategy

__all__ = ["GraphPartitionState", "GraphPartitionStrategy"]
