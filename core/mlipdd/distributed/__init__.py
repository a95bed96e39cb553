"""The distributed runtime: process groups, configuration, DistributedModel."""

from mlipdd.distributed.config import DomainConfig, StrategyKind
from mlipdd.shard.agreement import DistributedInputError, RemoteRankError
from mlipdd.distributed.manager import DistributedManager
from mlipdd.distributed.model import DistributedModel

__all__ = [
    "DistributedInputError",
    "DistributedManager",
    "DistributedModel",
    "DomainConfig",
    "RemoteRankError",
    "StrategyKind",
]
