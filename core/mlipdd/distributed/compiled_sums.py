"""Per-system sums over ranks INSIDE a compiled forward: ``compile=True`` at several ranks
for a wrapper with its own forward whose per-system sums go through `system_sum` (AIMNet2:
its charge equilibration sums every system's charges in every pass).

Under `mlipdd.distributed.compiled_halo` each rank compiles its plain ``[owned | ghost]``
rows (padded to caps) with a ghost shell deep enough for every owned atom's energy. A
per-system sum of those rows would count the ghost copies and miss the other ranks'
atoms; `system_sum` sums the OWNED rows (the ``OWNED_ROWS`` node field: 1 owned, 0 ghost;
padding atoms count in their own padding system) and completes the sum over ranks with
functional collectives traced into the graph (a reduce-scatter then an all-gather: every
rank gets the same bits; the backward is their adjoints, an all-reduce of the gradients).
Every rank calls the sums in the same order (the same code on every rank; NOTE
[collective order] in mlipdd.shard.exchange).

# NOTE [replicated seed]
The wrapper differentiates its energy itself, on every rank, seeding 1 on the replicated
total. With every per-system sum's backward an all-reduce of the gradients, each path from
the energy to a row is then counted once per rank: what a rank's backward gives is exactly
``world_size`` times its share of the forces (and of the strain derivative), whether the
path goes through the rows of this rank or through a replicated value (a total charge read
by every atom). The caller divides them by ``world_size`` (`CompiledHaloCall`); the energy
itself is already the replicated total. Exact only if every value on a path from the rows
to the energy that is not a row is such a sum or computed from them on every rank alike,
which the wrapper promises by declaring ``system_sums_over_ranks``; the first call at each
new set of shapes is compared with the eager distributed forward (NOTE [caught, not
silently wrong] in compiled_halo).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc

from mlipdd.comm import group_size

__all__ = ["OWNED_ROWS", "summing_over_ranks", "system_sum"]

OWNED_ROWS = "_mlipdd_owned"  # 1 on owned (and padding) rows, 0 on ghost rows; float: not an integer input


class _Ranks:
    """What the compiled region reads (a plain object dynamo guards on like a global)."""

    def __init__(self):
        self.group = None
        self.size = 1


RANKS = _Ranks()


@contextlib.contextmanager
def summing_over_ranks(group):
    """`system_sum` completes its sums over ``group``'s ranks inside this block."""
    RANKS.size = group_size(group)
    RANKS.group = (group if group is not None else dist.group.WORLD) if RANKS.size > 1 else None
    try:
        yield
    finally:
        RANKS.group, RANKS.size = None, 1


def system_sum(x: torch.Tensor, index: torch.Tensor, num_systems: int, owned: torch.Tensor | None = None) -> torch.Tensor:
    """Sum of ``x``'s rows per system (``index``: each row's system). With ``owned``
    (`OWNED_ROWS`, handed to the model by the compiled path at several ranks) the owned
    rows only, summed over the ranks of `summing_over_ranks`: the whole system's sum,
    replicated on every rank (NOTE [replicated seed])."""
    if owned is not None:
        x = x * owned.to(x.dtype).view(-1, *([1] * (x.dim() - 1)))
    out = torch.zeros((num_systems, *x.shape[1:]), dtype=x.dtype, device=x.device)
    # an out-of-place scatter_add, as `mlipdd.models.base.per_system_sum`: on the eager
    # distributed path (no ``owned``) the ShardTensor dispatch completes it over ranks
    out = out.scatter_add(0, index.to(torch.long).view(-1, *([1] * (x.dim() - 1))).expand_as(x), x)
    if owned is None or RANKS.size == 1:
        return out
    return _all_reduce(out)


def _all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum over ranks, differentiable and traceable: reduce-scatter, all-gather."""
    flat = x.reshape(-1)
    n, size = flat.shape[0], RANKS.size
    pad = (-n) % size
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    part = fc.reduce_scatter_tensor_autograd(flat, "sum", 0, RANKS.group)
    return fc.all_gather_tensor_autograd(part, 0, RANKS.group)[:n].reshape(x.shape)
