"""Graph-parallel helpers: a node partition and the few collectives a model calls.

Under the graph-partition strategy every rank holds the full geometry and owns one
contiguous block of node rows (`NodePartition`). A model that builds its own graph
stays single-process code and calls these helpers at the handful of places where a
node partition matters; with no partition active (one process, or any other
strategy) every helper is the identity, so the same model runs unchanged anywhere.

Public API (what a model, or a MethodAdapter around a third-party model, calls)::

    p = current_partition()              # NodePartition or None
    edge_index, vec = keep_owned_receivers(edge_index, vec)  # edges of owned receivers
    recv = local_receivers(edge_index[1])                     # rows of the owned block
    h = owned_rows(h_full)               # the owned block of a full per-node tensor
    h_full = gather_nodes(h)             # all_gather; adjoint: reduce-scatter
    h = scatter_to_owners(partial_full)  # reduce-scatter; adjoint: all_gather
    energy = sum_over_ranks(partial)     # all_reduce; adjoint: identity

# NOTE [gather adjoint]
``gather_nodes`` concatenates every rank's owned rows. Each rank then reads sender
rows of other ranks' nodes, so the gradient a rank computes for the full tensor has
entries for rows it does not own; their owner needs the sum over ranks of those
entries. That is a reduce-scatter, and the reduce-scatter's adjoint is the gather, so
the two autograd functions call each other in backward and double backward (force
training) works.

Under ``torch.compile`` (``DomainConfig(compile=True)``) the same helpers read the
partition from a plain holder and run as functional collectives, traced into the graph
(`mlipdd.shard.traced_collectives`); a model needs no change.

# NOTE [collective order]
Every helper that crosses ranks is a collective. All ranks must call them in the
same order, forward and backward: the model code is the same on every rank, and a
rank with no owned nodes or no edges still calls them with empty tensors (never skip
a helper because a local tensor is empty).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mlipdd.data import InputError
from mlipdd.shard import traced_collectives as traced
from mlipdd.shard.exchange import all_reduce_sum
from mlipdd.shard.internal import internal

__all__ = ["NodePartition", "PartitionScope", "current_partition", "gather_nodes", "gather_rows",
           "keep_owned_receivers", "local_receivers", "owned_rows", "owned_slice",
           "partition_scope", "reduce_scatter_rows", "scatter_to_owners", "sum_over_ranks"]


@dataclass(frozen=True)
class NodePartition:
    """Rank ``r`` owns rows ``bounds[r]:bounds[r + 1]`` of the full node set."""

    bounds: tuple[int, ...]  # world_size + 1 row offsets, first 0, last n_nodes
    rank: int
    group: object = None

    @classmethod
    def balanced(cls, n_nodes: int, world_size: int, rank: int, group=None) -> NodePartition:
        """The blocks of ``arange(n_nodes).tensor_split(world_size)`` (sizes differ by <= 1)."""
        base, extra = divmod(int(n_nodes), int(world_size))
        bounds = [0]
        for r in range(world_size):
            bounds.append(bounds[-1] + base + (1 if r < extra else 0))
        return cls(tuple(bounds), int(rank), group)

    @property
    def world_size(self) -> int:
        return len(self.bounds) - 1

    @property
    def n_nodes(self) -> int:
        return self.bounds[-1]

    @property
    def start(self) -> int:
        return self.bounds[self.rank]

    @property
    def stop(self) -> int:
        return self.bounds[self.rank + 1]

    @property
    def n_owned(self) -> int:
        return self.stop - self.start

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in zip(self.bounds[:-1], self.bounds[1:]))

    @property
    def owned_slice(self) -> slice:
        return slice(self.start, self.stop)

    def owns(self, index: torch.Tensor) -> torch.Tensor:
        """Boolean mask: which of the global row ``index`` values this rank owns."""
        return (index >= self.start) & (index < self.stop)


class PartitionScope:
    """The active partition plus whether the model asked for it (see `partition_scope`).

    ``ctx``: under the aten dispatch, the forward's `mlipdd.shard.aten.HaloContext`; the
    helpers then hand out aten ShardTensors (NOTE [aten graph partition] in
    `mlipdd.shard.aten.graph_partition`), and ``after_graph`` holds what they enter once
    the model's graph is built (the factory mode), closed with the scope."""

    def __init__(self, partition: NodePartition, ctx=None):
        self.partition = partition
        self.used = False
        self.ctx = ctx
        self.after_graph = contextlib.ExitStack()


_ACTIVE: ContextVar[PartitionScope | None] = ContextVar("mlipdd_node_partition", default=None)


@contextlib.contextmanager
def partition_scope(partition: NodePartition | PartitionScope) -> Iterator[PartitionScope]:
    """Make ``partition`` the one the helpers see for the block (the strategy enters it)."""
    scope = partition if isinstance(partition, PartitionScope) else PartitionScope(partition)
    token = _ACTIVE.set(scope)
    try:
        yield scope
    finally:
        _ACTIVE.reset(token)


def current_partition() -> NodePartition | None:
    """The node partition of the running graph-partition forward, or None.

    Asking marks the scope as used: the strategy refuses a forward in which the model
    never asked, since a model unaware of the partition would do all the work on every
    rank and its forces would be counted ``world_size`` times.
    """
    if torch.compiler.is_compiling():  # dynamo cannot read a ContextVar: mlipdd.shard.traced_collectives
        traced.HOLDER.asked = True
        return traced.HOLDER.partition
    scope = _ACTIVE.get()
    if scope is None:
        return None
    scope.used = True
    return scope.partition


def _aten_ctx():
    """The aten dispatch's context of the active partition (None: plain tensors)."""
    scope = None if torch.compiler.is_compiling() else _ACTIVE.get()
    return None if scope is None else scope.ctx


def _aten():
    from mlipdd.shard.aten import graph_partition as aten_gp

    return aten_gp


# ---- identity-when-inactive helpers ----------------------------------------------------


def owned_slice(n_nodes: int | None = None) -> slice:
    """Rows of the owned block (all rows when no partition is active)."""
    p = current_partition()
    if p is None:
        return slice(0, n_nodes)
    if n_nodes is not None and n_nodes != p.n_nodes:
        raise _rows_error("owned_slice", n_nodes, p)
    if _aten_ctx() is not None:
        from mlipdd.shard.aten import AtenRefusal

        raise AtenRefusal(
            "mlipdd aten dispatch refuses `owned_slice` under graph partition: a slice by this rank's row "
            "numbers gives a plain tensor that differs between ranks, which no later op can tell from a "
            "replicated one. Fix: owned_rows(x) (rows the dispatch tracks)")
    return p.owned_slice


def owned_rows(x: torch.Tensor) -> torch.Tensor:
    """The owned block of a full per-node tensor (``x`` itself when none is active)."""
    p = current_partition()
    if p is None:
        return x
    if x.shape[0] != p.n_nodes:
        raise _rows_error("owned_rows", x.shape[0], p)
    ctx = _aten_ctx()
    if ctx is not None:
        return _aten().owned_rows(p, ctx, x)
    return x[p.start : p.stop]


def keep_owned_receivers(edge_index: torch.Tensor, *edge_values: torch.Tensor):
    """Keep the edges whose receiver (``edge_index[1]``) is owned, with their rows of
    ``edge_values``; returns ``(edge_index, *edge_values)`` (unchanged when inactive).

    Indices stay global (rows of the full node set): read senders from
    `gather_nodes` output, scatter into owned rows with `local_receivers`.
    """
    p = current_partition()
    if p is None:
        return (edge_index, *edge_values)
    ctx = _aten_ctx()
    if ctx is not None:
        from mlipdd.shard.aten.factories import factory_rows

        kept = _aten().keep_owned_receivers(p, ctx, edge_index, edge_values)
        _ACTIVE.get().after_graph.enter_context(factory_rows(ctx))  # NOTE [aten factories], once the graph is built
        return kept
    mask = p.owns(edge_index[1])
    return (edge_index[:, mask], *(v[mask] for v in edge_values))


def local_receivers(receivers: torch.Tensor) -> torch.Tensor:
    """Global receiver rows -> rows of the owned block (the scatter target)."""
    p = current_partition()
    if p is not None and _aten_ctx() is not None:
        return _aten().local_receivers(p, receivers)
    return receivers if p is None or p.start == 0 else receivers - p.start


def gather_nodes(x_owned: torch.Tensor) -> torch.Tensor:
    """Owned rows from every rank -> the full ``(n_nodes, ...)`` tensor (see NOTE [gather adjoint])."""
    p = current_partition()
    if p is None:
        return x_owned
    if x_owned.shape[0] != p.n_owned:
        raise _rows_error("gather_nodes", x_owned.shape[0], p, owned=True)
    if _aten_ctx() is not None:
        return _aten().gather_nodes(p, x_owned)
    if p.world_size == 1:
        return x_owned
    return traced.traced_gather(x_owned, p) if torch.compiler.is_compiling() else _GatherNodes.apply(x_owned, p)


def scatter_to_owners(x_full: torch.Tensor) -> torch.Tensor:
    """Per-rank partial sums over the full node set -> the owned rows of their total."""
    p = current_partition()
    if p is None:
        return x_full
    if x_full.shape[0] != p.n_nodes:
        raise _rows_error("scatter_to_owners", x_full.shape[0], p)
    ctx = _aten_ctx()
    if ctx is not None:  # the rules completed the sum over ranks where it was made: the owned block of it
        return _aten().owned_rows(p, ctx, x_full, "scatter_to_owners")
    if p.world_size == 1:
        return x_full
    if torch.compiler.is_compiling():
        return traced.traced_reduce_scatter(x_full, p)
    return _ScatterToOwners.apply(x_full, p)


def sum_over_ranks(partial: torch.Tensor) -> torch.Tensor:
    """A per-rank partial (e.g. per-system energy of the owned atoms) summed over ranks,
    replicated; identity backward (each rank's partial enters the total once)."""
    p = current_partition()
    if p is not None and _aten_ctx() is not None:
        return _aten().sum_over_ranks(partial)
    if p is None or p.world_size == 1:
        return partial
    return traced.traced_sum(partial) if torch.compiler.is_compiling() else all_reduce_sum(partial, p.group)


def _rows_error(what: str, rows: int, p: NodePartition, owned: bool = False) -> InputError:
    want = f"{p.n_owned} owned rows" if owned else f"{p.n_nodes} rows (the full node set)"
    return InputError(
        f"{what} got a tensor with {rows} rows; under graph partition rank {p.rank} expects {want}. "
        "Gather owned features with gather_nodes, slice full ones with owned_rows"
    )


# ---- the collectives -------------------------------------------------------------------
# NOTE [padded blocks]: blocks differ in size by at most one row; the equal-size tensor
# collectives want equal blocks, so each block is padded to the largest and trimmed after.

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _padded(p: NodePartition) -> int:
    return max(p.sizes)


@internal  # NOTE [internal factories]
def gather_rows(x_owned: torch.Tensor, p: NodePartition) -> torch.Tensor:
    """Plain (no autograd) all_gather of every rank's owned block, in rank order."""
    if p.world_size == 1:
        return x_owned
    m = _padded(p)
    block = x_owned.new_zeros((m, *x_owned.shape[1:]))
    block[: p.n_owned] = x_owned
    out = x_owned.new_empty((m * p.world_size, *x_owned.shape[1:]))
    _all_gather(out, block, group=p.group)
    if all(s == m for s in p.sizes):
        return out
    return torch.cat([out[r * m : r * m + s] for r, s in enumerate(p.sizes)])


@internal  # NOTE [internal factories]
def reduce_scatter_rows(x_full: torch.Tensor, p: NodePartition) -> torch.Tensor:
    """Plain (no autograd) sum over ranks of a full-rows tensor; returns the owned block."""
    if p.world_size == 1:
        return x_full
    m = _padded(p)
    if all(s == m for s in p.sizes):
        blocks = x_full.contiguous()
    else:
        blocks = x_full.new_zeros((m * p.world_size, *x_full.shape[1:]))
        for r, (a, s) in enumerate(zip(p.bounds, p.sizes)):
            blocks[r * m : r * m + s] = x_full[a : a + s]
    out = x_full.new_empty((m, *x_full.shape[1:]))
    _reduce_scatter(out, blocks, group=p.group)
    return out[: p.n_owned]


class _GatherNodes(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_owned, partition):
        ctx.partition = partition
        return gather_rows(x_owned.detach(), partition)

    @staticmethod
    def backward(ctx, grad_full):
        return _ScatterToOwners.apply(grad_full, ctx.partition), None


class _ScatterToOwners(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_full, partition):
        ctx.partition = partition
        return reduce_scatter_rows(x_full.detach(), partition)

    @staticmethod
    def backward(ctx, grad_owned):
        return _GatherNodes.apply(grad_owned, ctx.partition), None
