"""Decomposition strategies: the `Strategy` base class and the built-in ones.

A strategy is found by name in the plugin registry (hook
``mlipdd_register_strategies``; `strategy_for`). The built-in names are the values
of `StrategyKind`; a plugin adds its own (see ``mlipdd.hookspecs``).
"""

from __future__ import annotations

from mlipdd.strategy.base import Strategy
from mlipdd.strategy.graph_partition import GraphPartitionStrategy
from mlipdd.strategy.halo import HaloPlanner, HaloStrategy
from mlipdd.strategy.kinds import StrategyKind
from mlipdd.strategy.sharded import ShardedStrategy


def strategy_for(name: StrategyKind | str) -> type[Strategy]:
    """The strategy class registered as ``name`` (a `StrategyKind` or a plugin's name)."""
    from mlipdd.plugins import get_strategy  # the registry sits above the layers it fills

    return get_strategy(name.value if isinstance(name, StrategyKind) else str(name))


__all__ = [
    "GraphPartitionStrategy",
    "HaloPlanner",
    "HaloStrategy",
    "ShardedStrategy",
    "Strategy",
    "StrategyKind",
    "strategy_for",
]
