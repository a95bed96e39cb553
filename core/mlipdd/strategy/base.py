"""`Strategy`: what a decomposition strategy implements for `DistributedModel` to drive it.

`DistributedModel` calls, per run and per forward::

    strategy = cls.from_config(config, group)     # once; cls.accepts(policy) checked first
    strategy.use_spec(spec)                        # once
    owned = strategy.partition(full_on_rank_0, device)
    # per forward (the decomposition stage): one collective vote, then the agreed rebuild
    strategy.check(owned); due = strategy.rebuild_due(owned)   # rank-local
    strategy.prepare(owned, rebuild=<due on any rank>)          # collective: migrate, plan
    model_batch, meta = strategy.model_batch(owned, spec)   # the rows and their context
    with strategy.model_scope(meta):
        outputs = model(model_batch)
    result = strategy.consolidate(outputs, meta, spec, autograd_outputs)

The core reduces the rank-local answers (and its own finite-positions check) in one
all-reduce per forward, so every rank takes the same decision (NOTE [decomposition
stage] in `mlipdd.distributed.model`); under `DomainParallel` this is its own stage of
the MD step, before the force call.

# NOTE [a strategy is self-contained]
Everything the rest of mlipdd needs to know about a strategy is on its class: which
storage policies it serves (``accepts``), the preset a plain model starts from (``preset``, for validation),
whether every rank holds the whole system (``whole_system``) and whether its ownership
is by cut planes (``spatial``: ``DomainConfig(balance=...)`` applies), and what a run
reports of it (``report``). No table in the core is keyed by a strategy's name, so a
third party's strategy, registered with ``mlipdd_register_strategies``, needs no core
edit; the built-in halo, sharded and graph-partition strategies register through the
built-in plugin like any third party's.
"""

from __future__ import annotations

import abc
import contextlib
from typing import TYPE_CHECKING, ClassVar

from mlipdd.comm import OnGroup

if TYPE_CHECKING:
    from mlipdd.data import Batch

__all__ = ["Strategy"]


class Strategy(OnGroup, abc.ABC):
    """Base class of every decomposition strategy (one instance per DistributedModel).

    ``group`` is the process group it works on (``rank`` / ``world_size`` come from
    it). ``grid`` (a `RankGrid`, or None) and ``rebuilds`` (neighbour-list rebuilds so
    far) are what `report` reads; override them when the strategy has them.
    """

    name: ClassVar[str] = ""  # the registered name, for messages
    # NOTE [a strategy is self-contained]
    preset: ClassVar[str | None] = None  # registered preset a model without a spec is validated from
    whole_system: ClassVar[bool] = False  # every rank holds every atom (validation checks ownership)
    spatial: ClassVar[bool] = False  # owns atoms by cut planes, so DomainConfig.balance applies
    grid = None
    rebuilds: int = 0
    balance = None  # the `LoadBalance` of a strategy that moves its cut planes

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

    def check(self, batch: Batch) -> None:
        """Rank-local, before every forward: raise `InputError` when ``batch`` is not one
        this strategy can run (the core agrees on it over ranks; default: no check)."""

    def rebuild_due(self, batch: Batch) -> bool:
        """Rank-local, before every forward: whether this rank needs `prepare` to rebuild
        (an atom moved too far, the cell changed, nothing built yet; default: never)."""
        return False

    @abc.abstractmethod
    def prepare(self, batch: Batch, rebuild: bool) -> None:
        """Collective, before every forward, with ``rebuild`` agreed by every rank (True when
        some rank's `rebuild_due` said so): migrate and rebuild then, else keep the plan."""

    @abc.abstractmethod
    def model_batch(self, batch: Batch, spec) -> tuple[Batch, object]:
        """The batch the model's forward sees, and the context of its rows (handed back to
        `model_scope` and `consolidate`)."""

    @abc.abstractmethod
    def consolidate(self, outputs: dict, meta, spec, autograd_outputs) -> dict:
        """The model's outputs -> replicated per-system values and owned per-atom rows."""

    def use_spec(self, spec) -> None:
        """Called once, right after `from_config`, with the model's resolved spec: a
        strategy whose layout depends on the model learns it here (default: nothing)."""

    def model_scope(self, meta):
        """A context entered around the model's forward (default: none)."""
        return contextlib.nullcontext()

    def ghost_rows(self) -> int:
        """Rows of atoms owned elsewhere that this rank's model reads, at the latest rebuild
        (halo: the ghost shell; sharded: the request table; default 0)."""
        return 0

    def report(self) -> dict:
        """What run summaries, benchmarks and the conformance kit print of this strategy:
        ``strategy`` (its name), ``grid`` (ranks per axis, or None), ``ghost_rows``,
        ``rebuilds`` and ``load_imbalance`` (max / mean owned atoms at the latest rebuild,
        or None); a strategy may add its own keys (sharded: ``stored_rows``)."""
        grid = self.grid
        return {"strategy": self.name, "grid": None if grid is None else tuple(grid.dims),
                "ghost_rows": self.ghost_rows(), "rebuilds": self.rebuilds,
                "load_imbalance": getattr(self.balance, "imbalance", None)}
