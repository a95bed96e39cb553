"""The collectives the aten rules issue, on plain local tensors (below autograd).

A rule runs inside ``__torch_dispatch__``, under autograd: autograd records the aten op
itself and differentiates it with its own formula, whose ops come back through the same
rules (the gradient of a GHOSTED read is a SHARES scatter, NOTE [aten gradients] in
`mlipdd.shard.aten.tensor`). So a rule only needs the forward half of each exchange:
the halo sends of `mlipdd.shard.exchange` and an all_reduce.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mlipdd.comm import group_size
from mlipdd.shard.exchange import _send_forward, _send_reverse
from mlipdd.shard.internal import internal


class OwnedRowsOnly:
    """The storage plan of sharded storage (NOTE [aten sharded storage]): every rank stores
    its owned rows and no ghost row, so converting between the atom kinds is the identity
    and sends nothing. Every rank of a sharded run holds one, so skipping the exchange is
    the same decision on all of them (collectives stay in step)."""

    n_ghost = 0

    def __init__(self, n_owned: int):
        self.n_owned = self.n_padded = n_owned


def _rows_first(fn, local: torch.Tensor, dim: int, plan, group: int = 1) -> torch.Tensor:
    """``fn`` on the rows moved to dim 0 (rows merged with ``group`` entries each: split)."""
    if isinstance(plan, OwnedRowsOnly):
        return local
    if group != 1:
        split = local.unflatten(dim, (local.shape[dim] // group, group))
        return _rows_first(fn, split, dim, plan).flatten(dim, dim + 1)
    if dim == 0:
        return fn(local, plan)
    return fn(local.movedim(dim, 0), plan).movedim(0, dim)


def _accumulate(local, plan):
    owned = local[: plan.n_owned]
    owned = owned + _send_reverse(local[plan.n_owned :], plan, owned)
    return torch.cat([owned, torch.zeros_like(local[plan.n_owned :])])


def _fill(local, plan):
    owned = local[: plan.n_owned]
    return torch.cat([owned, _send_forward(owned, plan)])


def _zero_ghosts(local, plan):
    return torch.cat([local[: plan.n_owned], torch.zeros_like(local[plan.n_owned :])])


@internal
def accumulate(local: torch.Tensor, dim: int, plan, group: int = 1) -> torch.Tensor:
    """SHARES -> owned rows complete, ghost rows zero (valid as OWNED and as SHARES)."""
    return _rows_first(_accumulate, local, dim, plan, group)


@internal
def fill(local: torch.Tensor, dim: int, plan, group: int = 1) -> torch.Tensor:
    """OWNED -> GHOSTED: every ghost row becomes its owner's row."""
    return _rows_first(_fill, local, dim, plan, group)


@internal
def zero_ghosts(local: torch.Tensor, dim: int, plan, group: int = 1) -> torch.Tensor:
    """GHOSTED/OWNED -> SHARES: the ghost rows' share is nothing."""
    return _rows_first(_zero_ghosts, local, dim, plan, group)


@internal
def fetch(local: torch.Tensor, dim: int, reads) -> torch.Tensor:
    """Sharded storage: owned rows -> ``[owned | request table]``, the rows an edge index
    names (each remote row sent by its owner: one all_to_all)."""
    return _rows_first(_fill, local, dim, reads)


@internal
def deliver(table: torch.Tensor, dim: int, reads) -> torch.Tensor:
    """Sharded storage: ``[owned | request table]`` sums -> owned rows, each request-table
    row sent to its owner and added there (one all_to_all; the adjoint of `fetch`)."""
    return _rows_first(_accumulate, table, dim, reads).narrow(dim, 0, reads.n_owned)


@internal
def all_reduce(local: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    from mlipdd.shard.aten.factories import clear_rank_local

    out = local.clone()
    if group_size(group) > 1:
        dist.all_reduce(out, op=op, group=group)
    clear_rank_local(out)  # NOTE [rank-local values]: the ranks' parts summed are the whole
    return out


@internal
def global_count(n: int, group) -> int:
    """A count summed over ranks (a host value: one small all_reduce)."""
    if group_size(group) == 1:
        return int(n)
    t = torch.tensor([int(n)], dtype=torch.long)
    dist.all_reduce(t, group=group)
    return int(t)
