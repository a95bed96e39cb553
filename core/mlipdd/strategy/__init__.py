"""Decomposition strategies: the `Strategy` base class and the built-in ones.

A strategy is found by name in the plugin registry (hook
``mlipdd_register_strategies``; ``mlipdd.plugins.get_strategy``). The built-in names
are the values of `StrategyKind`; a plugin adds its own (see ``mlipdd.hookspecs``).
"""

from __future__ import annotations

from mlipdd.strategy.base import Strategy
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
]
