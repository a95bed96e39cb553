"""`Strategy`: what a decomposition strategy implements for `DistributedModel` to drive it.

`DistributedModel` calls, per run and per forward::

    strategy = cls.from_config(config, group)     # once; cls.accepts(policy) checked first
    strategy.use_spec(spec)                        # once
    owned = strategy.partition(full_on_rank_0, device)
    strategy.prepare(owned)                        # collective: rebuild / migrate when due
    model_batch, meta = strategy.model_batch(owned, spec)
    with strategy.model_scope(meta):
        outputs = model(model_batch)
    result = strategy.consolidate(outputs, meta, spec, autograd_outputs)

Strategies are found by name in the plugin registry (hook
``mlipdd_register_strategies``); the built-in halo, sharded and graph-partition
strategies register through the built-in plugin like any third party's.
"""

from __future__ import annotations

import abc
import contextlib
from typing import TYPE_CHECKING, ClassVar

from mlipdd.comm import OnGroup

if TYPE_CHECKING:
    from mlipdd.data import Batch
    from mlipdd.shard import ShardMeta

__all__ = ["Strategy"]


class Strategy(OnGroup, abc.ABC):
    """Base class of every decomposition strategy (one instance per DistributedModel).

    ``group`` is the process group it works on (``rank`` / ``world_size`` come from
    it). ``grid`` (a `RankGrid`, or None) and ``rebuilds`` (neighbour-list rebuilds so
    far) are what run reports print; override them when the strategy has them.
    """

    name: ClassVar[str] = ""  # the registered name, for messages
    grid = None
    rebuilds: int = 0

    @classmethod
    @abc.abstractmethod
    def from_config(cls, config, group=None) -> Strategy:
        """A strategy for ``config`` (a `DomainConfig`) on ``group``."""

    @classmethod
    @abc.abstractmethod
    def accepts(cls, policy) -> bool:
        """Whether a model whose spec has this storage ``policy`` can run under it."""

    @abc.abstractmethod
    def partition(self, full: Batch | None, device=None) -> Batch:
        """Collective: rank 0's full batch (None elsewhere) -> this rank's owned batch."""

    @abc.abstractmethod
    def prepare(self, batch: Batch) -> None:
        """Collective, before every forward: validate, rebuild and migrate when due."""

    @abc.abstractmethod
    def model_batch(self, batch: Batch, spec) -> tuple[Batch, ShardMeta]:
        """The batch the model's forward sees, and the metadata of its rows."""

    @abc.abstractmethod
    def consolidate(self, outputs: dict, meta: ShardMeta, spec, autograd_outputs) -> dict:
        """The model's outputs -> replicated per-system values and owned per-atom rows."""

    def use_spec(self, spec) -> None:
        """Called once, right after `from_config`, with the model's resolved spec: a
        strategy whose layout depends on the model learns it here (default: nothing)."""

    def model_scope(self, meta: ShardMeta):
        """A context entered around the model's forward (default: none)."""
        return contextlib.nullcontext()
