"""Softmax, log-softmax and logsumexp over the rows: a global maximum and a global sum.

# NOTE [aten softmax over rows]
``softmax(x, dim=rows)`` is ``exp(x - m) / s`` with ``m`` the maximum over every rank's
rows (an all_reduce MAX) and ``s`` the sum of ``exp(x - m)`` over them (an all_reduce
SUM), each atom counted once (`valid_rows`); both are replicated, so every local row,
a ghost copy too, gets its global value. ``logsumexp`` is ``m + log(s)``. Their autograd
formulas need no count: logsumexp's is row-local (``grad * exp(x - result)``), and the
softmax ones are the two ``*_backward_data`` ops, each a sum over the rows (all-reduced)
and row-local math. Along other dims the ops stay row-local (`other_reduction`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mlipdd.shard.aten import comm
from mlipdd.shard.aten.placement import EDGES, GHOSTED, OWNED, REPLICATE, SHARES, Rows
from mlipdd.shard.aten.reductions import _dims, other_reduction
from mlipdd.shard.aten.rules import (
    as_owned,
    finish,
    refuse,
    rows_of,
    rule,
    uniform_along,
    valid_rows,
)
from mlipdd.shard.aten.tensor import unwrap

aten = torch.ops.aten


def _complete(x):
    """x's local rows with every owned row complete (shares summed), its kind, and the rows
    that count each atom or edge once."""
    p = x._place
    local = as_owned(x) if p.kind == SHARES else x._local
    kind = OWNED if p.kind == SHARES else p.kind
    return local, kind, valid_rows(local, p.as_kind(kind), x._ctx)


def _global_max(valid, dims, group):
    """The maximum over ``dims`` of every rank's valid rows (keepdim), -inf where a rank has
    none; infinite maxima taken as 0, as torch does, so ``x - m`` stays finite."""
    if valid.numel() == 0:
        shape = [1 if d in dims else s for d, s in enumerate(valid.shape)]
        part = valid.new_full(shape, float("-inf"))
    else:
        part = valid.amax(dim=dims, keepdim=True)
    m = comm.all_reduce(part.contiguous(), group, dist.ReduceOp.MAX)
    return torch.where(torch.isinf(m), torch.zeros_like(m), m)


def _stats(x, dims):
    local, kind, valid = _complete(x)
    m = _global_max(valid, dims, x._ctx.group)
    s = comm.all_reduce((valid - m).exp().sum(dim=dims, keepdim=True), x._ctx.group)
    return local, kind, m, s


def _atom_kind(kind):
    return OWNED if kind == SHARES else kind


@rule(aten._softmax.default, aten._log_softmax.default)
def softmax(func, args, kwargs):
    x, dim, half_to_float = args[0], args[1] % args[0].dim(), args[2]
    p = x._place
    if dim != p.dim:
        return other_reduction(func, args, kwargs)
    local, kind, m, s = _stats(x, [dim])
    out = local - m - s.log() if func is aten._log_softmax.default else (local - m).exp() / s
    if half_to_float:
        out = out.float()
    return finish(func, args, out, Rows(p.dim, kind, p.group), x._ctx)


@rule(aten.logsumexp.default)
def logsumexp(func, args, kwargs):
    x = args[0]
    p = x._place
    dims = _dims(x, args[1] if len(args) > 1 else kwargs.get("dim"))
    keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
    if p.dim not in dims:
        return other_reduction(func, args, kwargs)
    _, _, m, s = _stats(x, dims)
    out = m + s.log()
    if not keepdim:
        out = out.squeeze(dims)
    return finish(func, args, out, REPLICATE, x._ctx)


@rule(aten._softmax_backward_data.default, aten._log_softmax_backward_data.default)
def softmax_backward(func, args, kwargs):
    """grad_input of softmax: ``y * (g - sum(g * y))``; of log-softmax: ``g - exp(y) * sum(g)``,
    the sums over every rank's rows (NOTE [aten softmax over rows])."""
    grad, output, dim = args[0], args[1], args[2] % args[1].dim()
    yp = rows_of(output)
    if yp is None or dim != yp.dim:
        return other_reduction(func, args, kwargs)
    gp = rows_of(grad)
    if gp is None and not uniform_along(grad, dim):
        refuse(func, args, kwargs, "the gradient is a replicated tensor with its own value per row")
    if gp is not None and (gp.dim != yp.dim or gp.is_atoms() != yp.is_atoms() or gp.group != yp.group):
        refuse(func, args, kwargs, "the gradient and the output hold different rows")
    ctx = output._ctx
    y = output._local
    g, g_kind = (as_owned(grad), _atom_kind(gp.kind)) if gp is not None else (unwrap(grad), None)
    kinds = {yp.kind} | ({g_kind} if g_kind else set())
    kind = EDGES if not yp.is_atoms() else GHOSTED if kinds == {GHOSTED} else OWNED
    counted = yp.as_kind(OWNED) if yp.is_atoms() else yp
    log = func is aten._log_softmax_backward_data.default
    weighted = g.expand_as(y) if log else g * y
    total = comm.all_reduce(valid_rows(weighted, counted, ctx).sum(dim, keepdim=True), ctx.group)
    out = g - y.exp() * total if log else y * (g - total)
    return finish(func, args, out.to(args[3]), Rows(yp.dim, kind, yp.group), ctx)
