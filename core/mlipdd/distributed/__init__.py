"""The distributed runtime: process groups, configuration, DistributedModel."""

from mlipdd.comm import DistributedInputError, RemoteRankError
from mlipdd.distributed.checkpoint import (
    Checkpoint,
    CheckpointWriter,
    load_checkpoint,
    restore_dynamics,
    save_checkpoint,
)
from mlipdd.distributed.config import DomainConfig, StrategyKind
from mlipdd.distributed.domain_parallel import DomainParallel
from mlipdd.distributed.hooks import HookScope, gather_batch, gather_rows, unwrapped_positions
from mlipdd.distributed.manager import DistributedManager
from mlipdd.distributed.model import DistributedModel
from mlipdd.distributed.pipeline import DistributedPipelineModel
from mlipdd.distributed.reducer import DistributedReducer

__all__ = [
    "Checkpoint",
    "CheckpointWriter",
    "DistributedInputError",
    "DistributedManager",
    "DistributedModel",
    "DistributedPipelineModel",
    "DistributedReducer",
    "DomainConfig",
    "DomainParallel",
    "HookScope",
    "RemoteRankError",
    "StrategyKind",
    "gather_batch",
    "gather_rows",
    "load_checkpoint",
    "restore_dynamics",
    "save_checkpoint",
    "unwrapped_positions",
]
