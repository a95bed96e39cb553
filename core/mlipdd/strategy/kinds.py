"""The built-in strategies' names, spelled as constants for user code.

Not a closed list: any name registered with ``mlipdd_register_strategies`` is a
strategy, and the core decides by the strategy's class, never by this enum."""

from __future__ import annotations

import enum


class StrategyKind(str, enum.Enum):
    HALO = "halo"  # spatial subdomains + ghost shell (short-range MPNNs, pair potentials)
    SHARDED = "sharded"  # owned rows only, cross-rank reads routed to owners
    GRAPH_PARTITION = "graph_partition"  # replicated positions, node partition
