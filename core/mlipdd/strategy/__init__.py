"""Decomposition strategies, found by `StrategyKind`.

A strategy implements: ``from_config(config, group)``, ``accepts(policy)``,
``partition(full, device)``, ``prepare(batch)`` (collective; rebuilds and migrates
when due), ``model_batch(batch, spec) -> (batch, meta)`` and
``consolidate(outputs, meta, spec, autograd_outputs)``; optionally
``model_scope(meta)``, a context manager entered around the model's forward (graph
partition publishes its node partition there). `DistributedModel` drives any of them
the same way.
"""

from __future__ import annotations

from mlipdd.strategy.graph_partition import GraphPartitionStrategy
from mlipdd.strategy.halo import HaloStrategy
from mlipdd.strategy.kinds import StrategyKind
from mlipdd.strategy.sharded import ShardedStrategy

STRATEGIES: dict[StrategyKind, type] = {StrategyKind.HALO: HaloStrategy}
STRATEGIES[StrategyKind.SHARDED] = ShardedStrategy
STRATEGIES[StrategyKind.GRAPH_PARTITION] = GraphPartitionStrategy


def strategy_for(kind: StrategyKind) -> type:
    try:
        return STRATEGIES[StrategyKind(kind)]
    except KeyError:
        raise NotImplementedError(
            f"strategy {StrategyKind(kind).value!r} is not available yet; available: "
            f"{sorted(k.value for k in STRATEGIES)}"
        ) from None


__all__ = ["STRATEGIES", "GraphPartitionStrategy", "HaloStrategy", "StrategyKind", "strategy_for"]
