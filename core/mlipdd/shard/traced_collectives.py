"""The graph-partition collectives as ``torch.compile`` can trace them.

`mlipdd.shard.graph_partition`'s helpers call ``torch.distributed`` directly inside
``autograd.Function``s and read the active partition from a ``ContextVar``; dynamo can
trace neither (a ``ContextVar.get`` is a graph break, and a c10d call in Python runs
eagerly between graphs). Under ``torch.compile`` the helpers come here instead:

* the partition is read from `traced_partition`'s holder, a plain object dynamo reads
  (and guards on) like any global, set by the compiled call around it;
* the collectives are ``torch.distributed._functional_collectives``, which return new
  tensors and have traceable autograd formulas (all-gather <-> reduce-scatter), so the
  exchanges land INSIDE the compiled forward and its force backward, in the order the
  model calls them on every rank (NOTE [collective order] in graph_partition).

# NOTE [traced adjoints]
The adjoints are the eager helpers' (NOTE [gather adjoint]): gathering the owned rows
has a reduce-scatter backward, and ``sum_over_ranks`` an identity backward (each rank
differentiates the replicated total once; its own partial enters it once), written as
``all_reduce(partial) + (partial - partial)`` with the all-reduce outside autograd (the
value is the all-reduce's, bit for bit).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc

__all__ = ["TracedPartition", "traced_gather", "traced_partition", "traced_reduce_scatter", "traced_sum"]


class TracedPartition:
    """What the compiled region reads: the partition (the same object for the whole run,
    so dynamo's guards on it hold), the resolved group and whether the model asked."""

    def __init__(self):
        self.partition = None
        self.group = None
        self.asked = False


HOLDER = TracedPartition()


@contextlib.contextmanager
def traced_partition(partition):
    """Publish ``partition`` to the traced helpers for one compiled call; yields the holder
    (``asked`` tells whether the model read the partition)."""
    HOLDER.partition = partition
    HOLDER.group = partition.group if partition.group is not None else dist.group.WORLD
    HOLDER.asked = False
    try:
        yield HOLDER
    finally:
        HOLDER.partition = None


def _padded(p) -> int:
    return max(p.sizes)


def traced_gather(x_owned: torch.Tensor, p) -> torch.Tensor:
    """Every rank's owned rows in rank order; blocks padded to the largest (NOTE [padded blocks])."""
    m = _padded(p)
    pad = x_owned.new_zeros((m - p.n_owned, *x_owned.shape[1:]))
    blocks = fc.all_gather_tensor_autograd(torch.cat([x_owned, pad]), 0, HOLDER.group)
    if all(s == m for s in p.sizes):
        return blocks
    return torch.cat([blocks[r * m: r * m + s] for r, s in enumerate(p.sizes)])


def traced_reduce_scatter(x_full: torch.Tensor, p) -> torch.Tensor:
    """The sum over ranks of a full-rows tensor, this rank's owned block."""
    m = _padded(p)
    if all(s == m for s in p.sizes):
        blocks = x_full
    else:
        parts = []
        for a, s in zip(p.bounds, p.sizes):
            parts += [x_full[a: a + s], x_full.new_zeros((m - s, *x_full.shape[1:]))]
        blocks = torch.cat(parts)
    return fc.reduce_scatter_tensor_autograd(blocks, "sum", 0, HOLDER.group)[: p.n_owned]


def traced_sum(partial: torch.Tensor) -> torch.Tensor:
    """The partial summed over ranks, identity backward (NOTE [traced adjoints])."""
    total = fc.all_reduce(partial.detach(), "sum", HOLDER.group)
    return total + (partial - partial.detach())
