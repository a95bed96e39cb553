"""A mean scattered into atom rows: ``scatter_reduce(..., "mean")``, ``index_reduce(..., "mean")``.

# NOTE [aten scatter means]
An atom's mean over its edges needs every rank's edges of that atom at once, but it is
a ratio of two sums, and sums into atom rows have an exact rule (NOTE [aten halo rules]):
the sum of the values and the count of the edges are scattered like ``index_add`` (shares
under halo storage, delivered to the owners under sharded storage), summed into their
owners, and divided there. ``include_self=True`` (torch's default) counts the target's own
row as one more value; ``include_self=False`` leaves a row no edge reaches as it was. The
result's owned rows are what one process computes; its ghost rows mean nothing (OWNED; a
later read by the edge index copies the owners onto them).

No gradient code: autograd differentiates the recorded op with torch's formula (counts
by ``index_add`` / ``scatter_add`` of ones, a division, a read by the index), whose ops
come back through the rules (NOTE [aten gradients]). Floating values only (torch rounds an
integer mean); other reductions into atom rows (amax, amin, prod) stay refused by name.
"""

from __future__ import annotations

import torch

from mlipdd.shard.aten.index_rules import _scatter, _SizeMismatch
from mlipdd.shard.aten.placement import GHOSTED, OWNED, SHARES, Rows
from mlipdd.shard.aten.rules import as_owned, finish, is_inplace, refuse, rows_of, rule
from mlipdd.shard.aten.tensor import ShardTensor, unwrap

aten = torch.ops.aten
_SUMS = {"scatter": aten.scatter_add.default, "index": aten.index_add.default}


@rule(aten.index_reduce.default, aten.index_reduce_.default)
def index_reduce(func, args, kwargs):
    target, dim, idx, src, reduce = args[0], args[1] % max(args[0].dim(), 1), args[2], args[3], args[4]
    include_self = kwargs.get("include_self", args[5] if len(args) > 5 else True)
    return _reduced(func, args, kwargs, target, dim, idx, src, reduce, include_self, "index")


def scatter_reduce(func, args, kwargs, target, dim, idx, src, reduce, include_self):
    """The mean of ``scatter_reduce`` (called by `mlipdd.shard.aten.index_rules.scatter_add`)."""
    return _reduced(func, args, kwargs, target, dim, idx, src, reduce, include_self, "scatter")


def _reduced(func, args, kwargs, target, dim, idx, src, reduce, include_self, spelling):
    name = func.overloadpacket.__name__.rstrip("_")
    ip = rows_of(idx)
    if reduce != "mean":
        refuse(func, args, kwargs, f"{name}(reduce={reduce!r}) into rows: a max, a min or a product needs every "
               "rank's values of an atom at once (only sums and means into atom rows have a rule)",
               f"use {spelling}_add (a sum), or reduce='mean' (a sum and a count)")
    if ip is None or ip.values != "atoms" or ip.dim != (dim if spelling == "scatter" else 0):
        refuse(func, args, kwargs, f"{name} by an index that is not the edge index along the scatter dimension",
               "scatter by the edge index (receiver / sender) into atom rows")
    if not target.is_floating_point():
        refuse(func, args, kwargs, f"{name}(reduce='mean') of integers (torch rounds each mean)",
               "scatter floating values")
    ctx = idx._ctx
    tp = rows_of(target)
    zeros = torch.zeros_like(unwrap(target))
    ones = ShardTensor(torch.ones_like(unwrap(src)), rows_of(src) or Rows(ip.dim, ip.kind), ctx, "ones")

    total = _summed(func, args, kwargs, zeros, dim, idx, src, spelling)
    count = _summed(func, args, kwargs, zeros, dim, idx, ones, spelling)
    own = as_owned(target) if tp is not None and tp.kind == SHARES else unwrap(target)
    if include_self:
        out = (own + total) / (count + 1)
    else:
        out = torch.where(count > 0, total / count.clamp(min=1), own)
    place = Rows(dim, GHOSTED if ctx.reads is not None else OWNED)
    if is_inplace(func):
        if not isinstance(target, ShardTensor):
            refuse(func, args, kwargs, f"an in-place {name} into a plain tensor", "write it out of place")
        target._local.copy_(out)
        return finish(func, args, target._local, place, ctx)
    return finish(func, args, out, place, ctx)


def _summed(func, args, kwargs, zeros, dim, idx, values, spelling):
    """``values`` summed into ``zeros`` (plain, this rank's atom rows) by the edge index,
    the owners' rows complete (NOTE [aten halo rules])."""
    local_sum = _SUMS[spelling]

    def op(t, i, s):
        return local_sum(t, dim, i, s)

    try:
        out = _scatter(local_sum, (zeros, dim, idx, values), {}, zeros, dim, idx, values, op)
    except _SizeMismatch as exc:
        refuse(func, args, kwargs, str(exc))
    return as_owned(out)


@rule(aten.index_fill.int_Scalar, aten.index_fill_.int_Scalar, aten.index_fill.int_Tensor,
      aten.index_fill_.int_Tensor)
def index_fill(func, args, kwargs):
    """``x.index_fill(0, receiver, v)``: every atom some rank's edge index names takes ``v``
    (the gradient of ``index_reduce(..., include_self=False)`` spells its untouched rows so).
    Which atoms are named is a count of the index's entries, summed into the owners."""
    x, dim, idx, value = args[0], args[1] % max(args[0].dim(), 1), args[2], args[3]
    xp, ip = rows_of(x), rows_of(idx)
    if xp is None or ip is None or ip.values != "atoms" or not xp.is_atoms() or xp.dim != dim or xp.group != 1 \
            or idx.dim() != 1 or rows_of(value) is not None:
        refuse(func, args, kwargs, "index_fill of rows by an index that is not the edge index into atom rows",
               "fill by a mask of the rows (torch.where(mask, v, x))")
    ctx = idx._ctx
    zeros = torch.zeros(x.shape[dim], dtype=torch.float64 if not x.is_floating_point() else x.dtype,
                        device=x.device)
    ones = ShardTensor(torch.ones(idx.shape[0], dtype=zeros.dtype, device=x.device), Rows(0, ip.kind), ctx, "ones")
    reached = _summed(func, args, kwargs, zeros, 0, idx, ones, "index") > 0
    reached = reached.view([-1 if d == dim else 1 for d in range(x.dim())])
    own = as_owned(x) if xp.kind == SHARES else x._local
    out = torch.where(reached, torch.as_tensor(unwrap(value), dtype=own.dtype, device=own.device), own)
    kind = xp.kind if xp.kind == GHOSTED and ctx.reads is not None else OWNED
    if is_inplace(func):
        x._local.copy_(out)
        return finish(func, args, x._local, Rows(dim, kind), ctx)
    return finish(func, args, out, Rows(dim, kind), ctx)
