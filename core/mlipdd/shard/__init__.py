"""ShardTensor and the exchanges (knows nothing of models or dynamics).

The dispatch is the aten-level one, `mlipdd.shard.aten` (its rules register on import);
`exchange` holds the row exchanges it and the strategies use, `graph_partition` the
helpers a graph-partition model calls, `custom_ops` the OpAdapters' activation.
"""

from mlipdd.shard.aten import AtenRefusal, declare_row_local
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

__all__ = ["AtenRefusal", "ExchangePlan", "all_reduce_sum", "all_to_all_rows", "as_atom_rows", "call_adapted",
           "declare_row_local", "halo_accumulate", "halo_correct", "halo_fill", "is_distributed", "local", "pad",
           "process_group"]
