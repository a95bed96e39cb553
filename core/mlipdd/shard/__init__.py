"""ShardTensor and the dispatch machinery (knows nothing of models or dynamics)."""

# The modules that register dispatch rules (their order is PRECEDENCE's, not this one).
from mlipdd.shard import custom_ops as _custom_ops  # noqa: F401
from mlipdd.shard import handlers as _handlers  # noqa: F401
from mlipdd.shard import owned_rows as _owned_rows  # noqa: F401
from mlipdd.shard import replicated as _replicated  # noqa: F401
from mlipdd.shard import row_reductions as _row_reductions  # noqa: F401
from mlipdd.shard import scatter_spellings as _scatter_spellings  # noqa: F401
from mlipdd.shard import sharded_handlers as _sharded_handlers  # noqa: F401
from mlipdd.shard.declared import as_atom_rows, call_adapted, is_distributed, local, process_group
from mlipdd.shard.exchange import (
    ExchangePlan,
    all_reduce_sum,
    all_to_all_rows,
    halo_accumulate,
    halo_correct,
    halo_fill,
    pad,
)
from mlipdd.shard.layouts import GraphPartition, Halo, Layout, Replicated, Sharded
from mlipdd.shard.placement import Opaque, Rows, placement_of
from mlipdd.shard.propagation import NoRuleError, declare_row_local
from mlipdd.shard.registry import ANY_OP, FIRED, PRECEDENCE, register, rules_in_order
from mlipdd.shard.tensor import (
    DroppedScatterResultError,
    ShardMeta,
    ShardTensor,
    as_edge_rows,
    refresh_ghosts,
)

__all__ = ["ANY_OP", "FIRED", "PRECEDENCE", "DroppedScatterResultError", "ExchangePlan",
           "GraphPartition", "Halo", "Layout", "NoRuleError", "Opaque", "Replicated", "Rows",
           "ShardMeta", "ShardTensor", "Sharded", "all_reduce_sum", "all_to_all_rows",
           "as_atom_rows", "as_edge_rows", "call_adapted", "declare_row_local", "halo_accumulate", "halo_correct",
           "halo_fill", "is_distributed", "local", "pad", "placement_of", "process_group", "refresh_ghosts", "register",
           "rules_in_order"]
