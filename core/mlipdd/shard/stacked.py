"""Row tensors stacked along a new leading dim, and back.

# NOTE [stacked rows]
Every rule reads dim 0 of a ShardTensor as its rows. ``torch.stack([a, b], dim=0)`` of
two row tensors breaks that: dim 0 then counts the stacked tensors (mace stacks its
per-layer node energies and sums them with ``torch.sum(..., dim=0)``). Left as rows,
that count would be compared with the row counts, and on a rank that happens to own
exactly as many atoms as there are stacked tensors the sum would be taken for a sum
over atoms, an all_reduce the other ranks never join. So the stack is marked
`Stacked` (rows along dim 1; dim 0 is never rows), and the ops that remove dim 0 again
(a sum or mean over it, ``x[i]``, ``unbind``) give rows of the source layout back; a
whole sum is the sum over the stack, then the rows' own sum rule. Any other op on a
stacked tensor (``permute(1, 0, 2)``, ``* 2``, a reshape) sees rows of the source layout
again, exactly as before the mark existed: the mark settles the one ambiguous case, a
reduction over the stack, and changes nothing else.
Whether a tensor is stacked is decided by how it was made, the same on every rank.
"""

from __future__ import annotations

import dataclasses

import torch

from mlipdd.shard.layouts import Layout, Stacked
from mlipdd.shard.registry import ANY_OP, register
from mlipdd.shard.tensor import ShardTensor, local, promote
from mlipdd.shard.tensor import _iter_tensors as _tensors


def _stack_dim(args, kwargs) -> int:
    return args[1] if len(args) > 1 else kwargs.get("dim", 0)


def _stacks_rows(func, meta, args, kwargs) -> bool:
    tensors = args[0] if args else kwargs.get("tensors", ())
    return (
        _stack_dim(args, kwargs) == 0
        and len(tensors) > 0
        and all(isinstance(t, ShardTensor) and t.meta.layout.rows_lead()
                and not t.meta.layout.is_replicated() and t.dim() > 0 for t in tensors)
    )


@register(Layout, torch.stack, name="stack_rows", predicate=_stacks_rows,
          doc="torch.stack of row tensors along dim 0: the result is Stacked (rows along dim 1).")
def stack_rows(func, meta, args, kwargs):
    with torch._C.DisableTorchFunctionSubclass():
        out = func([local(t) for t in args[0]], *args[1:], **kwargs)
    return ShardTensor.wrap(out, dataclasses.replace(meta, layout=Stacked(source=meta.layout)))


_REDUCE_DIM0 = (torch.sum, torch.Tensor.sum, torch.mean, torch.Tensor.mean)


def _removes_stack_dim(func, meta, args, kwargs) -> bool:
    x = args[0] if args else kwargs.get("input")
    if not (isinstance(x, ShardTensor) and isinstance(x.meta.layout, Stacked)):
        return False
    if func in _REDUCE_DIM0:
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        whole_sum = dim is None and func in (torch.sum, torch.Tensor.sum) and not kwargs
        return whole_sum or (dim in (0, -x.dim()) and not kwargs.get("keepdim", False))
    if func in (torch.unbind, torch.Tensor.unbind):
        return (args[1] if len(args) > 1 else kwargs.get("dim", 0)) == 0
    return func is torch.Tensor.__getitem__ and isinstance(args[1], int)


@register(Stacked, *_REDUCE_DIM0, torch.unbind, torch.Tensor.unbind, torch.Tensor.__getitem__,
          name="unstack_rows", predicate=_removes_stack_dim,
          doc="A sum/mean over, index into, or unbind of a Stacked tensor's dim 0: rows again.")
def unstack_rows(func, meta, args, kwargs):
    if func in (torch.sum, torch.Tensor.sum) and len(args) == 1 and not kwargs:
        return torch.sum(torch.sum(args[0], dim=0))  # a whole sum: over the stack, then the rows' rule
    rows = dataclasses.replace(meta, layout=meta.layout.source)
    plain = [local(a) for a in args]
    with torch._C.DisableTorchFunctionSubclass():
        out = func(*plain, **kwargs)
    return promote(out, rows)


def _as_source_rows(a):
    if isinstance(a, ShardTensor) and isinstance(a.meta.layout, Stacked):
        return ShardTensor.wrap(local(a), dataclasses.replace(a.meta, layout=a.meta.layout.source))
    if isinstance(a, (tuple, list)):
        return type(a)(_as_source_rows(x) for x in a)
    return a


def _has_stacked(func, meta, args, kwargs) -> bool:
    return any(isinstance(t, ShardTensor) and isinstance(t.meta.layout, Stacked) for t in _tensors(args, kwargs))


@register(Stacked, ANY_OP, name="stacked_as_rows", predicate=_has_stacked,
          doc="Any other op on a Stacked tensor: it is rows of its source layout again (dispatched anew).")
def stacked_as_rows(func, meta, args, kwargs):
    args = tuple(_as_source_rows(a) for a in args)
    kwargs = {k: _as_source_rows(v) for k, v in kwargs.items()}
    return func(*args, **kwargs)  # through the source layout's own rules
