"""Decomposition strategies: the `Strategy` base class and the built-in ones.

A strategy is found by name in the plugin registry (hook
``mlipdd_register_strategies``; ``mlipdd.plugins.get_strategy``) and brings everything
else on its class (NOTE [a strategy is self-contained] in `mlipdd.strategy.base`).
`StrategyKind` only spells the built-in names; a plugin adds its own.
"""

from __future__ import annotations

from mlipdd.strategy.base import Strategy
from mlipdd.strategy.fitting import fitting_spec
from mlipdd.strategy.graph_partition import GraphPartitionStrategy
from mlipdd.strategy.halo import HaloPlanner, HaloStrategy, SpatialStrategy
from mlipdd.strategy.kinds import StrategyKind
from mlipdd.strategy.sharded import ShardedStrategy

__all__ = [
    "GraphPartitionStrategy",
    "HaloPlanner",
    "HaloStrategy",
    "ShardedStrategy",
    "SpatialStrategy",
    "Strategy",
    "StrategyKind",
    "fitting_spec",
]
