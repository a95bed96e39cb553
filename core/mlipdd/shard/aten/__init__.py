"""The aten-level ShardTensor (issue 21 item 2): the dispatch every strategy runs.

A wrapper
subclass whose ``__torch_dispatch__`` sees every op once, in its aten spelling, with a
placement per tensor (NOTE [aten placements]), per-op rules (NOTE [aten precedence]), and
refusal by default (NOTE [refuse by default]).
"""

from mlipdd.shard.aten import global_rows as _global_rows  # noqa: F401  (registers rules)
from mlipdd.shard.aten import index_rules as _index_rules  # noqa: F401
from mlipdd.shard.aten import matmul as _matmul  # noqa: F401
from mlipdd.shard.aten import reductions as _reductions  # noqa: F401
from mlipdd.shard.aten import scatter_means as _scatter_means  # noqa: F401
from mlipdd.shard.aten import softmax as _softmax  # noqa: F401
from mlipdd.shard.aten.placement import (
           EDGES,
           GHOSTED,
           OWNED,
           REPLICATE,
           SHARES,
           Replicate,
           Rows,
)
from mlipdd.shard.aten.row_local import declare_row_local
from mlipdd.shard.aten.rules import RULES
from mlipdd.shard.aten.tensor import (
           AtenRefusal,
           HaloContext,
           ShardTensor,
           from_local,
           owned_rows,
           to_local,
)

__all__ = ["EDGES", "GHOSTED", "OWNED", "REPLICATE", "RULES", "SHARES", "AtenRefusal", "HaloContext",
           "Replicate", "Rows", "ShardTensor", "declare_row_local", "from_local", "owned_rows", "to_local"]
