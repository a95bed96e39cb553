"""The distributed runtime: process groups, configuration, DistributedModel."""

from mlipdd.distributed.config import DomainConfig, StrategyKind
from mlipdd.shard.agreement import DistributedInputError, RemoteRankError
from mlipdd.distributed.manager import DistributedManager
from mlipdd.distributed.model import DistributedModel
from mlipdd.distributed.pipeline import DistributedPipelineModel

__all__ = [
    "DistributedInputError",
    "DistributedManager",
    "DistributedModel",
    "DistributedPipelineModel",
    "DomainConfig",
    "RemoteRankError",
    "StrategyKind",
]
