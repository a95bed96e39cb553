"""Row layouts: what one rank's rows of a tensor are, as small frozen types.

A `ShardMeta` carries one layout; the dispatch picks its rules by the layout's type
(`mlipdd.shard.registry`), never by strings or flags. The four layouts:

* `Halo`: ``[owned | ghost]`` rows; ghost rows mirror atoms owned elsewhere and are
  read locally (spatial halo strategy, MACE, LJ, Ewald).
* `Sharded`: owned rows only; a read of a remote row is routed to its owner and a
  scatter into one is sent there (sharded strategy, charge equilibration).
* `Replicated`: every rank holds the whole value (a per-system sum, the energy);
  ``source`` is the row layout it was reduced from.
* `GraphPartition`: every rank holds every row, and owns a block of them (graph
  partition strategy; the model calls `mlipdd.shard.graph_partition` itself).

# NOTE [layouts are not policies]
A storage policy (`mlipdd.spec.policies`) is what a model's spec asks for, in words a
spec file can store; a layout is what the running rank has, with the options the
dispatch reads. Each strategy translates one into the other (`Strategy.layout(policy)`).
"""

from __future__ import annotations

from dataclasses import dataclass

from mlipdd.shard.exchange import ExchangePlan

__all__ = ["HALO", "GraphPartition", "Halo", "Layout", "Replicated", "Sharded"]


@dataclass(frozen=True)
class Layout:
    """Base of the row layouts; use one of the concrete ones."""

    def is_halo(self) -> bool:
        return False

    def is_sharded(self) -> bool:
        return False

    def is_replicated(self) -> bool:
        return False

    def is_checked(self) -> bool:
        """Whether an op on rows of this layout without a rule is refused (NOTE [refuse by
        default] in `mlipdd.shard.propagation`). Graph partition holds every row on every
        rank and the model reduces through its own helpers; a spec whose policy switches
        an exchange off declares the ops it covers local (validation tries such specs)."""
        return False

    def node_rows(self, plan: ExchangePlan) -> int:
        """Rows of a per-atom tensor in this layout (-1: it has none)."""
        return plan.n_owned

    @property
    def system_reductions(self) -> bool:
        """Whether a sum over rows into per-system slots is completed over ranks."""
        return False


@dataclass(frozen=True)
class Halo(Layout):
    """``[owned | ghost]`` rows.

    ``correct_scatters``: a scatter into node rows sends ghost partials to their owners
    and refreshes the ghost rows (off: the scatter stays local). ``reduce_systems``: a
    scatter into per-system rows or a sum over rows counts owned rows, then all_reduce.
    """

    correct_scatters: bool = True
    reduce_systems: bool = True

    def is_halo(self) -> bool:
        return True

    def is_checked(self) -> bool:
        return self.correct_scatters and self.reduce_systems

    def node_rows(self, plan: ExchangePlan) -> int:
        return plan.n_padded

    @property
    def system_reductions(self) -> bool:
        return self.reduce_systems


HALO = Halo()  # the default: halo storage with every exchange on


@dataclass(frozen=True)
class Sharded(Layout):
    """Owned rows only. ``route_gathers``: an integer-index read of node rows fetches
    remote rows from their owners; ``route_scatters``: a scatter into node rows sends
    the part aimed at remote rows to their owners; ``reduce_systems`` as for `Halo`."""

    route_gathers: bool = True
    route_scatters: bool = True
    reduce_systems: bool = True

    def is_sharded(self) -> bool:
        return True

    def is_checked(self) -> bool:
        return self.route_gathers and self.route_scatters and self.reduce_systems

    @property
    def system_reductions(self) -> bool:
        return self.reduce_systems


@dataclass(frozen=True)
class Replicated(Layout):
    """Held whole by every rank; no node rows, never reduced again."""

    source: Layout = HALO  # the row layout the value was reduced from

    def is_replicated(self) -> bool:
        return True

    def node_rows(self, plan: ExchangePlan) -> int:
        return -1


@dataclass(frozen=True)
class GraphPartition(Layout):
    """Every row on every rank; the model keeps to its owned block (mlipdd.shard.graph_partition)."""

    reduce_systems: bool = True

    @property
    def system_reductions(self) -> bool:
        return self.reduce_systems

