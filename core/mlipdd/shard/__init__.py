"""ShardTensor and the dispatch machinery (knows nothing of models or dynamics)."""

from mlipdd.shard import handlers as _handlers  # noqa: F401  (fills the registry)
from mlipdd.shard import sharded_handlers as _sharded_handlers  # noqa: F401  (sharded storage rules)
from mlipdd.shard.exchange import (
    ExchangePlan,
    all_reduce_sum,
    all_to_all_rows,
    halo_accumulate,
    halo_correct,
    halo_fill,
    pad,
)
from mlipdd.shard.registry import FIRED, register
from mlipdd.shard.tensor import DroppedScatterResultError, ShardMeta, ShardTensor, local

__all__ = [
    "FIRED",
    "DroppedScatterResultError",
    "ExchangePlan",
    "ShardMeta",
    "ShardTensor",
    "all_reduce_sum",
    "all_to_all_rows",
    "halo_accumulate",
    "halo_correct",
    "halo_fill",
    "local",
    "pad",
    "register",
]
