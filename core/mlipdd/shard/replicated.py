"""Replicated values (one per system, identical on every rank) meeting per-rank rows.

# NOTE [replicated gradients]
A per-system reduction inside the forward (the Lagrange multiplier of charge
equilibration, a per-system mean) gives every rank the same value ``S``. Its uses are
of two kinds. A *replicated* use (the final energy, ``S * 2``) is computed identically
on every rank and seeded identically in the backward, so ``S``'s reduction passes the
gradient through unchanged. A *per-rank* use (``S[batch.batch]``, ``chi - S``) feeds
rows that only this rank holds, so each rank's backward sees only its share of
``dE/dS``; the shares must be summed over ranks. `to_rows` is that boundary: identity
forward, all_reduce backward. The dispatch inserts it wherever a replicated tensor
meets atom or edge rows, so a model never writes it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mlipdd.comm import group_size
from mlipdd.shard.layouts import Layout
from mlipdd.shard.placement import tensor_args as _tensors
from mlipdd.shard.registry import ANY_OP, register
from mlipdd.shard.tensor import ShardMeta, ShardTensor, local, promote


class _ReplicatedToRows(torch.autograd.Function):
    """Identity forward; backward sums the per-rank shares (NOTE [replicated gradients])."""

    @staticmethod
    def forward(ctx, value, group):
        ctx.group = group
        return value.clone()

    @staticmethod
    def backward(ctx, grad):
        total = grad.clone()
        if group_size(ctx.group) > 1:
            dist.all_reduce(total, group=ctx.group)
        return total, None


def to_rows(value: torch.Tensor, group=None) -> torch.Tensor:
    """A replicated value about to be used by per-rank rows (plain tensors in and out)."""
    return _ReplicatedToRows.apply(value, group)


def replicated(value: torch.Tensor, meta: ShardMeta) -> ShardTensor:
    """Mark the result of a cross-rank reduction as replicated."""
    return ShardTensor.wrap(value, meta.as_replicated())


def is_replicated(t) -> bool:
    """Held whole by every rank (a ShardTensor of `Replicated` layout)."""
    return isinstance(t, ShardTensor) and t._meta.layout.is_replicated()


def _rows_layout(args, kwargs) -> ShardMeta | None:
    """The row layout a mixed call works in: a rows ShardTensor's, else the replicated one's source."""
    source = None
    for t in _tensors(args, kwargs):
        if isinstance(t, ShardTensor):
            if not is_replicated(t):
                return t._meta
            source = source or t._meta.as_rows()
    return source


def mixes_replicated_and_rows(func, meta, args, kwargs) -> bool:
    """A replicated tensor next to atom/edge rows (a rows ShardTensor, or a plain index or
    operand whose length is the number of atom or edge rows)."""
    tensors = list(_tensors(args, kwargs))
    if not any(is_replicated(t) for t in tensors):
        return False
    layout = _rows_layout(args, kwargs)
    if layout is None:
        return False
    for t in tensors:
        if is_replicated(t):
            continue
        if isinstance(t, ShardTensor) or (t.dim() > 0 and layout.row_kind(t.shape[0]) != "other"):
            return True
    return False


MIXING_OPS = (
    torch.Tensor.__add__, torch.Tensor.__radd__, torch.Tensor.__sub__, torch.Tensor.__rsub__,
    torch.Tensor.__mul__, torch.Tensor.__rmul__, torch.Tensor.__truediv__, torch.Tensor.__rtruediv__,
    torch.Tensor.add, torch.Tensor.sub, torch.Tensor.mul, torch.Tensor.div,
    torch.add, torch.sub, torch.mul, torch.div, torch.where,
    torch.Tensor.__getitem__, torch.Tensor.index_select, torch.index_select,
)


@register(Layout, *MIXING_OPS, name="replicated_to_rows", predicate=mixes_replicated_and_rows,
          doc="A replicated value read per atom or edge: to_rows (gradient summed over ranks), then the op.")
def enter_rows(func, meta, args, kwargs):
    """Run ``func`` with every replicated input passed through `to_rows`."""
    layout = _rows_layout(args, kwargs)

    def convert(a):
        if is_replicated(a):
            return to_rows(local(a), layout.group)
        if isinstance(a, (tuple, list)):
            return type(a)(convert(x) for x in a)
        return local(a)

    args = tuple(convert(a) for a in args)
    kwargs = {k: convert(v) for k, v in kwargs.items()}
    with torch._C.DisableTorchFunctionSubclass():
        out = func(*args, **kwargs)
    return promote(out, layout)


_EXPANSIONS = (torch.Tensor.expand, torch.Tensor.repeat, torch.broadcast_to, torch.Tensor.broadcast_to)


def expands_to_rows(func, meta, args, kwargs) -> bool:
    """A replicated value given a leading dim of this rank's atom or edge row count, by
    sizes (``u.expand(h.shape[0], -1)``, MEGNet's global state fed to every atom)."""
    x = args[0] if args else None
    if func not in _EXPANSIONS or not is_replicated(x) or len(args) < 2:
        return False
    sizes = args[1] if len(args) == 2 and isinstance(args[1], (tuple, list, torch.Size)) else args[1:]
    rows = meta.as_rows()
    grows = len(sizes) > x.dim() or (x.dim() > 0 and x.shape[0] == 1)
    return bool(sizes) and grows and sizes[0] in (rows.n_padded, rows.n_edges) and rows.row_kind(sizes[0]) != "other"


@register(Layout, *_EXPANSIONS, name="replicated_expanded_to_rows", predicate=expands_to_rows,
          doc="A replicated value expanded to one copy per atom or edge row: to_rows first, then rows.")
def expand_to_rows(func, meta, args, kwargs):
    """Each copy is used by one row, so the gradients of the copies are this rank's share:
    summed over ranks before they reach the replicated value (NOTE [replicated gradients]);
    left replicated, the copies would be all-reduced as rows of different lengths."""
    rows = meta.as_rows()
    value = to_rows(local(args[0]), rows.group)
    with torch._C.DisableTorchFunctionSubclass():
        out = func(value, *args[1:], **kwargs)
    return ShardTensor.wrap(out, rows)


_PRODUCTS = (torch.Tensor.__mul__, torch.Tensor.__rmul__, torch.Tensor.mul, torch.mul)


def is_zero_product(func, meta, args, kwargs) -> bool:
    """A replicated value times the number 0: ``positions.sum() * 0`` (mace keeps its
    strain in the autograd graph this way)."""
    if func not in _PRODUCTS or len(args) != 2 or kwargs:
        return False
    a, b = args
    return (is_replicated(a) and _is_zero_number(b)) or (is_replicated(b) and _is_zero_number(a))


def _is_zero_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == 0


@register(Layout, *_PRODUCTS, name="zero_product", predicate=is_zero_product,
          doc="A replicated value times the number 0: a plain zero (no cross-rank gradient to carry).")
def zero_product(func, meta, args, kwargs):
    """The product, plain: it is zero on every rank whatever the total was, so it carries
    no cross-rank gradient; kept replicated, it would make the strain it is added to
    replicated, and the virial taken there would come out whole on every rank and then be
    summed over ranks once more (NOTE [whole sums are replicated] in `mlipdd.shard.handlers`)."""
    with torch._C.DisableTorchFunctionSubclass():
        return func(*(local(a) if isinstance(a, ShardTensor) else a for a in args))


# Calls that take tensors but compute nothing row-wise from them (autograd drivers).
_NOT_MATH = {torch.autograd.grad, torch.autograd.backward, torch.Tensor.backward}


def meets_rows_in_any_op(func, meta, args, kwargs) -> bool:
    """The row boundary for ANY op (einsum, matmul, bmm, ...), not just `MIXING_OPS`.

    # NOTE [no per-row tensor marked replicated]
    Without this, an op outside `MIXING_OPS` that combines a replicated tensor with
    plain per-edge rows (mace: ``einsum(unit_shifts, cell[...])``) would return per-edge
    rows still marked replicated; a later `to_rows` would then all_reduce tensors whose
    length differs between ranks, a collective mismatch. Checking every op costs a scan
    of its arguments, and only while a replicated tensor is involved.
    """
    return func not in _NOT_MATH and mixes_replicated_and_rows(func, meta, args, kwargs)


register(Layout, ANY_OP, name="row_boundary", predicate=meets_rows_in_any_op,
         doc="A replicated value meeting atom/edge rows in any other op (einsum, matmul): to_rows, then the op.")(
    enter_rows)
