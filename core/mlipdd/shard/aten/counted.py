"""Means and variances over distributed rows, written above autograd as sums and a global count.

# NOTE [aten means]
Below autograd a mean cannot be exact: autograd records ``aten::mean`` and differentiates
it by ITS formula, which divides the gradient by the element count of the tensor it saw,
the wrapper's LOCAL count (this rank's rows, `mlipdd.shard.aten.tensor`). No rule under
``__torch_dispatch__`` can correct a gradient it never sees as a mean's. So the mean, the
variance and the standard deviation are taken one level up, in a torch-function mode the
spatial strategies enter around the model's forward (`SpatialStrategy.model_scope`): when
they reduce over a tensor's row dimension they become what one process computes, spelled
with ops that have exact rules:

    mean = x.sum(dims) / N,   var = ((x - mean(keepdim)) ** 2).sum(dims) / max(N - correction, 0)

``N`` is the GLOBAL count of the reduced entries: atoms counted once each (their owned
rows, every rank's; cached by the forward's `HaloContext`) or edge rows (an all_reduce of
this rank's count each time: rows kept by a mask differ between calls), times the sizes
of the other reduced dims. The division by ``N`` is `_OverCount`, one autograd node whose
gradient divides by the same ``N``; every other step's gradient comes from the rules.
Reductions over other dims, and every other function, pass through untouched. An
``aten::mean`` that still reaches the dispatch over the rows came from inside a composite
op (a decomposition below the torch-function level): the reduction rule refuses it.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from mlipdd.shard.aten import comm
from mlipdd.shard.aten.contraction_order import ordered_contraction
from mlipdd.shard.aten.one_row_einsum import (
    einsum_operands,
    holds_a_single_row,
    one_row_einsum,
    parse,
)
from mlipdd.shard.aten.placement import Rows
from mlipdd.shard.aten.tensor import ShardTensor

Tensor = torch.Tensor
_MEANS = {torch.mean, Tensor.mean}
_SPREADS = {torch.var: "var", Tensor.var: "var", torch.std: "std", Tensor.std: "std",
            torch.var_mean: "var_mean", torch.std_mean: "std_mean"}


class CountedReductions(TorchFunctionMode):
    """NOTE [aten means]; active around the model's forward. It also spells an einsum on a
    rank holding a single row shape-stably (NOTE [a single row] in `one_row_einsum`) and
    contracts products over rows in one order on every rank (NOTE [contraction order])."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.einsum:  # NOTE [a single row] in mlipdd.shard.aten.one_row_einsum
            call = einsum_operands(args, kwargs)
            if call is not None and holds_a_single_row(call[1]):
                spelled = parse(*call)
                if spelled is not None:
                    return one_row_einsum(*spelled, call[1])
        if func is Tensor.__getitem__ and _a_row_by_number(args):
            # NOTE [a row by its global number]: torch checks x[i] against the LOCAL size
            # before the dispatch (a rank owning no atom: IndexError); torch.select does not
            return torch.select(args[0], args[0]._place.dim, args[1])
        if (func in _MEANS or func in _SPREADS) and args and _counted(args[0]):
            x = args[0]
            if func in _MEANS:
                dims, keepdim, dtype = _mean_args(args[1:], kwargs)
                if _over_rows(x, dims) and (dtype is not None or x.is_floating_point()):
                    return _mean(x, dims, keepdim, dtype)
            else:
                dims, correction, keepdim = _spread_args(args[1:], kwargs)
                if _over_rows(x, dims) and x.is_floating_point():
                    return _spread(_SPREADS[func], x, dims, correction, keepdim)
        ordered = ordered_contraction(func, args, kwargs)  # NOTE [contraction order]
        return func(*args, **kwargs) if ordered is NotImplemented else ordered


def _a_row_by_number(args) -> bool:
    """``x[i]`` with a Python int ``i`` on atom rows along dim 0 (the select rule's case)."""
    return len(args) == 2 and type(args[1]) is int and _counted(args[0]) and args[0]._place.dim == 0 \
        and args[0]._place.is_atoms()


def _counted(x) -> bool:
    return isinstance(x, ShardTensor) and isinstance(x._place, Rows)


def _mean_args(rest, kwargs):
    """``mean(x, dim=None, keepdim=False, *, dtype=None)`` (``out=`` left to torch)."""
    if "out" in kwargs:
        return None, False, None
    dims = rest[0] if rest else kwargs.get("dim")
    keepdim = rest[1] if len(rest) > 1 else kwargs.get("keepdim", False)
    return _dim_list(dims), keepdim, kwargs.get("dtype")


def _spread_args(rest, kwargs):
    """``var(x, dim=None, *, correction=1, keepdim=False)`` and the legacy
    ``var(x, unbiased)`` / ``var(x, dim, unbiased, keepdim)``."""
    rest = list(rest)
    unbiased = kwargs.get("unbiased")
    if rest and isinstance(rest[0], bool):
        unbiased = rest.pop(0)
        dims = None
    else:
        dims = rest.pop(0) if rest else kwargs.get("dim")
        if rest and isinstance(rest[0], bool) and len(rest) > 1:  # (dim, unbiased, keepdim)
            unbiased = rest.pop(0)
    keepdim = rest[0] if rest else kwargs.get("keepdim", False)
    correction = kwargs.get("correction")
    if correction is None:
        correction = 1 if unbiased is None else int(unbiased)
    return _dim_list(dims), correction, keepdim


def _dim_list(dims):
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return None
    return [dims] if isinstance(dims, int) else list(dims)


def _over_rows(x, dims) -> bool:
    return dims is None or x._place.dim in {d % max(x.dim(), 1) for d in dims}


def _count(x, dims) -> int:
    """The global number of entries a reduction of ``x`` over ``dims`` takes (NOTE [aten means])."""
    p, ctx = x._place, x._ctx
    reduced = range(x.dim()) if dims is None else {d % max(x.dim(), 1) for d in dims}
    others = 1
    for d in reduced:
        if d != p.dim:
            others *= x.shape[d]
    if p.is_atoms():
        rows = ctx.global_count("atoms") * p.group
    else:  # every rank asks at the same op (each runs the model's ops in order)
        rows = comm.global_count(x.shape[p.dim], ctx.group)
    return rows * others


def _mean(x, dims, keepdim, dtype):
    total = x.sum(dim=dims, keepdim=keepdim, dtype=dtype)
    return _OverCount.apply(total, _count(x, dims))


def _spread(kind, x, dims, correction, keepdim):
    mean = _mean(x, dims, True, None)
    deviation = x - mean
    var = _OverCount.apply((deviation * deviation).sum(dim=dims, keepdim=keepdim), max(_count(x, dims) - correction, 0))
    out = var.sqrt() if kind.startswith("std") else var
    if kind.endswith("_mean"):
        return out, mean if keepdim else mean.squeeze(dims if dims is not None else list(range(x.dim())))
    return out


class _OverCount(torch.autograd.Function):
    """``total / count`` for a replicated total and a global count, as one node: a division
    by a plain number would meet the dispatch's check of numbers that equal this rank's
    local counts (NOTE [aten counts]), which a global count may match by chance."""

    @staticmethod
    def forward(fctx, total, count):
        fctx.count = count
        return _divided(total, count)

    @staticmethod
    def backward(fctx, grad):
        return _OverCount.apply(grad, fctx.count), None


def _divided(t, count):
    if isinstance(t, ShardTensor):
        return ShardTensor(t._local / count, t._place, t._ctx, t._origin)
    return t / count
