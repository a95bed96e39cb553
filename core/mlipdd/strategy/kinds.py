"""Names of the decomposition strategies (shared by the runtime and the strategies)."""

from __future__ import annotations

import enum


class StrategyKind(str, enum.Enum):
    HALO = "halo"  # spatial subdomains + ghost shell (short-range MPNNs, pair potentials)
    SHARDED = "sharded"  # owned rows only, cross-rank reads routed to owners
    GRAPH_PARTITION = "graph_partition"  # replicated positions, node partition
