"""Reductions: over other dims row-local; over the rows a local sum + all_reduce.

# NOTE [aten reductions]
At the aten level a sum over the rows has one spelling (``aten.sum.dim_IntList``,
``aten.sum.default``), however the model wrote it: ``x.sum(0)``, ``x.t().sum(1)``,
``x.flatten().sum()``, ``torch.einsum("ni->i", x)``. The rule sums the rows that count
each atom or edge once (`valid_rows`), this rank's share of the sum, and all-reduces it
at once into `Replicate`. Its gradient is an ``expand`` of a replicated value, uniform over
the rows, which every rule reads as rows (NOTE [aten gradients]).

Means, variances and standard deviations over the rows are taken above autograd (NOTE
[aten means] in `mlipdd.shard.aten.counted`): their autograd formulas divide by the
LOCAL element count (``self.sym_numel()`` of the wrapper, which holds this rank's rows),
a wrong gradient no rule below autograd can correct. One that reaches this level over
the rows came from inside a composite op and is refused; so are the reductions over the
rows that have no cross-rank rule (median, mode, cumsum, softmax, ...), each by name.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mlipdd.shard.aten import comm
from mlipdd.shard.aten.placement import REPLICATE, SHARES, Rows
from mlipdd.shard.aten.rules import as_owned, finish, refuse, rule, run_local, valid_rows
from mlipdd.shard.aten.tensor import ShardTensor

aten = torch.ops.aten


def _dims(x, dims):
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return list(range(x.dim()))
    if isinstance(dims, int):
        dims = [dims]
    return sorted({d % max(x.dim(), 1) for d in dims})


def _kept(p: Rows, dims, keepdim: bool) -> Rows:
    return p if keepdim else p.moved(p.dim - sum(1 for d in dims if d < p.dim))


def _identity_rows(local: torch.Tensor, row_dim: int, kind: str) -> torch.Tensor:
    """One row of max's (min's) identity in place of none: a rank that holds none of the rows
    still joins the all_reduce, which the identity leaves to the other ranks' values."""
    shape = list(local.shape)
    shape[row_dim] = 1
    if local.dtype == torch.bool:
        fill = kind == "min"
    elif local.is_floating_point():
        fill = -torch.inf if kind == "max" else torch.inf
    else:
        info = torch.iinfo(local.dtype)
        fill = info.min if kind == "max" else info.max
    return local.new_full(shape, fill)


def _over_rows(func, args, kwargs, local, op):
    x = args[0]
    kind = _KIND[func.overloadpacket]
    row_dim = x._place.dim
    if kind != "sum" and local.dim() > row_dim and local.shape[row_dim] == 0:
        local = _identity_rows(local, row_dim, kind)
    part = op(local)
    reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[kind]
    return finish(func, args, comm.all_reduce(part, x._ctx.group, reduce_op), REPLICATE, x._ctx)


_KIND = {aten.sum: "sum", aten.amax: "max", aten.amin: "min", aten.max: "max", aten.min: "min",
         aten.linalg_vector_norm: "sum"}


@rule(aten.sum.dim_IntList, aten.sum.default, aten.amax.default, aten.amin.default, aten.max.default,
      aten.min.default)
def sum_like(func, args, kwargs):
    x = args[0]
    p = x._place
    dims = _dims(x, args[1] if len(args) > 1 else kwargs.get("dim"))
    keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
    if p.dim not in dims:
        local = x._local
        if p.kind == SHARES and func.overloadpacket is not aten.sum:  # max of shares is not a share
            local = as_owned(x)
            p = p.as_kind("atoms-owned")
        out = func(local, *args[1:], **kwargs)
        return finish(func, args, out, _kept(p, dims, keepdim), x._ctx)
    local = x._local if func.overloadpacket is aten.sum else as_owned(x)
    rows = valid_rows(local, p if func.overloadpacket is aten.sum else p.as_kind("atoms-owned") if p.is_atoms() else p,
                      x._ctx)
    return _over_rows(func, args, kwargs, rows, lambda r: func(r, *args[1:], **kwargs))


@rule(aten.linalg_vector_norm.default)
def vector_norm(func, args, kwargs):
    x = args[0]
    p = x._place
    ord_ = args[1] if len(args) > 1 else kwargs.get("ord", 2)
    dims = _dims(x, args[2] if len(args) > 2 else kwargs.get("dim"))
    keepdim = args[3] if len(args) > 3 else kwargs.get("keepdim", False)
    if p.dim not in dims:
        local = as_owned(x) if p.kind == SHARES else x._local
        kind = "atoms-owned" if p.kind == SHARES else p.kind
        return finish(func, args, run_local(func, (local, *args[1:]), kwargs), _kept(p.as_kind(kind), dims, keepdim), x._ctx)
    if ord_ != 2:
        refuse(func, args, kwargs, f"a norm of order {ord_} over the rows", "use the 2-norm, or a sum over the rows")
    rows = valid_rows(as_owned(x), p.as_kind("atoms-owned") if p.is_atoms() else p, x._ctx)
    squares = (rows * rows.conj()).real.sum(dim=dims, keepdim=keepdim)
    total = comm.all_reduce(squares, x._ctx.group)
    return finish(func, args, total.sqrt().to(x.dtype), REPLICATE, x._ctx)


@rule(aten.mean.dim, aten.mean.default, aten.var.correction, aten.std.correction, aten.var_mean.correction,
      aten.std_mean.correction, aten.prod.dim_int, aten.prod.default, aten.cumsum.default, aten.cumprod.default,
      aten.argmax.default,
      aten.argmin.default, aten.max.dim, aten.min.dim, aten.median.dim, aten.median.default, aten.nanmedian.dim,
      aten.nanmedian.default, aten.mode.default, aten.count_nonzero.dim_IntList,
      aten.count_nonzero.default, aten.nansum.default, aten.nanmean.default, aten.cummax.default,
      aten.cummin.default, aten.logcumsumexp.default)
def other_reduction(func, args, kwargs):
    """Row-local along the other dims; refused over the rows (NOTE [aten reductions]). Also
    the other-dims case of softmax and logsumexp (`mlipdd.shard.aten.softmax`)."""
    x = args[0]
    p = x._place
    name = func.overloadpacket.__name__
    if len(args) > 1 and not isinstance(args[1], (bool, torch.Tensor)) and args[1] is not None:  # softmax bwd: below
        dims = _dims(x, args[1])
    elif "dim" in kwargs and kwargs["dim"] is not None:
        dims = _dims(x, kwargs["dim"])
    else:
        dims = list(range(x.dim()))
    if name.startswith(("_softmax_backward", "_log_softmax_backward")):
        dims = [args[2] % x.dim()]
    if p.dim in dims:
        if name in ("mean", "var", "std", "var_mean", "std_mean"):
            refuse(func, args, kwargs, f"`{name}` over the row dimension inside a composite op (torch.{name} "
                   "itself is taken above autograd, NOTE [aten means]; this one was reached below it, where its "
                   "gradient would divide by this rank's local count)",
                   f"call torch.{name} / x.{name} on the rows directly, or write the step from sums over the rows "
                   "(x.sum(0)) divided by a count that is a sum over the rows too (torch.ones_like(x).sum(0))")
        refuse(func, args, kwargs, f"`{name}` over the row dimension has no cross-rank rule: its value needs "
               "every rank's rows at once", "write it from sums, maxima or minima over the rows (x.sum(0), "
               "x.amax(0)) and row-local math, or compute it per system with index_add / scatter_add by the "
               "system index")
    local = as_owned(x) if p.kind == SHARES else x._local
    kind = "atoms-owned" if p.kind == SHARES else p.kind
    out = run_local(func, (local, *args[1:]), kwargs)
    keepdim = kwargs.get("keepdim", False) or (len(args) > 2 and args[2] is True)
    if name.startswith(("_softmax", "_log_softmax")) or name in ("cumsum", "cumprod", "cummax", "cummin", "logcumsumexp"):
        place = p.as_kind(kind)
    else:
        place = _kept(p.as_kind(kind), dims, keepdim)
    place = place.plain_values() if isinstance(place, Rows) else place
    if isinstance(out, (tuple, list)):
        if name in ("max", "min", "median") and len(out) == 2:  # values and indices of the other dims
            return type(out)(ShardTensor(o, place, x._ctx, name) for o in out)
        return type(out)(ShardTensor(o, place, x._ctx, name) for o in out)
    return finish(func, args, out, place, x._ctx)


@rule(aten.any.default, aten.any.dim, aten.any.dims, aten.all.default, aten.all.dim, aten.all.dims)
def any_all(func, args, kwargs):
    """``bool((index < 0).any())``: over the rows an all_reduce of the local answer."""
    x = args[0]
    p = x._place
    dims = _dims(x, args[1] if len(args) > 1 else kwargs.get("dim"))
    keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
    local = as_owned(x) if p.kind == SHARES else x._local
    if p.dim not in dims:
        return finish(func, args, func(local, *args[1:], **kwargs), _kept(p.as_kind(p.kind if p.kind != SHARES else "atoms-owned"), dims, keepdim), x._ctx)
    rows = valid_rows(local, p.as_kind("atoms-owned") if p.is_atoms() else p, x._ctx)
    part = func(rows, *args[1:], **kwargs).to(torch.uint8)
    op = dist.ReduceOp.MAX if func.overloadpacket is aten.any else dist.ReduceOp.MIN
    return finish(func, args, comm.all_reduce(part, x._ctx.group, op).bool(), REPLICATE, x._ctx)


@rule(aten.native_layer_norm.default)
def layer_norm(func, args, kwargs):
    """Normalisation over trailing feature dims: row-local (its mean and rstd per row)."""
    x, shape = args[0], args[1]
    p = x._place
    if p.dim >= x.dim() - len(shape):
        refuse(func, args, kwargs, "a layer norm over the row dimension", "normalise over features only")
    local = as_owned(x) if p.kind == SHARES else x._local
    kind = "atoms-owned" if p.kind == SHARES else p.kind
    out = func(local, *[a._local if isinstance(a, ShardTensor) else a for a in args[1:]], **kwargs)
    place = p.as_kind(kind).plain_values()
    return tuple(ShardTensor(o, place, x._ctx, "aten::native_layer_norm") for o in out)


@rule(aten.native_layer_norm_backward.default)
def layer_norm_backward(func, args, kwargs):
    """The input's gradient per row; the weight's and bias's gradients are sums over the
    rows that count once, all-reduced."""
    grad, x, shape, mask = args[0], args[1], args[2], args[7]
    gp, xp = grad._place, x._place
    ctx = x._ctx
    plain = [a._local if isinstance(a, ShardTensor) else a for a in args[:-1]]
    g_local = as_owned(grad) if gp.kind == SHARES else grad._local
    plain[0] = g_local
    grad_input, _, _ = func(*plain, [mask[0], False, False])
    rows = [valid_rows(t, xp.as_kind("atoms-owned") if xp.is_atoms() else xp, ctx) if t is not None else None
            for t in (plain[0], plain[1], plain[3], plain[4])]
    _, grad_weight, grad_bias = func(rows[0], rows[1], shape, rows[2], rows[3], plain[5], plain[6],
                                     [False, mask[1], mask[2]])
    place = xp.as_kind("atoms-owned" if xp.kind == SHARES else xp.kind).plain_values()
    out_in = ShardTensor(grad_input, place, ctx, "aten::native_layer_norm_backward") if grad_input is not None else None
    reps = [ShardTensor(comm.all_reduce(g, ctx.group), REPLICATE, ctx, "aten::native_layer_norm_backward")
            if g is not None else None for g in (grad_weight, grad_bias)]
    return (out_in, *reps)
